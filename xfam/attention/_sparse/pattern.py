"""Sparse attention patterns: which keys each query may see, as blocks plus an exact rule.

A pattern describes itself in two ways that must agree:

* ``allowed(q_pos, k_pos)`` -- the exact rule on (query, key) positions, the paper's definition
  (a window, a stride, a block permutation ...). It is what the dense reference path and the tests
  use, and what the block path applies inside the blocks it visits.
* ``layout(...)`` -- for each query block of ``block`` positions, the key blocks it visits,
  ``[Hp, nQ, K]`` (Hp = 1 when all heads share the pattern, else one row per head; -1 pads). It
  must cover every allowed pair (a test checks it); the block path costs O(L * K * block).

Global positions (Longformer's, BigBird's) are listed apart in ``global_positions``: they attend to
every key and every query attends to them, so the engine handles them densely beside the blocks.

Positions are key indices (``AttnMask`` coordinates): queries sit at ``offset + i``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class SparsePattern:
    """Base of every pattern. Subclasses set ``block`` and implement ``allowed`` and ``layout``.

    Attributes:
        block: positions per block (queries and keys).
        heads: 1 when the pattern is the same for all heads, else the number of heads.
        global_positions: key-index positions with global attention (empty: none).
    """

    block: int
    heads: int = 1
    global_positions: tuple[int, ...] = ()

    def allowed(self, q_pos: Tensor, k_pos: Tensor, head: Tensor | None = None) -> Tensor:
        """Whether query position ``q_pos`` may see key position ``k_pos`` (all broadcast).

        ``head`` holds head indices broadcastable to the positions when ``heads > 1`` (patterns
        shared by all heads ignore it). Causality and padding are not part of the rule.
        """
        raise NotImplementedError  # abstract

    def layout(self, n_q: int, n_k: int, offset: int, causal: bool, device: torch.device) -> Tensor:
        """``[Hp, n_q, K]`` key-block indices each query block visits (-1: none).

        ``offset`` is the key index of the first query, a multiple of ``block`` or not; ``causal``
        lets a pattern skip future blocks.
        """
        raise NotImplementedError  # abstract

    def band(self, offset: int, causal: bool) -> tuple[int, int] | None:
        """For a banded layout (query block i visits key blocks ``first + i .. first + i + K - 1``,
        clipped to the sequence), ``(first, K)``: the engine then takes strided views of the keys
        instead of gathering them. None for other layouts."""
        return None

    def key(self) -> tuple:
        """Identifies the pattern's geometry, so layers with equal patterns share derived tensors."""
        public = tuple((k, v) for k, v in sorted(vars(self).items()) if not k.startswith("_"))
        return (type(self).__name__, self.block, self.heads, self.global_positions, public)


def auto_block(reach: int) -> int:
    """The engine tile for a band reaching ``reach`` positions: the power of two nearest ``reach / 2``
    within [64, 256]. Larger query blocks mean larger matmuls and fewer overlapping key copies, at the
    price of masked pairs inside the tile; at a 512 window, tile 256 measured ~1.2x faster than 64."""
    return int(min(256, max(64, 2 ** round(math.log2(max(reach, 2) / 2)))))


def window_band(offset: int, block: int, before: int, after: int) -> tuple[int, int]:
    """``(first, K)`` of the banded layout covering, for every query of a block, the positions
    from ``before`` before it to ``after`` after it (see ``SparsePattern.band``)."""
    first = (offset - before) // block  # key block of query block 0's earliest key
    last = (offset + block - 1 + after) // block
    return first, last - first + 1


def band_layout(n_q: int, n_k: int, first: int, width: int, device: torch.device) -> Tensor:
    """``[1, n_q, K]`` indices of a banded layout, -1 outside ``[0, n_k)``."""
    idx = first + torch.arange(n_q, device=device)[:, None] + torch.arange(width, device=device)[None, :]
    return torch.where((idx >= 0) & (idx < n_k), idx, torch.full_like(idx, -1))[None]


def window_layout(n_q: int, n_k: int, offset: int, block: int, before: int, after: int, device: torch.device) -> Tensor:
    """``[1, n_q, K]``: for query block i, the key blocks holding positions within ``before``
    positions before and ``after`` after any query of the block (clipped to ``[0, n_k)``)."""
    return band_layout(n_q, n_k, *window_band(offset, block, before, after), device)
