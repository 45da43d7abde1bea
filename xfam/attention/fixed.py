"""Fixed attention (Child et al., 2019, "Generating Long Sequences with Sparse Transformers",
arXiv:1904.10509, sec. 4.2, Fig. 3c), with block length ``l`` and ``c`` summary positions:

    A(1)_i = {j : floor(j / l) = floor(i / l)}           (i's own block of l positions)
    A(2)_i = {j : j mod l in {l - c, ..., l - 1}}         (the last c positions of every block)

Causal (the paper's autoregressive case): both intersected with ``j <= i``. Bidirectional: exactly
the definitions above without the causal cut (A(1) the whole block, A(2) the summary positions of
every block, before and after i). The paper chose ``c in {8, 16, 32}`` for ``l in {128, 256}``.
Every head uses the same summary positions; the paper found distinct sub-blocks of length c per head
preferable (sec. 4.2), which this pattern does not offer.

A head uses ``A(1)``, ``A(2)`` or their union (``part``); see ``xfam.attention._factorized`` for the
three ways to use them in a model and for the paths. The factorised path computes A(1)
block-diagonally (``[B, H, N / l, l, l]`` scores) and A(2) against the ``G = c N / l`` gathered
summary keys, shared by every query (``[B, H, N, G]``): O(N (l + c N / l)) time and memory, never
an N x N matrix. Under the causal mask the summary keys are visited in chunks of query rows, each
chunk against the summary keys before its end only (``causal_chunks``), which halves the A(2) work.

Degenerate limit: ``l >= L`` puts every position in one block, so A(1) (and the union) is dense
attention (causal or bidirectional).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from xfam.attention._base import ATTENTION
from xfam.attention._factorized import Band, FactorizedMechanism, FactorizedPattern, Part
from xfam.core.registry import Positive, Probability


class Keys:
    """Queries ``q0 .. q1 - 1`` all see the same gathered key positions ``g [G]``. Scores ``[B, H, m, G]``."""

    def __init__(self, q0: int, q1: int, g: Tensor):
        self.g = g
        self.q_pos = torch.arange(q0, q1, device=g.device)[:, None]  # [m, 1]
        self.k_pos = g[None]  # [1, G]

    def prepare(self, x: Tensor) -> Tensor:
        return x[:, :, self.g]  # [B, H, G, Dh]

    def scores(self, q: Tensor, kf: Tensor) -> Tensor:
        return q @ kf.transpose(-1, -2)  # [B, H, m, G]

    def apply(self, p: Tensor, vf: Tensor) -> Tensor:
        return p @ vf  # [B, H, m, Dh]

    def scatter(self, a: Tensor, x: Tensor, out: Tensor) -> None:
        out.index_add_(2, self.g, a.transpose(-1, -2) @ x)  # [B, H, G, Dh] into the key positions

    def rows(self, x: Tensor) -> Tensor:
        return x[..., None]

    def to_query(self, y: Tensor) -> Tensor:
        return y


class FixedPattern(FactorizedPattern):
    """``rule1: floor(i / l) = floor(j / l)``, ``rule2: j mod l >= l - c`` (causality from the mask)."""

    def __init__(self, stride: int, summary: int, part: Part, block: int):
        self.stride, self.summary, self.part, self.block = stride, summary, part, block

    def rule1(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return torch.div(q_pos, self.stride, rounding_mode="floor") == torch.div(
            k_pos, self.stride, rounding_mode="floor"
        )

    def rule2(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return torch.remainder(k_pos, self.stride) >= self.stride - self.summary

    def blocks1(self, q_lo: Tensor, q_hi: Tensor, k_lo: Tensor, k_hi: Tensor, causal: bool) -> Tensor:
        first = torch.div(q_lo, self.stride, rounding_mode="floor") * self.stride
        last = torch.div(q_hi, self.stride, rounding_mode="floor") * self.stride + self.stride - 1
        return (k_hi >= first) & (k_lo <= last)

    def blocks2(self, q_lo: Tensor, q_hi: Tensor, k_lo: Tensor, k_hi: Tensor, causal: bool) -> Tensor:
        # the key block's residues run from k_lo mod l for (k_hi - k_lo) steps: do they reach l - c?
        reach = torch.remainder(k_lo, self.stride) + (k_hi - k_lo)
        return (reach >= self.stride - self.summary).expand(q_lo.shape[0], -1)

    def factor1(self, q0: int, q1: int, n: int, causal: bool, device: torch.device) -> Band:
        return Band(q0, q1, self.stride, 0, self.stride, n, device)

    def factor2(self, q0: int, q1: int, n: int, causal: bool, device: torch.device) -> Keys:
        pos = torch.arange(q1 if causal else n, device=device)  # causal: no key after the chunk
        return Keys(q0, q1, pos[torch.remainder(pos, self.stride) >= self.stride - self.summary])


@ATTENTION.register("fixed")
class Fixed(FactorizedMechanism):
    """Sparse Transformer fixed attention.

    Args:
        stride: ``l``, the block length (the paper: 128 or 256).
        summary: ``c``, the summary positions at the end of every block (the paper: 8, 16 or 32).
        part: which subset this head (or layer) uses: ``1`` (A(1)), ``2`` (A(2)) or ``union``
            (both merged into one head). Vary it with ``per_layer`` / ``per_head``.
        block: tile of the block engine (speed only).
        backend: ``auto`` | ``factorized`` | ``block`` | ``dense`` | ``triton`` (see ``xfam.attention._factorized``).
        dropout: dropout on the attention probabilities.
    """

    paper = "Child et al., 2019, arXiv:1904.10509 (Sparse Transformer, fixed)"

    def __init__(
        self,
        *,
        stride: Annotated[int, Positive] = 128,
        summary: Annotated[int, Positive] = 16,
        part: Part = "union",
        block: Annotated[int, Positive] = 64,
        backend: Literal["auto", "factorized", "block", "dense", "triton"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        super().__init__(pattern=FixedPattern(stride, summary, part, block), backend=backend, dropout=dropout)

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        max_len, out = ctx.get("max_len"), []
        if max_len is not None and params["stride"] > max_len:
            out.append(
                f"stride={params['stride']} is larger than model.max_len={max_len}; valid: 1..{max_len} "
                f"(stride = max_len with part 1 or union is full attention). Fix: set attention.stride <= {max_len}."
            )
        if params["summary"] > params["stride"]:
            out.append(
                f"summary={params['summary']} exceeds stride={params['stride']}: a block of l positions has at most "
                f"l summary positions; valid: 1..{params['stride']}. Fix: set attention.summary <= attention.stride."
            )
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"stride": seq_len, "summary": 1, "part": "union"}
