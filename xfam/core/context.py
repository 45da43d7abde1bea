"""The per-call layer context: what every layer of one forward pass shares."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from torch import Tensor

from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask


class Rotary(Protocol):
    """What a layer uses of the positional encoding: its rotation (identity for non-rotary kinds) and its
    layer's score modifier (None for most kinds)."""

    def rotate(self, x: Tensor, tables: tuple[Tensor, ...], key: bool = False) -> Tensor: ...

    def score_modifier(self, layer: int) -> ScoreModifier | None: ...


@dataclasses.dataclass
class LayerContext:
    """Everything a block needs that is the same for all layers of one forward pass.

    ``rotary`` holds the tables for the keys computed in this call (memory + segment, or the new
    tokens when decoding); queries use its last Sq rows. ``step``: in a fixed-shape decode call
    (``xfam.model.static_cache``), the position of its one new token, a 0-dim long tensor; the mechanism's
    ``decode_step`` then attends over its own state and ``mask`` covers the new row alone.
    """

    mask: AttnMask
    pos: Rotary
    bias: ScoreBias | None
    rotary: tuple[Tensor, ...] | None
    decoding: bool = False
    step: Tensor | None = None
