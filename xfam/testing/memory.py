"""The memory contract: state in, state out (never hidden in buffers), positions spanning memory plus segment,
stored states detached between segments. A memory that needs a long-term store built outside the model
(``needs_store``) is skipped: give it its store in a test of its own.

A memory that keeps the last ``mem_len`` inputs of its layer and prepends them as keys (a ``mem_len`` parameter,
no ``augments_attention``: Transformer-XL's recurrence) has a degenerate limit: with ``mem_len`` covering
everything seen so far, segment k's logits equal those positions of one run over all segments, for every
relative encoding (keys carried in memory keep their meaning, and their distance, next segment).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.registry import signature_params
from xfam.memory import MEMORY, Memory
from xfam.pos import POS
from xfam.testing._compat import refusals
from xfam.testing._suite import each
from xfam.testing.doubles import build_model, own_components

V, B, D = 13, 2, 32
#: (segment length, segments, mem_len): memory exactly one segment, spanning three, longer than the run
SIZES = [(6, 2, 6), (4, 3, 8), (4, 2, 16)]


def recurrent(cls: type[Memory]) -> bool:
    """Keeps the last ``mem_len`` layer inputs as keys: equal to one full run when ``mem_len`` covers it."""
    return "mem_len" in signature_params(cls) and not cls.augments_attention and not cls.needs_store


def relative_encodings(comps: Any = None) -> list[str]:
    """Every relative encoding of xfam's own (a memory needs one)."""
    return [n for n in own_components(POS) if POS.get(n).relative]


def memory_cases(comps) -> list:
    return [pytest.param(n, dict(comps.params), id=n) for n in comps.names]


def recurrent_cases(comps) -> list:
    return [pytest.param(n, dict(comps.params), id=n) for n in comps.names if recurrent(MEMORY.get(n))]


def tensors(state: Any) -> Iterator[Tensor]:
    """Every tensor in a memory state (a tensor, or dicts, lists and tuples of them)."""
    if isinstance(state, Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from tensors(value)


def model_with(name: str, params: dict, **kw: Any):
    if MEMORY.get(name).needs_store:
        pytest.skip(f"memory={name} retrieves from a long-term store built outside the model: test it with its store")
    if problems := refusals(pos={"name": "rope"}, memory={"name": name, **params}, layers=kw.get("layers", 3)):
        pytest.skip(f"refused in a causal language model with pos=rope (as validate would): {' '.join(problems)}")
    return build_model(pos="rope", layers=kw.pop("layers", 3), memory={"name": name, **params}, **kw)


@each(("name", "params"), recurrent_cases)
@each("pos", relative_encodings)
@each(("seg_len", "n_segments", "mem_len"), SIZES)
def test_segments_with_memory_equal_one_full_run(name, params, pos, seg_len, n_segments, mem_len):
    """With mem_len covering everything seen so far, segment k's logits equal those positions of a single
    run over all segments: keys carried in memory keep their meaning (and their distance) next segment."""
    model = build_model(pos=pos, layers=3, memory={"name": name, **params, "mem_len": mem_len})
    x = torch.randint(0, V, (B, seg_len * n_segments))
    full = model(x).logits
    state = model.init_memory(B, x.device)
    for i in range(n_segments):
        out = model(x[:, i * seg_len : (i + 1) * seg_len], memory=state)
        state = out.memory
        stored = model.memories[0].read(state[0])
        assert stored is not None, "a recurrent memory's read() returned nothing after a segment"
        kept = min(mem_len, (i + 1) * seg_len)  # at least: compressive also keeps compressed slots
        assert len(state) == 3 and stored.shape[0::2] == (B, D) and stored.shape[1] >= kept
        assert torch.allclose(out.logits, full[:, i * seg_len : (i + 1) * seg_len], atol=1e-5), f"segment {i}"
    # without memory the later segment does not see the earlier one (the memory is what carried it)
    alone = model(x[:, -seg_len:]).logits
    assert not torch.allclose(alone, full[:, -seg_len:], atol=1e-4)


@each(("name", "params"), memory_cases)
def test_memory_is_detached_between_segments(name, params):
    model = model_with(name, params, layers=2).train()
    x = torch.randint(0, V, (B, 12))
    out1 = model(x[:, :6], memory=model.init_memory(B, x.device))
    assert all(not t.requires_grad and t.grad_fn is None for t in tensors(out1.memory)), "a stored state has a graph"
    # a loss on segment 2 reaches the parameters, but no graph runs back into segment 1
    leaf = model.embed.weight
    out2 = model(x[:, 6:], memory=out1.memory)
    (g,) = torch.autograd.grad(out2.logits.sum(), leaf, allow_unused=True)
    assert g is not None
    seg1_only = torch.tensor(sorted(set(x[:, :6].flatten().tolist()) - set(x[:, 6:].flatten().tolist())))
    if len(seg1_only):  # embedding rows used only in segment 1 get no gradient from segment 2
        assert torch.equal(g[seg1_only], torch.zeros_like(g[seg1_only]))
    # and the returned state does not change when segment 2 is run again: state in, state out
    again = model(x[:, 6:], memory=out1.memory)
    assert torch.allclose(again.logits, out2.logits, atol=1e-6)


@each(("name", "params"), memory_cases)
def test_state_in_state_out(name, params):
    """One state per layer; a segment run twice from the same state gives the same logits and the same new state,
    and leaves the state it was given as it was (no state hidden in buffers, none updated in place)."""
    model = model_with(name, params)
    x = torch.randint(0, V, (B, 12))
    first = model(x[:, :6], memory=model.init_memory(B, x.device)).memory
    assert len(first) == model.num_layers
    before = [t.clone() for t in tensors(first)]
    a, b = model(x[:, 6:], memory=first), model(x[:, 6:], memory=first)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(s, t) for s, t in zip(tensors(a.memory), tensors(b.memory)))
    assert all(torch.equal(s, t) for s, t in zip(before, tensors(first))), "running a segment changed its input state"


@each(("name", "params"), memory_cases)
def test_the_state_carries_the_past_into_the_next_segment(name, params):
    model = model_with(name, params)
    x = torch.randint(0, V, (B, 12))
    state = model(x[:, :6], memory=model.init_memory(B, x.device)).memory
    if not any(t.numel() for t in tensors(state)):
        pytest.skip(f"memory={name} stores nothing")
    fresh = model(x[:, 6:], memory=model.init_memory(B, x.device)).logits
    assert not torch.allclose(model(x[:, 6:], memory=state).logits, fresh, atol=1e-5)


@each(("name", "params"), memory_cases)
def test_training_gradients_and_aux_losses(name, params):
    """Two training segments: the aux losses a memory owns are ``memory/<name>`` scalars, finite; the loss (with
    them) has a finite gradient on every parameter it reaches, and reaches every layer."""
    model = model_with(name, params).train()
    x = torch.randint(0, V, (B, 13))
    state, loss = model.init_memory(B, x.device), torch.zeros(())
    for seg in (slice(0, 6), slice(6, 12)):
        out = model(x[:, seg], memory=state)
        state = out.memory
        assert all(k.startswith("memory/") and v.dim() == 0 and torch.isfinite(v) for k, v in out.aux.items())
        targets = x[:, seg.start + 1 : seg.stop + 1]
        loss = loss + F.cross_entropy(out.logits.flatten(0, 1), targets.flatten()) + sum(out.aux.values())
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{pname} has a non-finite gradient"
    for i, block in enumerate(model.blocks):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters()), f"layer {i}"
