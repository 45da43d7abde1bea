"""The memory contract (state in, state out; positions span memory plus segment; detached between
segments), proven with ``toy_memory``, a Transformer-XL-like cache of each layer's inputs."""

from __future__ import annotations

import pytest
import torch
from doubles import build_model, xfam_components

from xfam.pos import POS

V = 13
# every relative encoding, and the toy modifier: a modifier must also read positions over [memory | segment]
RELATIVE = [n for n in xfam_components(POS) if POS.get(n).relative] + ["toy_modifier"]


def test_the_relative_encodings_are_the_expected_ones():
    assert {"none", "rope", "alibi"} <= set(RELATIVE)
    assert not {"learned", "sinusoidal"} & set(RELATIVE)


# the toy proves the contract; every real recurrent memory must meet it too
RECURRENT = ["toy_memory", "xl", "compressive"]


@pytest.mark.parametrize("memory", RECURRENT)
@pytest.mark.parametrize("pos", RELATIVE)
@pytest.mark.parametrize(("seg_len", "n_segments", "mem_len"), [(6, 2, 6), (4, 3, 8), (4, 2, 16)])
def test_segments_with_memory_equal_one_full_run(memory, pos, seg_len, n_segments, mem_len):
    """With mem_len covering everything seen so far, segment k's logits equal those positions of a single
    run over all segments: keys carried in memory keep their meaning (and their distance) next segment."""
    model = build_model(pos=pos, layers=3, memory={"name": memory, "mem_len": mem_len})
    x = torch.randint(0, V, (2, seg_len * n_segments))
    full = model(x).logits
    state = model.init_memory(2, x.device)
    for i in range(n_segments):
        out = model(x[:, i * seg_len : (i + 1) * seg_len], memory=state)
        state = out.memory
        stored = model.memories[0].read(state[0])
        kept = min(mem_len, (i + 1) * seg_len)  # at least: compressive also keeps compressed slots
        assert len(state) == 3 and stored.shape[0::2] == (2, 32) and stored.shape[1] >= kept
        assert torch.allclose(out.logits, full[:, i * seg_len : (i + 1) * seg_len], atol=1e-5), f"segment {i}"
    # without memory the later segment does not see the earlier one (the memory is what carried it)
    alone = model(x[:, -seg_len:]).logits
    assert not torch.allclose(alone, full[:, -seg_len:], atol=1e-4)


@pytest.mark.parametrize("memory", RECURRENT)
def test_memory_is_detached_between_segments(memory):
    model = build_model(pos="rope", memory={"name": memory, "mem_len": 8}).train()
    x = torch.randint(0, V, (2, 12))
    out1 = model(x[:, :6], memory=model.init_memory(2, x.device))
    stored = [m.read(st) for m, st in zip(model.memories, out1.memory)]
    assert all(not m.requires_grad and m.grad_fn is None for m in stored)
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


def test_memory_state_is_per_layer_and_follows_the_schedule():
    model = build_model(
        pos="none", layers=3, memory={"name": "toy_memory", "mem_len": 4, "per_layer": {"1": {"mem_len": 2}}}
    )
    x = torch.randint(0, V, (1, 6))
    out = model(x, memory=model.init_memory(1, x.device))
    assert [m.shape[1] for m in out.memory] == [4, 2, 4]


# The refusals (absolute positions, batches that are not streams) are in tests/unit/test_compat.py.
