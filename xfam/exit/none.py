"""Every token runs every layer, in order (the standard Transformer stack)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from xfam.exit._base import EXIT, ExitOutput, ExitPolicy


@EXIT.register("none")
class FullDepth(ExitPolicy):
    """Runs layers 0..L-1 for all tokens; no auxiliary loss."""

    full_stack = True

    def __init__(self) -> None:
        super().__init__()

    def forward(
        self,
        x: Tensor,
        run_layer: Callable[[int, Tensor], Tensor],
        num_layers: int,
        head: Callable[[Tensor], Tensor],
        positions: Tensor | None = None,
        key_padding: Tensor | None = None,
        decoding: bool = False,
        targets: Tensor | None = None,
    ) -> ExitOutput:
        for step in range(num_layers):
            x = run_layer(step, x)
        return ExitOutput(hidden=x)
