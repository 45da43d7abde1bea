"""Strided attention (Child et al., 2019, "Generating Long Sequences with Sparse Transformers",
arXiv:1904.10509, sec. 4.2, Fig. 3b), with stride ``l``:

    A(1)_i = {t, t + 1, ..., i},  t = max(0, i - l)     (the previous l positions and i itself)
    A(2)_i = {j : (i - j) mod l = 0}                     (every l-th position back from i)

Causal (the paper's autoregressive case): both intersected with ``j <= i``, as written above.
Bidirectional: the same definitions without the causal cut, i.e. the symmetric forms
``A(1)_i = {j : |i - j| <= l}`` and ``A(2)_i = {j : (i - j) mod l = 0}`` over the whole sequence.

A head uses ``A(1)``, ``A(2)`` or their union (``part``); see ``xfam.attention._factorized`` for the
three ways to use them in a model and for the paths. The factorised path computes A(1) as a band
(query blocks of ``qb`` against ``l + qb`` keys, ``2 l + qb`` bidirectional) and A(2) on the
transposed ``[l, R]`` grid (each query against the ``R = N / l`` keys of its column): O(N (l + qb +
N / l)) time and memory, O(N sqrt(N)) for ``l ~ sqrt(N)`` as in the paper.

Degenerate limit: ``l >= L - 1`` makes A(1) (and so the union) every earlier position (causal) or
every position (bidirectional): dense attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from xfam.attention._base import ATTENTION
from xfam.attention._factorized import Band, FactorizedMechanism, FactorizedPattern, Part
from xfam.core.registry import Positive, Probability


class Column:
    """The key grid transposed (position ``p = r l + c``): query ``(r, c)`` of rows ``a .. b - 1`` sees
    the keys ``(r', c)`` of its own column in rows ``r' < kb``. Scores ``[B, H, l, Rq, Rk]``."""

    def __init__(self, a: int, b: int, kb: int, stride: int, device: torch.device):
        self.l, self.rq, self.rk = stride, b - a, kb
        cols = torch.arange(stride, device=device)[:, None, None]  # [l, 1, 1]
        self.q_pos = (a + torch.arange(b - a, device=device))[:, None] * stride + cols  # [l, Rq, 1]
        self.k_pos = torch.arange(kb, device=device) * stride + cols  # [l, 1, Rk]

    def _cols(self, x: Tensor, rows: int) -> Tensor:
        return x[:, :, : rows * self.l].unflatten(2, (rows, self.l)).transpose(2, 3)  # [B, H, l, rows, Dh]

    def prepare(self, x: Tensor) -> Tensor:
        return self._cols(x, self.rk).contiguous()  # [B, H, l, Rk, Dh]

    def scores(self, q: Tensor, kf: Tensor) -> Tensor:
        return self._cols(q, self.rq) @ kf.transpose(-1, -2)  # [B, H, l, Rq, Rk]

    def apply(self, p: Tensor, vf: Tensor) -> Tensor:
        return (p @ vf).transpose(2, 3).flatten(2, 3)  # [B, H, l, Rq, Dh] -> [B, H, Rq l, Dh]

    def scatter(self, a: Tensor, x: Tensor, out: Tensor) -> None:
        g = a.transpose(-1, -2) @ self._cols(x, self.rq)  # [B, H, l, Rk, Dh]
        out[:, :, : self.rk * self.l].unflatten(2, (self.rk, self.l)).add_(g.transpose(2, 3))

    def rows(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.rq, self.l)).transpose(-1, -2)[..., None]  # [*, l, Rq, 1]

    def to_query(self, y: Tensor) -> Tensor:
        return y.transpose(-1, -2).flatten(-2)  # [*, l, Rq] -> [*, Rq l]


class StridedPattern(FactorizedPattern):
    """``rule1: |i - j| <= l``, ``rule2: (i - j) mod l = 0`` (causality comes from the mask)."""

    def __init__(self, stride: int, part: Part, block: int):
        self.stride, self.part, self.block = stride, part, block

    def rule1(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return (q_pos - k_pos).abs() <= self.stride

    def rule2(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return torch.remainder(q_pos - k_pos, self.stride) == 0

    def blocks1(self, q_lo: Tensor, q_hi: Tensor, k_lo: Tensor, k_hi: Tensor, causal: bool) -> Tensor:
        ahead = 0 if causal else self.stride
        return (k_hi >= q_lo - self.stride) & (k_lo <= q_hi + ahead)

    def blocks2(self, q_lo: Tensor, q_hi: Tensor, k_lo: Tensor, k_hi: Tensor, causal: bool) -> Tensor:
        # some i - j in [q_lo - k_hi, q_hi - k_lo] is a multiple of l
        return torch.div(q_hi - k_lo, self.stride, rounding_mode="floor") * self.stride >= q_lo - k_hi

    def band_block(self) -> int:
        """Query block of the band: the largest divisor of ``l`` not above ``block``."""
        return max(d for d in range(1, min(self.block, self.stride) + 1) if self.stride % d == 0)

    def factor1(self, q0: int, q1: int, n: int, causal: bool, device: torch.device) -> Band:
        qb = self.band_block()
        return Band(q0, q1, qb, -self.stride, (1 if causal else 2) * self.stride + qb, n, device)

    def factor2(self, q0: int, q1: int, n: int, causal: bool, device: torch.device) -> Column:
        key_rows = q1 // self.stride if causal else n // self.stride  # causal: no later row
        return Column(q0 // self.stride, q1 // self.stride, key_rows, self.stride, device)


@ATTENTION.register("strided")
class Strided(FactorizedMechanism):
    """Sparse Transformer strided attention.

    Args:
        stride: ``l``, the band length of A(1) and the step of A(2) (the paper: ``l ~ sqrt(L)``).
        part: which subset this head (or layer) uses: ``1`` (A(1)), ``2`` (A(2)) or ``union``
            (both merged into one head). Vary it with ``per_layer`` / ``per_head``.
        block: query block of the band factor and tile of the block engine (speed only).
        backend: ``auto`` | ``factorized`` | ``block`` | ``dense`` | ``triton`` (see ``xfam.attention._factorized``).
        dropout: dropout on the attention probabilities.
    """

    paper = "Child et al., 2019, arXiv:1904.10509 (Sparse Transformer, strided)"

    def __init__(
        self,
        *,
        stride: Annotated[int, Positive] = 128,
        part: Part = "union",
        block: Annotated[int, Positive] = 64,
        backend: Literal["auto", "factorized", "block", "dense", "triton"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        super().__init__(pattern=StridedPattern(stride, part, block), backend=backend, dropout=dropout)

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        max_len = ctx.get("max_len")
        if max_len is not None and params["stride"] > max_len:
            return [
                f"stride={params['stride']} is larger than model.max_len={max_len}; valid: 1..{max_len} "
                f"(stride = max_len with part 1 or union is full attention). Fix: set attention.stride <= {max_len}."
            ]
        return []

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"stride": seq_len, "part": "union"}
