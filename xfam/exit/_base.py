"""Contract of the exit slot: the policy owns how depth is traversed.

The model hands the policy its input rows ``x [B, G + S, D]`` and a ``LayerStack``
(``xfam.core.stack``): ``stack.run_layer(step, x) -> x`` runs one layer (attention, memory and decode
state are handled inside), ``stack.head(x, proj=None) -> logits`` is the final norm and output layer
(``[B, S, V]`` for a language model, pooled ``[B, C]`` for a classifier; ``proj`` replaces the output
layer with a policy's own per-layer classifier), and ``stack.positions [G + S]``,
``stack.key_padding [B, G + S]``, ``stack.decoding`` and, in training, ``stack.targets`` (``[B, S]``
next-token ids with -100 = none, or ``[B]`` labels, which per-layer classifiers train on) describe the
call. The policy decides which layers run for which tokens, and returns the final hidden states, the
auxiliary losses it owns (per-layer losses, exit classifiers, ponder cost) and the per-token depth used.
A policy that shares one block across steps (ACT) says so with ``blocks_needed``. The model's stack also has
``run_layer_rows(step, x, running)``, which early exit uses once tokens have left (``xfam.exit._early``); a
stack without it (a test double) runs every layer whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.core.registry import Component, Registry
from xfam.core.stack import LayerStack
from xfam.exit._early import Decide, traverse_all, traverse_with_exits


@dataclasses.dataclass
class ExitOutput:
    """What a traversal returns.

    Attributes:
        hidden: final hidden states ``[B, S, D]`` (before the final norm and head).
        aux: auxiliary losses owned by the policy, summed into the training loss and logged.
        depth: layers used per token ``[B, S]`` (None when every token used every layer).
        logits: the output, when the policy's own per-layer classifiers produced it (else the model
            applies its head to ``hidden``).
    """

    hidden: Tensor
    aux: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    depth: Tensor | None = None
    logits: Tensor | None = None


class ExitPolicy(nn.Module, Component):
    """Base of every ``exit`` component.

    Capabilities:
        early_exit: tokens may skip layers at inference (decode state must then be propagated).
        full_stack: runs every layer once, in order, for every token (the plain stack), so the
            model may replace the traversal (reversible layers run the stack in one pass).
    """

    early_exit: ClassVar[bool] = False
    full_stack: ClassVar[bool] = False

    def blocks_needed(self, num_layers: int) -> int:
        """How many distinct blocks the model builds (1 for a weight-shared recurrent block)."""
        return num_layers

    def forward(self, x: Tensor, stack: LayerStack) -> ExitOutput:
        """``x [B, G + S, D]`` through the layers of ``stack`` (run with ``stack.run_layer``)."""
        raise NotImplementedError  # abstract

    def full_depth(self) -> contextlib.AbstractContextManager[None]:
        """Within this context an early-exit policy runs every layer for every token (the full model
        it is compared against in ``xfam eval`` and ``xfam generate``); others are unaffected."""
        return contextlib.nullcontext()


class EarlyExitPolicy(ExitPolicy):
    """Base of policies whose tokens may leave the stack early (``calm``, ``depth_adaptive``).

    ``inference_options`` are the parameters that only change inference (threshold, measure, ...):
    ``xfam eval``, ``xfam generate`` and ``xfam calibrate`` may override them on a trained model.
    """

    early_exit = True
    inference_options: ClassVar[tuple[str, ...]] = ()
    threshold: float  # above 1: no exits
    exit_at: int  # > 0: every token exits after this layer

    def __init__(self) -> None:
        super().__init__()
        self._full = False

    def traverse(self, x: Tensor, stack: LayerStack, decide: Decide) -> tuple[Tensor, Tensor]:
        """Inference: each token's state at its exit ``[B, S, D]`` and its depth ``[B, S]``. Every layer for
        every token when exits are disabled (``full_depth()``, or a threshold above 1 without ``exit_at``),
        every token out after ``exit_at`` when it is set, else where ``decide`` says."""
        n = stack.num_layers
        if self._full or (self.exit_at == 0 and self.threshold > 1):
            return traverse_all(x, stack.run_layer, n)[-1], torch.full(x.shape[:2], n, device=x.device)
        if self.exit_at:
            decide = lambda n, before, after: torch.full(after.shape[:2], n == self.exit_at, device=after.device)
        run_rows = getattr(stack, "run_layer_rows", None)  # (a stack without it runs exited tokens' layers whole)
        return traverse_with_exits(x, stack.run_layer, n, decide, stack.decoding, run_rows)

    @contextlib.contextmanager
    def full_depth(self) -> Iterator[None]:
        self._full, before = True, self._full
        try:
            yield
        finally:
            self._full = before


def target_nll(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per-target NLL and which targets count: ``[B, S, V]`` with ``[B, S]`` ids (-100 = none) gives
    ``[B, S]``; ``[B, C]`` with ``[B]`` labels gives ``[B]``. Ignored targets have NLL 0."""
    keep = targets != -100
    nll = F.cross_entropy(logits.float().flatten(0, -2), targets.clamp_min(0).flatten(), reduction="none")
    return nll.view(targets.shape) * keep, keep


def layer_losses(
    hiddens: list[Tensor], logits_of: Callable[[int, Tensor], Tensor], targets: Tensor, weights: list[float]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-layer classifiers' training loss ``sum_n weights[n-1] * mean NLL at layer n`` (mean over the
    targets that count; ``logits_of(n, h)`` is layer n's classifier, n = 1..N), and per layer the NLL
    and argmax prediction ``[N, *targets.shape]`` (for oracles and consistency labels), and which
    targets count ``targets.shape``."""
    nlls, preds = [], []
    for n, h in enumerate(hiddens, start=1):
        logits = logits_of(n, h)
        nll, keep = target_nll(logits, targets)
        nlls.append(nll)
        preds.append(logits.argmax(-1))
    count = keep.sum().clamp_min(1)
    loss = sum(
        (w * nll.sum() / count for w, nll in zip(weights, nlls, strict=True) if w), targets.new_zeros(()).float()
    )
    return loss, torch.stack(nlls), torch.stack(preds), keep


EXIT: Registry[ExitPolicy] = Registry("exit", ExitPolicy)
