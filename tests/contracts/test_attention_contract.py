"""The attention contract, for every registered ``xfam.`` mechanism (and each of its backends).

A new mechanism gets these tests by registering. What it must satisfy, for every mask direction it
declares (``causal`` / ``bidirectional``):

* ``[B, H, Sq, Dh]`` out, dtype preserved (fp32 and fp64), gradients reach q, k and v;
* pure bf16 and fp16 (padded, so general paths run) keep the dtype and stay close to fp32;
* right padding leaves the real tokens' outputs unchanged (``WIDTH_DEPENDENT`` bidirectional layouts excepted);
* no causal leak: a future key/value never changes a past output;
* deterministic in eval mode;
* parity with ``reference_attention`` on every form of ``AttnMask``, with a score bias when it
  ``accepts_bias`` and with a score modifier when it ``hosts_modifiers``;
* grouped-query (Hkv < H) equals explicit expansion of the key/value heads;
* ``decode`` (the default KV cache or its own state) equals attention over the whole prefix.

A mechanism with ``fixed_length`` is tested at ``max_len`` only (no keys in front, no decoding).
A mechanism that approximates dense attention declares its degenerate limit (docs/architecture.md) as
a classmethod ``exact_params(seq_len) -> dict`` of parameters under which it equals softmax
attention (window covering the sequence, one bucket, ...); the parity tests build it with those.
"""

from __future__ import annotations

import pytest
import torch
from doubles import TableBias, ToyModifier, xfam_components

from xfam.attention import ATTENTION
from xfam.attention.vanilla import reference_attention
from xfam.core.mask import SHARED, AttnMask
from xfam.core.registry import signature_params
from xfam.core.state import expand_kv
from xfam.pos.alibi import AlibiBias

B, H, DH, S = 2, 4, 8, 12
TOL = 1e-5


def variants() -> list[tuple[str, dict]]:
    """(name, params): one per backend where the mechanism has a ``backend`` parameter."""
    out = []
    for name in xfam_components(ATTENTION):
        cls = ATTENTION.get(name)
        if "backend" in signature_params(cls):
            # (the Triton path runs in the slow interpreter here and tiles blocks >= 16: its parity with the
            # reference path, per mechanism, is tests/kernels/test_dispatch.py)
            out += [(name, {"backend": b}) for b in cls.backends if b != "triton"]
        else:
            out.append((name, {}))
    return out


def cases(causal_only: bool = False) -> list:
    """pytest params ``(name, params, causal)`` over every variant and mask direction it supports."""
    out = []
    for name, params in variants():
        cls = ATTENTION.get(name)
        directions = [c for c, ok in ((True, cls.causal), (False, cls.bidirectional)) if ok]
        for causal in directions:
            if causal or not causal_only:
                label = "-".join([name, *map(str, params.values()), "causal" if causal else "bidir"])
                out.append(pytest.param(name, params, causal, id=label))
    return out


def build(name: str, params: dict, causal: bool, heads: int = H, kv_heads: int = H, seq_len: int = S):
    cls = ATTENTION.get(name)
    cfg = {"name": name, **cls.exact_params(seq_len), **params}
    struct = dict(dim=heads * DH, heads=heads, kv_heads=kv_heads, head_dim=DH, max_len=S, causal=causal, num_layers=2)
    torch.manual_seed(0)
    return ATTENTION.build(cfg, **struct, layer=0).eval()


def qkv(sq: int = S, sk: int = S, kv_heads: int = H, dtype=torch.float32, grad: bool = False):
    q = torch.randn(B, H, sq, DH, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, kv_heads, sk, DH, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, kv_heads, sk, DH, dtype=dtype, requires_grad=grad)
    return q, k, v


PAD_LEFT = torch.tensor([[False] * 3 + [True] * 9, [True] * 12])
PAD_RIGHT = torch.tensor([[True] * 12, [True] * 8 + [False] * 4])
SEGMENTS = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 7 + [4] * 5])
# memory tokens in packed rows: keys every document sees (AttnMask's SHARED id), mechanisms with ``shared_keys``
SHARED_SEGMENTS = torch.tensor([[SHARED] * 2 + [0] * 6 + [1] * 4, [SHARED] * 3 + [3] * 4 + [4] * 5])

MASKS = {  # name -> (Sq, AttnMask kwargs without q_len); Sk = 12 throughout
    "causal": (12, dict(causal=True)),
    "causal_offset": (5, dict(causal=True)),  # keys (memory or cache) in front of the queries
    "causal_single_query": (1, dict(causal=True)),
    "causal_left_padding": (12, dict(causal=True, key_padding=PAD_LEFT)),
    "causal_offset_padding": (7, dict(causal=True, key_padding=PAD_LEFT)),
    "causal_segments": (12, dict(causal=True, segments=SEGMENTS)),
    "causal_shared_segments": (12, dict(causal=True, segments=SHARED_SEGMENTS)),
    "causal_window": (12, dict(causal=True, window=4)),
    "causal_window_offset": (6, dict(causal=True, window=3)),
    "bidirectional": (12, dict()),
    "bidirectional_padding": (12, dict(key_padding=PAD_RIGHT)),
    "bidirectional_segments": (12, dict(segments=SEGMENTS)),
    "bidirectional_shared_segments": (12, dict(segments=SHARED_SEGMENTS)),
    "bidirectional_window": (12, dict(window=3)),
}


def mask_cases() -> list:
    """``(name, params, causal, form)`` over every case and every mask form of its direction."""
    out = []
    for p in cases():
        name, params, causal = p.values
        for form, (sq, kw) in MASKS.items():
            cls = ATTENTION.get(name)
            if "shared" in form and not cls.shared_keys:
                continue
            if kw.get("causal", False) == causal and (sq == S or not cls.fixed_length):
                out.append(pytest.param(name, params, causal, form, id=f"{p.id}-{form}"))
    return out


def modifier_cases() -> list:
    """``(name, causal, form)`` for the mechanisms that host score modifiers (built with their defaults)."""
    out = []
    for name in xfam_components(ATTENTION):
        cls = ATTENTION.get(name)
        for form, (sq, kw) in MASKS.items():
            causal = kw.get("causal", False)
            supported = cls.causal if causal else cls.bidirectional
            if cls.hosts_modifiers and supported and (sq == S or not cls.fixed_length):
                out.append(pytest.param(name, causal, form, id=f"{name}-{form}"))
    return out


def make_mask(form: str) -> tuple[int, AttnMask]:
    sq, kw = MASKS[form]
    return sq, AttnMask(q_len=sq, k_len=S, **kw)


@pytest.mark.parametrize(("name", "params", "causal"), cases())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shape_dtype_and_gradients(name, params, causal, dtype):
    mech = build(name, params, causal).to(dtype)
    q, k, v = qkv(dtype=dtype, grad=True)
    out = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=causal))
    assert out.shape == (B, H, S, DH) and out.dtype == dtype
    (out * torch.randn_like(out)).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


@pytest.mark.parametrize(("name", "params", "causal"), cases(causal_only=True))
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


@pytest.mark.parametrize(("name", "params", "causal"), cases())
def test_deterministic(name, params, causal):
    mech = build(name, params, causal)
    q, k, v = qkv()
    mask = AttnMask(q_len=S, k_len=S, causal=causal)
    assert torch.equal(mech(q, k, v, mask), mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=causal)))


@pytest.mark.parametrize(("name", "params", "causal", "form"), mask_cases())
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


@pytest.mark.parametrize(("name", "params", "causal"), [c for c in cases() if ATTENTION.get(c.values[0]).accepts_bias])
def test_a_score_bias_is_added_after_the_scaling(name, params, causal):
    """softmax(q k^T / sqrt(d) + b): the bias (ALiBi's -m|i-j|) is not scaled by 1/sqrt(d). With q = 0 the
    weights are softmax(b) exactly (d = 8: a scaled bias would be visibly flatter)."""
    mech = build(name, params, causal)
    _, k, v = qkv()
    q = torch.zeros(B, H, S, DH)
    bias, mask = AlibiBias(H, H), AttnMask(q_len=S, k_len=S, causal=causal)
    bias.slopes *= 8.0  # steep enough to tell b from b / sqrt(8)
    b = bias.dense(mask)  # [1, H, S, S]: -m_h |i - j|
    weights = b.masked_fill(~mask.dense(), float("-inf")).softmax(-1) if causal else b.softmax(-1)
    assert torch.allclose(mech(q, k, v, mask, bias), weights @ v, atol=TOL)


@pytest.mark.parametrize(("name", "causal", "form"), modifier_cases())
def test_parity_with_reference_under_a_score_modifier(name, causal, form):
    cls = ATTENTION.get(name)
    mech = build(name, {}, causal)
    sq, mask = make_mask(form)
    q, k, v = qkv(sq=sq)
    mod = ToyModifier(DH, alpha=0.3, beta=0.2)
    out = mech(q, k, v, mask, TableBias(H) if cls.accepts_bias else None, mod)
    _, mask = make_mask(form)
    ref = reference_attention(q, k, v, mask, TableBias(H) if cls.accepts_bias else None, mod)
    assert torch.allclose(out, ref, atol=TOL)


@pytest.mark.parametrize(("name", "params", "causal"), cases())
@pytest.mark.parametrize("kv_heads", [1, 2])
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


@pytest.mark.parametrize(("name", "params", "causal"), cases(causal_only=True))
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kv_heads", [H, 2])
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


@pytest.mark.parametrize(("name", "params", "causal"), cases())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
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


# Their bidirectional layouts are cut over the padded width (as the papers' code, which pads every input to one
# fixed length): BlockBERT's blocks are k_len / n_blocks long, BigBird's last global blocks are the last blocks.
WIDTH_DEPENDENT = {"blockwise", "bigbird"}


def padding_cases() -> list:
    out = []
    for p in cases():
        name, _, causal = p.values
        if name in WIDTH_DEPENDENT and not causal:
            reason = "layout cut over the padded width (docs/attention.md)"
            p = pytest.param(*p.values, id=p.id, marks=pytest.mark.xfail(strict=True, reason=reason))
        out.append(p)
    return out


@pytest.mark.parametrize(("name", "params", "causal"), padding_cases())
def test_right_padding_leaves_the_real_tokens_unchanged(name, params, causal):
    """A row alone equals the same row right-padded to a longer batch-mate's width (batched evaluation equals one
    row at a time), with the mechanism's own defaults (blocks, windows, buckets) over 640 positions. Sinkhorn's
    balancing once spread mass onto blocks of padding only."""
    cls = ATTENTION.get(name)
    if cls.fixed_length:
        pytest.skip("fixed_length: every row has max_len tokens")
    struct = dict(dim=H * DH, heads=H, kv_heads=H, head_dim=DH, max_len=1024, causal=causal, num_layers=2)
    torch.manual_seed(0)
    mech = ATTENTION.build({"name": name, **params}, **struct, layer=0).double().eval()
    q, k, v = (torch.randn(1, H, 640, DH, dtype=torch.float64) for _ in range(3))
    n = 451  # real tokens
    alone = mech(q[:, :, :n], k[:, :, :n], v[:, :, :n], AttnMask(q_len=n, k_len=n, causal=causal))
    padding = (torch.arange(640) < n)[None]
    padded = mech(q, k, v, AttnMask(q_len=640, k_len=640, causal=causal, key_padding=padding))
    torch.testing.assert_close(padded[:, :, :n], alone, atol=1e-9, rtol=1e-9)
