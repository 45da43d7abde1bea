"""The auxiliary-loss channel of attention mechanisms: per-layer losses reach the model output
(summed over layers, also through a per-head schedule) and carry gradients into every layer."""

from __future__ import annotations

import torch
from doubles import build_model

from xfam.testing import aux_losses


def test_mechanism_aux_losses_are_summed_over_layers_and_differentiable() -> None:
    model = build_model(attention={"name": "toy_aux", "weight": 0.5}, layers=3)
    qs = []
    for b in model.blocks:
        b.attn.mechanism.register_forward_hook(lambda m, args, o: qs.append(args[0]))
    out = model(torch.randint(0, 13, (2, 9)))
    assert set(out.aux) == {"attention/toy"} and len(qs) == 3
    assert torch.allclose(out.aux["attention/toy"], sum(0.5 * q.pow(2).mean() for q in qs))
    out.aux["attention/toy"].backward()
    for block in model.blocks:
        assert block.attn.qkv.weight.grad.abs().sum() > 0


def test_the_toy_meets_the_kits_aux_loss_contract() -> None:
    aux_losses.test_aux_losses_are_summed_over_layers_and_reach_every_layer("toy_aux", {"weight": 0.5})


def test_aux_losses_through_a_per_head_schedule() -> None:
    attention = {"name": "vanilla", "per_head": [{"heads": 2}, {"heads": 2, "name": "toy_aux", "weight": 1.0}]}
    model = build_model(attention=attention, layers=2)
    out = model(torch.randint(0, 13, (2, 9)))
    assert "attention/toy" in out.aux and out.aux["attention/toy"] > 0
