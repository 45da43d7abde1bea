"""One Transformer block: self-attention (projections, heads, rotary, memory), in a decoder of an
encoder-decoder cross-attention to the encoder's output (``xfam.model.cross``), and the FFN."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.attention._base import AttentionMechanism
from xfam.core.context import LayerContext
from xfam.core.state import DecodeState, LayerView, expand_kv
from xfam.model.cross import CrossAttention, CrossSource
from xfam.model.layers import FeedForward, make_norm
from xfam.model.spec import ModelSpec

#: A memory's hook into its layer's attention: ``(q [B, H, S, Dh], out [B, H, S, Dh]) -> out``.
Augment = Callable[[Tensor, Tensor], Tensor]


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
    ) -> tuple[Tensor, DecodeState | None]:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        if mem is not None:
            mk, mv = self._kv_rows(mem, self.qkv.weight, self.qkv.bias)  # no queries for memory
            k, v = torch.cat((mk, k), dim=1), torch.cat((mv, v), dim=1)  # [B, M + S, Hkv*Dh]
        q, k, v = self._heads(q, self.heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        q_plain = q  # before any rotation: what a retrieval memory compares (positions do not apply)
        if ctx.rotary is not None:
            q = ctx.pos.rotate(q, tuple(t[-s:] for t in ctx.rotary))  # tables [Sk_now, ...]: the last S rows
            k = ctx.pos.rotate(k, ctx.rotary, key=True)
        if self.persistent_k is not None:
            q, k, v = self._with_persistent(q, q_plain, k, v, rotated=ctx.rotary is not None)
        modifier = ctx.pos.score_modifier(self.layer)
        if ctx.decoding:
            o, state = self.mechanism.decode(q, k, v, state, ctx.mask, ctx.bias, modifier)
        else:
            o = self.mechanism(q, k, v, ctx.mask, ctx.bias, modifier)  # [B, H, S, Dh]
        if augment is not None:  # a memory that takes part in attention (e.g. kNN retrieval)
            o = augment(q_plain, o)
        o = o.transpose(1, 2).reshape(b, s, self.q_width)  # [B, H, S, Dh] -> [B, S, H*Dh]
        return self.out(o), state

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
        pk = self.persistent_k.to(k.dtype).expand(k.shape[0], -1, -1, -1)  # [B, Hkv, P, Dh]
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
        return self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)

    def frozen_queries(self, x: Tensor) -> Tensor:
        """``[B, N, D] -> [B, H, N, Dh]``; weights detached."""
        bias = None if self.qkv.bias is None else self.qkv.bias.detach()[: self.q_width]
        return self._heads(F.linear(x, self.qkv.weight.detach()[: self.q_width], bias), self.heads)

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


class Block(nn.Module):
    """Pre-norm ``x + f(norm(x))`` or post-norm ``norm(x + f(x))`` sublayers: self-attention, then (given a
    ``cross`` mechanism: a decoder of an encoder-decoder) cross-attention, then the FFN."""

    def __init__(
        self, spec: ModelSpec, mechanism: AttentionMechanism, layer: int, cross: AttentionMechanism | None = None
    ):
        super().__init__()
        self.pre = spec.norm_position == "pre"
        self.norm1, self.norm2 = make_norm(spec), make_norm(spec)
        self.attn = SelfAttention(spec, mechanism, layer)
        self.cross = CrossAttention(spec, cross, layer) if cross is not None else None
        self.norm_cross = make_norm(spec) if cross is not None else None
        self.ffn = FeedForward(spec)
        self.drop = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()

    def forward(
        self,
        x: Tensor,
        ctx: LayerContext,
        mem: Tensor | None = None,
        state: DecodeState | None = None,
        augment: Augment | None = None,
        source: CrossSource | None = None,
    ) -> tuple[Tensor, DecodeState | None]:
        """``x [B, S, D]``; ``source``: the encoder output, for a block with cross-attention."""
        if self.pre:
            h = self.norm1(x)
            a, state = self.attn(h, ctx, None if mem is None else self.norm1(mem), state, augment)
            x = x + self.drop(a)
            if self.cross is not None:
                x = x + self.drop(self.cross(self.norm_cross(x), source))
            x = x + self.drop(self.ffn(self.norm2(x)))
        else:
            a, state = self.attn(x, ctx, mem, state, augment)
            x = self.norm1(x + self.drop(a))
            if self.cross is not None:
                x = self.norm_cross(x + self.drop(self.cross(x, source)))
            x = self.norm2(x + self.drop(self.ffn(x)))
        return x, state

    def residual_projections(self) -> list[nn.Module]:
        """The projections that write into the residual stream (attention outputs, FFN down), whose init the
        model scales by 1/sqrt(2L) (``ModelSpec.init_std``)."""
        return [self.attn.out, self.ffn.down] + ([self.cross.out] if self.cross is not None else [])

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
