"""The attention contract: what every mechanism satisfies, for every mask direction it declares (``causal`` /
``bidirectional``) and each of its ``backends`` (a Triton kernel's parity is the ``backends`` part's):

* ``[B, H, Sq, Dh]`` out, dtype preserved (fp32 and fp64), gradients reach q, k and v;
* pure bf16 and fp16 (padded, so general paths run) keep the dtype and stay close to fp32;
* right padding leaves the real tokens' outputs unchanged;
* no causal leak: a future key/value never changes a past output;
* deterministic in eval mode;
* parity with ``reference_attention`` on every form of ``AttnMask``, with a score bias when it
  ``accepts_bias`` and with a score modifier when it ``hosts_modifiers``;
* grouped-query (Hkv < H) equals explicit expansion of the key/value heads;
* ``decode`` (the default KV cache or its own state) equals attention over the whole prefix.

A mechanism with ``fixed_length`` is tested at ``max_len`` only (no keys in front, no decoding). A mechanism
that approximates dense attention declares its degenerate limit as a classmethod
``exact_params(seq_len) -> dict`` of parameters under which it equals softmax attention (window covering the
sequence, one bucket, ...); the parity tests build it with those, under the ``params`` of ``contract_tests``.
"""

from __future__ import annotations

import pytest
import torch

from xfam.attention import ATTENTION
from xfam.attention.vanilla import reference_attention
from xfam.core.mask import AttnMask
from xfam.core.state import expand_kv
from xfam.pos.alibi import AlibiBias
from xfam.testing._attention_cases import (
    DH,
    B,
    H,
    S,
    build,
    cases,
    make_mask,
    mask_cases,
    modifier_cases,
    qkv,
)
from xfam.testing._suite import each
from xfam.testing.doubles import TableBias, ToyModifier, manual_seed

TOL = 1e-5


def causal_cases(comps):
    return cases(comps, causal_only=True)


def bias_cases(comps):
    return [c for c in cases(comps) if ATTENTION.get(c.values[0]).accepts_bias]


@each(("name", "params", "causal"), cases)
@each("dtype", [torch.float32, torch.float64])
def test_shape_dtype_and_gradients(name, params, causal, dtype):
    mech = build(name, params, causal).to(dtype)
    q, k, v = qkv(dtype=dtype, grad=True)
    out = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=causal))
    assert out.shape == (B, H, S, DH) and out.dtype == dtype
    (out * torch.randn_like(out)).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


@each(("name", "params", "causal"), causal_cases)
def test_no_causal_leak(name, params, causal):
    mech = build(name, params, causal)
    for sq in (S,) if mech.fixed_length else (S, 5):  # also with keys in front of the queries
        q, k, v = qkv(sq=sq)
        mask = AttnMask(q_len=sq, k_len=S, causal=True)
        out = mech(q, k, v, mask)
        t = S - 3  # change key/value t: queries at key index < t must not notice
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t:] += torch.randn_like(k2[:, :, t:])
        v2[:, :, t:] += 1.0
        out2 = mech(q, k2, v2, AttnMask(q_len=sq, k_len=S, causal=True))
        past = t - (S - sq)  # queries 0..past-1 sit before key t
        assert torch.allclose(out[:, :, :past], out2[:, :, :past], atol=1e-6)
        assert not torch.allclose(out[:, :, past:], out2[:, :, past:], atol=1e-3)  # the change is visible


@each(("name", "params", "causal"), cases)
def test_deterministic(name, params, causal):
    mech = build(name, params, causal)
    q, k, v = qkv()
    mask = AttnMask(q_len=S, k_len=S, causal=causal)
    assert torch.equal(mech(q, k, v, mask), mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=causal)))


@each(("name", "params", "causal", "form"), mask_cases)
def test_parity_with_reference_on_every_mask_form(name, params, causal, form):
    mech = build(name, params, causal)
    sq, mask = make_mask(form)
    q, k, v = qkv(sq=sq)
    out = mech(q, k, v, mask)
    assert torch.allclose(out, reference_attention(q, k, v, mask), atol=TOL)
    if mech.accepts_bias:
        bias = TableBias(H)
        _, mask = make_mask(form)
        out = mech(q, k, v, mask, bias)
        assert torch.allclose(out, reference_attention(q, k, v, mask, bias), atol=TOL)
        assert not torch.allclose(out, reference_attention(q, k, v, mask), atol=1e-3)  # the bias mattered


@each(("name", "params", "causal"), bias_cases)
def test_a_score_bias_is_added_after_the_scaling(name, params, causal):
    """softmax(q k^T / sqrt(d) + b): the bias (ALiBi's -m|i-j|) is not scaled by 1/sqrt(d). With q = 0 the
    weights are softmax(b) exactly (d = 8: a scaled bias would be visibly flatter)."""
    mech = build(name, params, causal)
    _, k, v = qkv()
    q = torch.zeros(B, H, S, DH)
    bias, mask = AlibiBias(H, H), AttnMask(q_len=S, k_len=S, causal=causal)
    bias.slopes *= 8.0  # steep enough to tell b from b / sqrt(8)
    b = bias.dense(mask)  # [1, H, S, S]: -m_h |i - j|
    allowed = mask.dense()
    weights = b.masked_fill(~allowed, float("-inf")).softmax(-1) if allowed is not None else b.softmax(-1)
    assert torch.allclose(mech(q, k, v, mask, bias), weights @ v, atol=TOL)


@each(("name", "params", "causal", "form"), modifier_cases)
def test_parity_with_reference_under_a_score_modifier(name, params, causal, form):
    cls = ATTENTION.get(name)
    mech = build(name, params, causal)
    sq, mask = make_mask(form)
    q, k, v = qkv(sq=sq)
    mod = ToyModifier(DH, alpha=0.3, beta=0.2)
    out = mech(q, k, v, mask, TableBias(H) if cls.accepts_bias else None, mod)
    _, mask = make_mask(form)
    ref = reference_attention(q, k, v, mask, TableBias(H) if cls.accepts_bias else None, mod)
    assert torch.allclose(out, ref, atol=TOL)


@each(("name", "params", "causal"), cases)
@each("kv_heads", [1, 2])
def test_grouped_query_equals_explicit_expansion(name, params, causal, kv_heads):
    mech = build(name, params, causal, kv_heads=kv_heads)
    q, k, v = qkv(kv_heads=kv_heads)
    mask = AttnMask(q_len=S, k_len=S, causal=causal)
    bias = TableBias(H) if mech.accepts_bias else None
    out = mech(q, k, v, mask, bias)
    expanded = mech(q, expand_kv(k, H), expand_kv(v, H), AttnMask(q_len=S, k_len=S, causal=causal), bias)
    assert torch.allclose(out, expanded, atol=TOL)
    ref = reference_attention(q, expand_kv(k, H), expand_kv(v, H), AttnMask(q_len=S, k_len=S, causal=causal), bias)
    assert torch.allclose(out, ref, atol=TOL)


@each(("name", "params", "causal"), causal_cases)
@each("window", [None, 3])
@each("kv_heads", [H, 2])
def test_decode_equals_full(name, params, causal, window, kv_heads):
    """Prompt of 4, then 1, 1, 3, 1, ... new tokens per call, each against the state of the call before."""
    mech = build(name, params, causal, kv_heads=kv_heads)
    if mech.fixed_length:
        pytest.skip(f"attention={name} needs sequences of exactly max_len tokens: no incremental decoding")
    q, k, v = qkv(kv_heads=kv_heads)
    bias = TableBias(H) if mech.accepts_bias else None
    full = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True, window=window), bias)
    outs, state, t = [], None, 0
    for n in (4, 1, 1, 3, 1, 2):
        mask = AttnMask(q_len=n, k_len=t + n, causal=True, window=window)
        out, state = mech.decode(q[:, :, t : t + n], k[:, :, t : t + n], v[:, :, t : t + n], state, mask, bias)
        outs.append(out)
        t += n
    assert t == S
    assert torch.allclose(torch.cat(outs, dim=2), full, atol=TOL)


@each(("name", "params", "causal"), cases)
@each("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_the_dtype_and_the_values(name, params, causal, dtype):
    """Pure bf16/fp16 (``precision=bf16-true``, ``model.half()``), with padding so that general paths run: the
    output keeps the dtype and is close to fp32's. It found routing's fp32-only CPU ``cdist`` and Sinkhorn's
    0 / 0 in fp16 (LSH's general path, which its degenerate limit here does not reach, has its own test)."""
    form = "causal_left_padding" if causal else "bidirectional_padding"
    sq, mask = make_mask(form)
    mech = build(name, params, causal)
    q, k, v = qkv(sq=sq)
    want = mech(q, k, v, mask)
    got = mech.to(dtype)(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.1)


@each(("name", "params", "causal"), cases)
def test_right_padding_leaves_the_real_tokens_unchanged(name, params, causal):
    """A row alone equals the same row right-padded to a longer batch-mate's width (batched evaluation equals one
    row at a time), with the mechanism's own defaults (blocks, windows, buckets) over 640 positions. Sinkhorn's
    balancing once spread mass onto blocks of padding only. (A layout cut over the padded width, as BlockBERT's
    and BigBird's bidirectional ones, fails this by design: ``contract_tests(..., xfail=...)`` says so.)"""
    cls = ATTENTION.get(name)
    if cls.fixed_length:
        pytest.skip("fixed_length: every row has max_len tokens")
    struct = dict(dim=H * DH, heads=H, kv_heads=H, head_dim=DH, max_len=1024, causal=causal, num_layers=2)
    manual_seed(0)
    mech = ATTENTION.build({"name": name, **params}, **struct, layer=0).double().eval()
    q, k, v = (torch.randn(1, H, 640, DH, dtype=torch.float64) for _ in range(3))
    n = 451  # real tokens
    alone = mech(q[:, :, :n], k[:, :, :n], v[:, :, :n], AttnMask(q_len=n, k_len=n, causal=causal))
    padding = (torch.arange(640) < n)[None]
    padded = mech(q, k, v, AttnMask(q_len=640, k_len=640, causal=causal, key_padding=padding))
    torch.testing.assert_close(padded[:, :, :n], alone, atol=1e-9, rtol=1e-9)
