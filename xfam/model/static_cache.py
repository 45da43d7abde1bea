"""Fixed-shape decoding: which models can decode one token per call in fixed shapes, and the ``StaticCache``
that a prompt's eager ``DecodeCache`` becomes (``xfam.model.plan.StaticCache``; the mechanisms' own states in
``xfam.attention._static``).

A fixed-shape step runs the model's ordinary forward (the same blocks, norms, residual options, head) with
each mechanism's ``decode_step`` on its preallocated state and the row's position as a tensor, so a
compiled step (``xfam.eval.fast_decode``) never recompiles from one position to the next. What it cannot
express falls back to eager decoding, each with its reason (``static_problems``).
"""

from __future__ import annotations

from typing import Any

import torch

from xfam.model.attn_options import needs_scores
from xfam.model.plan import DecodeCache, StaticCache


class NoStaticStep(Exception):
    """A mechanism cannot continue this prompt's decode state in fixed shape (the message says why)."""


def static_problems(model: Any, capacity: int, compiled: bool = True) -> list[str]:
    """Why ``model`` (an ``XfamModel``) cannot decode ``capacity`` tokens in all through a fixed-shape step,
    ``compiled`` or not (empty: it can). An early-exit policy decides each token's depth as it runs, which
    the uncompiled step follows (its skipped layers write the token's keys and values in place,
    ``xfam.model.propagate``) and one compiled graph cannot."""
    spec, out = model.spec, []
    if model.uses_memory:
        out.append("a memory model decodes segment by segment, each segment's cache starting from a new memory")
    if not model.exit.full_stack and (compiled or not model.exit.early_exit):
        out.append(f"exit={model.exit.registry_name} chooses each token's layers as it runs")
    if model.aux_tokens:
        out.append("auxiliary tokens (model.num_memory_tokens, or ETC's global tokens) ride along every call")
    if spec.num_mem_kv:
        out.append("model.num_mem_kv: persistent keys lead every call's keys")
    if spec.shift_tokens or spec.ffn == "sepconv":
        out.append("model.shift_tokens / model.ffn=sepconv keep earlier rows of every sublayer")
    if spec.reversible:
        out.append("model.reversible runs the stack in one recomputed pass")
    if scores := needs_scores(spec):
        out.append(f"model.{', model.'.join(scores)} change the score matrix")
    if model.pos.kind == "modifier":
        out.append(f"pos={model.pos.registry_name} modifies the scores of every key")
    if model.pos.bounded and capacity > spec.max_len:
        name, top = model.pos.registry_name, spec.max_len
        out.append(f"pos={name} encodes positions < model.max_len={top}, and {capacity} are needed")
    if any(b.cross is not None for b in model.blocks):
        out.append("cross-attention reads an encoder's output")
    out += sorted({why for b in model.blocks if (why := b.attn.mechanism.static_problem()) is not None})
    return out


def to_static(model: Any, cache: DecodeCache, capacity: int) -> StaticCache:
    """The ``StaticCache`` continuing ``cache`` (an eager call's, after the prompt) with room for ``capacity``
    tokens in all; raises ``NoStaticStep`` when a mechanism cannot hold this prefix in fixed shape (a
    Longformer global position after the prompt)."""
    if cache.key_padding is not None:
        raise NoStaticStep("the prompt has padding")
    layers = []
    for block, state in zip(_blocks_by_layer(model), cache.layers, strict=True):
        static = block.attn.mechanism.static_state(state, capacity)
        if static is None:
            name = block.attn.mechanism.registry_name or "per_head"
            raise NoStaticStep(f"attention={name} cannot hold this prompt's state in fixed shape")
        layers.append(static)
    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    rotary = model.pos.rotary_tables(torch.arange(capacity, device=device), dtype)
    pos = torch.tensor(cache.length, device=device)
    return StaticCache(capacity, pos, layers, None if rotary is None else tuple(rotary))


def _blocks_by_layer(model: Any) -> list[Any]:
    """The block that runs as each layer (a shared block, ALBERT's, runs as every layer)."""
    return [model.blocks[i % len(model.blocks)] for i in range(model.num_layers)]
