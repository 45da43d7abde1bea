"""A learned per-head bias of the clipped relative distance (``pos=clipped_bias``).

Shaw et al. (NAACL 2018, arXiv:1803.02155, sec. 3.2) clip the relative distance ``j - i`` to ``[-k, k]``: "precise
relative position information is not useful beyond a certain distance", so every key further than ``k`` away on
one side shares one learned value. Raffel et al. (T5, JMLR 2020, arXiv:1910.10683, sec. 2.1) add a learned scalar
per head and relative distance to the attention logits, one table shared by every layer. This encoding is the
two together, T5's scalar bias over Shaw's clipped distances (2k + 1 of them; in a causal model only ``j <= i``
occur):

    score[h, i, j] = q_i . k_j / sqrt(d) + w[h, clip(j - i, -k, k)]

It depends only on ``j - i``, so it is relative (keys in a memory or a decode cache keep their bias), and it is
evaluated on the (query, key) pairs a mechanism visits (``pairs``), never as a dense table in a sparse mechanism.
The table starts at N(0, 0.02), as T5's.
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor, nn

from xfam.api import POS, PositionalEncoding, Range, ScoreBias


class ClippedBias(ScoreBias):
    """``b[h, i, j] = table[clip(j - i, -clip, clip) + clip, h]``."""

    def __init__(self, heads: int, clip: int):
        super().__init__()
        self.heads, self.clip = heads, clip
        self.table = nn.Parameter(torch.randn(2 * clip + 1, heads) * 0.02)  # [2k + 1, H]

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        rel = (k_pos - q_pos).clamp(-self.clip, self.clip) + self.clip  # [*pairs] in 0..2k
        return self.table[rel].movedim(-1, 0)  # [H, *pairs]


@POS.register("clipped_bias")
class ClippedBiasEncoding(PositionalEncoding):
    """A learned scalar per head and clipped relative distance, added to every head's scores.

    Args:
        heads: attention heads (injected).
        clip: the largest distance with its own value, Shaw et al.'s k (their best: 16 for translation; they
            found no gain beyond k >= 2 there).
    """

    kind = "bias"
    relative = True
    paper = "Shaw et al., NAACL 2018, arXiv:1803.02155 (clipping); Raffel et al., JMLR 2020, arXiv:1910.10683 (T5 bias)"

    def __init__(self, *, heads: int, clip: Annotated[int, Range(ge=1)] = 16):
        super().__init__()
        self.bias = ClippedBias(heads, clip)

    def score_bias(self) -> ScoreBias:
        return self.bias
