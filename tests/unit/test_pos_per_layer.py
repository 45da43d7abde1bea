"""Learned positions per layer (Al-Rfou et al., 2018, arXiv:1808.04444): every layer's input gets its own
table's vectors at its positions, the first layer's included; one table per step of a shared block.

The registry-driven contract (tests/contracts/test_pos_contract.py) covers shapes, gradients, no causal
leak, cached decoding and the classifier for ``pos=learned_per_layer`` like every encoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from doubles import assert_same_model, build_model, decode_logits

from xfam.attention import ATTENTION
from xfam.core.errors import ConfigError
from xfam.exit import EXIT
from xfam.memory import MEMORY
from xfam.model import compat
from xfam.pos import POS

V, S, L, D, MAX = 13, 10, 3, 16, 24
POS_CFG = {"name": "learned_per_layer"}

#: model overrides: plain, one block shared by the L steps (ALBERT), the Universal Transformer's L steps
STACKS = {
    "plain": {},
    "share_layers": {"share_layers": True},
    "act": {"exit": {"name": "act", "mode": "fixed", "signal": False}},
}


def model_of(stack: str, **kw):
    return build_model(pos=POS_CFG, layers=L, dim=D, max_len=MAX, **{**STACKS[stack], **kw})


def block_io(model, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The input and output of every block run, in order (a shared block's runs one after another)."""
    ins, outs = [], []
    hooks = [
        h
        for b in model.blocks
        for h in (
            b.register_forward_pre_hook(lambda m, args: ins.append(args[0].detach())),
            b.register_forward_hook(lambda m, args, out: outs.append(out[0].detach())),
        )
    ]
    model(x)
    for h in hooks:
        h.remove()
    return ins, outs


@pytest.mark.parametrize("stack", STACKS)
def test_each_layer_input_gets_its_own_table(stack):
    """Layer l's input is the previous layer's output (the embedding for l = 0) plus P_l[0..S-1]: this fails if
    the same table served every layer, or only the first layer got one, or a shared block's steps shared one."""
    model = model_of(stack, init_std=0.5)  # (tables far apart)
    x = torch.randint(0, V, (2, S))
    ins, outs = block_io(model, x)
    assert len(ins) == L and len(model.pos.tables) == L
    before = [model.embed(x).detach(), *outs[:-1]]
    for layer in range(L):
        added = ins[layer] - before[layer]  # [B, S, D]
        table = model.pos.tables[layer].weight[:S].detach()
        assert torch.allclose(added, table.expand_as(added), atol=1e-6), f"layer {layer}"
    weights = [t.weight for t in model.pos.tables]
    assert all(not torch.allclose(weights[i], weights[j]) for i in range(L) for j in range(i))


def test_parameters_are_layers_times_max_len_times_dim():
    plain = sum(p.numel() for p in build_model(pos="none", layers=L, dim=D, max_len=MAX).parameters())
    per_layer = model_of("plain")
    assert sum(p.numel() for p in per_layer.parameters()) - plain == L * MAX * D
    shared = model_of("share_layers")  # one block, still one table per step
    assert sum(p.numel() for p in shared.pos.parameters()) == L * MAX * D


@pytest.mark.parametrize("stack", ["plain", "share_layers"])
def test_decode_with_memory_tokens_equals_recomputation(stack):
    """New tokens take their positions after the cache; memory tokens in front take none."""
    model = model_of(stack, num_memory_tokens=2)
    x = torch.randint(0, V, (2, S))
    assert torch.allclose(decode_logits(model, x, 4, 1), model(x).logits, atol=1e-5)
    assert torch.allclose(decode_logits(model, x, 1, 3), model(x).logits, atol=1e-5)


def test_no_causal_leak_through_every_layers_table():
    model = model_of("plain", init_std=0.5)
    x = torch.randint(0, V, (2, S))
    base = model(x).logits
    y = x.clone()
    y[:, 6] = (y[:, 6] + 1) % V
    out = model(y).logits
    assert torch.equal(out[:, :6], base[:, :6]) and not torch.allclose(out[:, 6:], base[:, 6:], atol=1e-4)


def test_a_position_past_the_tables_is_refused():
    model = model_of("plain")
    with pytest.raises(ConfigError, match="past the learned tables"):
        model(torch.randint(0, V, (1, MAX + 1)))


def test_checkpoint_round_trip(tmp_path: Path):
    model, fresh = model_of("plain", seed=1), model_of("plain", seed=2)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert_same_model(model, fresh, torch.randint(0, V, (2, S)))


def selection(**kw) -> compat.Selection:
    base = {
        "attention": [(ATTENTION.get("vanilla"), {"name": "vanilla"}, False)],
        "pos": (POS.get("learned_per_layer"), POS_CFG),
        "memory": [(MEMORY.get("none"), {"name": "none"})],
        "exit": (EXIT.get("none"), {"name": "none"}),
        "causal": True,
    }
    return compat.Selection(**{**base, **kw})


def test_memory_and_reversible_layers_are_refused_with_the_reason():
    assert compat.check(selection()) == []
    memory = compat.check(selection(memory=[(MEMORY.get("xl"), {"name": "xl"})], streams=True))
    assert any("pos=learned_per_layer is absolute" in p for p in memory), memory
    reversible = compat.check(selection(reversible=True))
    assert any("pos=learned_per_layer adds a table to every layer's input" in p for p in reversible), reversible
