"""Blockwise self-attention (Qiu et al., 2019, "Blockwise Self-Attention for Long Document
Understanding", BlockBERT, arXiv:1911.02972, sec. 3).

The L x L attention matrix is split into n x n blocks; query block i attends key block pi(i) only,
for a permutation pi of the n blocks chosen per head. The paper's masking matrix, 0-based, is

    M[i, j] = 1  iff  pi(floor(i n / L)) = floor(j n / L),
    out_b = softmax(Q_b K_pi(b)^T / sqrt(Dh)) V_pi(b)      for every query block b,

so blocks hold L / n positions; when n does not divide L the same formula gives blocks of
floor(L / n) or ceil(L / n) positions (no padding, no error). BlockBERT gave the identity
permutation to most heads (local context) and cyclic shifts pi(i) = (i + s) mod n to the others
(long-range context): with BERT's 12 heads, 10:2 for n = 2 (identity : shift 1) and 8:2:2 for
n = 3. The default here generalises that: ``max(1, H // 6)`` heads per shift s = 1..n-1, the rest
identity. ``shifts`` (one per head) or ``permutations`` (one list per head) override it.

It is an encoder (bidirectional) mechanism: a shifted block lies after its query block, and a
causal cut would leave most queries of a shifted head with nothing to see, so a causal model is
refused at build time (``causal = False``). Cost O(L^2 / n) through the block engine, whose tile is
one block (``[B, H, n, L/n, L/n]`` scores). Degenerate limit: n = 1 is dense attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from xfam.attention._base import ATTENTION
from xfam.attention._factorized import layout_from_blocks
from xfam.attention._sparse import SparseMechanism, SparsePattern
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask
from xfam.core.registry import Positive, Probability


def default_shifts(n_blocks: int, heads: int) -> list[int]:
    """BlockBERT's assignment generalised: ``max(1, H // 6)`` heads per shift 1..n-1, the rest identity."""
    per = max(1, heads // 6)
    shifted = [s for s in range(1, n_blocks) for _ in range(per)]
    return [0] * (heads - len(shifted)) + shifted


def head_permutations(
    n_blocks: int, heads: int, shifts: list[int] | None, permutations: list[list[int]] | None
) -> tuple[tuple[int, ...], ...]:
    """One permutation of ``0..n-1`` per head (``perm[h][i]`` = key block of query block i)."""
    if permutations is not None:
        return tuple(tuple(p) for p in permutations)
    shifts = default_shifts(n_blocks, heads) if shifts is None else shifts
    return tuple(tuple((i + s) % n_blocks for i in range(n_blocks)) for s in shifts)


class BlockPermutationPattern(SparsePattern):
    """``pi_h(floor(i n / L)) = floor(j n / L)`` on keys ``0..L-1``; the engine's tile is ``ceil(L / n)``."""

    def __init__(self, perms: tuple[tuple[int, ...], ...], length: int):
        self.perms, self.length, self.n = perms, length, len(perms[0])
        self.block = -(-length // self.n)
        self.heads = 1 if len(set(perms)) == 1 else len(perms)
        self._perm = torch.tensor(perms[: self.heads], dtype=torch.long)  # [Hp, n]

    def _blk(self, pos: Tensor) -> Tensor:
        return torch.div(pos * self.n, self.length, rounding_mode="floor")

    def allowed(self, q_pos: Tensor, k_pos: Tensor, head: Tensor | None = None) -> Tensor:
        perm = self._perm.to(q_pos.device)
        head = torch.zeros((), dtype=torch.long, device=q_pos.device) if head is None else head
        inside = (q_pos >= 0) & (q_pos < self.length) & (k_pos >= 0) & (k_pos < self.length)
        return inside & (perm[head, self._blk(q_pos).clamp(0, self.n - 1)] == self._blk(k_pos))

    def layout(self, n_q: int, n_k: int, offset: int, causal: bool, device: torch.device) -> Tensor:
        b, n = self.block, self.n
        eye = torch.eye(n, device=device)

        def touched(first: int, tiles: int) -> Tensor:  # [tiles, n]: tile t holds positions of block P
            pos = first + torch.arange(tiles * b, device=device)
            real = ((pos >= 0) & (pos < self.length)).float()[:, None]
            return (eye[self._blk(pos).clamp(0, n - 1)] * real).view(tiles, b, n).amax(1)

        perm = eye[self._perm.to(device)]  # [Hp, n, n]: P -> pi_h(P) one-hot
        ok = touched(offset, n_q) @ perm @ touched(0, n_k).t()  # [Hp, nQ, nK]
        return layout_from_blocks(ok > 0)


@ATTENTION.register("blockwise")
class Blockwise(SparseMechanism):
    """BlockBERT's blockwise attention: query block i of n attends key block pi_h(i) only.

    Args:
        n_blocks: n, the number of blocks (BlockBERT: 2 or 3).
        shifts: one cyclic shift s per head, pi(i) = (i + s) mod n (0 = identity); null = the
            paper's assignment (module docstring).
        permutations: one permutation of 0..n-1 per head (overrides the shifts).
        backend: ``auto`` (the flash kernel on CUDA, else the block engine) | ``block`` | ``dense`` (the
            reference) | ``triton``.
        dropout: dropout on the attention probabilities.
    """

    paper = "Qiu et al., 2019, arXiv:1911.02972 (BlockBERT)"
    causal = False
    accepts_memory = False

    def __init__(
        self,
        *,
        heads: int,
        n_blocks: Annotated[int, Positive] = 2,
        shifts: list[int] | None = None,
        permutations: list[list[int]] | None = None,
        backend: Literal["auto", "block", "dense", "triton"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        super().__init__(pattern=None, backend=backend, dropout=dropout)  # type: ignore[arg-type]
        self.perms = head_permutations(n_blocks, heads, shifts, permutations)
        self._patterns: dict[int, BlockPermutationPattern] = {}  # blocks depend on the length

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        if mask.k_len not in self._patterns:
            if len(self._patterns) >= 8:
                self._patterns.pop(next(iter(self._patterns)))
            self._patterns[mask.k_len] = BlockPermutationPattern(self.perms, mask.k_len)
        return self.attend(self._patterns[mask.k_len], q, k, v, mask, bias, modifier)

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        n, heads, max_len = params["n_blocks"], ctx.get("heads"), ctx.get("max_len")
        shifts, perms, out = params["shifts"], params["permutations"], []
        if max_len is not None and n > max_len:
            out.append(f"n_blocks={n} > model.max_len={max_len}; valid: 1..{max_len}. Fix: fewer blocks.")
        if shifts is not None and perms is not None:
            out.append(
                "shifts and permutations are both set. Fix: give one of them (permutations is the general form)."
            )
        if heads is None:
            return out
        if shifts is not None and len(shifts) != heads:
            out.append(f"shifts has {len(shifts)} entries for {heads} heads. Fix: one shift per head.")
        if perms is not None and (len(perms) != heads or any(sorted(p) != list(range(n)) for p in perms)):
            out.append(
                f"permutations must hold {heads} permutations of 0..{n - 1} (one per head), got {perms}. "
                f"Fix: e.g. {[list(range(n))] * heads}."
            )
        if shifts is None and perms is None and n > 1 and (n - 1) * max(1, heads // 6) >= heads:
            out.append(
                f"the default head assignment (max(1, heads // 6) heads per shift 1..{n - 1}, the rest identity) "
                f"leaves no identity head with {heads} heads and n_blocks={n}. Fix: set attention.shifts, one per "
                f"head, e.g. {[s % n for s in range(heads)]}, or fewer blocks."
            )
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"n_blocks": 1}
