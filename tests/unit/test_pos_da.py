"""DA-Transformer: f(0) = 1, monotone and bounded, ReLU scores rescaled, relative, per layer and head."""

from __future__ import annotations

import math

import pytest
import torch
from doubles import build_model

from xfam.attention.vanilla import reference_attention
from xfam.core.mask import AttnMask
from xfam.pos.da import DA, DAModifier


def modifier(alpha: list[float], beta: list[float]) -> DAModifier:
    return DAModifier(torch.tensor(alpha), torch.tensor(beta))


def test_f_is_one_at_zero_monotone_and_bounded():
    mod = modifier([0.5, -0.5, 0.2], [0.0, 1.0, 2.0])
    f = mod.weights(AttnMask(q_len=1, k_len=200, causal=False), torch.zeros(()))[:, 0, :].flip(-1)  # R = 0..199
    assert torch.allclose(f[:, 0], torch.ones(3))  # f(0) = 1
    d = f.diff(dim=-1)
    assert (d[0] >= 0).all() and (d[2] >= 0).all() and (d[1] <= 0).all()  # alpha > 0 rises, alpha < 0 falls
    assert f[0, -1] <= 1 + math.exp(0.0) + 1e-6 and f[2, -1] <= 1 + math.exp(2.0) + 1e-6  # bounded by 1 + e^beta
    assert f[1, -1] < 1e-6  # -> 0 as alpha R -> -inf
    r, a, b = 7.0, 0.2, 2.0
    assert float(f[2, 7]) == pytest.approx((1 + math.exp(b)) / (1 + math.exp(b - a * r)), rel=1e-6)


def test_attention_is_softmax_of_relu_scores_times_f():
    torch.manual_seed(0)
    mod = modifier([0.3, -0.2], [0.5, -1.0])
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    mask = AttnMask(q_len=6, k_len=6, causal=True)
    out = reference_attention(q, k, v, mask, modifier=mod)
    r = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs().float()
    a, b = torch.tensor([0.3, -0.2])[:, None, None], torch.tensor([0.5, -1.0])[:, None, None]
    f = (1 + b.exp()) / (1 + (b - a * r).exp())
    s = torch.relu(q @ k.mT) * f / 2.0  # sqrt(d) = 2
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    assert torch.allclose(out, s.softmax(-1) @ v, atol=1e-6)


def test_relative_a_shift_of_every_position_changes_nothing():
    mod = modifier([0.3, -0.2], [0.5, -1.0])
    a = mod.weights(AttnMask(q_len=5, k_len=5, causal=False), torch.zeros(()))
    b = mod.weights(AttnMask(q_len=5, k_len=17, causal=False), torch.zeros(()))[:, :, 12:]  # queries at 12..16
    assert torch.allclose(a, b)


def test_each_layer_and_head_has_its_own_parameters_and_learns_them():
    model = build_model(pos="da", layers=3).train()
    assert model.pos.alpha.shape == (3, 4) and model.pos.beta.shape == (3, 4)
    assert len(set(model.pos.alpha[0].tolist())) == 4  # heads start with different preferences
    model(torch.randint(0, 13, (2, 12))).logits.sum().backward()
    assert model.pos.alpha.grad.abs().sum() > 0 and model.pos.beta.grad.abs().sum() > 0
    assert DA.kind == "modifier" and DA.relative
