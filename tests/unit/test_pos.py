"""Known values and invariances of each positional encoding (RoPE, ALiBi, sinusoidal, learned)."""

from __future__ import annotations

import math

import pytest
import torch
from doubles import build_model

from xfam.core.errors import ConfigError
from xfam.core.mask import AttnMask
from xfam.pos import POS
from xfam.pos.alibi import Alibi, alibi_slopes
from xfam.pos.learned import Learned
from xfam.pos.rope import Rope
from xfam.pos.sinusoidal import Sinusoidal

# -- RoPE --------------------------------------------------------------------------------------


def rotated(rope: Rope, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return rope.rotate(x, rope.rotary_tables(positions, x.dtype))


def test_rope_rotates_each_channel_pair_by_position_times_frequency():
    """Dh=4, base 10000: pairs (0, 2) at theta_0 = 1 and (1, 3) at theta_1 = 10000^(-1/2) = 0.01."""
    rope = Rope(head_dim=4)
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])  # [B, H, S=1, Dh]
    p = 3.0
    y = rotated(rope, x, torch.tensor([3]))[0, 0, 0]
    for a, b, theta in ((0, 2, 1.0), (1, 3, 0.01)):
        c, s = math.cos(p * theta), math.sin(p * theta)
        xa, xb = float(x[0, 0, 0, a]), float(x[0, 0, 0, b])
        assert float(y[a]) == pytest.approx(xa * c - xb * s, abs=1e-6)
        assert float(y[b]) == pytest.approx(xa * s + xb * c, abs=1e-6)
    # position 0 is the identity; rotation keeps the norm
    assert torch.allclose(rotated(rope, x, torch.tensor([0])), x)
    assert float(y.norm()) == pytest.approx(float(x.norm()), rel=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    rope = Rope(head_dim=8)
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    pos = torch.arange(6)
    scores = rotated(rope, q, pos) @ rotated(rope, k, pos).transpose(-1, -2)
    for shift in (1, 7, 40):
        shifted = rotated(rope, q, pos + shift) @ rotated(rope, k, pos + shift).transpose(-1, -2)
        assert torch.allclose(scores, shifted, atol=1e-5)
    # directly: R(i) q . R(j) k == q . R(j - i) k
    i, j = 5, 2
    lhs = rotated(rope, q[..., :1, :], torch.tensor([i])) @ rotated(rope, k[..., :1, :], torch.tensor([j])).mT
    rhs = q[..., :1, :] @ rotated(rope, k[..., :1, :], torch.tensor([j - i])).mT
    assert torch.allclose(lhs, rhs, atol=1e-5)
    # and the scores do depend on the distance (not a no-op)
    assert not torch.allclose(scores, q @ k.mT, atol=1e-3)


def test_rope_partial_rotary_dim_rotates_the_first_channels_only():
    torch.manual_seed(0)
    full, part = Rope(head_dim=4), Rope(head_dim=8, rotary_dim=4)
    x, pos = torch.randn(1, 2, 6, 8), torch.arange(6) + 3
    y = rotated(part, x, pos)
    assert torch.equal(y[..., 4:], x[..., 4:])  # the other channels carry no position
    assert torch.allclose(y[..., :4], rotated(full, x[..., :4], pos))  # theta_k = base^(-2k/r)
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    scores = rotated(part, q, pos) @ rotated(part, k, pos).mT
    assert torch.allclose(scores, rotated(part, q, pos + 11) @ rotated(part, k, pos + 11).mT, atol=1e-5)


def test_rope_interpolation_divides_positions_by_the_factor():
    x = torch.randn(1, 2, 5, 8)
    pos = torch.tensor([0, 4, 10, 30, 100])
    got = rotated(Rope(head_dim=8, interpolation=4.0), x, pos)
    assert torch.allclose(got, rotated(Rope(head_dim=8), x, pos / 4.0), atol=1e-6)


def test_rope_refuses_a_bad_rotary_dim():
    for r in (3, 10):
        (msg,) = POS.check({"name": "rope", "rotary_dim": r}, {"head_dim": 8})
        assert "rotary_dim" in msg and "Fix" in msg
    assert POS.check({"name": "rope", "rotary_dim": 8}, {"head_dim": 8}) == []


def test_rope_refuses_an_odd_head_dim():
    (msg,) = POS.check({"name": "rope"}, {"head_dim": 7})
    assert "head_dim=7 is odd" in msg and "Fix:" in msg


# -- ALiBi -------------------------------------------------------------------------------------

# Exponents e of the slopes 2^e of the authors' reference code (ofirpress/attention_with_linear_biases),
# written out by hand: for 2^n heads, 2^(-8/2^n) and its powers; otherwise the slopes of the lower power of
# two followed by every other slope of twice that count.
ALIBI_EXPONENTS = {
    1: [-8],
    2: [-4, -8],
    3: [-4, -8, -2],
    4: [-2, -4, -6, -8],
    5: [-2, -4, -6, -8, -1],
    6: [-2, -4, -6, -8, -1, -3],
    7: [-2, -4, -6, -8, -1, -3, -5],
    8: [-1, -2, -3, -4, -5, -6, -7, -8],
    9: [-1, -2, -3, -4, -5, -6, -7, -8, -0.5],
    10: [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5],
    11: [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5],
    12: [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5],
    13: [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5, -4.5],
    14: [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5, -4.5, -5.5],
    15: [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5, -4.5, -5.5, -6.5],
    16: [-0.5, -1, -1.5, -2, -2.5, -3, -3.5, -4, -4.5, -5, -5.5, -6, -6.5, -7, -7.5, -8],
    24: [-0.5, -1, -1.5, -2, -2.5, -3, -3.5, -4, -4.5, -5, -5.5, -6, -6.5, -7, -7.5, -8]
    + [-0.25, -0.75, -1.25, -1.75, -2.25, -2.75, -3.25, -3.75],
}


@pytest.mark.parametrize("heads", list(ALIBI_EXPONENTS))
def test_alibi_slopes_match_the_reference_code(heads):
    assert alibi_slopes(heads) == pytest.approx([2.0**e for e in ALIBI_EXPONENTS[heads]], rel=1e-12)


def test_alibi_slopes_spot_values():
    assert alibi_slopes(8) == pytest.approx([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625])
    assert alibi_slopes(6) == pytest.approx([0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125])
    assert alibi_slopes(12)[8:] == pytest.approx([0.70710678, 0.35355339, 0.17677670, 0.08838835])


@pytest.mark.parametrize(("sq", "sk", "causal"), [(5, 5, False), (5, 5, True), (3, 7, True)])
def test_alibi_bias_is_minus_slope_times_distance(sq, sk, causal):
    alibi = Alibi(heads=4)
    dense = alibi.score_bias().dense(AttnMask(q_len=sq, k_len=sk, causal=causal))
    assert dense.shape == (1, 4, sq, sk)
    slopes = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    for h in range(4):
        for i in range(sq):
            for j in range(sk):
                assert float(dense[0, h, i, j]) == pytest.approx(-slopes[h] * abs(i + sk - sq - j))
    if not causal:
        assert torch.equal(dense, dense.transpose(-1, -2))  # symmetric in the bidirectional model


def test_alibi_decay_is_exp_minus_slope():
    bias = Alibi(heads=8).score_bias()
    assert torch.allclose(bias.decay(), torch.exp(-torch.tensor([2.0**-e for e in range(1, 9)])))
    # exp(b[h, i, j]) == decay_h ** (i - j) on causal pairs
    dense = bias.dense(AttnMask(q_len=6, k_len=6, causal=True))[0]
    dist = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).clamp_min(0)
    causal = dist.new_ones(6, 6, dtype=torch.bool).tril()
    powers = bias.decay()[:, None, None] ** dist
    assert torch.allclose(dense.exp()[:, causal], powers[:, causal], rtol=1e-6)
    assert torch.allclose(bias.select_heads(2, 5).decay(), bias.decay()[2:5])
    assert bias.kernel_params()["kind"] == "alibi"


def test_alibi_num_heads_leaves_the_other_heads_unbiased():
    bias = Alibi(heads=6, num_heads=2).score_bias()
    dense = bias.dense(AttnMask(q_len=4, k_len=4))[0]
    assert torch.equal(dense[2:], torch.zeros(4, 4, 4))
    assert torch.allclose(
        dense[:2],
        -torch.tensor([2.0**-4, 2.0**-8])[:, None, None]
        * ((torch.arange(4)[:, None] - torch.arange(4)[None, :]).abs()),
    )
    (msg,) = POS.check({"name": "alibi", "num_heads": 8}, {"heads": 4})
    assert "num_heads=8 exceeds model.heads=4" in msg and "Fix:" in msg


# -- sinusoidal --------------------------------------------------------------------------------


def test_sinusoidal_matches_the_paper_formula():
    """PE(p, 2k) = sin(p / 10000^(2k/d)), PE(p, 2k+1) = cos(p / 10000^(2k/d)); d = 8, so 10000^(2k/8) = 10^k."""
    enc = Sinusoidal(dim=8, scale=1.0)
    pe = enc.embed(torch.zeros(1, 4, 8), torch.arange(4))[0]  # [S, D]
    expected = {
        (0, 0): 0.0,
        (0, 1): 1.0,
        (1, 0): math.sin(1.0),
        (1, 1): math.cos(1.0),
        (2, 2): math.sin(0.2),
        (2, 3): math.cos(0.2),
        (3, 4): math.sin(0.03),
        (3, 7): math.cos(0.003),
    }
    for (p, c), value in expected.items():
        assert float(pe[p, c]) == pytest.approx(value, abs=1e-6), (p, c)


def test_sinusoidal_default_scale_and_odd_width():
    x = torch.randn(1, 3, 8)
    plain = Sinusoidal(dim=8, scale=1.0).embed(x, torch.arange(3)) - x
    assert torch.allclose(Sinusoidal(dim=8).embed(x, torch.arange(3)) - x, plain / math.sqrt(8), atol=1e-6)
    pe = Sinusoidal(dim=5, scale=1.0).embed(torch.zeros(1, 2, 5), torch.arange(2))[0]
    assert float(pe[1, 4]) == pytest.approx(math.sin(1 / 10000 ** (4 / 5)), abs=1e-6)


# -- learned -----------------------------------------------------------------------------------


def test_learned_adds_its_table_row():
    enc = Learned(dim=4, max_len=8)
    x = torch.randn(1, 3, 4)
    assert torch.equal(enc.embed(x, torch.tensor([5, 6, 7])), x + enc.table.weight[5:8])


def test_learned_refuses_positions_past_the_table():
    model = build_model(pos="learned", max_len=8)
    model(torch.randint(0, 13, (1, 8)))  # exactly max_len is fine
    with pytest.raises(ConfigError) as info:
        model(torch.randint(0, 13, (1, 9)))
    msg = str(info.value)
    assert "pos=learned" in msg and "position 8" in msg and "Fix:" in msg and "rope" in msg
    out = model(torch.randint(0, 13, (1, 8)), cache=model.empty_cache())
    with pytest.raises(ConfigError, match="position 8"):  # decoding past the table too
        model(torch.randint(0, 13, (1, 1)), cache=out.cache)


def test_partial_and_interpolated_rope_in_a_model_decode_like_the_full_forward():
    from doubles import decode_logits

    model = build_model(pos={"name": "rope", "rotary_dim": 4, "interpolation": 2.0}, kv_heads=2)
    x = torch.randint(0, 13, (2, 12))
    assert torch.allclose(decode_logits(model, x, 5, 1), model(x).logits, atol=1e-5)
