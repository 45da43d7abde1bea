"""Every token runs every layer, in order (the standard Transformer stack)."""

from __future__ import annotations

from torch import Tensor

from xfam.core.stack import LayerStack
from xfam.exit._base import EXIT, ExitOutput, ExitPolicy


@EXIT.register("none")
class FullDepth(ExitPolicy):
    """Runs layers 0..L-1 for all tokens; no auxiliary loss."""

    full_stack = True

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: Tensor, stack: LayerStack) -> ExitOutput:
        for step in range(stack.num_layers):
            x = stack.run_layer(step, x)
        return ExitOutput(hidden=x)
