"""ALiBi: attention with linear biases (Press, Smith & Lewis, ICLR 2022, arXiv:2108.12409).

Each head h adds ``-m_h * |i - j|`` to the score of query i and key j. The slopes form a geometric
sequence starting at ``2^(-8/n)`` with the same ratio; for a head count that is not a power of two
the authors' reference code (ofirpress/attention_with_linear_biases, also fairseq and
x-transformers) takes the slopes of the closest lower power of two, then every other slope of the
doubled count. In a causal model ``|i - j| = i - j`` on every visible pair; the bidirectional form
is the symmetric one. The bias is a pure distance decay: ``exp(bias) = exp(-m_h) ** |i - j|``, which
kernelised attention (performer, rfa) hosts exactly as decayed prefix sums (``xfam.attention._linear``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

import torch
from torch import Tensor

from xfam.core.bias import ScoreBias
from xfam.core.registry import Range
from xfam.pos._base import POS, PositionalEncoding


def alibi_slopes(heads: int) -> list[float]:
    """Slopes for ``heads`` heads by the rule of the paper's reference code."""

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_2(heads)
    lower = 2 ** math.floor(math.log2(heads))
    return power_of_2(lower) + alibi_slopes(2 * lower)[0::2][: heads - lower]


class AlibiBias(ScoreBias):
    """``b[h, i, j] = -m_h |i - j|``; heads beyond ``alibi_heads`` get no bias."""

    slopes: Tensor  # [H], a buffer

    def __init__(self, heads: int, alibi_heads: int):
        super().__init__()
        self.heads = heads
        slopes = torch.zeros(heads)
        slopes[:alibi_heads] = torch.tensor(alibi_slopes(alibi_heads))
        self.register_buffer("slopes", slopes, persistent=False)  # [H]

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        dist = (q_pos - k_pos).abs().to(self.slopes.dtype)
        return -self.slopes.view(-1, *([1] * dist.dim())) * dist  # [H, *pairs]

    def kernel_params(self) -> dict[str, Any]:
        return {"kind": "alibi", "slopes": self.slopes}

    def decay(self) -> Tensor:
        return torch.exp(-self.slopes)


@POS.register("alibi")
class Alibi(PositionalEncoding):
    """Linear distance bias -m_h |i - j| on each head's scores; nothing is added to the input.

    Args:
        heads: number of query heads (injected).
        num_heads: apply the bias to the first ``num_heads`` heads only (the others see no
            position bias, as in x-transformers' ``alibi_num_heads``); null for all heads.
    """

    paper = "Press, Smith & Lewis, ICLR 2022, arXiv:2108.12409"

    kind = "bias"
    relative = True
    decays = True

    def __init__(self, *, heads: int, num_heads: Annotated[int, Range(ge=1)] | None = None):
        super().__init__()
        self.bias = AlibiBias(heads, num_heads or heads)

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        n, heads = params["num_heads"], ctx.get("heads")
        if n is not None and heads is not None and n > heads:
            return [f"num_heads={n} exceeds model.heads={heads}. Fix: set pos.num_heads <= {heads}."]
        return []

    def score_bias(self) -> ScoreBias:
        return self.bias
