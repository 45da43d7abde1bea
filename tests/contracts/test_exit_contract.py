"""The exit contract (the policy owns how depth is traversed, returns its aux losses and the depth used): the
kit's (``xfam.testing.exit``, ``yaml_defaults``) for every registered ``xfam.`` policy and the toys, the same
functions a component author runs with ``contract_tests("exit", "<name>")``; and what the core promises, proven
with ``toy_deep`` (deep supervision over every layer) and ``toy_stop`` (stop after k layers)."""

from __future__ import annotations

import pytest
import torch
from doubles import build_model, decode_logits, xfam_components

from xfam.exit import EXIT
from xfam.testing import contract_tests

V = 13
TestExit = contract_tests("exit", [*xfam_components(EXIT), "toy_deep", "toy_stop"])


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_aux_loss_is_returned_under_exit_key_and_reaches_every_layer(task):
    model = build_model(exit={"name": "toy_deep"}, layers=3, task=task).train()
    x = torch.randint(0, V, (2, 8))
    out = model(x)
    assert set(out.aux) == {"exit/deep"}
    # the value is the policy's: sum over layers of mean logsumexp(head(h_l)), h_l each layer's output
    hiddens = model.exit.last_hiddens
    assert len(hiddens) == 3
    expected = sum(model.head_logits(h).logsumexp(-1).mean() for h in hiddens)
    assert torch.allclose(out.aux["exit/deep"], expected)
    assert torch.allclose(model.head_logits(hiddens[-1]), out.logits)  # the last one is the model's output
    assert torch.equal(out.depth, torch.full((2, 8), 3))
    out.aux["exit/deep"].backward()
    for i, block in enumerate(model.blocks):
        for name, p in block.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"aux loss does not reach blocks.{i}.{name}"


def test_deep_supervision_sees_every_intermediate_layer():
    """Each layer's term changes when only that layer's weights change (h_l really is layer l's output)."""
    model = build_model(exit={"name": "toy_deep"}, layers=3)
    x = torch.randint(0, V, (1, 8))
    model(x)
    before = [h.clone() for h in model.exit.last_hiddens]
    with torch.no_grad():
        model.blocks[1].ffn.down.weight.mul_(2.0)
    model(x)
    after = model.exit.last_hiddens
    assert torch.equal(before[0], after[0])
    assert not torch.allclose(before[1], after[1]) and not torch.allclose(before[2], after[2])


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("task", ["lm", "classify"])
def test_stopping_after_k_layers_equals_a_k_layer_model(k, task):
    deep = build_model(exit={"name": "toy_stop", "stop_after": k}, layers=3, task=task, pos="rope")
    shallow = build_model(layers=k, task=task, pos="rope")
    missing, unexpected = shallow.load_state_dict(deep.state_dict(), strict=False)
    assert missing == [] and all(name.startswith("blocks.") for name in unexpected)
    x = torch.randint(0, V, (2, 8))
    out = deep(x)
    assert torch.allclose(out.logits, shallow(x).logits, atol=1e-6)
    assert torch.equal(out.depth, torch.full((2, 8), k))
    assert not torch.allclose(out.logits, build_model(layers=3, task=task, pos="rope")(x).logits, atol=1e-4)


def test_early_exit_decoding_equals_full_recompute():
    """Layers that did not run keep no decode state; decoding still equals the full pass."""
    model = build_model(exit={"name": "toy_stop", "stop_after": 1}, layers=3, pos="alibi")
    x = torch.randint(0, V, (2, 9))
    assert torch.allclose(decode_logits(model, x, prompt=3), model(x).logits, atol=1e-5)
