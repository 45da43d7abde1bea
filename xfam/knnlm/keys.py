"""The kNN-LM key: the input of the final layer's feed-forward network (Khandelwal et al., 2020, §3:
"the input to the final layer's FFN, after layer normalisation").

In a pre-norm block that is ``norm2(x)`` of the last block, in a post-norm block the FFN's input (the
attention sublayer's normalised output); either way it is what the last block's ``ffn`` module receives,
so a forward pre-hook on that module captures it without touching the model code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from xfam.core.errors import ConfigError


def check_supported(model: nn.Module) -> None:
    """Refuse, with the reason and the fix, a model whose final-layer FFN input is not a per-token key
    of the prediction: a classifier, or an exit policy that does not run every layer once for every
    token (early exit, weight-shared recurrence). A model with memory is fine: the loops carry it."""
    problems = []
    if getattr(model, "task", None) != "lm":
        problems.append(
            "kNN-LM interpolates next-token distributions; this checkpoint is a classifier. "
            "Fix: use a language-model checkpoint."
        )
    policy = getattr(model, "exit", None)
    if policy is not None and not policy.full_stack:
        problems.append(
            f"exit={policy.registry_name} does not run every layer once for every token, so the final layer's "
            "FFN input is not what each prediction came from (early exit) or the final block runs several "
            "times (a weight-shared recurrent block). Fix: use a model trained with exit=none."
        )
    if problems:
        raise ConfigError(problems)


class KeyCapture:
    """Context manager that records the input of the last block's FFN on every forward.

        with KeyCapture(model) as keys:
            out = model(tokens)
            q = keys.take()      # [B, S, D]: one key per input position (global tokens dropped)

    A stack that runs the FFN in chunks along the sequence (reversible layers with ``ffn_chunks``)
    calls it several times per forward; ``take`` joins the calls since the last ``take``."""

    def __init__(self, model: nn.Module):
        # (an XfamModel, whose last block's ffn is hooked: an engine does not import the model to type it)
        self.model: Any = model
        self.skip = int(getattr(model, "aux_tokens", 0))  # ETC's global tokens, in front of the input
        self._parts: list[Tensor] = []
        self._handle: Any = None

    def _hook(self, module: nn.Module, args: tuple[Tensor, ...]) -> None:
        self._parts.append(args[0].detach())

    def __enter__(self) -> KeyCapture:
        self._parts.clear()
        self._handle = self.model.blocks[-1].ffn.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._parts.clear()

    def take(self) -> Tensor:
        """The keys of the forward calls since the last ``take``: ``[B, S, D]``."""
        if not self._parts:
            raise RuntimeError("no forward pass reached the last block's FFN since the last take()")
        keys = self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts, dim=1)  # [B, G + S, D]
        self._parts.clear()
        return keys[:, self.skip :]
