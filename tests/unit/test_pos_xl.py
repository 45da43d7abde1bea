"""Transformer-XL relative attention: the four-term score, relative, across keys in front (memory)."""

from __future__ import annotations

import math

import pytest
import torch
from doubles import build_model

from xfam.core.mask import AttnMask
from xfam.core.sinusoid import sinusoid_table
from xfam.pos.xl import XLModifier


def four_terms(q, k, w_r, u, v, dim, mask):
    """A_ij = q.k + q.W_R R_{i-j} + u.k + v.W_R R_{i-j} per pair (loops: the definition), / sqrt(Dh)."""
    b, h, sq, d = q.shape
    q_pos, k_pos = mask.positions(q.device)
    out = torch.zeros(b, h, sq, len(k_pos), dtype=q.dtype)
    for i in range(sq):
        for j in range(len(k_pos)):
            r = sinusoid_table(torch.tensor([int(q_pos[i] - k_pos[j])]), dim)[0].to(q.dtype)  # [D]
            wr = torch.einsum("d,dhe->he", r, w_r)  # [H, Dh]
            a = (q[:, :, i] * k[:, :, j]).sum(-1)
            bterm = (q[:, :, i] * wr).sum(-1)
            c = (u * k[:, :, j]).sum(-1)
            dterm = (v * wr).sum(-1)
            out[:, :, i, j] = (a + bterm + c + dterm) / math.sqrt(d)
    return out


@pytest.mark.parametrize(("sq", "causal"), [(6, True), (3, True), (6, False)])
def test_scores_are_the_four_terms(sq, causal):
    torch.manual_seed(0)
    dim, h, dh = 12, 2, 4
    w_r, u, v = (torch.randn(dim, h, dh, dtype=torch.float64), torch.randn(h, dh, dtype=torch.float64),
                 torch.randn(h, dh, dtype=torch.float64))  # fmt: skip
    q, k = torch.randn(2, h, sq, dh, dtype=torch.float64), torch.randn(2, h, 6, dh, dtype=torch.float64)
    mask = AttnMask(q_len=sq, k_len=6, causal=causal)  # sq < 6: memory keys in front of the segment
    scores = q @ k.mT / math.sqrt(dh)
    got = XLModifier(w_r, u, v, dim).logits(scores, q, k, mask)
    assert torch.allclose(got, four_terms(q, k, w_r, u, v, dim, mask), atol=1e-10)


def test_relative_a_shift_of_every_position_changes_nothing():
    torch.manual_seed(0)
    mod = XLModifier(torch.randn(8, 2, 4), torch.randn(2, 4), torch.randn(2, 4), 8)
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    a = mod.logits(torch.zeros(1, 2, 5, 5), q, k, AttnMask(q_len=5, k_len=5, causal=False))
    k_long = torch.cat((torch.randn(1, 2, 9, 4), k), dim=2)  # the same 5 keys after 9 memory slots
    b = mod.logits(torch.zeros(1, 2, 5, 14), q, k_long, AttnMask(q_len=5, k_len=14, causal=False))[..., 9:]
    assert torch.allclose(a, b, atol=1e-5)


def test_each_layer_has_its_parameters_and_learns_them():
    model = build_model(pos="xl", layers=3).train()
    assert model.pos.w_r.shape == (3, 32, 4, 8) and model.pos.u.shape == (3, 4, 8)
    model(torch.randint(0, 13, (2, 12))).logits.sum().backward()
    for p in (model.pos.w_r, model.pos.u, model.pos.v):
        assert p.grad is not None and p.grad.abs().sum() > 0
