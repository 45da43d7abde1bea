"""Dynamic position bias: the MLP of the distance, relative, shared by all layers, exact on sparse paths."""

from __future__ import annotations

import pytest
import torch
from doubles import build_model

from xfam.attention._base import ATTENTION
from xfam.core.mask import AttnMask
from xfam.pos.dynamic import DynamicBias


@pytest.mark.parametrize("log_distance", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_bias_is_the_mlp_of_the_distance(log_distance, norm):
    torch.manual_seed(0)
    bias = DynamicBias(heads=3, hidden=8, depth=2, log_distance=log_distance, norm=norm)
    q, k = torch.arange(10)[:, None], torch.arange(10)[None, :]
    got = bias.pairs(q, k)  # [H, 10, 10]
    n = torch.tensor(7.0 - 2.0)
    x = torch.sign(n) * torch.log1p(n.abs()) if log_distance else n
    assert torch.allclose(got[:, 7, 2], bias.mlp(x.view(1, 1))[0], atol=1e-6)
    assert torch.equal(bias.pairs(q + 100, k + 100), got)  # relative: a shift changes nothing
    assert not torch.allclose(got[:, 7, 2], got[:, 2, 7])  # direction matters (i - j, not |i - j|)


def test_one_mlp_shared_by_every_layer_and_trained():
    model = build_model(pos="dynamic", layers=3).train()
    mlps = [n for n, _ in model.named_modules() if n.endswith("mlp")]
    assert len(mlps) == 1
    model(torch.randint(0, 13, (2, 12))).logits.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".mlp." in n)


@pytest.mark.parametrize("causal", [True, False])
def test_sparse_path_evaluates_the_bias_on_its_visited_pairs(causal):
    torch.manual_seed(0)
    bias = DynamicBias(heads=4, hidden=8, depth=2, log_distance=True, norm=False).double()
    fast = ATTENTION.build({"name": "local", "window": 5, "block": 4, "backend": "block"}, max_len=24, causal=causal)
    ref = ATTENTION.build({"name": "local", "window": 5, "block": 4, "backend": "dense"}, max_len=24, causal=causal)
    q, k, v = (torch.randn(2, 4, 24, 8, dtype=torch.float64) for _ in range(3))
    mask = AttnMask(q_len=24, k_len=24, causal=causal)
    assert torch.allclose(fast(q, k, v, mask, bias), ref(q, k, v, mask, bias), atol=1e-10)


def test_the_model_keeps_the_mlps_own_init():
    """The model's N(0, 0.02) init would leave a ~1e-6 bias, blind to order at the start."""
    model = build_model(pos="dynamic")
    bias = model.pos.bias.pairs(torch.arange(12)[:, None], torch.arange(12)[None, :])
    assert bias.std() > 1e-2
