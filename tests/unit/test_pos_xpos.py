"""xPos (Sun et al., 2023, arXiv:2212.10554), the ``pos=rope pos.xpos=true`` option: RoPE whose channel pair
k is also scaled by zeta_k^(n / gamma) on the query at n and zeta_k^(-m / gamma) on the key at m."""

from __future__ import annotations

import math

import pytest
import torch
from doubles import build_model, decode_logits

from xfam.attention import ATTENTION
from xfam.core.errors import ConfigError
from xfam.exit import EXIT
from xfam.model import compat
from xfam.pos import POS
from xfam.pos.rope import Rope


def score(rope: Rope, q: torch.Tensor, k: torch.Tensor, n: int, m: int) -> float:
    """q at position n against k at position m through the model's hooks; q, k ``[Dh]``."""
    tq = rope.rotary_tables(torch.tensor([n]), q.dtype)
    tk = rope.rotary_tables(torch.tensor([m]), k.dtype)
    return float(rope.rotate(q.view(1, 1, 1, -1), tq) @ rope.rotate(k.view(1, 1, 1, -1), tk, key=True).mT)


def paper_score(q: torch.Tensor, k: torch.Tensor, n: int, m: int, gamma: float = 512.0) -> float:
    """The definition written out per channel pair (k, k + Dh/2): theta_k = 10000^(-2k/Dh),
    zeta_k = (2k/Dh + 0.4) / 1.4, score = sum_k zeta_k^((n - m)/gamma) * (R(n theta_k) q_k) . (R(m theta_k) k_k)."""
    d, total = q.numel(), 0.0
    for i in range(d // 2):
        theta, zeta = 10000 ** (-2 * i / d), (2 * i / d + 0.4) / 1.4
        a, b = (q[i].item(), q[i + d // 2].item()), (k[i].item(), k[i + d // 2].item())

        def rot(v: tuple[float, float], p: int, theta: float = theta) -> tuple[float, float]:
            c, s = math.cos(p * theta), math.sin(p * theta)
            return v[0] * c - v[1] * s, v[0] * s + v[1] * c

        ra, rb = rot(a, n), rot(b, m)
        total += zeta ** ((n - m) / gamma) * (ra[0] * rb[0] + ra[1] * rb[1])
    return total


@pytest.mark.parametrize(("n", "m"), [(0, 0), (5, 2), (700, 100), (3000, 2999), (2000, 0)])
def test_scores_equal_the_papers_definition(n, m):
    torch.manual_seed(0)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    rope = Rope(head_dim=8, xpos=True).double()
    assert score(rope, q, k, n, m) == pytest.approx(
        paper_score(q, k, n, m), rel=1e-6, abs=1e-7 * (1 + n)
    )  # fp32 frequencies
    # without xPos: the plain rotation, the same definition with zeta = 1
    plain = Rope(head_dim=8).double()
    assert score(plain, q, k, n, m) == pytest.approx(
        paper_score(q, k, n, m, gamma=math.inf), rel=1e-6, abs=1e-7 * (1 + n)
    )  # fp32 frequencies


def test_zeta_is_the_papers_and_scores_shrink_with_distance():
    rope = Rope(head_dim=8, xpos=True, xpos_scale_base=4.0)
    assert torch.allclose(rope.zeta, torch.tensor([0.4, 0.65, 0.9, 1.15]) / 1.4)
    q = k = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # one channel pair, zeta_0
    ratio = score(rope, q, k, 9, 1) / score(Rope(head_dim=8), q, k, 9, 1)
    assert ratio == pytest.approx((0.4 / 1.4) ** (8 / 4.0), rel=1e-5)


def test_a_shift_of_every_position_changes_no_score():
    torch.manual_seed(1)
    rope = Rope(head_dim=16, xpos=True, xpos_scale_base=64.0)
    q, k, pos = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16), torch.arange(7)

    def scores(p: torch.Tensor) -> torch.Tensor:
        t = rope.rotary_tables(p, q.dtype)
        return rope.rotate(q, t) @ rope.rotate(k, t, key=True).mT

    for shift in (1, 13, 300):
        assert torch.allclose(scores(pos), scores(pos + shift), rtol=1e-4, atol=1e-5)


def test_a_causal_model_decodes_like_its_full_forward():
    model = build_model(pos={"name": "rope", "xpos": True, "xpos_scale_base": 8.0, "rotary_dim": 4}, kv_heads=2)
    x = torch.randint(0, 13, (2, 12))
    assert torch.allclose(decode_logits(model, x, 5, 1), model(x).logits, atol=1e-5)


def test_bidirectional_models_refuse_it_with_the_reason():
    def selection(causal: bool, xpos: bool) -> compat.Selection:
        return compat.Selection(
            attention=[(ATTENTION.get("vanilla"), {}, False)],
            pos=(POS.get("rope"), {"xpos": xpos}),
            memory=[],
            exit=(EXIT.get("none"), {}),
            causal=causal,
        )

    (msg,) = compat.check(selection(causal=False, xpos=True))
    assert "pos.xpos=true" in msg and "causal" in msg and "Fix: pos.xpos=false" in msg
    assert compat.check(selection(causal=True, xpos=True)) == []
    assert compat.check(selection(causal=False, xpos=False)) == []


def test_positions_past_the_float_range_are_refused():
    rope = Rope(head_dim=8, xpos=True, xpos_scale_base=2.0)
    top = rope.xpos_max_position(torch.float32)  # zeta_0^(-p/gamma) = float max / 256
    assert top == int(math.log(torch.finfo(torch.float32).max / 256) / math.log(1.4 / 0.4) * 2.0)
    tables = rope.rotary_tables(torch.arange(top - 3, top + 1), torch.float32)
    assert all(torch.isfinite(t).all() for t in tables)
    with pytest.raises(ConfigError, match=r"pos.xpos=true: position .* Fix: a larger pos.xpos_scale_base"):
        rope.rotary_tables(torch.arange(top, top + 2), torch.float32)
    assert rope.xpos_max_position(torch.float16) < top


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_keys_up_to_128_stay_finite_at_the_last_position_allowed(dtype):
    """The limit counts the rotated key times its scale, not the scale alone: in fp16 the table alone fits up to
    9 gamma, where a key entry of 2 already overflowed."""
    rope = Rope(head_dim=8, xpos=True, xpos_scale_base=16.0)
    top = rope.xpos_max_position(dtype)
    p = torch.arange(top - 1, top + 1)
    tables = rope.rotary_tables(p, dtype)
    for x in (torch.full((1, 1, 2, 8), 128.0, dtype=dtype), torch.full((1, 1, 2, 8), -128.0, dtype=dtype)):
        assert torch.isfinite(rope.rotate(x, tables, key=True)).all()
        q = rope.rotate(x / 128, tables)  # the query scale, the inverse, is still a normal number
        assert (q.abs()[..., :4] >= torch.finfo(dtype).tiny).all()
