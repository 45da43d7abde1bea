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
    """Padding and documents ``[B, rows]`` of the last ``rows`` keys of ``mask`` (None: all real / one document)."""
    pad = None if mask.key_padding is None else mask.key_padding[:, -rows:]
    seg = None if mask.segments is None else mask.segments[:, -rows:]
    return pad, seg


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
        group = full[..., j * size : (j + 1) * size]  # [B, P + S, size]
        if a == 0:
            out.append(group[:, p:])
            continue
        moved = F.pad(group, (0, 0, a, -a))[:, p:]  # row i <- row i - a (zeros past either end)
        ok = None
        if pad is not None:
            ok = F.pad(pad.to(h.dtype), (a, -a))[:, p:]  # [B, S]: the source row is real
        if seg is not None:
            same = (F.pad(seg, (a, -a), value=NO_DOC)[:, p:] == seg[:, p:]).to(h.dtype)
            ok = same if ok is None else ok * same
        out.append(moved if ok is None else moved * ok.unsqueeze(-1))
    out.append(full[:, p:, len(amounts) * size :])  # channels the split leaves over stay in place
    return torch.cat(out, dim=-1)
