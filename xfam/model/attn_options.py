"""The block's attention options (docs/blocks.md): what changes q, k, v or the heads' outputs, which works
with every mechanism, and what changes the score matrix, which needs a mechanism that forms it
(``AttentionMechanism.hosts_modifiers``; ``xfam.model.block_compat`` refuses the others).

On q, k, v and the outputs (any mechanism, fused and kernel paths included):

* ``attn_qk_norm=l2``: cosine-similarity attention (Henry et al., 2020, "Query-Key Normalization for
  Transformers", arXiv:2010.04245): q and k l2-normalised per head, the scores ``g cos(q, k)`` with a learned
  (or fixed, ``attn_qk_scale``) temperature g. The mechanism divides by sqrt(Dh), so q is multiplied by
  g sqrt(Dh).
* ``attn_qk_norm=rms``: RMSNorm of q and k per head with a learned gain (QK-norm as in ViT-22B, Dehghani
  et al., 2023, arXiv:2302.05442, with RMSNorm for LayerNorm).
* ``value_residual``: ResFormer (Zhou et al., 2024, arXiv:2410.17897): layer n > 1 attends over
  ``(V_n + V_1) / 2``, the first layer's values of the same tokens (``Carry.values``).
* ``attn_head_scale``: a learned scale per head on its output, init 1 (NormFormer, Shleifer et al., 2021).
* ``attn_gate``: ``o * sigmoid(W_g x + b_g)`` per output channel, from the layer input (AlphaFold2,
  Jumper et al., 2021, supplementary 1.6.1, gating; W_g = 0 and b_g = 1 at init).
* ``attn_on_attn``: attention on attention (Huang et al., 2019, arXiv:1908.06954, eq. 5-7): with
  ``a`` the multi-head attention's output and ``x`` the query input, ``(W_i [a; x] + b_i) * sigmoid(W_g [a; x] + b_g)``.

On the scores (``ScoreOptions``, a ``ScoreModifier``; explicit scores only):

* ``attn_talking_heads``: learned H x H mixing of the heads' logits before the softmax and of their weights
  after it (Shazeer et al., 2020, "Talking-Heads Attention", arXiv:2003.02436), identity at init.
* ``residual_attn``: RealFormer (He et al., 2020, arXiv:2012.11747): each layer's pre-softmax scores are its
  own plus the previous layer's (accumulated) scores, which it passes on (``Carry.scores``).
* ``attn_topk``: each query keeps its k largest weights (Zhao et al., 2019, "Explicit Sparse Transformer",
  arXiv:1912.11637): softmax over the scores at or above the k-th largest (ties kept), which equals those
  weights renormalised; with
  ``attn_topk_straight_through`` the forward takes them and the backward the dense softmax's gradient.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from xfam.core.bias import ScoreModifier
from xfam.core.mask import AttnMask
from xfam.model.fused import l2_normalize
from xfam.model.spec import ModelSpec


@dataclasses.dataclass
class Carry:
    """What one forward call's layers pass to the next, for the options that read an earlier layer:
    RealFormer's accumulated scores ``[B, H, Sq, Sk]``, ResFormer's first-layer values ``[B, Hkv, S, Dh]``,
    and ResiDual's dual stream ``[B, S, D]`` (a one-element list the ``Link`` updates); and the layer now
    running."""

    scores: Tensor | None = None
    values: Tensor | None = None
    dual: list | None = None
    step: int = 0  # the layer running now (stochastic depth's schedule follows it)


def qk_temperature_init(max_len: int) -> float:
    """Henry et al.'s initial temperature g0 = log2(L^2 - L), L the longest training sequence."""
    return math.log2(max(max_len * max_len - max_len, 2))


class QKNorm(nn.Module):
    """``attn_qk_norm``: normalise queries and keys ``[B, H|Hkv, S, Dh]`` per head (see the module docstring)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.kind, dh = spec.attn_qk_norm, spec.d_head
        self.sqrt_dh = math.sqrt(dh)
        if self.kind == "rms":
            self.q_norm, self.k_norm = nn.RMSNorm(dh, eps=1e-6), nn.RMSNorm(dh, eps=1e-6)
        elif spec.attn_qk_scale is None:
            self.scale = nn.Parameter(torch.tensor(qk_temperature_init(spec.max_len)))
        else:
            self.register_buffer("scale", torch.tensor(float(spec.attn_qk_scale)), persistent=False)

    def q(self, x: Tensor) -> Tensor:
        if self.kind == "rms":
            return self.q_norm(x)
        return l2_normalize(x, self.scale * self.sqrt_dh)  # scores g cos(q, k)

    def k(self, x: Tensor) -> Tensor:
        return self.k_norm(x) if self.kind == "rms" else l2_normalize(x)


class ScoreOptions(ScoreModifier):
    """The block's score options (talking heads, residual attention, top-k); ``carry`` is set per call."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.heads
        self.pre_mix = self.post_mix = None
        if spec.attn_talking_heads:
            self.pre_mix, self.post_mix = nn.Parameter(torch.eye(h)), nn.Parameter(torch.eye(h))  # [H, H]
        self.residual, self.topk, self.straight = spec.residual_attn, spec.attn_topk, spec.attn_topk_straight_through
        self.carry: Carry | None = None

    def all_logits(self, scores: Tensor, q: Tensor, k: Tensor, mask: AttnMask) -> Tensor:
        if self.pre_mix is not None:  # logits of head g = sum_h P[h, g] logits_h
            scores = mix_heads(scores, self.pre_mix)
        if self.residual and self.carry is not None:
            if self.carry.scores is not None:
                scores = scores + self.carry.scores
            self.carry.scores = scores  # passed on: the next layer adds these
        return scores

    def probs(self, probs: Tensor, mask: AttnMask) -> Tensor:
        if self.topk is not None and self.topk < probs.shape[-1]:
            kth = probs.topk(self.topk, dim=-1).values[..., -1:]  # [B, H, Sq, 1]: the k-th largest weight t_i
            kept = probs * (probs >= kth)  # every weight >= t_i (ties at t_i all kept, as the paper's mask)
            hard = kept / kept.sum(-1, keepdim=True).clamp_min(1e-30)
            probs = probs + (hard - probs).detach() if self.straight else hard
        if self.post_mix is not None:
            probs = mix_heads(probs, self.post_mix)
        return probs


def mix_heads(x: Tensor, p: Tensor) -> Tensor:
    """``x [B, H, Sq, Sk]`` with head g of the output ``sum_h p[h, g] x_h``: one batched ``[H, H] @ [H, Sq*Sk]``
    over contiguous rows (an einsum over the head axis would move the whole tensor twice)."""
    return (p.t().to(x.dtype) @ x.flatten(2)).view_as(x)


class AttentionOnAttention(nn.Module):
    """Huang et al.'s AoA: ``[a; x] [B, S, 2D] -> info * sigmoid(gate) [B, S, D]``."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.proj = nn.Linear(2 * spec.dim, 2 * spec.dim)  # [W_i; W_g], with their biases

    def forward(self, a: Tensor, x: Tensor) -> Tensor:
        info, gate = self.proj(torch.cat((a, x), dim=-1)).chunk(2, dim=-1)
        return info * torch.sigmoid(gate)


def needs_scores(spec: ModelSpec) -> list[str]:
    """The options set in ``spec`` that change the score matrix (need a mechanism that forms it)."""
    return [
        name
        for name, on in (
            ("attn_talking_heads", spec.attn_talking_heads),
            ("residual_attn", spec.residual_attn),
            ("attn_topk", spec.attn_topk is not None),
        )
        if on
    ]
