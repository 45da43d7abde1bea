"""Adaptive attention span (Sukhbaatar et al., 2019): the soft mask and the renormalised weights are
the paper's formulas, the span learns from the LM loss and shrinks under its L1 penalty, stays in
[0, S], and the trimmed banded fast path equals the explicit masked computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from doubles import TableBias, build_model, decode_logits

from xfam.attention import ATTENTION
from xfam.attention.adaptive_span import AdaptiveSpan, span_band_attention, span_mask
from xfam.attention.local import WindowPattern
from xfam.core.errors import ConfigError
from xfam.core.mask import AttnMask
from xfam.core.state import expand_kv

B, H, DH, S, R = 2, 4, 8, 24, 4
RATIOS = torch.tensor([0.0, 0.1, 0.27, 0.5])  # spans 0, 2.4, 6.48, 12 positions (S = 24)


def make(dynamic: bool = False, backend: str = "block", causal: bool = True, heads: int = H, **kw) -> AdaptiveSpan:
    cfg = {"name": "adaptive_span", "ramp": R, "block": 4, "dynamic": dynamic, "backend": backend, **kw}
    mech = ATTENTION.build(cfg, heads=heads, kv_heads=heads, head_dim=DH, max_len=S, causal=causal)
    if dynamic:  # spans that differ by query and head, some beyond S/2
        g = torch.Generator().manual_seed(3)
        mech.span_proj.data = torch.randn(heads, DH, generator=g)
        mech.span_bias.data = torch.linspace(-3, 0, heads)
    else:
        mech.span_ratio.data = RATIOS[:heads].clone()
    return mech.double().eval()


def qkv(sq: int = S, sk: int = S, kv_heads: int = H, dh: int = DH, grad: bool = False):
    shape = lambda n, h: (B, h, n, dh)  # noqa: E731
    return tuple(
        torch.randn(*shape(n, h), dtype=torch.float64, requires_grad=grad)
        for n, h in ((sq, H), (sk, kv_heads), (sk, kv_heads))
    )


def explicit(q, k, v, z, mask: AttnMask, bias=None) -> torch.Tensor:
    """a_ij = m(x_ij) exp(s_ij) / sum_k m(x_ik) exp(s_ik) one query at a time, x = |i - j| in key
    coordinates, over the keys the mask allows; z: [H] or [B, H, Sq]."""
    heads, sq, sk = q.shape[1], q.shape[2], k.shape[2]
    k, v = expand_kv(k, heads), expand_kv(v, heads)
    allowed = mask.dense()
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(heads):
            for i in range(sq):
                zi = float(z[h] if z.dim() == 1 else z[b, h, i])
                w = []
                for j in range(sk):
                    if allowed is not None and not allowed[min(b, allowed.shape[0] - 1), 0, i, j]:
                        w.append(0.0)
                        continue
                    x = abs(i + mask.offset - j)
                    s = float(q[b, h, i] @ k[b, h, j]) / math.sqrt(q.shape[-1])
                    s += 0.0 if bias is None else float(bias.pairs(torch.tensor(i + mask.offset), torch.tensor(j))[h])
                    w.append(min(max((R + zi - x) / R, 0.0), 1.0) * math.exp(s))
                w = torch.tensor(w, dtype=torch.float64)
                out[b, h, i] = (w / w.sum()) @ v[b, h]
    return out


def test_soft_mask_is_the_papers_ramp():
    dist = torch.arange(11, dtype=torch.float64)
    # z = 5, R = 4: full weight up to x = z, then falling by 1/R per position to 0 at x = z + R
    expected = [1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0, 0]
    assert span_mask(torch.tensor(5.0, dtype=torch.float64), dist, 4).tolist() == expected
    m = span_mask(torch.tensor(2.5, dtype=torch.float64), dist, 4)
    assert torch.allclose(m[:8], torch.tensor([1, 1, 1, 0.875, 0.625, 0.375, 0.125, 0], dtype=torch.float64))
    assert span_mask(torch.tensor(0.0), torch.tensor(0.0), 32) == 1  # a query always sees itself fully


@pytest.mark.parametrize("backend", ["block", "dense"])
@pytest.mark.parametrize("causal", [True, False])
def test_weights_are_renormalised_by_the_mask(backend, causal):
    """With v = identity the outputs are the attention weights themselves."""
    mech = make(backend=backend, causal=causal)
    q, k, _ = qkv(dh=S)
    v = torch.eye(S, dtype=torch.float64).expand(B, H, S, S)
    mask = AttnMask(q_len=S, k_len=S, causal=causal)
    a = mech(q * 3, k, v, mask)  # [B, H, Sq, Sk] weights (scaled scores: a peaked softmax)
    assert torch.allclose(a.sum(-1), torch.ones(B, H, S, dtype=torch.float64), atol=1e-12)
    dist = (torch.arange(S)[:, None] - torch.arange(S)[None, :]).abs().double()
    z = S * RATIOS.double()
    m = span_mask(z.view(H, 1, 1), dist, R)
    if causal:
        m = m.tril()
    scores = torch.einsum("bhqd,bhkd->bhqk", q * 3, k) / math.sqrt(S)
    expected = m * scores.exp() / (m * scores.exp()).sum(-1, keepdim=True)
    assert torch.allclose(a, expected, atol=1e-12)
    assert (a[m.expand_as(a) == 0] == 0).all()  # keys out of span (and future keys) get no weight
    plain = torch.softmax(scores.masked_fill(m == 0, float("-inf")), -1)
    assert not torch.allclose(a, plain, atol=1e-3)  # the ramp reweights, it is not a hard window


MASKS = {
    "causal": (S, dict(causal=True)),
    "causal_offset": (9, dict(causal=True)),
    "causal_single": (1, dict(causal=True)),
    "causal_left_padding": (
        S,
        dict(causal=True, key_padding=torch.arange(S)[None].expand(B, S) >= torch.tensor([[5], [0]])),
    ),
    "causal_segments": (S, dict(causal=True, segments=(torch.arange(S) >= 10).long()[None].expand(B, S))),
    "causal_window": (S, dict(causal=True, window=5)),
    "bidirectional": (S, dict()),
    "bidirectional_padding": (S, dict(key_padding=torch.arange(S)[None].expand(B, S) < torch.tensor([[S], [15]]))),
}


@pytest.mark.parametrize("form", list(MASKS))
@pytest.mark.parametrize("dynamic", [False, True])
def test_fast_path_equals_the_explicit_formula(form, dynamic):
    sq, kw = MASKS[form]
    causal = kw.get("causal", False)
    fast, ref = make(dynamic, "block", causal), make(dynamic, "dense", causal)
    q, k, v = qkv(sq=sq)
    bias = TableBias(H, max_pos=S)
    out = fast(q, k, v, AttnMask(q_len=sq, k_len=S, **kw), bias)
    assert torch.allclose(out, ref(q, k, v, AttnMask(q_len=sq, k_len=S, **kw), bias), atol=1e-10)
    z = fast.spans(q)[0].detach()
    if form in ("causal", "causal_offset", "bidirectional"):  # the formula written out, one query at a time
        assert torch.allclose(out, explicit(q, k, v, z, AttnMask(q_len=sq, k_len=S, **kw), bias), atol=1e-10)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_fast_path_gradients_equal_the_reference(dynamic, kv_heads):
    fast, ref = make(dynamic, "block"), make(dynamic, "dense")
    q, k, v = qkv(kv_heads=kv_heads, grad=True)
    w = torch.randn(B, H, S, DH, dtype=torch.float64)
    grads = []
    for mech in (fast, ref):
        out = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True))
        loss = (out * w).sum() + 1e3 * mech.aux_losses()["span"]
        grads.append(torch.autograd.grad(loss, [q, k, v, *mech.parameters()]))
    for g_fast, g_ref in zip(*grads, strict=True):
        assert torch.allclose(g_fast, g_ref, atol=1e-10)
    assert all(g.abs().sum() > 0 for g in grads[0][3:])  # the span parameters learn


def test_trimming_visits_only_the_largest_span_and_changes_nothing():
    mech = make()
    q, k, v = qkv()
    z, z_max = mech.spans()
    assert z_max == pytest.approx(12.0)
    window = mech.window(z_max, S)
    assert window == 20  # floor(R + 12) + 1 = 17 keys, rounded up to blocks of 4; the sequence has 24
    mask = lambda: AttnMask(q_len=S, k_len=S, causal=True)  # noqa: E731
    trimmed = span_band_attention(q, k, v, z, R, WindowPattern(window, 4, True), mask())
    untrimmed = span_band_attention(q, k, v, z, R, WindowPattern(S, 4, True), mask())
    assert torch.equal(trimmed, mech(q, k, v, mask()))
    assert torch.allclose(trimmed, untrimmed, atol=1e-12)
    # a key at distance >= max z + R reaches no query: changing key 0 leaves queries 16.. unchanged
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 0] += 5
    v2[:, :, 0] += 5
    out2 = mech(q, k2, v2, mask())
    assert torch.equal(out2[:, :, 16:], trimmed[:, :, 16:])
    assert not torch.allclose(out2[:, :, :16], trimmed[:, :, :16])


def test_trimmed_window_follows_the_spans_as_they_grow():
    mech, ref = make(), make(backend="dense")
    q, k, v = qkv()
    windows = []
    for ratio in (0.0, 0.05, 0.3, 0.6, 1.0):
        for m in (mech, ref):
            m.span_ratio.data.fill_(ratio)
        windows.append(mech.window(mech.spans()[1], S))
        out = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True))
        assert torch.allclose(out, ref(q, k, v, AttnMask(q_len=S, k_len=S, causal=True)), atol=1e-10)
    assert windows == [8, 8, 12, 20, 24]  # multiples of the block, capped by the sequence
    assert len(mech._patterns) <= 2  # one engine geometry per recent window, not one per step


def test_span_learns_from_the_lm_loss_and_the_penalty_shrinks_it():
    attention = {"name": "adaptive_span", "ramp": 8, "init_span": 0.25, "span_loss": 0.01, "block": 8}
    model = build_model(attention=attention, max_len=S, layers=2).train()
    spans = [b.attn.mechanism.span_ratio for b in model.blocks]
    x = torch.randint(0, 13, (2, S))
    out = model(x)
    lm = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    lm_grads = torch.autograd.grad(lm, spans, retain_graph=True)
    assert all(g.abs().min() > 0 for g in lm_grads)  # every head's span gets a gradient from the LM loss
    penalty = out.aux["attention/span"]
    assert torch.allclose(penalty, sum(0.01 * S * s.mean() for s in spans))  # lambda * mean span, summed over layers
    pen_grads = torch.autograd.grad(penalty, spans, retain_graph=True)
    for g in pen_grads:  # d/d(ratio) of lambda * mean_h(S * ratio_h) = lambda S / H > 0: descent shrinks spans
        assert torch.allclose(g, torch.full_like(g, 0.01 * S / 4))
    opt = torch.optim.SGD(spans, lr=1.0)
    before = [s.detach().clone() for s in spans]
    penalty.backward()
    opt.step()
    assert all((s < b).all() for s, b in zip(spans, before, strict=True))


def test_dynamic_span_learns_from_both_losses():
    mech = make(dynamic=True)
    q, k, v = qkv(grad=True)
    out = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True))
    z = mech.spans(q)[0]
    assert z.shape == (B, H, S) and (z > 0).all() and (z < S).all()  # S sigmoid(.) lies in (0, S)
    lm_grads = torch.autograd.grad(
        (out * torch.randn_like(out)).sum(), [mech.span_proj, mech.span_bias], retain_graph=True
    )
    assert all(g.abs().sum() > 0 for g in lm_grads)
    (g_bias,) = torch.autograd.grad(mech.aux_losses()["span"], [mech.span_bias])
    assert (g_bias > 0).all()  # the penalty lowers every head's span offset b


def test_spans_stay_in_zero_to_max_span():
    mech = make()
    q, k, v = qkv()
    mech.span_ratio.data = torch.tensor([-0.3, 0.5, 1.4, 7.0], dtype=torch.float64)  # as after an optimiser step
    out = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True))
    assert mech.span_ratio.tolist() == [0.0, 0.5, 1.0, 1.0]
    z, z_max = mech.spans()
    assert z.tolist() == [0.0, 12.0, 24.0, 24.0] and z_max == 24.0
    ref = make(backend="dense")
    ref.span_ratio.data = torch.tensor([0.0, 0.5, 1.0, 1.0], dtype=torch.float64)
    assert torch.allclose(out, ref(q, k, v, AttnMask(q_len=S, k_len=S, causal=True)), atol=1e-10)
    # training against a large penalty drives spans to 0 and holds them there
    mech.span_loss = 10.0
    opt = torch.optim.SGD(mech.parameters(), lr=1.0)
    for _ in range(3):
        mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True))
        opt.zero_grad()
        mech.aux_losses()["span"].backward()
        opt.step()
    mech.spans()
    assert mech.span_ratio.tolist() == [0.0] * H


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("sq", [S, 7])
def test_no_causal_leak(dynamic, sq):
    mech = make(dynamic)
    q, k, v = qkv(sq=sq)
    out = mech(q, k, v, AttnMask(q_len=sq, k_len=S, causal=True))
    t = S - 4
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t:] += torch.randn_like(k2[:, :, t:])
    v2[:, :, t:] += 1.0
    out2 = mech(q, k2, v2, AttnMask(q_len=sq, k_len=S, causal=True))
    past = t - (S - sq)
    assert torch.equal(out[:, :, :past], out2[:, :, :past])
    assert not torch.allclose(out[:, :, past:], out2[:, :, past:])


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("pos", ["rope", "alibi"])
def test_decoding_equals_full_recompute(dynamic, pos):
    attention = {"name": "adaptive_span", "ramp": 4, "init_span": 0.2, "dynamic": dynamic, "block": 4}
    model = build_model(attention=attention, pos=pos, max_len=S, layers=2, kv_heads=2, dtype=torch.float64)
    x = torch.randint(0, 13, (2, 20))
    full = model(x).logits
    for prompt, step in ((5, 1), (1, 3)):
        assert torch.allclose(decode_logits(model, x, prompt, step), full, atol=1e-10)


def test_bad_span_settings_are_config_errors():
    ctx = dict(heads=H, head_dim=DH, max_len=S, causal=True)
    with pytest.raises(ConfigError, match=r"max_span=25 is larger than model.max_len=24.*Fix: set attention.max_span"):
        ATTENTION.build({"name": "adaptive_span", "max_span": 25}, **ctx)
    with pytest.raises(ConfigError, match="init_span=1.5: must be <= 1"):
        ATTENTION.build({"name": "adaptive_span", "init_span": 1.5}, **ctx)
    with pytest.raises(ConfigError, match="ramp=0: must be > 0"):
        ATTENTION.build({"name": "adaptive_span", "ramp": 0}, **ctx)
    assert ATTENTION.build({"name": "adaptive_span", "max_span": S}, **ctx).max_span == S
    assert ATTENTION.build({"name": "adaptive_span"}, **ctx).max_span == S  # null = max_len
