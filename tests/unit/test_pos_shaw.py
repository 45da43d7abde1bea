"""Shaw relative positions: equal to the paper's explicit formula, clipped at k, relative, per layer."""

from __future__ import annotations

import math

import pytest
import torch
from doubles import build_model

from xfam.attention.vanilla import reference_attention
from xfam.core.mask import AttnMask
from xfam.pos.shaw import ShawModifier


def explicit(q, k, v, wk, wv, clip, mask):
    """Eqs. 3-6 with a^K_ij, a^V_ij materialised per pair (loops: the definition, not the fast split)."""
    b, h, sq, d = q.shape
    q_pos, k_pos = mask.positions(q.device)
    ok = mask.dense(q.device)
    out = torch.zeros_like(q)
    for i in range(sq):
        rel = (k_pos - q_pos[i]).clamp(-clip, clip) + clip  # [Sk]
        ak, av = wk[rel], wv[rel] if wv is not None else 0.0  # [Sk, Dh]
        e = torch.einsum("bhd,bhkd->bhk", q[:, :, i], k + ak) / math.sqrt(d)
        if ok is not None:
            e = e.masked_fill(~ok[..., i, :], float("-inf"))
        out[:, :, i] = torch.einsum("bhk,bhkd->bhd", e.softmax(-1), v + av)
    return out


@pytest.mark.parametrize("values", [True, False])
@pytest.mark.parametrize(("sq", "causal"), [(9, True), (4, True), (9, False)])
def test_equals_the_papers_formula(values, sq, causal):
    torch.manual_seed(0)
    clip = 3
    wk, wv = torch.randn(2 * clip + 1, 8, dtype=torch.float64), torch.randn(2 * clip + 1, 8, dtype=torch.float64)
    mod = ShawModifier(wk, wv if values else None, clip)
    q = torch.randn(2, 3, sq, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 9, 8, dtype=torch.float64) for _ in range(2))
    mask = AttnMask(q_len=sq, k_len=9, causal=causal)  # sq < 9: keys in front of the queries
    got = reference_attention(q, k, v, mask, modifier=mod)
    assert torch.allclose(got, explicit(q, k, v, wk, wv if values else None, clip, mask), atol=1e-10)


def test_distances_beyond_k_share_the_last_embedding_and_shifts_change_nothing():
    mod = ShawModifier(torch.zeros(5, 2), None, clip=2)
    idx = mod.index(AttnMask(q_len=1, k_len=10, causal=True), torch.device("cpu"))[0]  # query at 9
    assert idx.tolist() == [0] * 8 + [1, 2]  # j - i = -9..-1 clipped at -2; 0 is index k
    a = mod.index(AttnMask(q_len=6, k_len=6, causal=False), torch.device("cpu"))
    b = mod.index(AttnMask(q_len=6, k_len=20, causal=False), torch.device("cpu"))[:, 14:]
    assert torch.equal(a, b)


def test_each_layer_has_its_tables_and_learns_them():
    model = build_model(pos={"name": "shaw", "clip": 4}, layers=3).train()
    assert model.pos.keys.shape == (3, 9, 8) and model.pos.values.shape == (3, 9, 8)
    model(torch.randint(0, 13, (2, 12))).logits.sum().backward()
    assert model.pos.keys.grad[1].abs().sum() > 0 and model.pos.values.grad[2].abs().sum() > 0
    assert build_model(pos={"name": "shaw", "values": False}).pos.values is None
