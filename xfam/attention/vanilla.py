"""Dense scaled dot-product attention (Vaswani et al., 2017): softmax(q k^T / sqrt(Dh) + b) v.

Three paths behind ``backend``:

* ``sdpa`` -- ``torch.nn.functional.scaled_dot_product_attention`` (flash/memory-efficient
  kernels; grouped-query heads natively). Takes the mask as a causal flag when it is plainly
  causal, else as one additive tensor that folds in the score bias.
* ``torch`` -- the einsum reference: explicit scores, so it can host score modifiers.
* ``triton`` -- xfam's fused flash kernel (``xfam.attention._fused``): masks, ALiBi and T5 biases
  in-kernel, so a biased or windowed call never materialises an ``Sq x Sk`` tensor.

``auto`` takes the Triton kernel on CUDA for the calls it computes exactly, else sdpa, or torch when a
score modifier needs explicit scores; the choice is logged once.

Persistent keys (``mask.persistent``, ``model.num_mem_kv``) take part in the softmax like any key, with
no position: a score bias is zero on them (``additive_mask``) and a score modifier acts on the other
keys only.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.attention import _fused as fused
from xfam.attention import _static as static
from xfam.attention._base import ATTENTION, AttentionMechanism
from xfam.core.bias import ScoreBias, ScoreModifier, additive_mask
from xfam.core.mask import AttnMask
from xfam.core.registry import Probability
from xfam.core.state import DecodeState, expand_kv


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttnMask,
    bias: ScoreBias | None = None,
    modifier: ScoreModifier | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """Explicit-score attention; the ground truth every other path is tested against."""
    heads = q.shape[1]
    k, v = expand_kv(k, heads), expand_kv(v, heads)  # [B, H, Sk, Dh]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # [B, H, Sq, Sk]
    p = mask.persistent
    if modifier is not None:
        scores = modifier.all_logits(scores, q, k, mask)  # (a positional modifier: on the last Sk - P keys)
    add = additive_mask(mask, bias, scores.dtype, scores.device)
    if add is not None:
        scores = scores + add
    probs = torch.softmax(scores, dim=-1)
    if modifier is not None:
        probs = modifier.probs(probs, mask)
    if dropout:
        probs = F.dropout(probs, dropout)
    out = torch.einsum("bhqk,bhkd->bhqd", probs, v)  # [B, H, Sq, Dh]
    extra = modifier.output(probs[..., p:], mask) if modifier is not None else None
    return out if extra is None else out + extra


@ATTENTION.register("vanilla")
class Vanilla(AttentionMechanism):
    """Full softmax attention over all visible keys.

    Args:
        backend: ``auto`` | ``sdpa`` | ``torch`` | ``triton`` (see the module docstring).
        dropout: dropout on the attention probabilities (training only).
    """

    paper = "Vaswani et al., 2017, arXiv:1706.03762"

    hosts_modifiers = True
    accepts_persistent_kv = True
    cross_attention = True
    backends = ("sdpa", "torch", "triton")

    def __init__(
        self,
        *,
        backend: Literal["auto", "sdpa", "torch", "triton"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        super().__init__()
        self.backend, self.dropout = backend, dropout

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        p = self.dropout if self.training else 0.0
        fallback = "torch" if modifier is not None else "sdpa"
        path = fused.choose("vanilla", self.backend, fallback, q, mask, bias, p, modifier)
        if path == "triton":
            return fused.flash(q, k, v, mask, bias)
        if path == "torch":
            return reference_attention(q, k, v, mask, bias, modifier, p)
        if mask.is_plain_causal and bias is None:
            attn_mask, is_causal = None, True
        else:
            attn_mask, is_causal = additive_mask(mask, bias, q.dtype, q.device), False
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal, enable_gqa=k.shape[1] != q.shape[1]
        )

    def static_problem(self) -> str | None:
        return None

    def static_state(self, prefix: DecodeState, capacity: int) -> DecodeState:
        return static.kv_state(prefix, capacity)

    def decode_step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None
    ) -> Tensor:
        """Dense attention over the key/value cache's slots 0..pos (``xfam.attention._static.kv_step``)."""
        return static.kv_step(q, k, v, state, pos, bias)

    def static_write(self, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None) -> None:
        static.kv_write(k, v, state, pos)

    @classmethod
    def refusals(cls, params: dict, selection: Any) -> list[str]:
        backend, out = params.get("backend"), []
        if backend in ("sdpa", "triton") and selection.pos[0].kind == "modifier":
            out.append(
                f"attention=vanilla backend={backend} cannot host pos={selection.pos[0].registry_name} "
                f"({backend} never materialises scores). Fix: attention.backend=auto or attention.backend=torch."
            )
        if backend == "triton" and params.get("dropout"):
            out.append(
                "attention=vanilla backend=triton: the Triton kernel has no attention dropout. "
                "Fix: attention.dropout=0, or attention.backend=auto (sdpa while dropout is on)."
            )
        return out + fused.triton_refusals(cls, {"backend": backend}, selection, "sdpa")
