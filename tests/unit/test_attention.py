"""Vanilla attention and the score-bias / score-modifier contracts, proven with the toy doubles."""

from __future__ import annotations

import gc
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from doubles import QuadraticBias, ToyModifier, build_model, quadratic_bias_value

import xfam.core.logs
from xfam.attention.vanilla import Vanilla, reference_attention
from xfam.core.bias import additive_mask
from xfam.core.mask import AttnMask
from xfam.core.state import expand_kv


def explicit_softmax(q, k, v, score_fn, out_fn=None):
    """Attention one (batch, head, query) at a time: softmax over the visible keys of
    q.k/sqrt(Dh) + score_fn(b, h, i, j), then sum_j p_j v_j (+ out_fn(b, h, i, p))."""
    bsz, heads, sq, dh = q.shape
    sk = k.shape[2]
    out = torch.zeros_like(q)
    for b in range(bsz):
        for h in range(heads):
            for i in range(sq):
                s = [float(q[b, h, i] @ k[b, h, j]) / math.sqrt(dh) + score_fn(b, h, i, j) for j in range(sk)]
                p = torch.softmax(torch.tensor(s, dtype=torch.float64), 0)
                out[b, h, i] = (p[:, None] * v[b, h].double()).sum(0)
                if out_fn is not None:
                    out[b, h, i] += out_fn(b, h, i, p)
    return out


def causal_offset(off: int, fn):
    return lambda b, h, i, j: fn(b, h, i, j) if j <= i + off else float("-inf")


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
@pytest.mark.parametrize(("sq", "sk", "causal"), [(5, 5, True), (3, 7, True), (5, 5, False)])
def test_toy_bias_equals_hand_written_softmax(backend, sq, sk, causal):
    scale, off = 0.1, sk - sq
    q, k, v = torch.randn(2, 3, sq, 4), torch.randn(2, 3, sk, 4), torch.randn(2, 3, sk, 4)
    bias = QuadraticBias(3, scale)
    mask = AttnMask(q_len=sq, k_len=sk, causal=causal)
    out = Vanilla(backend=backend)(q, k, v, mask, bias)

    def score(b, h, i, j):
        return quadratic_bias_value(h, i + off, j, scale)

    expected = explicit_softmax(q, k, v, causal_offset(off, score) if causal else score)
    assert torch.allclose(out, expected.float(), atol=1e-5)


def test_score_bias_forms_agree():
    bias = QuadraticBias(3, 0.1)
    mask = AttnMask(q_len=3, k_len=6, causal=True)
    dense = bias.dense(mask)
    assert dense.shape == (1, 3, 3, 6)
    for h in range(3):
        for i in range(3):
            for j in range(6):
                assert dense[0, h, i, j] == pytest.approx(quadratic_bias_value(h, i + 3, j, 0.1))
    # (b) pairs on gathered index pairs, e.g. a sparse path's (query, key) lists
    qi, kj = torch.tensor([3, 4, 5, 5]), torch.tensor([0, 4, 1, 5])
    assert torch.equal(bias.pairs(qi, kj), dense[0][:, qi - 3, kj])
    # select_heads: the same values for a slice of heads, in every form
    part = bias.select_heads(1, 3)
    assert part.heads == 2
    assert torch.equal(part.dense(mask), dense[:, 1:3])
    assert torch.equal(part.pairs(qi, kj), bias.pairs(qi, kj)[1:3])
    assert bias.decay() is None and part.decay() is None  # not a pure distance decay


def test_additive_mask_folds_mask_and_bias():
    bias = QuadraticBias(2, 0.1)
    mask = AttnMask(q_len=4, k_len=4, causal=True)
    add = additive_mask(mask, bias, torch.float32, torch.device("cpu"))
    assert torch.equal(torch.isinf(add[0, 0]), ~torch.ones(4, 4, dtype=torch.bool).tril())
    finite = torch.isfinite(add)
    assert torch.equal(add[finite], bias.dense(mask).expand_as(add)[finite])
    assert additive_mask(AttnMask(q_len=4, k_len=4), None, torch.float32, torch.device("cpu")) is None


def test_additive_mask_never_confuses_two_biases_on_one_mask():
    """Regression: the per-forward memo was keyed on id(bias); a short-lived bias (a per-head slice)
    freed by the garbage collector handed its id, and its cached tensor, to the next slice."""
    parent = QuadraticBias(4, 0.1)
    mask = AttnMask(q_len=4, k_len=4)
    for t in range(20):
        start = 2 * (t % 2)
        part = parent.select_heads(start, start + 2)
        got = additive_mask(mask, part, torch.float32, torch.device("cpu"))
        assert torch.equal(got, parent.dense(mask)[:, start : start + 2]), t
        del part
        gc.collect(0)  # the slice sits in a reference cycle: free it now, as a later collection would


def test_toy_modifier_equals_hand_computed_attention():
    alpha, beta, dh, off = 0.3, 0.2, 4, 2
    q, k, v = torch.randn(1, 2, 4, dh), torch.randn(1, 2, 6, dh), torch.randn(1, 2, 6, dh)
    mask = AttnMask(q_len=4, k_len=6, causal=True)
    out = Vanilla(backend="torch")(q, k, v, mask, modifier=ToyModifier(dh, alpha, beta))

    def score(b, h, i, j):  # + alpha * sum(q_i) * (j - i), i a key index
        return alpha * float(q[b, h, i].sum()) * (j - (i + off))

    def extra(b, h, i, p):  # + beta * sum_j p_j (i - j) * [1..Dh]
        mean_dist = sum(float(p[j]) * ((i + off) - j) for j in range(6))
        return beta * mean_dist * torch.arange(1, dh + 1, dtype=torch.float64)

    expected = explicit_softmax(q, k, v, causal_offset(off, score), extra)
    assert torch.allclose(out, expected.float(), atol=1e-5)
    plain = Vanilla(backend="torch")(q, k, v, mask)
    assert not torch.allclose(out, plain, atol=1e-3)  # the modifier really changed something


def count_sdpa(monkeypatch) -> list[int]:
    calls = [0]
    real = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


def test_auto_backend_picks_the_reference_path_for_a_modifier_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(xfam.core.logs, "_seen", set())
    calls = count_sdpa(monkeypatch)
    caplog.set_level(logging.INFO, logger="xfam")
    q = k = v = torch.randn(1, 2, 5, 4)
    mask = AttnMask(q_len=5, k_len=5, causal=True)
    mod = ToyModifier(4, 0.3, 0.2)
    mech = Vanilla(backend="auto")
    for _ in range(3):
        out = mech(q, k, v, mask, modifier=mod)
    assert calls[0] == 0
    assert torch.allclose(out, reference_attention(q, k, v, mask, modifier=mod), atol=1e-6)
    picked = [r.getMessage() for r in caplog.records if "backend=auto" in r.getMessage()]
    assert len(picked) == 1 and "torch path" in picked[0] and "modifier" in picked[0]

    caplog.clear()
    for _ in range(3):
        mech(q, k, v, mask)
    assert calls[0] == 3
    picked = [r.getMessage() for r in caplog.records if "backend=auto" in r.getMessage()]
    assert len(picked) == 1 and "sdpa" in picked[0]


@pytest.mark.parametrize(("backend", "sdpa_calls"), [("sdpa", 1), ("torch", 0)])
def test_explicit_backend_is_obeyed(monkeypatch, backend, sdpa_calls):
    calls = count_sdpa(monkeypatch)
    q = torch.randn(1, 2, 5, 4)
    Vanilla(backend=backend)(q, q, q, AttnMask(q_len=5, k_len=5, causal=True))
    assert calls[0] == sdpa_calls


def test_modifier_pos_is_hosted_in_a_model():
    """The model hands pos.score_modifier(layer) to the mechanism: toy_modifier changes the logits
    of a model with the same weights, and the auto and torch paths agree."""
    tokens = torch.randint(0, 13, (2, 8))
    with_mod = build_model(pos="toy_modifier")(tokens).logits
    torch_path = build_model(pos="toy_modifier", attention={"name": "vanilla", "backend": "torch"})(tokens).logits
    without = build_model(pos="none")(tokens).logits
    assert torch.allclose(with_mod, torch_path, atol=1e-6)
    assert not torch.allclose(with_mod, without, atol=1e-4)


def test_expand_kv_is_repeat_interleave():
    x = torch.arange(2 * 3).float().view(1, 2, 3, 1)  # [B, Hkv=2, S, 1]
    y = expand_kv(x, 4)
    assert y.shape == (1, 4, 3, 1)
    assert torch.equal(y[0, :, 0, 0], torch.tensor([0.0, 0.0, 3.0, 3.0]))  # heads 0,1 <- kv 0; 2,3 <- kv 1
    assert expand_kv(x, 2) is x


def test_reference_attention_dropout_only_in_training():
    q = torch.randn(1, 2, 6, 4)
    mech = Vanilla(backend="torch", dropout=0.5)
    mask = AttnMask(q_len=6, k_len=6, causal=True)
    mech.eval()
    assert torch.equal(mech(q, q, q, mask), mech(q, q, q, mask))
    mech.train()
    assert not torch.allclose(mech(q, q, q, mask), reference_attention(q, q, q, mask), atol=1e-3)
