"""What an exit policy drives: the model's layer stack for one forward call.

The exit slot owns how depth is traversed; the model owns everything inside a layer (attention,
memory, decode state) and the head. A policy gets one ``LayerStack`` and calls ``run_layer`` for
the layers it wants, in order, and ``head`` where it needs logits (early exits, per-layer losses).
The rows of every tensor are ``[aux tokens | input]`` (aux tokens: memory tokens or ETC's globals,
none in most models); the head drops the aux rows, and scores the T rows that have targets: every input row,
or a Decision Transformer's state rows (``scored_rows``).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn


class LayerStack(Protocol):
    """The layer stack of one forward call.

    Attributes:
        num_layers: layers (steps) in the stack; a weight-shared policy (ACT) runs one block this often.
        positions: ``[G + S]`` positions of the rows.
        key_padding: ``[B, G + S]`` True for real tokens (None: no padding).
        decoding: the call extends a decode cache (a policy that skips layers must still complete it).
        targets: the loss's targets in training (``[B, S]`` next-token ids with -100 = none, or ``[B]``
            labels), for policies that train per-layer classifiers; None otherwise.
    """

    num_layers: int
    positions: Tensor
    key_padding: Tensor | None
    decoding: bool
    targets: Tensor | None

    def run_layer(self, step: int, x: Tensor) -> Tensor:
        """Layer ``step`` (0-based) on ``x [B, G + S, D]``; memory and decode state are handled inside."""
        ...

    def head(self, x: Tensor, proj: nn.Module | None = None) -> Tensor:
        """Final norm and output layer: ``[B, G + S, D] -> [B, S, V]`` (language model) or pooled ``[B, C]``;
        ``proj`` replaces the output layer (a policy's own per-layer classifier)."""
        ...

    def scored_rows(self, rows: Tensor) -> Tensor:
        """Of per-row values ``[B, G + S, ...]``, the T rows the head scores ``[B, T, ...]``."""
        ...

    def spread_scores(self, scores: Tensor, rows: int, fill: float) -> Tensor:
        """Per-scored-row values ``[B, T]`` back to every row ``[B, rows]``, ``fill`` on the others."""
        ...
