"""The memory contract (state in, state out; positions span memory plus segment; detached between segments),
for every registered ``xfam.`` memory and ``toy_memory``, a Transformer-XL-like cache of each layer's inputs.

The contracts are the kit's (``xfam.testing.memory``, ``yaml_defaults``), the same functions a component author
runs with ``contract_tests("memory", "<name>")``.
"""

from __future__ import annotations

import pytest
import torch
from doubles import build_model, xfam_components

from xfam.memory import MEMORY
from xfam.testing import contract_tests
from xfam.testing import memory as memory_contract

V = 13
TestMemory = contract_tests("memory", [*xfam_components(MEMORY), "toy_memory"])

# the real memories the full-run contract applies to, and the toy that proves it
RECURRENT = ["toy_memory", "xl", "compressive"]


def test_the_relative_encodings_and_the_recurrent_memories_are_the_expected_ones():
    relative = memory_contract.relative_encodings()
    assert {"none", "rope", "alibi"} <= set(relative)
    assert not {"learned", "sinusoidal"} & set(relative)
    assert [n for n in [*xfam_components(MEMORY), "toy_memory"] if memory_contract.recurrent(MEMORY.get(n))] == [
        "compressive",
        "xl",
        "toy_memory",
    ]


@pytest.mark.parametrize("memory", RECURRENT)
@pytest.mark.parametrize("pos", ["toy_modifier"])
@pytest.mark.parametrize(("seg_len", "n_segments", "mem_len"), memory_contract.SIZES)
def test_segments_with_memory_equal_one_full_run(memory, pos, seg_len, n_segments, mem_len):
    """The kit's contract with the toy modifier too: a modifier must also read positions over [memory | segment]."""
    memory_contract.test_segments_with_memory_equal_one_full_run(memory, {}, pos, seg_len, n_segments, mem_len)


def test_memory_state_is_per_layer_and_follows_the_schedule():
    model = build_model(
        pos="none", layers=3, memory={"name": "toy_memory", "mem_len": 4, "per_layer": {"1": {"mem_len": 2}}}
    )
    x = torch.randint(0, V, (1, 6))
    out = model(x, memory=model.init_memory(1, x.device))
    assert [m.shape[1] for m in out.memory] == [4, 2, 4]


# The refusals (absolute positions, batches that are not streams) are in tests/unit/test_compat.py.
