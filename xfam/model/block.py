"""One Transformer block: self-attention (projections, heads, rotary, memory), in a decoder of an
encoder-decoder cross-attention to the encoder's output (``xfam.model.cross``), and the FFN; each sublayer
joined to the stream by a ``Link`` (``xfam.model.residual``), with the block options of
``xfam.model.attn_options``, ``layout`` and ``shift`` (docs/blocks.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.attention._base import AttentionMechanism
from xfam.core.bias import ChainedModifier
from xfam.core.context import LayerContext
from xfam.core.state import DecodeState, LayerView, expand_kv
from xfam.model.attn_options import AttentionOnAttention, Carry, QKNorm, ScoreOptions, needs_scores
from xfam.model.cross import CrossAttention, CrossSource
from xfam.model.layers import FeedForward, make_norm
from xfam.model.layout import DEFAULT_LAYOUT, BlockLayout
from xfam.model.residual import Link
from xfam.model.sepconv import SepConvTransition
from xfam.model.shift import row_info, shift_amounts, shift_tokens
from xfam.model.spec import ModelSpec

#: A memory's hook into its layer's attention: ``(q [B, H, S, Dh], out [B, H, S, Dh]) -> out``.
Augment = Callable[[Tensor, Tensor], Tensor]


def make_ffn(spec: ModelSpec, causal: bool) -> FeedForward | SepConvTransition:
    """The FFN of ``model.ffn``: position-wise, or the Universal Transformer's convolutional transition."""
    return SepConvTransition(spec, causal) if spec.ffn == "sepconv" else FeedForward(spec)


class SelfAttention(nn.Module):
    """Projections around a mechanism: ``x [B, S, D] -> [B, S, D]``.

    One fused q/k/v projection; key/value heads may be fewer than query heads (grouped-query
    attention). Memory states ``[B, M, D]`` are projected to keys/values and put in front. With
    ``num_mem_kv`` = P, learned persistent keys/values ``[Hkv, P, Dh]`` (Sukhbaatar et al., 2019,
    "Augmenting Self-attention with Persistent Memory", arXiv:1907.01470) lead the keys of every
    query: keys = [persistent | memory or cache | segment] (see ``_with_persistent``).
    """

    def __init__(self, spec: ModelSpec, mechanism: AttentionMechanism, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.n_kv_heads, spec.d_head
        self.layer = layer
        self.q_width = self.heads * self.head_dim
        self.kv_width = self.kv_heads * self.head_dim
        self.qkv = nn.Linear(spec.dim, self.q_width + 2 * self.kv_width, bias=spec.bias)
        self.out = nn.Linear(self.q_width, spec.dim, bias=spec.bias)
        self.mechanism = mechanism
        self.persistent_k = self.persistent_v = None
        if spec.num_mem_kv:  # normal init, like the embeddings (x-transformers draws them from randn)
            shape = (self.kv_heads, spec.num_mem_kv, self.head_dim)  # [Hkv, P, Dh]
            self.persistent_k = nn.Parameter(torch.randn(shape) * spec.init_std)
            self.persistent_v = nn.Parameter(torch.randn(shape) * spec.init_std)
        # block options (xfam.model.attn_options); None when off
        self.qk_norm = QKNorm(spec) if spec.attn_qk_norm != "none" else None
        self.score_options = ScoreOptions(spec) if needs_scores(spec) else None
        self.value_residual = spec.value_residual
        self.head_scale = nn.Parameter(torch.ones(self.heads)) if spec.attn_head_scale else None
        self.gate = None
        if spec.attn_gate:  # AlphaFold2's init: W = 0, b = 1 (kept by the model's init: ``own_init_modules``)
            self.gate = nn.Linear(spec.dim, self.q_width)
            nn.init.zeros_(self.gate.weight)
            nn.init.ones_(self.gate.bias)
        self.aoa = AttentionOnAttention(spec) if spec.attn_on_attn else None

    def own_init_modules(self) -> list[nn.Module]:
        """Modules initialised here, which the model's normal init leaves alone: the AlphaFold2 gate."""
        return [] if self.gate is None else [self.gate]

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)  # [B, S, n*Dh] -> [B, n, S, Dh]

    def forward(
        self,
        x: Tensor,
        ctx: LayerContext,
        mem: Tensor | None = None,
        state: DecodeState | None = None,
        augment: Augment | None = None,
        carry: Carry | None = None,
    ) -> tuple[Tensor, DecodeState | None]:
        """``carry``: what earlier layers of this call pass on (RealFormer's scores, ResFormer's values)."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        if mem is not None:
            mk, mv = self._kv_rows(mem, self.qkv.weight, self.qkv.bias)  # no queries for memory
            k, v = torch.cat((mk, k), dim=1), torch.cat((mv, v), dim=1)  # [B, M + S, Hkv*Dh]
        q, k, v = self._heads(q, self.heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        if self.qk_norm is not None:
            q, k = self.qk_norm.q(q), self.qk_norm.k(k)
        if self.value_residual and carry is not None:  # ResFormer: (V_n + V_1) / 2, V_1 the first layer's
            v = v if carry.values is None else (v + carry.values) / 2
            carry.values = v if carry.values is None else carry.values
        q_plain = q  # before any rotation: what a retrieval memory compares (positions do not apply)
        if ctx.rotary is not None:
            q = ctx.pos.rotate(q, tuple(t[-s:] for t in ctx.rotary))  # tables [Sk_now, ...]: the last S rows
            k = ctx.pos.rotate(k, ctx.rotary, key=True)
        if self.persistent_k is not None:
            q, k, v = self._with_persistent(q, q_plain, k, v, rotated=ctx.rotary is not None)
        modifier = ctx.pos.score_modifier(self.layer)
        if self.score_options is not None:
            self.score_options.carry = carry
            modifier = self.score_options if modifier is None else ChainedModifier(modifier, self.score_options)
        if ctx.step is not None:  # a fixed-shape step: the state is preallocated and updated in place
            assert state is not None  # (``StaticCache`` holds every layer's)
            o = self.mechanism.decode_step(q, k, v, state, ctx.step, ctx.bias)
        elif ctx.decoding:
            o, state = self.mechanism.decode(q, k, v, state, ctx.mask, ctx.bias, modifier)
        else:
            o = self.mechanism(q, k, v, ctx.mask, ctx.bias, modifier)  # [B, H, S, Dh]
        if augment is not None:  # a memory that takes part in attention (e.g. kNN retrieval)
            o = augment(q_plain, o)
        if self.head_scale is not None:  # NormFormer: one learned scale per head
            o = o * self.head_scale.to(o.dtype)[:, None, None]
        o = o.transpose(1, 2).reshape(b, s, self.q_width)  # [B, H, S, Dh] -> [B, S, H*Dh]
        if self.gate is not None:  # AlphaFold2: a sigmoid gate per output channel, from the layer input
            o = o * torch.sigmoid(self.gate(x))
        out = self.out(o)  # [B, S, D]
        return (out if self.aoa is None else self.aoa(out, x)), state

    def _with_persistent(
        self, q: Tensor, q_plain: Tensor, k: Tensor, v: Tensor, rotated: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The persistent keys/values in front: ``k, v [B, Hkv, Sk, Dh] -> [B, Hkv, P + Sk, Dh|2Dh]``.

        They have no position: a query's score against one is ``q . pk / sqrt(Dh)`` wherever the query
        sits (a score bias is zero on them, ``additive_mask``). A rotary encoding rotates the queries, so
        (R_i q) . pk would depend on the query's position i; the score is taken from the unrotated query
        through a second block of channels instead: ``q' = sqrt(2) [R q | q]`` ``[B, H, Sq, 2Dh]``, other
        keys ``[R k | 0]``, persistent keys ``[0 | pk]``, so ``q' . k' / sqrt(2 Dh)`` is ``(R q) . (R k) / sqrt(Dh)``
        and ``q . pk / sqrt(Dh)`` (twice the q.k work, under rotary encodings only).
        """
        assert self.persistent_k is not None and self.persistent_v is not None  # (called only with them)
        pk = self.persistent_k.to(k.dtype).expand(k.shape[0], -1, -1, -1)  # [B, Hkv, P, Dh]
        if self.qk_norm is not None:  # (persistent keys are keys: normalised like the others)
            pk = self.qk_norm.k(pk)
        pv = self.persistent_v.to(v.dtype).expand(v.shape[0], -1, -1, -1)
        if rotated:
            q = torch.cat((q, q_plain), dim=-1) * math.sqrt(2)  # [B, H, Sq, 2Dh]
            k, pk = torch.cat((k, torch.zeros_like(k)), dim=-1), torch.cat((torch.zeros_like(pk), pk), dim=-1)
        return q, torch.cat((pk, k), dim=2), torch.cat((pv, v), dim=2)

    # -- for memories (LayerView): the layer's projections with detached weights, no positions ------
    def _kv_rows(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        w = weight[self.q_width :]  # key/value rows only
        return F.linear(x, w, None if bias is None else bias[self.q_width :]).split((self.kv_width,) * 2, dim=-1)

    def frozen_keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, N, D] -> 2 x [B, Hkv, N, Dh]``; weights detached."""
        bias = None if self.qkv.bias is None else self.qkv.bias.detach()
        k, v = self._kv_rows(x, self.qkv.weight.detach(), bias)
        k = self._heads(k, self.kv_heads)
        return (k if self.qk_norm is None else self.qk_norm.k(k)), self._heads(v, self.kv_heads)

    def frozen_queries(self, x: Tensor) -> Tensor:
        """``[B, N, D] -> [B, H, N, Dh]``; weights detached."""
        bias = None if self.qkv.bias is None else self.qkv.bias.detach()[: self.q_width]
        q = self._heads(F.linear(x, self.qkv.weight.detach()[: self.q_width], bias), self.heads)
        return q if self.qk_norm is None else self.qk_norm.q(q)

    def frozen_weights(self, h: Tensor, states: Tensor) -> Tensor:
        """Content attention probabilities of ``h [B, S, D]`` over ``states [B, M, D]``: ``[B, H, S, M]``."""
        q, k = self.frozen_queries(h), expand_kv(self.frozen_keys_values(states)[0], self.heads)  # [B, H, *, Dh]
        return torch.softmax(q @ k.transpose(-1, -2) * self.head_dim**-0.5, dim=-1)

    def frozen_attend(self, h: Tensor, states: Tensor) -> Tensor:
        """Content attention of ``h [B, S, D]`` over ``states [B, M, D]`` -> ``[B, S, H*Dh]``; weights
        detached (the Compressive Transformer's attention-reconstruction target and estimate)."""
        q = self.frozen_queries(h)
        k, v = self.frozen_keys_values(states)
        k, v = expand_kv(k, self.heads), expand_kv(v, self.heads)  # [B, H, M, Dh]
        o = F.scaled_dot_product_attention(q, k, v)  # [B, H, S, Dh]
        return o.transpose(1, 2).reshape(h.shape[0], h.shape[1], self.q_width)


class FFNSublayer(nn.Module):
    """An FFN sublayer beyond a block's first (macaron's leading half step, a custom order's extra f's)."""

    def __init__(self, spec: ModelSpec, half: bool, causal: bool = True):
        super().__init__()
        self.norm = make_norm(spec) if spec.residual != "rezero" else nn.Identity()
        self.ffn, self.link = make_ffn(spec, causal), Link(spec, half=half, ffn=True)


def _sublayers(group: nn.ModuleList) -> list[FFNSublayer]:
    """A block's ``before`` / ``after``, typed as what they hold (``nn.ModuleList`` yields ``nn.Module``)."""
    return cast("list[FFNSublayer]", list(group))


class Block(nn.Module):
    """Sublayers in the order of its ``BlockLayout``: FFNs before (macaron), self-attention, (given a ``cross``
    mechanism: a decoder of an encoder-decoder) cross-attention, FFNs after. Each joins the stream through its
    ``Link``: pre-norm ``x + f(norm(x))`` by default, post-norm ``norm(x + f(x))``, and the other options of
    ``xfam.model.residual``. The first FFN after the attention is ``ffn``/``norm2`` (the default block's)."""

    def __init__(
        self,
        spec: ModelSpec,
        mechanism: AttentionMechanism,
        layer: int,
        cross: AttentionMechanism | None = None,
        layout: BlockLayout = DEFAULT_LAYOUT,
        causal: bool = True,
    ):
        super().__init__()
        self.pre = spec.pre_norm
        norm = make_norm if spec.residual != "rezero" else lambda _spec: nn.Identity()  # ReZero has no norms
        # (the default block's modules first, in the order they always had: the optimiser's state follows it)
        self.norm1 = norm(spec)
        self.norm2 = norm(spec) if layout.after else None
        self.attn = SelfAttention(spec, mechanism, layer)
        self.cross = CrossAttention(spec, cross, layer) if cross is not None else None
        self.norm_cross = norm(spec) if cross is not None else None
        self.ffn = make_ffn(spec, causal) if layout.after else None
        self.link_attn = Link(spec, post_norm=spec.attn_post_norm)
        self.link_cross = Link(spec) if cross is not None else None
        self.link_ffn = Link(spec, half=layout.half, ffn=True) if layout.after else None
        self.before = nn.ModuleList(FFNSublayer(spec, layout.half, causal) for _ in range(layout.before))
        self.after = nn.ModuleList(FFNSublayer(spec, layout.half, causal) for _ in range(layout.after - 1))
        if spec.residual == "rezero":  # one alpha per layer, shared by its sublayers (the ReZero reference code)
            for link in self.links()[1:]:
                link.gain = self.link_attn.gain
        self.layer_drop, self.num_layers = spec.layer_drop, spec.layers
        self.shifts = shift_amounts(spec.shift_tokens, causal) if spec.shift_tokens else None
        self.keeps_rows = self.shifts is not None or spec.ffn == "sepconv"  # decode state: sublayers' last rows

    def forward(
        self,
        x: Tensor,
        ctx: LayerContext,
        mem: Tensor | None = None,
        state: DecodeState | None = None,
        augment: Augment | None = None,
        source: CrossSource | None = None,
        carry: Carry | None = None,
    ) -> tuple[Tensor, DecodeState | None]:
        """``x [B, S, D]``; ``source``: the encoder output, for a block with cross-attention; ``carry``: what
        earlier layers of the call pass on (options that read them)."""
        keep = self._survivors(x, 0 if carry is None else carry.step)
        dual = None if carry is None else carry.dual
        # the decode state then also keeps sublayers' last rows (shift, convolution)
        rows_prev: dict[str, Tensor] = {}
        rows_new: dict[str, Tensor] = {}
        if self.keeps_rows and state is not None:
            rows_prev, state = state["rows"], state["mechanism"]
        if self.shifts is not None:
            shifted = lambda name, f: lambda h: f(self._shift(h, ctx, name, rows_prev, rows_new))  # noqa: E731
        else:
            shifted = lambda name, f: f  # noqa: E731

        def ffn(name: str, f: nn.Module) -> Callable[[Tensor], Tensor]:
            if not getattr(f, "mixes_rows", False):
                return shifted(name, f)
            return shifted(name, lambda h: self._transition(f, h, ctx, name, rows_prev, rows_new))

        for i, sub in enumerate(_sublayers(self.before)):
            x = sub.link(x, ffn(f"before{i}", sub.ffn), sub.norm, keep, dual)
        if mem is not None and self.pre:  # memory: states of this layer's input, normed as its rows are
            mem = self.norm1(mem)
        new_state = [state]

        def attend(h: Tensor) -> Tensor:
            out, new_state[0] = self.attn(h, ctx, mem, state, augment, carry)
            return out

        x = self.link_attn(x, shifted("attn", attend), self.norm1, keep, dual)
        if self.cross is not None:
            cross, link_cross, norm_cross = self.cross, self.link_cross, self.norm_cross
            assert link_cross is not None and norm_cross is not None  # built with ``cross``
            x = link_cross(x, lambda h: cross(h, source), norm_cross, keep, dual)
        if self.ffn is not None:
            assert self.link_ffn is not None and self.norm2 is not None  # built with ``ffn``
            x = self.link_ffn(x, ffn("ffn", self.ffn), self.norm2, keep, dual)
        for i, sub in enumerate(_sublayers(self.after)):
            x = sub.link(x, ffn(f"after{i}", sub.ffn), sub.norm, keep, dual)
        if self.keeps_rows and ctx.decoding:
            return x, {"mechanism": new_state[0], "rows": rows_new}
        return x, new_state[0]

    def links(self) -> list[Link]:
        """Every sublayer's ``Link``, attention's first."""
        extra = [sub.link for sub in self.ffn_sublayers()]
        return [self.link_attn] + [k for k in (self.link_cross, self.link_ffn) if k is not None] + extra

    def ffn_sublayers(self) -> list[FFNSublayer]:
        """The FFN sublayers beyond the first: ``before``'s, then ``after``'s."""
        return _sublayers(self.before) + _sublayers(self.after)

    def survival(self, step: int) -> float:
        """Stochastic depth's linear schedule: layer ``step`` (0-based) of L runs with probability
        1 - (step + 1) / L * ``model.layer_drop`` (Huang et al., 2016, p_l = 1 - l / L (1 - p_L))."""
        return 1.0 - self.layer_drop * (step + 1) / self.num_layers

    def _survivors(self, x: Tensor, step: int) -> Tensor | None:
        """Stochastic depth in training: ``[B, 1, 1]``, 1 / survival for the samples that run layer ``step``, else 0
        (by step, not by block: a shared block, ALBERT's or ACT's, follows the schedule of the layer it runs as)."""
        if not self.training or not self.layer_drop:
            return None
        survival = self.survival(step)
        keep = torch.rand(x.shape[0], 1, 1, device=x.device) < survival
        return keep.to(x.dtype) / survival

    def _shift(self, h: Tensor, ctx: LayerContext, name: str, prev: dict, new: dict) -> Tensor:
        """Token shifting of one sublayer's input ``h [B, S, D]``; in decoding, with the rows kept from before."""
        assert self.shifts is not None  # (called only with token shifting on)
        before = prev.get(name)
        rows = h.shape[1] + (0 if before is None else before.shape[1])
        pad, seg = row_info(ctx.mask, rows) if not ctx.mask.cross else (None, None)
        out = shift_tokens(h, self.shifts, pad, seg, before)
        if ctx.decoding:
            keep = max(self.shifts)
            new[name] = (h if before is None else torch.cat((before, h), dim=1))[:, -keep:]
        return out

    def _transition(self, f: nn.Module, h: Tensor, ctx: LayerContext, name: str, prev: dict, new: dict) -> Tensor:
        """A transition that mixes rows (``ffn=sepconv``) on ``h [B, S, D]``: it reads the layer's padding and
        documents and, in decoding, the rows it kept in the previous call."""
        out, kept = f(h, ctx.mask, prev.get(f"conv/{name}"))
        if ctx.decoding:
            new[f"conv/{name}"] = kept
        return out

    def residual_projections(self) -> list[nn.Linear]:
        """The projections that write into the residual stream (attention outputs, FFN down), whose init the
        model scales by 1/sqrt(2L) (``ModelSpec.init_std``)."""
        ffns = ([self.ffn] if self.ffn is not None else []) + [sub.ffn for sub in self.ffn_sublayers()]
        attn_out = self.attn.out if self.attn.aoa is None else self.attn.aoa.proj  # (AoA writes the stream)
        return [attn_out] + [f.down for f in ffns] + ([self.cross.out] if self.cross is not None else [])

    def view(self, segments: Tensor | None) -> LayerView:
        """What a memory of this layer may use (``xfam.memory._base.LayerView``): the attention's
        projections after the input norm (pre-norm), with detached weights."""
        norm = self.norm1 if self.pre else nn.Identity()
        weights = {n: p.detach() for n, p in norm.named_parameters()}
        frozen = lambda x: torch.func.functional_call(norm, weights, (x,))  # the input norm, weights detached
        return LayerView(
            keys_values=lambda x: self.attn.frozen_keys_values(frozen(x)),
            queries=lambda x: self.attn.frozen_queries(frozen(x)),
            attend=lambda h, m: self.attn.frozen_attend(frozen(h), frozen(m)),
            weights=lambda h, m: self.attn.frozen_weights(frozen(h), frozen(m)),
            segments=segments,
        )


def deepnorm_init(block: Block, beta: float) -> list[nn.Linear]:
    """DeepNet's initialisation of one block (Wang et al., 2022, Fig. 2): Xavier-normal with gain beta for the
    FFNs, the value and the output projections, gain 1 for the query and key projections (biases zero).
    Returns the modules initialised, which the model's normal init then leaves alone."""
    done: list[nn.Linear] = []

    def xavier(weight: Tensor, rows: slice, gain: float) -> None:
        part = torch.empty_like(weight[rows])
        nn.init.xavier_normal_(part, gain=gain)
        with torch.no_grad():
            weight[rows] = part

    attn = block.attn
    q, kv = attn.q_width, attn.kv_width
    xavier(attn.qkv.weight, slice(0, q), 1.0)
    xavier(attn.qkv.weight, slice(q, q + kv), 1.0)  # k
    xavier(attn.qkv.weight, slice(q + kv, q + 2 * kv), beta)  # v
    xavier(attn.out.weight, slice(None), beta)
    done += [attn.qkv, attn.out]
    if block.cross is not None:
        c = block.cross
        xavier(c.q.weight, slice(None), 1.0)
        xavier(c.kv.weight, slice(0, c.kv.out_features // 2), 1.0)
        xavier(c.kv.weight, slice(c.kv.out_features // 2, None), beta)
        xavier(c.out.weight, slice(None), beta)
        done += [c.q, c.kv, c.out]
    ffns = ([block.ffn] if block.ffn is not None else []) + [s.ffn for s in block.ffn_sublayers()]
    for f in ffns:
        xavier(f.up.weight, slice(None), beta)
        xavier(f.down.weight, slice(None), beta)
        done += [f.up, f.down]
    for m in done:
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    return done
