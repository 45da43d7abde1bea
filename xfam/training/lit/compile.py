"""``trainer.compile``: ``torch.compile`` of the model for training (docs/compile.md).

What is compiled is the ``XfamModel`` call of the training step (embedding, every layer, exit policy, head,
the auxiliary losses a component returns); the loss over the logits, logging and the optimizer stay eager, as
they are in Lightning's loop. Evaluation, in-training generation and rollouts call the eager model: their
shapes and modes change from call to call (decode caches, growing prefixes), where a compiled graph would be
recompiled again and again for no gain.

The compiled wrapper is kept *out of* the module tree (``CompiledTraining`` is not an ``nn.Module``): as an
attribute of a ``LightningModule`` it would be registered as a submodule, and the parameters would reach
``state_dict`` a second time under torch.compile's ``_orig_mod.`` prefix. So a compiled run's checkpoint is
the eager run's, key for key, and loads into an uncompiled model (and the reverse); ``strip_compiled_prefix``
also removes the prefix from a state dict written by code that compiled the model in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from xfam.core.logs import log, log_once

#: The prefix ``torch.compile``'s ``OptimizedModule`` puts before the names of the module it wraps.
PREFIX = "_orig_mod."


def compile_mode(config: Mapping[str, Any]) -> str | None:
    """The mode ``trainer.compile_mode`` names when ``trainer.compile`` is on, else None (a checkpoint's config
    from before the option existed: off)."""
    trainer = config.get("trainer") or {}
    return str(trainer.get("compile_mode", "default")) if trainer.get("compile", False) else None


def dynamo_settings() -> None:
    """Let dynamo trace past xfam's ``log_once`` (a backend choice said on a component's first call): as a
    reorderable logging function it is called after the graph with the same message, instead of splitting
    the graph at every call site (``scripts/compile_census.py`` counted 4-5 breaks per model without this)."""
    torch._dynamo.config.reorderable_logging_functions.add(log_once)


class CompiledTraining:
    """``torch.compile(model, mode=...)``, held as a plain object so it is never a submodule (see the module
    docstring). Compilation itself happens on the first call, with the first batch's shapes."""

    def __init__(self, model: nn.Module, mode: str) -> None:
        self.mode = mode
        dynamo_settings()
        self.call = torch.compile(model, mode=None if mode == "default" else mode)
        device = next(model.parameters()).device.type
        graphs = " (CUDA graphs)" if mode == "reduce-overhead" and device == "cuda" else ""
        log.info(
            f"trainer.compile: torch.compile of the model's training forward ({type(model).__name__}: embedding, "
            f"layers, exit policy, head) with mode={mode}{graphs} on {device}; the loss, evaluation and generation "
            "run eagerly"
        )


def strip_compiled_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every ``_orig_mod.`` segment removed from its keys (``model._orig_mod.embed.weight`` ->
    ``model.embed.weight``), in order; ``state`` itself when no key has one."""
    if not any(PREFIX in k for k in state):
        return state
    return {k.replace(PREFIX, ""): v for k, v in state.items()}
