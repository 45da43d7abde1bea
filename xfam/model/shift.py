"""Token shifting (``model.shift_tokens``; x-transformers' ``shift_tokens``, after the token shift of
Peng et al.'s RWKV): a sublayer's input channels are split into groups, group j taken from the row
``amounts[j]`` positions earlier (a negative amount: later), so each token mixes its neighbours' features
at no cost. Amounts are 0..s in a causal model and -s..s in a bidirectional one; channels left over by the
split stay in place. A row never takes features from padding or from another document (zeros instead).

In a decoding loop a sublayer keeps its last ``s`` input rows (``prev``), so cached decoding equals the
full pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.mask import AttnMask

NO_DOC = -(10**9)  # a document id no row has: what lies outside the sequence


def shift_amounts(s: int, causal: bool) -> tuple[int, ...]:
    return tuple(range(0, s + 1)) if causal else tuple(range(-s, s + 1))


def row_info(mask: AttnMask, rows: int) -> tuple[Tensor | None, Tensor | None]:
    """Padding and documents ``[B, rows]`` of the last ``rows`` keys of ``mask`` (None: all real / one document).
    A decode call's mask has no document ids for the cached rows: one document then, as in generation."""
    pad = None if mask.key_padding is None else mask.key_padding[:, -rows:]
    seg = mask.segments
    seg = None if seg is None or seg.shape[1] < rows else seg[:, -rows:]
    return pad, seg


def moved(t: Tensor, a: int, fill: float = 0) -> Tensor:
    """``t [B, N, ...]`` moved ``a`` rows along dim 1 (row i <- row i - a), ``fill`` where nothing comes in."""
    if a == 0:
        return t
    if abs(a) >= t.shape[1]:
        return torch.full_like(t, fill)
    return F.pad(t, (0, 0) * (t.dim() - 2) + (a, -a), value=fill)


def source_ok(pad: Tensor | None, seg: Tensor | None, a: int, p: int, dtype: torch.dtype) -> Tensor | None:
    """``[B, N - p, 1]``: 1 where row i of ``[p:]`` may read row i - a, a real row of its own document (``pad`` /
    ``seg``: ``[B, N]``; None: always)."""
    if a == 0 or (pad is None and seg is None):
        return None
    ok = None if pad is None else moved(pad.to(dtype), a)[:, p:]
    if seg is not None:
        same = (moved(seg, a, NO_DOC)[:, p:] == seg[:, p:]).to(dtype)
        ok = same if ok is None else ok * same
    assert ok is not None  # (pad or seg is given)
    return ok.unsqueeze(-1)


def shift_tokens(
    h: Tensor, amounts: tuple[int, ...], pad: Tensor | None, seg: Tensor | None, prev: Tensor | None = None
) -> Tensor:
    """``h [B, S, D]`` with its channel groups shifted along S; ``prev [B, P, D]``: the rows before ``h`` (decoding);
    ``pad`` / ``seg``: ``[B, P + S]`` real rows and document ids of ``[prev | h]``."""
    s, size = h.shape[1], h.shape[-1] // len(amounts)
    full = h if prev is None else torch.cat((prev, h), dim=1)  # [B, P + S, D]
    p = full.shape[1] - s
    out = []
    for j, a in enumerate(amounts):
        group = moved(full[..., j * size : (j + 1) * size], a)[:, p:]  # [B, S, size]: row i <- row i - a
        ok = source_ok(pad, seg, a, p, h.dtype)  # [B, S, 1]: the source row is real and of the same document
        out.append(group if ok is None else group * ok)
    out.append(full[:, p:, len(amounts) * size :])  # channels the split leaves over stay in place
    return torch.cat(out, dim=-1)
