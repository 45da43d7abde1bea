"""The auxiliary-loss channel of attention mechanisms (``aux_loss``): each layer's ``aux_losses()`` reach the model
output as ``attention/<name>``, summed over layers, and a loss on them has finite gradients that reach every layer.
A mechanism without ``aux_loss`` has no case here."""

from __future__ import annotations

import pytest
import torch

from xfam.attention import ATTENTION
from xfam.testing._suite import each
from xfam.testing.doubles import build_model

V, S = 13, 9


def aux_cases(comps) -> list:
    return [pytest.param(n, dict(comps.params), id=n) for n in comps.names if ATTENTION.get(n).aux_loss]


@each(("name", "params"), aux_cases)
def test_aux_losses_are_summed_over_layers_and_reach_every_layer(name, params):
    cls = ATTENTION.get(name)
    model = build_model(attention={"name": name, **cls.exact_params(S), **params}, layers=3).train()
    out = model(torch.randint(0, V, (2, S)))
    per_layer = [block.attn.mechanism.aux_losses() for block in model.blocks]
    keys = {key for losses in per_layer for key in losses}
    assert keys, f"attention={name} declares aux_loss but its aux_losses() returned nothing after a training forward"
    objective = model.blocks[0].attn.mechanism.model_objective()
    own = {k for k in out.aux if k.startswith("attention/")} - ({f"attention/{objective.name}"} if objective else set())
    assert own == {f"attention/{key}" for key in keys}
    for key in keys:
        total = torch.stack([losses[key] for losses in per_layer if key in losses]).sum()
        assert torch.allclose(out.aux[f"attention/{key}"], total)
    sum(out.aux[f"attention/{key}"] for key in keys).backward()
    for i, block in enumerate(model.blocks):
        grads = [p.grad for p in block.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), f"layer {i}"
        assert any(g.abs().sum() > 0 for g in grads), f"the aux losses do not reach layer {i}"
