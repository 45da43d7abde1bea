"""Autoregressive continuous generation: a ``task=regress`` model continues a sequence of vectors by feeding
each predicted vector back as its next input (the model predicts the mean of the next vector, so generation
is deterministic: no sampling).

As in token generation (``xfam.eval.generate``): without memory the prefix runs in one call and every new
vector in one incremental call with the model's decode state (a KV cache, or whatever each mechanism
keeps); with memory the stream runs segment by segment with the memory carried (``SegmentStream``).
``cache=False`` recomputes the whole sequence at every step instead, the definition the cached path
must equal.

Shapes: B sequences, P prefix steps, n new steps, F values per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.eval.generate import CachedStream, SegmentStream, prefix_problems
from xfam.model.transformer import ModelOutput, XfamModel


def continuous_problems(model: XfamModel, segment_len: int | None = None) -> list[str]:
    """Why ``model`` cannot continue vector sequences (empty when it can)."""
    if model.task != "regress" or not model.causal:
        return [
            f"generate_continuous continues vectors with a causal regress model; this one is a model of task "
            f"{model.task!r} on {model.inputs['kind']} inputs. Fix: a model trained with task=regress "
            f"(data=timeseries); a language model generates text with `xfam generate`."
        ]
    return prefix_problems(model, segment_len, "steps")


@torch.no_grad()
def generate_continuous(
    model: XfamModel, prefix: Tensor, steps: int, *, cache: bool = True, segment_len: int | None = None
) -> Tensor:
    """Continue ``prefix [B, P, F]`` by ``steps`` vectors, each the model's prediction from everything before
    it; returns the new vectors ``[B, steps, F]``. ``cache``: incremental calls with the decode cache (False:
    recompute the whole sequence at every step); ``segment_len``: a memory model's training ``data.seq_len``."""
    if problems := continuous_problems(model, segment_len):
        raise ConfigError(problems)
    if prefix.dim() != 3 or prefix.shape[1] == 0 or steps < 1:
        raise ConfigError(
            f"generate_continuous needs a prefix [B, P >= 1, F] and steps >= 1; got prefix {tuple(prefix.shape)} and "
            f"steps={steps}. Fix: pass at least one vector per sequence and a positive number of steps."
        )
    model.eval()
    step: SegmentStream | CachedStream | Callable[[Tensor], ModelOutput]
    if model.uses_memory:
        assert segment_len is not None  # (continuous_problems refused a memory model without it)
        step = SegmentStream(model, segment_len)
    elif cache:
        step = CachedStream(model)
    else:
        step = lambda x: model(x)  # noqa: E731  (the definition: the whole sequence every time)
    x, new = prefix, []
    out = step(x)
    for i in range(steps):
        nxt = out.logits[:, -1:].to(prefix.dtype)  # [B, 1, F]
        new.append(nxt)
        x = torch.cat((x, nxt), dim=1)
        if i + 1 < steps:
            out = step(x)
    return torch.cat(new, dim=1)  # [B, steps, F]
