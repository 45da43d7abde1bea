"""The Universal Transformer's coordinate embedding (position (+) step), provided for the exit slot's ACT."""

from __future__ import annotations

import math

import pytest
import torch

from xfam.core.sinusoid import TimestepSignal, sinusoid_table


@pytest.mark.parametrize(("i", "t"), [(0, 0), (3, 1), (7, 5), (100, 12)])
def test_signal_is_the_papers_formula(i, t):
    """d = 4: P^t_{i,2j} = sin(i / 100^j) + sin(t / 100^j), P^t_{i,2j+1} = cos(i / 100^j) + cos(t / 100^j)."""
    got = TimestepSignal(4, scale=1.0).signal(torch.tensor([i]), t)[0]
    for j in range(2):
        w = 10000 ** (2 * j / 4)
        assert float(got[2 * j]) == pytest.approx(math.sin(i / w) + math.sin(t / w), abs=1e-5)
        assert float(got[2 * j + 1]) == pytest.approx(math.cos(i / w) + math.cos(t / w), abs=1e-5)


def test_it_adds_position_and_step_and_the_step_part_alone_on_request():
    pos, x = torch.arange(6), torch.randn(2, 6, 8)
    full, step_only = TimestepSignal(8), TimestepSignal(8, positions=False)
    scale = 1 / math.sqrt(8)
    for t in (0, 3):
        time = sinusoid_table(torch.tensor([t]), 8)  # [1, D], the same at every position
        assert torch.allclose(full(x, pos, t), x + scale * (sinusoid_table(pos, 8) + time), atol=1e-6)
        assert torch.allclose(step_only(x, pos, t), x + scale * time, atol=1e-6)
    # the step is visible: the same positions at two steps get different signals, differing by the step part only
    diff = full.signal(pos, 4) - full.signal(pos, 1)
    assert not torch.allclose(diff, torch.zeros_like(diff), atol=1e-3)
    assert torch.allclose(diff, diff[:1].expand_as(diff), atol=1e-6)


def test_odd_widths_and_dtypes():
    x = torch.randn(1, 3, 5, dtype=torch.float64)
    out = TimestepSignal(5)(x, torch.arange(3), 2)
    assert out.dtype == torch.float64 and out.shape == x.shape and torch.isfinite(out).all()
