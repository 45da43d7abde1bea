"""Factorised attention (Child et al., 2019, "Generating Long Sequences with Sparse Transformers",
sec. 4.2): the shared code of ``strided`` and ``fixed``.

A factorised pattern has two subsets of keys per query, ``A(1)`` and ``A(2)``; a head uses one of
them or their union (``part``: 1, 2 or ``union``, the paper's "merged" head). The paper's three ways
to use them in a model are all the shared schedule form (``xfam.core.schedule``): interleaved per layer
(``per_layer: [{part: 1}, {part: 2}]``), merged (``part: union``) and split across heads
(``per_head: [{heads: 2, part: 1}, {heads: 2, part: 2}]``).

Three paths behind ``backend`` (``auto`` picks ``factorized`` and logs it once):

* ``factorized`` -- each subset is computed in the layout where it is dense, on the key grid of
  ``N = ceil(Sk / l) * l`` positions seen as ``R = N / l`` rows of ``l`` (position ``p = r l + c``):

      Band    (A(1) of both): query blocks of ``qb`` against windows of ``w`` keys,
              scores [B, H, N / qb, qb, w]  (fixed: qb = w = l, block-diagonal);
      Column  (A(2) strided): the grid transposed, query (r, c) against the keys (r', c) of its
              own column, scores [B, H, l, R, R];
      Keys    (A(2) fixed): every query against one gathered set of G = c N / l summary keys,
              scores [B, H, N, G];

  one softmax runs over the subsets of each query together (row maxima and sums combined across
  the layouts, no concatenated copy); for the union, A(2) leaves A(1)'s keys to A(1), so no key
  counts twice. Under a causal mask the query rows go in ``CAUSAL_CHUNKS`` chunks that visit
  only the keys before their end. Cost O(N (w + R)) strided, O(N (l + G)) fixed, never an N x N
  matrix; a hand-written backward (``_Attend``) keeps only the probabilities. This path is in
  ``xfam.attention._factorized_path``; the factors and patterns it runs on are here.
* ``block`` -- the sparse engine's gathered block path with the pattern's block layout.
* ``dense`` -- the engine's dense reference (explicit Sq x Sk scores, for tests).

Queries sit on the grid of the keys (query ``i`` at key index ``offset + i``; only the rows holding
queries are computed); the causal cut, padding, documents and windows come from ``AttnMask`` and
are applied on the visited pairs, and a score bias is evaluated on them with ``bias.pairs``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.attention._factorized_path import Factor, factorized_attention
from xfam.attention._sparse import SparseMechanism, SparsePattern
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask

Part = Literal[1, 2, "union"]


def layout_from_blocks(ok: Tensor) -> Tensor:
    """``[Hp, nQ, nK]`` or ``[nQ, nK]`` bool (query block may see key block) -> ``[Hp|1, nQ, K]``
    key-block indices for ``SparsePattern.layout``, -1 pads."""
    ok = ok if ok.dim() == 3 else ok[None]
    n_k = ok.shape[-1]
    width = max(int(ok.sum(-1).max()), 1)
    idx = torch.where(ok, torch.arange(n_k, device=ok.device), n_k).sort(-1).values[..., :width]
    return torch.where(idx < n_k, idx, -1)


# -- factors: one subset of keys per query, in the layout where it is dense ---------------------------


class Band:
    """Queries ``q0 .. q1 - 1`` in blocks of ``qb``; block ``t`` sees the keys ``t qb + lo .. t qb + lo + w - 1``
    (``lo`` and ``w`` multiples of ``qb``). Scores ``[B, H, nB, qb, w]``."""

    def __init__(self, q0: int, q1: int, qb: int, lo: int, w: int, n: int, device: torch.device):
        self.q0, self.qb, self.lo, self.w, self.nb, self.n = q0, qb, lo, w, (q1 - q0) // qb, n
        start = q0 + torch.arange(self.nb, device=device) * qb
        self.q_pos = (start[:, None] + torch.arange(qb, device=device))[..., None]  # [nB, qb, 1]
        self.k_pos = (start + lo)[:, None, None] + torch.arange(w, device=device)  # [nB, 1, w]

    def prepare(self, x: Tensor) -> Tensor:
        first, span = self.q0 + self.lo, (self.nb - 1) * self.qb + self.w
        front, back = max(0, -first), max(0, first + span - self.n)
        xp = F.pad(x, (0, 0, front, back)) if front or back else x  # zeros outside the sequence
        win = xp[:, :, first + front : first + front + span].unfold(2, self.w, self.qb)  # [B, H, nB, Dh, w]
        return win.transpose(-1, -2).contiguous()  # [B, H, nB, w, Dh]

    def scores(self, q: Tensor, kf: Tensor) -> Tensor:
        return q.unflatten(2, (self.nb, self.qb)) @ kf.transpose(-1, -2)  # [B, H, nB, qb, w]

    def apply(self, p: Tensor, vf: Tensor) -> Tensor:
        return (p @ vf).flatten(2, 3)  # [B, H, m, Dh]

    def scatter(self, a: Tensor, x: Tensor, out: Tensor) -> None:
        g = a.transpose(-1, -2) @ x.unflatten(2, (self.nb, self.qb))  # [B, H, nB, w, Dh]
        for t in range(self.w // self.qb):  # sub-block t of every window: one run of whole key blocks
            first = (self.q0 + self.lo) // self.qb + t  # key block of query block 0's sub-block t
            lo, hi = max(0, -first), min(self.nb, self.n // self.qb - first)
            if hi > lo:
                keys = out[:, :, (first + lo) * self.qb : (first + hi) * self.qb].unflatten(2, (hi - lo, self.qb))
                keys += g[:, :, lo:hi, t * self.qb : (t + 1) * self.qb]

    def rows(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.nb, self.qb))[..., None]

    def to_query(self, y: Tensor) -> Tensor:
        return y.flatten(-2)


# -- patterns ---------------------------------------------------------------------------------------------


class FactorizedPattern(SparsePattern):
    """``A(1)``, ``A(2)`` or their union. Subclasses give each subset's exact rule (``rule1``,
    ``rule2``), its block coverage for the engine's layout (``blocks1``, ``blocks2``: may a query
    block ``[q_lo, q_hi]`` see a key block ``[k_lo, k_hi]``) and its factor on the key grid."""

    stride: int
    part: Part

    def rule1(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        raise NotImplementedError  # abstract

    def rule2(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        raise NotImplementedError  # abstract

    def blocks1(self, q_lo: Tensor, q_hi: Tensor, k_lo: Tensor, k_hi: Tensor, causal: bool) -> Tensor:
        raise NotImplementedError  # abstract

    def blocks2(self, q_lo: Tensor, q_hi: Tensor, k_lo: Tensor, k_hi: Tensor, causal: bool) -> Tensor:
        raise NotImplementedError  # abstract

    def factor1(self, q0: int, q1: int, n: int, causal: bool, device: torch.device) -> Factor:
        """A(1) of the queries at grid positions ``q0 .. q1 - 1`` (whole rows of ``l``) on a grid of ``n``."""
        raise NotImplementedError  # abstract

    def factor2(self, q0: int, q1: int, n: int, causal: bool, device: torch.device) -> Factor:
        """A(2) likewise; under a causal mask it may leave out keys after ``q1``."""
        raise NotImplementedError  # abstract

    def allowed(self, q_pos: Tensor, k_pos: Tensor, head: Tensor | None = None) -> Tensor:
        if self.part == 1:
            return self.rule1(q_pos, k_pos)
        if self.part == 2:
            return self.rule2(q_pos, k_pos)
        return self.rule1(q_pos, k_pos) | self.rule2(q_pos, k_pos)

    def layout(self, n_q: int, n_k: int, offset: int, causal: bool, device: torch.device) -> Tensor:
        b = self.block
        q_lo = (offset + torch.arange(n_q, device=device) * b)[:, None]  # [nQ, 1]
        k_lo = (torch.arange(n_k, device=device) * b)[None, :]  # [1, nK]
        q_hi, k_hi = q_lo + b - 1, k_lo + b - 1
        ok = torch.zeros(n_q, n_k, dtype=torch.bool, device=device)
        if self.part in (1, "union"):
            ok |= self.blocks1(q_lo, q_hi, k_lo, k_hi, causal)
        if self.part in (2, "union"):
            ok |= self.blocks2(q_lo, q_hi, k_lo, k_hi, causal)
        if causal:
            ok &= k_lo <= q_hi
        return layout_from_blocks(ok)

    def factors(self, q0: int, q1: int, n: int, causal: bool, device: torch.device) -> list[tuple[Any, Any]]:
        """``(factor, rule)`` per subset used; in the union A(2) leaves A(1)'s keys to A(1)."""
        out: list[tuple[Any, Any]] = []
        if self.part in (1, "union"):
            out.append((self.factor1(q0, q1, n, causal, device), self.rule1))
        if self.part == 2:
            out.append((self.factor2(q0, q1, n, causal, device), self.rule2))
        if self.part == "union":
            rule = lambda q, k: self.rule2(q, k) & ~self.rule1(q, k)  # noqa: E731
            out.append((self.factor2(q0, q1, n, causal, device), rule))
        return out


class FactorizedMechanism(SparseMechanism):
    """A mechanism on a ``FactorizedPattern``: the factorised path, the engine's block path or its
    dense reference (``backend``)."""

    backends: ClassVar[tuple[str, ...]] = ("factorized", "block", "dense", "triton")

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        return self.attend(self.pattern, q, k, v, mask, bias, modifier, fallback="factorized")

    def fast_path(
        self, path: str, pattern: SparsePattern, q: Tensor, k: Tensor, v: Tensor, mask: AttnMask, bias: Any, p: float
    ) -> Tensor:
        return factorized_attention(q, k, v, cast(FactorizedPattern, pattern), mask, bias, p)  # (its own pattern)
