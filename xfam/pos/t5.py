"""T5 relative position bias (Raffel et al., JMLR 2020, arXiv:1910.10683, sec. 2.1; the bucketing
of the authors' Mesh TensorFlow code, ``_relative_position_bucket``).

Each head adds a learned scalar ``b[h, bucket(j - i)]`` to the score of query i and key j. Buckets:
with ``n = i - j`` (how far back the key is),

* bidirectional: half of the ``num_buckets`` for keys at or before the query, half for keys after
  it (``n < 0``), each half by ``|n|``; causal: every bucket for ``max(n, 0)``;
* within a half of B buckets: ``|n| < B/2`` gets its own bucket (the exact range); beyond,
  ``B/2 + floor(log(|n| / (B/2)) / log(max_distance / (B/2)) * (B - B/2))``, at most ``B - 1``:
  log-spaced buckets that would reach bucket B at ``max_distance``; clamped, the last bucket holds
  every distance from where the formula reaches B - 1 (91 for the bidirectional defaults 32 and
  128, 113 causal).

One table ``[num_buckets, H]`` for the whole model (T5 shares it across layers), initialised
N(0, 0.02). The bias depends only on ``i - j``, so it is relative (memory keeps its meaning), and it
is evaluated on the (query, key) pairs a mechanism visits (``pairs``), never as a dense L x L
table in a sparse mechanism. It is not a pure distance decay, so kernelised attention cannot host it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

import torch
from torch import Tensor, nn

from xfam.core.bias import ScoreBias
from xfam.core.registry import Range
from xfam.pos._base import POS, PositionalEncoding


def t5_bucket(n: Tensor, causal: bool, num_buckets: int, max_distance: int) -> Tensor:
    """Bucket of each distance ``n = i - j`` (query minus key position), as Mesh TensorFlow's."""
    ret = torch.zeros_like(n)
    if causal:
        n = n.clamp_min(0)
    else:
        num_buckets //= 2
        ret = ret + (n < 0).long() * num_buckets
        n = n.abs()
    exact = num_buckets // 2
    far = (
        exact
        + (torch.log(n.clamp_min(1).float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)).long()
    )
    return ret + torch.where(n < exact, n, far.clamp_max(num_buckets - 1))


class T5Bias(ScoreBias):
    """``b[h, i, j] = table[bucket(i - j), h]``."""

    def __init__(self, heads: int, causal: bool, num_buckets: int, max_distance: int):
        super().__init__()
        self.heads, self.causal, self.num_buckets, self.max_distance = heads, causal, num_buckets, max_distance
        self.table = nn.Parameter(torch.randn(num_buckets, heads) * 0.02)  # [buckets, H]

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        buckets = t5_bucket(q_pos - k_pos, self.causal, self.num_buckets, self.max_distance)
        return self.table[buckets].movedim(-1, 0)  # [H, *pairs]

    def kernel_params(self) -> dict[str, Any]:
        """The table ``[NB, H]`` and the bucket of a distance ``qpos - kpos``, looked up in-kernel."""
        bucket = lambda n: t5_bucket(n, self.causal, self.num_buckets, self.max_distance)  # noqa: E731
        return {"kind": "table", "table": self.table, "bucket": bucket}


@POS.register("t5")
class T5(PositionalEncoding):
    """Learned per-head bias over log-bucketed relative distances, shared by all layers.

    Args:
        num_buckets: buckets (bidirectional: half for keys before or at the query, half after).
        max_distance: where the log-spaced buckets would run out; the last bucket starts somewhat
            before it (the module docstring).
    """

    paper = "Raffel et al., JMLR 2020, arXiv:1910.10683 (T5)"

    kind = "bias"
    relative = True

    def __init__(
        self,
        *,
        heads: int,
        causal: bool,
        num_buckets: Annotated[int, Range(ge=2)] = 32,
        max_distance: Annotated[int, Range(ge=2)] = 128,
    ):
        super().__init__()
        self.bias = T5Bias(heads, causal, num_buckets, max_distance)

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        nb, md = params["num_buckets"], params["max_distance"]
        half = nb if ctx.get("causal") else nb // 2  # buckets per direction
        if ctx.get("causal") is False and nb % 2:
            return [f"num_buckets={nb} is odd; bidirectional T5 splits them in two halves. Fix: an even count."]
        if half < 2:  # the exact range half // 2 would be empty, and the log-spaced buckets divide by it
            return [f"num_buckets={nb} leaves {half} per direction; bidirectional T5 needs at least 2 (one exact, "
                    "one log-spaced). Fix: pos.num_buckets >= 4."]  # fmt: skip
        if md <= half // 2:
            return [
                f"max_distance={md} must exceed the exact range ({half // 2} = half of the {half} buckets per "
                f"direction). Fix: pos.max_distance > {half // 2}, or fewer buckets."
            ]
        return []

    def score_bias(self) -> ScoreBias:
        return self.bias
