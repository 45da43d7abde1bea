"""Contract of the exit slot: the policy owns how depth is traversed.

The model hands the policy a ``run_layer(step, x) -> x`` closure (attention, memory and decode
state are handled inside it), a ``head(x) -> logits`` for policies that exit early or add
per-layer losses, and the positions ``[S]``, key padding ``[B, S]`` and whether it is decoding.
The policy decides which layers run for which tokens, returns the final hidden states, the
auxiliary losses it owns (exit classifiers, ponder cost) and per-token depth used.
A policy that shares one block across steps (ACT) says so with ``blocks_needed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

from torch import Tensor, nn

from xfam.registry import Component, Registry


@dataclasses.dataclass
class ExitOutput:
    """What a traversal returns.

    Attributes:
        hidden: final hidden states ``[B, S, D]`` (before the final norm and head).
        aux: auxiliary losses owned by the policy, summed into the training loss and logged.
        depth: layers used per token ``[B, S]`` (None when every token used every layer).
        hiddens: per-layer outputs, only for policies with ``wants_hidden_states``.
    """

    hidden: Tensor
    aux: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    depth: Tensor | None = None
    hiddens: list[Tensor] | None = None


class ExitPolicy(nn.Module, Component):
    """Base of every ``exit`` component.

    Capabilities:
        wants_hidden_states: the policy keeps every layer's output (per-layer classifiers).
        early_exit: tokens may skip layers at inference (decode state must then be propagated).
        full_stack: runs every layer once, in order, for every token (the plain stack), so the
            model may replace the traversal (reversible layers run the stack in one pass).
    """

    wants_hidden_states: ClassVar[bool] = False
    early_exit: ClassVar[bool] = False
    full_stack: ClassVar[bool] = False

    def blocks_needed(self, num_layers: int) -> int:
        """How many distinct blocks the model builds (1 for a weight-shared recurrent block)."""
        return num_layers

    def forward(
        self,
        x: Tensor,
        run_layer: Callable[[int, Tensor], Tensor],
        num_layers: int,
        head: Callable[[Tensor], Tensor],
        positions: Tensor | None = None,
        key_padding: Tensor | None = None,
        decoding: bool = False,
    ) -> ExitOutput:
        """``x [B, S, D]`` at ``positions [S]`` (key padding ``[B, S]``, True = real) through the layers."""
        raise NotImplementedError  # abstract


EXIT: Registry[ExitPolicy] = Registry("exit", ExitPolicy)
