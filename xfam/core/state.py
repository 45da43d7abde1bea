"""State passed between calls and layers: decode caches, memory states, the view a memory gets of its
layer, and the head expansion of grouped-query attention."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import Tensor

#: Decode state of one layer's mechanism; the default is a key/value cache.
DecodeState = dict[str, Any]

#: Opaque per-layer memory state; None means empty.
MemoryState = Any


@dataclasses.dataclass
class LayerView:
    """What a memory may use of its layer during ``write`` (weights detached: no gradient reaches the layer).

    Attributes:
        keys_values: ``[B, N, D] -> ([B, Hkv, N, Dh], [B, Hkv, N, Dh])``, the layer's key/value projections
            (after its input norm, no positions).
        queries: ``[B, N, D] -> [B, H, N, Dh]``, the query projection (after the input norm, no positions).
        attend: ``(h [B, S, D], states [B, M, D]) -> [B, S, H*Dh]``, the layer's content attention of
            ``h`` over ``states`` (no positions, no mask), before the output projection.
        weights: ``(h [B, S, D], states [B, M, D]) -> [B, H, S, M]``, the probabilities of ``attend``.
        segments: ``[B, S]`` document ids of the segment (continuing across segments), or None.
    """

    keys_values: Callable[[Tensor], tuple[Tensor, Tensor]]
    queries: Callable[[Tensor], Tensor]
    attend: Callable[[Tensor, Tensor], Tensor]
    weights: Callable[[Tensor, Tensor], Tensor]
    segments: Tensor | None = None


def expand_kv(x: Tensor, heads: int) -> Tensor:
    """Repeat ``[B, Hkv, S, Dh]`` key/value heads to ``[B, H, S, Dh]`` for grouped-query attention."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)
