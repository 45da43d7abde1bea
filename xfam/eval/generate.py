"""Autoregressive sampling with the model's incremental decode state (KV cache or whatever each
mechanism keeps), with temperature, top-k and nucleus (top-p, Holtzman et al., 2020) filtering."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.model.transformer import XfamModel

if TYPE_CHECKING:
    from xfam.knnlm.interpolate import KnnMixer


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set of mass >= top_p."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class Generation(NamedTuple):
    """``tokens [B, T + n]``, the logits each new token was drawn from ``[B, n, V]``, and the layers the
    model used for each of them ``[B, n]`` (None unless the exit policy reports depth)."""

    tokens: Tensor
    logits: Tensor
    depth: Tensor | None


@torch.no_grad()
def generate(
    model: XfamModel,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_token: int | None = None,
    knn: KnnMixer | None = None,
) -> Generation:
    """Continue ``prompt [B, T]``. The prompt is processed in one call, then each new token in one
    incremental call (an early-exit policy decides each token's depth in that call). With ``knn``
    (``xfam.knnlm.KnnMixer``) tokens are drawn from kNN-LM's interpolated distribution, whose
    log-probabilities are then the returned logits."""
    if model.task != "lm":
        raise ConfigError("generate needs a language model; this checkpoint is a classifier. Fix: use `xfam eval`.")
    if model.uses_memory:
        raise ConfigError(
            "generate decodes with each layer's decode state; it does not also carry segment memory. "
            "Fix: sample from a model trained with memory=none."
        )
    if prompt.shape[1] == 0:
        raise ConfigError("generate needs a prompt of at least one token. Fix: pass prompt=<text>.")
    bad = [f"max_new_tokens={max_new_tokens} (valid: >= 1)"] if max_new_tokens < 1 else []
    bad += [f"temperature={temperature} (valid: >= 0, 0 = greedy)"] if not temperature >= 0 else []
    bad += [f"top_k={top_k} (valid: >= 0, 0 = off)"] if top_k < 0 else []
    bad += [f"top_p={top_p} (valid: 0 < top_p <= 1, 1 = off)"] if not 0 < top_p <= 1 else []
    if bad:  # (top_p <= 0 kept no token: NaN probabilities, and sampling failed inside torch)
        raise ConfigError(f"generate: {'; '.join(bad)}. Fix: a value in the valid range.")
    model.eval()
    with knn if knn is not None else contextlib.nullcontext():
        out = model(prompt, cache=model.empty_cache())
        tokens, used, depths = prompt, [], []
        logits = out.logits[:, -1] if knn is None else knn(out.logits[:, -1])
        for _ in range(max_new_tokens):
            used.append(logits)
            depths.append(out.depth[:, -1] if out.depth is not None else None)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)  # [B, 1]
            tokens = torch.cat((tokens, nxt), dim=1)
            if stop_token is not None and bool((nxt == stop_token).all()):
                break
            out = model(nxt, cache=out.cache)
            logits = out.logits[:, -1] if knn is None else knn(out.logits[:, -1])
    depth = torch.stack(depths, dim=1) if depths and depths[0] is not None else None
    return Generation(tokens, torch.stack(used, dim=1), depth)
