"""The block path's score helpers, shared by the whole path (``engine``), the chunked one (``chunked``) and
adaptive span: padding and document constraints on visited pairs, the masked softmax, the cached additive mask
of a geometry, and a score bias on visited pairs."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.bias import ScoreBias
from xfam.core.mask import AttnMask, same_document


def _batch_ok(mask: AttnMask, pos: Tensor, q_pos: Tensor) -> Tensor | None:
    """Padding and document constraints at key positions ``pos [Hp, nQ, Kb]`` for queries at
    ``q_pos [nQ, b]``: broadcastable to ``[B, Hp, nQ, b, Kb]``, or None."""
    out = None
    n = max(mask.k_len, int(q_pos.max().item()) + 1)
    pos = pos.clamp(0, mask.k_len - 1)  # out-of-range keys are masked by the geometry already
    if mask.key_padding is not None:
        pad = mask.key_padding.to(pos.device)  # [B, Sk]
        out = pad[:, pos][:, :, :, None, :]
    if mask.segments is not None:
        seg = F.pad(mask.segments.to(pos.device), (0, n - mask.k_len), value=-1)  # [B, n]
        q_seg = seg[:, q_pos]  # [B, nQ, b]
        same = same_document(q_seg[:, None, :, :, None], seg[:, pos][:, :, :, None, :])  # [B, Hp, nQ, b, Kb]
        out = same if out is None else out & same
    return out


def _softmax(scores: Tensor, ok: Tensor, rows_ok: bool = False) -> Tensor:
    """Softmax over allowed entries; rows with none allowed give zeros (and finite gradients).
    ``rows_ok`` promises every row has an allowed entry, which saves the final multiply."""
    probs = torch.softmax(scores.masked_fill(~ok, torch.finfo(scores.dtype).min), dim=-1)
    return probs if rows_ok else probs * ok.any(dim=-1, keepdim=True)


def _additive(geo: Any, dtype: torch.dtype) -> Tensor:
    """``geo.ok`` as an additive mask (0 / dtype min), cached per dtype."""
    cache = geo.additive
    if dtype not in cache:
        cache[dtype] = torch.zeros(geo.ok.shape, dtype=dtype, device=geo.ok.device).masked_fill_(
            ~geo.ok, torch.finfo(dtype).min
        )
    return cache[dtype]


def _pairs(bias: ScoreBias, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """The bias on visited pairs; per-head key positions (a leading ``Hp = H`` dim) pick head h."""
    if k_pos.shape[0] == 1:
        return bias.pairs(q_pos[0], k_pos[0])  # [H, nQ, b, Kb]
    return torch.stack([bias.pairs(q_pos[0], k_pos[h])[h] for h in range(k_pos.shape[0])])
