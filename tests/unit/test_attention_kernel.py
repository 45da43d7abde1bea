"""Kernelised attention: Performer (FAVOR+), RFA and the shared chunked linear attention.

The approximation claims (Choromanski et al., 2021, sec. 2-4; Peng et al., 2021, eq. 3-4): each random
feature estimator of the softmax kernel is unbiased, its mean squared error falls as 1/m, and
orthogonal features are no worse than i.i.d. ones. The engine: chunking never changes the result,
no future key leaks through the prefix sums (stabiliser included), running-sum decoding equals the
full recompute, and a decaying bias (ALiBi) equals the explicitly decayed weights.

One file over 400 lines: Performer and RFA share the engine these tests pin down.
"""

from __future__ import annotations

import math

import pytest
import torch
from doubles import build_model, decode_logits

from xfam.attention import ATTENTION
from xfam.attention._linear_sums import ChunkedPrefix, bidirectional_sums, causal_sums, decayed_scan, gaussian_matrix
from xfam.attention.performer import favor_log_features
from xfam.attention.rfa import _SinCos, rff_features
from xfam.attention.vanilla import reference_attention
from xfam.core.errors import ConfigError
from xfam.core.mask import AttnMask
from xfam.exit import EXIT
from xfam.model import compat
from xfam.pos import POS
from xfam.pos.alibi import AlibiBias

B, H, DH, S = 2, 4, 8, 12
MS = (16, 64, 256, 1024)
SLOPE_TOL = 0.15  # fitted log-log slope of MSE vs m must lie in [-1.15, -0.85]


def pairs(d: int = 16, norm: float = 0.6, n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(2))
    return norm * x / x.norm(dim=-1, keepdim=True), norm * y / y.norm(dim=-1, keepdim=True)


def favor_estimate(x, y, w):
    """phi(x) . phi(y) for draws ``w [draws, m, d]``: ``[draws, pairs]``; its target is exp(x . y)."""
    return (favor_log_features(x, w[:, None]).exp() * favor_log_features(y, w[:, None]).exp()).sum(-1)


def rff_estimate(x, y, w):
    """RFA eq. 4: exp(|x|^2/2 + |y|^2/2) phi(x) . phi(y); its target is exp(x . y) (sigma = 1)."""
    norms = torch.exp((x * x).sum(-1) / 2 + (y * y).sum(-1) / 2)
    return (rff_features(x, w[:, None]) * rff_features(y, w[:, None])).sum(-1) * norms


ESTIMATORS = {"performer": (favor_estimate, 0.6), "rfa": (rff_estimate, 1.0)}  # RFA: unit-norm inputs (the paper)


def mse(name: str, m: int, orthogonal: bool, draws: int = 300, seed: int = 0) -> float:
    est, norm = ESTIMATORS[name]
    x, y = pairs(norm=norm)
    w = gaussian_matrix(m, x.shape[-1], orthogonal, torch.Generator().manual_seed(seed + m), draws=draws).double()
    return ((est(x, y, w) - torch.exp((x * y).sum(-1))) ** 2).mean().item()


@pytest.mark.parametrize("name", ["performer", "rfa"])
@pytest.mark.parametrize("orthogonal", [False, True])
def test_kernel_mse_falls_as_one_over_m(name, orthogonal):
    logm = torch.tensor([math.log(m) for m in MS])
    loge = torch.tensor([math.log(mse(name, m, orthogonal)) for m in MS])
    slope = ((logm - logm.mean()) * (loge - loge.mean())).sum() / ((logm - logm.mean()) ** 2).sum()
    assert abs(slope + 1) < SLOPE_TOL, f"log-log slope {slope:.3f}"


@pytest.mark.parametrize("name", ["performer", "rfa"])
@pytest.mark.parametrize("orthogonal", [False, True])
def test_estimator_is_unbiased(name, orthogonal):
    est, norm = ESTIMATORS[name]
    x, y = pairs(norm=norm)
    draws = 4000
    w = gaussian_matrix(16, 16, orthogonal, torch.Generator().manual_seed(1), draws=draws).double()
    e = est(x, y, w)  # [draws, pairs]
    err = (e.mean(0) - torch.exp((x * y).sum(-1))).abs()
    assert (err < 4 * e.std(0) / math.sqrt(draws)).all()  # within 4 standard errors, every pair
    assert (err / torch.exp((x * y).sum(-1)) < 0.02).all()
    biased = (e.mean(0) * 1.1 - torch.exp((x * y).sum(-1))).abs()  # the test can tell a 10% bias
    assert (biased > 4 * e.std(0) / math.sqrt(draws)).any()


@pytest.mark.parametrize("name", ["performer", "rfa"])
@pytest.mark.parametrize("m", [16, 32])
def test_orthogonal_features_are_no_worse_than_iid(name, m):
    iid = sum(mse(name, m, False, draws=2000, seed=s) for s in range(3))
    orth = sum(mse(name, m, True, draws=2000, seed=s) for s in range(3))
    assert orth <= iid


def test_orthogonal_draw_has_orthogonal_blocks_and_gaussian_lengths():
    w = gaussian_matrix(40, 16, True, torch.Generator().manual_seed(0))
    for block in (w[:16], w[16:32]):
        u = block / block.norm(dim=-1, keepdim=True)
        assert torch.allclose(u @ u.T, torch.eye(16), atol=1e-5)
    many = gaussian_matrix(16, 16, True, torch.Generator().manual_seed(1), draws=2000)
    assert abs(many.norm(dim=-1).pow(2).mean().item() - 16) < 0.5  # E|w|^2 = d, as for N(0, I) rows


# -- the mechanisms ------------------------------------------------------------------------------


def build(name: str, causal: bool = True, kv_heads: int = H, max_len: int = S, **params):
    struct = dict(dim=H * DH, heads=H, kv_heads=kv_heads, head_dim=DH, max_len=max_len, causal=causal, num_layers=2)
    torch.manual_seed(0)
    return ATTENTION.build({"name": name, **params}, **struct, layer=0).eval().double()


def qkv(sq=S, sk=S, kv_heads=H, scale=1.0):
    g = torch.Generator().manual_seed(3)
    q = scale * torch.randn(B, H, sq, DH, generator=g, dtype=torch.float64)
    k = scale * torch.randn(B, kv_heads, sk, DH, generator=g, dtype=torch.float64)
    return q, k, torch.randn(B, kv_heads, sk, DH, generator=g, dtype=torch.float64)


PAD = torch.tensor([[False] * 3 + [True] * 9, [True] * 10 + [False] * 2])
SEG = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 7 + [4] * 5])
CAUSAL_FORMS = {
    "plain": (S, {}),
    "offset": (5, {}),
    "padding": (S, {"key_padding": PAD}),
    "offset_padding": (7, {"key_padding": PAD}),
    "segments": (S, {"segments": SEG}),
    "offset_segments_padding": (6, {"segments": SEG, "key_padding": PAD}),
}
BIDIR_FORMS = {"plain": (S, {}), "padding": (S, {"key_padding": PAD}), "segments": (S, {"segments": SEG})}
VARIANTS = {  # name -> (mechanism, params): random features on the fast path
    "performer": ("performer", {}),
    "performer_iid": ("performer", {"features": "iid"}),
    "rfa": ("rfa", {}),
    "rfa_raw": ("rfa", {"normalize": False, "features": "orthogonal"}),
    "rfa_gate": ("rfa", {"gate": True}),
}


def twins(name: str, params: dict, causal: bool, chunk: int):
    """The chunked mechanism and the quadratic reference with the same features and parameters."""
    fast = build(name, causal, chunk=chunk, backend="chunked", **params)
    ref = build(name, causal, backend="quadratic", **params)
    ref.load_state_dict(fast.state_dict())
    if hasattr(fast, "gate_b"):  # a gate away from its initial value
        with torch.no_grad():
            for m in (fast, ref):
                m.gate_w.copy_(0.3 * torch.arange(H * DH, dtype=torch.float64).view(H, DH).sin())
    return fast, ref


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("form", list(CAUSAL_FORMS))
@pytest.mark.parametrize("chunk", [1, 7, S])
@pytest.mark.parametrize("alibi", [False, True])
def test_causal_chunked_equals_quadratic(variant, form, chunk, alibi):
    name, params = VARIANTS[variant]
    fast, ref = twins(name, params, True, chunk)
    sq, kw = CAUSAL_FORMS[form]
    q, k, v = qkv(sq=sq)
    bias = AlibiBias(H, H).double() if alibi else None
    out = fast(q, k, v, AttnMask(q_len=sq, k_len=S, causal=True, **kw), bias)
    expected = ref(q, k, v, AttnMask(q_len=sq, k_len=S, causal=True, **kw), bias)
    assert torch.allclose(out, expected, atol=1e-10)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "rfa_gate"])
@pytest.mark.parametrize("form", list(BIDIR_FORMS))
@pytest.mark.parametrize("alibi", [False, True])
def test_bidirectional_sums_equal_quadratic(variant, form, alibi):
    """Global sums, or (documents, symmetric ALiBi) a forward and a backward decayed scan, equal the L x L form."""
    name, params = VARIANTS[variant]
    fast, ref = twins(name, params, False, 5)
    sq, kw = BIDIR_FORMS[form]
    q, k, v = qkv()
    bias = AlibiBias(H, H).double() if alibi else None
    out = fast(q, k, v, AttnMask(q_len=sq, k_len=S, **kw), bias)
    assert torch.allclose(out, ref(q, k, v, AttnMask(q_len=sq, k_len=S, **kw), bias), atol=1e-10)


def grads(mech, q, k, v, mask, bias=None) -> list[torch.Tensor]:
    """d(loss)/d(q, k, v and every parameter) for a fixed random cotangent."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = mech(q, k, v, mask, bias)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    params = [p for p in mech.parameters() if p.requires_grad]
    return list(torch.autograd.grad((out * cot).sum(), [q, k, v, *params]))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("form", ["plain", "offset_padding", "offset_segments_padding"])
@pytest.mark.parametrize("alibi", [False, True])
def test_causal_chunked_gradients_equal_quadratic(variant, form, alibi):
    """The hand-written backward of the chunked core (``ChunkedPrefix``) against autograd on the L x L form,
    for inputs and learned parameters (RFA's sigma and gate), with decays, padding and documents."""
    name, params = VARIANTS[variant]
    fast, ref = twins(name, params, True, 5)
    sq, kw = CAUSAL_FORMS[form]
    q, k, v = qkv(sq=sq)
    bias = AlibiBias(H, H).double() if alibi else None
    got = grads(fast, q, k, v, AttnMask(q_len=sq, k_len=S, causal=True, **kw), bias)
    expected = grads(ref, q, k, v, AttnMask(q_len=sq, k_len=S, causal=True, **kw), bias)
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a, b, atol=1e-9), (a - b).abs().max()


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "rfa_gate"])
@pytest.mark.parametrize("form", list(BIDIR_FORMS))
@pytest.mark.parametrize("alibi", [False, True])
def test_bidirectional_gradients_equal_quadratic(variant, form, alibi):
    name, params = VARIANTS[variant]
    fast, ref = twins(name, params, False, 5)
    sq, kw = BIDIR_FORMS[form]
    q, k, v = qkv()
    bias = AlibiBias(H, H).double() if alibi else None
    for a, b in zip(
        grads(fast, q, k, v, AttnMask(q_len=sq, k_len=S, **kw), bias),
        grads(ref, q, k, v, AttnMask(q_len=sq, k_len=S, **kw), bias),
        strict=True,
    ):
        assert torch.allclose(a, b, atol=1e-9), (a - b).abs().max()


def test_chunked_prefix_backward_passes_gradcheck():
    """Every input of the core, a zero carry (a document start) and an initial state included."""
    g = torch.Generator().manual_seed(0)
    b, h, n, c, m, d = 1, 2, 4, 3, 5, 4
    shapes = [(b, h, n, c, m), (b, h, n, c, m), (b, h, n, c, d), (b, h, n, c, c), (b, h, n, c), (b, h, n), (b, h, n, c)]
    ins = [torch.rand(s, generator=g, dtype=torch.float64) for s in shapes]
    ins[5][0, 0, 2] = 0.0
    s0 = torch.randn(b, h, m, d, generator=g, dtype=torch.float64)
    ins = [t.requires_grad_() for t in (*ins, s0)]
    assert torch.autograd.gradcheck(ChunkedPrefix.apply, ins)
    assert torch.autograd.gradcheck(lambda *a: ChunkedPrefix.apply(*a, None)[0], ins[:-1])


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("rows", [2, 9])  # 9 rows: one op per step; 2 rows: pieces under the parallel grain
def test_decayed_scan_equals_the_recurrence(reverse, rows):
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(rows, 6, 40000, generator=g), torch.rand(rows, 6, generator=g)
    c[0, 3] = 0.0
    init = torch.randn(rows, 40000, generator=g)
    y, last = decayed_scan(x, c, init, reverse=reverse)
    s, order = init, range(5, -1, -1) if reverse else range(6)
    for j in order:
        assert torch.allclose(y[:, j], s, atol=1e-5)
        s = c[:, j, None] * s + x[:, j]
    assert torch.allclose(last, s, atol=1e-5)


def test_fused_sin_cos_features_match_and_pass_gradcheck():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    assert torch.allclose(_SinCos.apply(x, w) / math.sqrt(5), rff_features(x, w))
    assert torch.autograd.gradcheck(_SinCos.apply, (x.requires_grad_(), w.requires_grad_()))


def test_chunk_sizes_agree_with_each_other_and_the_unchunked_form():
    q, k, v = qkv()
    outs = [build("performer", chunk=c)(q, k, v, AttnMask(q_len=S, k_len=S, causal=True)) for c in (1, 7, S)]
    assert torch.allclose(outs[0], outs[1], atol=1e-12) and torch.allclose(outs[0], outs[2], atol=1e-12)


def test_decayed_prefix_sums_equal_explicitly_decayed_weights():
    mech = build("performer", chunk=5)
    q, k, v = qkv()
    bias = AlibiBias(H, H).double()
    out = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True), bias)
    w = mech.proj
    fq = favor_log_features(q * DH**-0.25, w).exp()  # the paper's features, unstabilised
    fk = favor_log_features(k * DH**-0.25, w).exp()
    lam = bias.decay().double()  # exp(-m_h)
    expected = torch.zeros_like(out)
    for h in range(H):
        for i in range(S):
            wts = torch.stack([lam[h] ** (i - j) * (fq[:, h, i] * fk[:, h, j]).sum(-1) for j in range(i + 1)], 1)
            expected[:, h, i] = (wts[..., None] * v[:, h, : i + 1]).sum(1) / wts.sum(1, keepdim=True)
    assert torch.allclose(out, expected, atol=1e-10)
    assert not torch.allclose(out, mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True)), atol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, S])
def test_decayed_scans_equal_the_dense_normalised_form_for_a_deterministic_feature_map(causal, chunk):
    """With phi(x) = elu(x) + 1 (Katharopoulos et al., 2020) and gamma_h = exp(-m_h): the engine's decayed
    scans equal (phi(Q) phi(K)^T * gamma^|i-j|) V / row sums, causally (j <= i) and bidirectionally."""
    q, k, v = qkv()
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1  # [B, H, S, Dh]
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    dist = (torch.arange(S)[:, None] - torch.arange(S)[None, :]).double()  # i - j
    decay = torch.exp(-slopes[:, None, None] * dist.abs())  # gamma_h^|i-j|, [H, S, S]
    if causal:
        decay = decay * (dist >= 0)
    weights = (fq @ fk.mT) * decay  # [B, H, S, S]
    expected = weights @ v / weights.sum(-1, keepdim=True)
    ls, ld = torch.zeros(B, H, S, dtype=torch.float64), -slopes.view(1, H, 1)
    if causal:
        num, den, _ = causal_sums(fq, fk, v, ls, ld, chunk=chunk, stabilise=False)
    else:
        num, den = bidirectional_sums(fq, fk, v, ls, None, None, chunk, ld)
    assert torch.allclose(num / den[..., None], expected, atol=1e-12)
    if not causal:  # and the scans are not the undecayed global sums
        plain = bidirectional_sums(fq, fk, v, ls, None, None, chunk)
        assert not torch.allclose(plain[0] / plain[1][..., None], expected, atol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
def test_performer_with_alibi_approaches_softmax_with_alibi_as_features_grow(causal):
    """exp(q . k / sqrt(d) - m |i - j|) = kernel x decay: FAVOR+ with m random features on the decayed scans
    converges to exact softmax attention with the ALiBi bias (error ~ 1/sqrt(m), averaged over draws)."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (0.5 * torch.randn(1, H, 24, DH, generator=g, dtype=torch.float64) for _ in range(3))
    mask, bias = AttnMask(q_len=24, k_len=24, causal=causal), AlibiBias(H, H).double()
    exact = reference_attention(q, k, v, mask, bias)
    assert not torch.allclose(exact, reference_attention(q, k, v, mask), atol=1e-2)  # ALiBi matters here
    errors = []
    for m in (16, 128, 1024, 8192):
        err = 0.0
        for seed in range(4):
            torch.manual_seed(seed)
            mech = (
                ATTENTION.build(
                    {"name": "performer", "num_features": m, "chunk": 8},
                    dim=H * DH,
                    heads=H,
                    kv_heads=H,
                    head_dim=DH,
                    max_len=24,
                    causal=causal,
                    num_layers=1,
                    layer=0,
                )
                .eval()
                .double()
            )
            err += (mech(q, k, v, mask, bias) - exact).pow(2).mean().sqrt().item() / 4
        errors.append(err)
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0] / 10 and errors[-1] < 0.01, errors


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("alibi", [False, True])
def test_no_causal_leak_through_the_prefix_sums(variant, alibi):
    name, params = VARIANTS[variant]
    mech, _ = twins(name, params, True, 5)
    q, k, v = qkv()
    bias = AlibiBias(H, H).double() if alibi else None
    out = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True), bias)
    t = 8
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t:] *= 30.0  # a huge future key would move a global stabiliser; the running max does not
    v2[:, :, t:] += 1.0
    out2 = mech(q, k2, v2, AttnMask(q_len=S, k_len=S, causal=True), bias)
    assert torch.equal(out[:, :, :t], out2[:, :, :t])
    assert not torch.allclose(out[:, :, t:], out2[:, :, t:], atol=1e-3)
    assert torch.isfinite(out2).all()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_decode_with_running_sums_equals_full_recompute(variant, alibi, kv_heads):
    name, params = VARIANTS[variant]
    mech = build(name, kv_heads=kv_heads, chunk=3, **params)
    q, k, v = qkv(kv_heads=kv_heads)
    bias = AlibiBias(H, H).double() if alibi else None
    pad = torch.tensor([[False] * 2 + [True] * 10, [True] * 12])
    full = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True, key_padding=pad), bias)
    outs, state, t = [], None, 0
    for n in (4, 1, 1, 3, 1, 2):
        mask = AttnMask(q_len=n, k_len=t + n, causal=True, key_padding=pad[:, : t + n])
        out, state = mech.decode(q[:, :, t : t + n], k[:, :, t : t + n], v[:, :, t : t + n], state, mask, bias)
        assert set(state) == {"s", "z", "m"}  # running sums, no key/value cache
        assert state["s"].shape[:2] == (B, H) and state["s"].shape[-1] == DH
        outs.append(out)
        t += n
    assert torch.allclose(torch.cat(outs, 2), full, atol=1e-10)


def test_exact_features_equal_softmax_attention_with_alibi():
    mech = build("performer", features="exact")
    q, k, v = qkv()
    bias = AlibiBias(H, H).double()
    mask = AttnMask(q_len=S, k_len=S, causal=True)
    assert torch.allclose(mech(q, k, v, mask, bias), reference_attention(q, k, v, mask, bias), atol=1e-12)


def test_large_inputs_stay_finite():
    q, k, v = qkv(scale=40.0)  # |x|^2 / 2 far beyond exp's range
    for causal in (True, False):
        for name in ("performer", "rfa"):
            mech = build(name, causal)
            out = mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=causal))
            assert torch.isfinite(out).all()


# -- redraw schedule -----------------------------------------------------------------------------


def test_features_redraw_exactly_every_n_training_steps_and_never_in_eval():
    model = build_model(attention={"name": "performer", "num_features": 16, "redraw_every": 3}, layers=1).train()
    (mech,) = [m for m in model.modules() if hasattr(m, "proj")]
    x = torch.randint(0, 13, (2, 10))
    seen = []
    for _ in range(10):
        model(x)
        seen.append(mech.proj.clone())
    changed = [i for i in range(1, 10) if not torch.equal(seen[i], seen[i - 1])]
    assert changed == [3, 6, 9]  # the 4th, 7th and 10th training steps use new features
    assert int(mech.steps) == 10
    model.eval()
    for _ in range(5):
        model(x)
    assert torch.equal(mech.proj, seen[-1]) and int(mech.steps) == 10


@pytest.mark.parametrize("name", ["performer", "rfa"])
def test_a_layer_run_several_times_in_one_step_keeps_its_features(name):
    """ACT runs one shared block up to T times per forward: the schedule advances once per training step (the
    model's ``new_step``), not per call. Counting calls redrew mid-step: RFA's backward then failed on the
    overwritten features, and Performer's repeats each saw other features."""
    model = build_model(attention={"name": name, "redraw_every": 1}, exit={"name": "act"}, layers=3).train()
    (mech,) = [m for m in model.modules() if hasattr(m, "proj")]
    x = torch.randint(0, 13, (2, 10))
    for step in range(1, 3):
        before = mech.proj.clone()
        out = model(x)
        (out.logits.pow(2).mean() + sum(out.aux.values())).backward()
        assert int(mech.steps) == step
        assert torch.equal(mech.proj, before) == (step == 1)  # step 2 is the first with new features


def test_a_reversible_recomputation_uses_the_features_of_its_forward():
    """The reversible stack recomputes each layer in backward: with a redraw per call it took the gradients of
    features the forward never used (the outputs agreed, the gradients did not)."""
    x = torch.randint(0, 13, (2, 10))

    def grads(redraw_every):
        attention = {"name": "rfa", "redraw_every": redraw_every}
        model = build_model(attention=attention, reversible=True, dtype=torch.float64).train()
        model(x).logits.pow(2).mean().backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    for a, b in zip(grads(None), grads(1), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_save_and_load_midway_keeps_the_schedule_and_the_features():
    def run(mech, steps):
        q, k, v = (t.float() for t in qkv())
        out = []
        for _ in range(steps):
            mech.new_step()  # what the model does at the start of each training forward
            mech(q, k, v, AttnMask(q_len=S, k_len=S, causal=True))
            out.append(mech.proj.clone())
        return out

    torch.manual_seed(1)
    whole = build("performer", redraw_every=2).float().train()
    torch.manual_seed(1)
    first = build("performer", redraw_every=2).float().train()
    reference = run(whole, 7)
    head = run(first, 3)
    saved = {k: t.clone() for k, t in first.state_dict().items()}
    assert {"proj", "steps", "seed"} <= set(saved)  # the features and the schedule travel in checkpoints
    torch.manual_seed(99)  # a different process: other global RNG, other initial draw
    resumed = build("performer", redraw_every=2).float().train()
    resumed.load_state_dict(saved)
    assert torch.equal(resumed.proj, head[-1])
    tail = run(resumed, 4)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, reference, strict=True))


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["performer", "rfa"])
def test_alibi_is_hosted_in_both_directions_and_other_biases_are_refused(name):
    model = build_model(attention={"name": name, "num_features": 32}, pos="alibi", layers=2)
    x = torch.randint(0, 13, (2, 10))
    assert torch.allclose(decode_logits(model, x, prompt=3), model(x).logits, atol=1e-5)
    classifier = build_model(attention={"name": name, "num_features": 32}, pos="alibi", layers=2, task="classify")
    assert torch.isfinite(classifier(x).logits).all()

    def selection(pos: str, causal: bool) -> compat.Selection:
        return compat.Selection(
            attention=[(ATTENTION.get(name), {"features": "orthogonal"}, False)],
            pos=(POS.get(pos), {}),
            memory=[],
            exit=(EXIT.get("none"), {}),
            causal=causal,
        )

    for causal in (True, False):
        assert compat.check(selection("alibi", causal)) == []
        (msg,) = compat.check(selection("t5", causal))
        assert f"attention={name}" in msg and "pos=t5 is no such decay" in msg and "Alternatives: pos in [" in msg
        assert "alibi" in msg and "attention.features=exact" in msg


def test_rfa_gate_needs_a_causal_model():
    with pytest.raises(ConfigError, match="gate=true"):
        build("rfa", causal=False, gate=True)
    build("rfa", causal=True, gate=True)


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_rope_rotates_q_and_k_before_the_feature_map(task):
    """RoPE with kernelised attention: the model rotates q and k, then the mechanism maps them to features, so
    the kernel estimates exp(R_i q . R_j k) = exp(q . R_{j-i} k): softmax attention with RoPE scores. In the
    exact-kernel limit the model equals vanilla attention with RoPE (same weights). (RFA shares the path;
    its exact limit is not plain softmax: it normalises q and k.)"""
    name = "performer"
    vanilla = build_model(pos="rope", task=task, init_std=0.5)  # unit-scale scores: positions matter
    exact = build_model(attention={"name": name, "features": "exact"}, pos="rope", task=task)
    exact.load_state_dict(vanilla.state_dict(), strict=False)  # the mechanism's own buffers stay
    x = torch.randint(0, 13, (2, 10))
    assert torch.allclose(exact(x).logits, vanilla(x).logits, atol=1e-5)
    unrotated = build_model(attention={"name": name, "features": "exact"}, pos="none", task=task)
    unrotated.load_state_dict(vanilla.state_dict(), strict=False)
    assert not torch.allclose(unrotated(x).logits, vanilla(x).logits, atol=1e-3)  # the rotation is in the path


# -- stabiliser across documents and padding -------------------------------------------------------


def _far_apart_keys(s: int, small: int) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[1, 1, S, 8]`` whose first ``small`` keys have norm 0.1 and the rest norm 35: key log-scales
    about -2.6 and -150, whose difference exp underflows in fp32."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, s, 8, generator=g) for _ in range(3))
    norms = torch.tensor([0.1] * small + [35.0] * (s - small)).view(1, 1, s, 1)
    return q, torch.nn.functional.normalize(k, dim=-1) * norms, v


@pytest.mark.parametrize("causal", [True, False])
def test_a_packed_document_is_not_lost_under_an_earlier_ones_scale(causal):
    """The running max of the key scales restarts at every document: a document of small keys in front once set
    the max, and a later document's keys (scale about exp(-150) below it) underflowed to 0 in fp32 (errors up to
    3.7 against the quadratic path)."""
    torch.manual_seed(0)
    struct = dict(dim=8, heads=1, kv_heads=1, head_dim=8, max_len=8, causal=causal, num_layers=1, layer=0)
    chunked = ATTENTION.build({"name": "performer", "chunk": 4, "backend": "chunked"}, **struct).eval()
    q, k, v = _far_apart_keys(8, 3)
    packed = chunked(q, k, v, AttnMask(q_len=8, k_len=8, causal=causal, segments=torch.tensor([[0] * 3 + [1] * 5])))
    alone = chunked(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], AttnMask(q_len=5, k_len=5, causal=causal))
    torch.testing.assert_close(packed[:, :, 3:], alone, atol=1e-5, rtol=1e-5)


def test_decoding_after_a_padded_first_token_equals_the_full_pass():
    """A decode call whose only key is padding no longer sets the running max (its own scale was taken as the
    max, and the real keys after it underflowed: decode differed from the full pass by 2.46)."""
    torch.manual_seed(0)
    struct = dict(dim=16, heads=2, kv_heads=2, head_dim=8, max_len=6, causal=True, num_layers=1, layer=0)
    mech = ATTENTION.build({"name": "performer", "chunk": 4}, **struct).eval()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    k = k * 10
    k[:, :, 0] = 0.0  # the left pad's key
    pad = torch.tensor([[False] + [True] * 5])
    full = mech(q, k, v, AttnMask(q_len=6, k_len=6, causal=True, key_padding=pad))
    state, outs = None, []
    for t in range(6):
        mask = AttnMask(q_len=1, k_len=t + 1, causal=True, key_padding=pad[:, : t + 1])
        out, state = mech.decode(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, mask)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 2)[:, :, 1:], full[:, :, 1:], atol=1e-5, rtol=1e-5)
