"""The chunked causal linear-attention kernel (kernels/linear_attention.py) against its PyTorch reference (the
plain recurrence), and that reference against xfam's ``causal_sums``: outputs, final state and every gradient,
with no decay, ALiBi's per-head decay, learned gates, resets (-inf), padded keys (-inf), an initial state and
lengths that are not a multiple of the chunk; fp32 and fp16 (Triton's interpreter on CPU), bf16 on CUDA only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import xfam.kernels.linear_attention as module
from xfam.attention._linear_sums import _stabiliser, causal_sums
from xfam.kernels import runtime
from xfam.kernels.linear_attention import causal_linear_attention, causal_linear_attention_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REASON = runtime.why_not(DEVICE)
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"Triton kernels cannot run here: {REASON}")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # max error / max |reference|
INF = float("-inf")
B, H = 2, 2


def _case(name: str, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """Leaves (in ``dtype``) and the call's other arguments. T, m, Dv vary; none is a power of two times 16."""
    t, m, dv, chunk = {"plain": (37, 8, 16, 16), "alibi": (50, 16, 17, 16), "gates": (45, 32, 20, 16),
                       "resets": (64, 12, 24, 16), "padding": (33, 16, 16, 64), "state": (29, 20, 33, 16),
                       "everything": (70, 24, 33, 16)}[name]  # fmt: skip
    g = torch.Generator().manual_seed(len(name))
    leaves = {
        "q": torch.randn(B, H, t, m, generator=g) / m**0.25,  # [B, H, T, m]
        "k": torch.randn(B, H, t, m, generator=g) / m**0.25,
        "v": torch.randn(B, H, t, dv, generator=g),  # [B, H, T, Dv]
    }
    if name in ("alibi", "state"):
        leaves["slopes"] = 2.0 ** -torch.arange(1.0, H + 1)  # [H]: log_decay = -slope_h at every position
    if name in ("gates", "resets", "everything"):
        ld = F.logsigmoid(torch.randn(B, H, t, generator=g) + 2)  # [B, H, T], RFA-style gates
        if name != "gates":  # resets: at 0 (the state is cut), a chunk start, mid-chunk, twice in one chunk
            ld[0, 1, 0], ld[1, 0, 16], ld[0, 0, 21], ld[1, 1, 23], ld[1, 1, 26], ld[0, 0, 40] = (INF,) * 6
            ld[1, 0, 35] = -1e6  # finite, but a reset in fp32: the decays after it in its chunk stay exact
        leaves["log_decay"] = ld
    if name in ("gates", "padding", "everything"):
        lw = -torch.rand(B, H, t, generator=g)  # [B, H, T] key log-scales <= 0
        if name != "gates":
            lw[1, :, :5], lw[0, :, 17] = INF, INF  # a left pad and a padded key inside
        leaves["key_logscale"] = lw
    if name in ("resets", "state", "everything"):
        leaves["state"] = torch.randn(B, H, m, dv, generator=g)  # [B, H, m, Dv]
    # slopes stay fp32 (a buffer; in fp16 the sum of T * B per-position gradients would round off)
    return {n: x.to(DEVICE, torch.float32 if n == "slopes" else dtype) for n, x in leaves.items()}, {"chunk": chunk}


def _run(fn, leaves: dict[str, torch.Tensor], kw: dict, upcast: bool) -> tuple[list[torch.Tensor], list]:
    """Outputs and the gradients of every leaf for a fixed random cotangent."""
    x = {n: (t.float() if upcast else t).detach().requires_grad_(True) for n, t in leaves.items()}
    args = {n: t for n, t in x.items() if n != "slopes"}
    if "slopes" in x:
        args["log_decay"] = -x["slopes"].view(1, -1, 1)  # [1, H, 1], broadcast over B and T
    out, state = fn(**args, **kw)
    g = torch.Generator().manual_seed(1)
    loss = (out.float() * torch.randn(out.shape, generator=g).to(out.device)).sum()
    loss = loss + (state.float() * torch.randn(state.shape, generator=g).to(out.device)).sum()
    return [out, state], list(torch.autograd.grad(loss, list(x.values())))


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(want.abs().max().item(), 1e-3), f"{what}: max error {err:.3g}"


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["plain", "alibi", "gates", "resets", "padding", "state", "everything"])
def test_kernel_equals_reference(name: str, dtype: torch.dtype) -> None:
    leaves, kw = _case(name, dtype)
    got, d_got = _run(causal_linear_attention, leaves, kw, upcast=False)
    want, d_want = _run(causal_linear_attention_reference, leaves, kw, upcast=True)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for what, a, b in zip(["out", "final state"], got, want):
        _assert_close(a, b, TOL[dtype], f"{name} {what}")
    for leaf, a, b in zip(leaves, d_got, d_want):
        assert a.dtype == leaves[leaf].dtype, leaf
        _assert_close(a, b, TOL[dtype], f"{name} d{leaf}")


@needs_kernel
def test_value_columns_split_over_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dv = 33 in blocks of 16: three programs per (B, H), dq and dk summed over their partials."""
    tiles = module._tiles
    monkeypatch.setattr(module, "_tiles", lambda t, m, dv, chunk: (*tiles(t, m, dv, chunk)[:2], 16, 4, 1))
    leaves, kw = _case("state", torch.float32)
    got, d_got = _run(causal_linear_attention, leaves, kw, upcast=False)
    want, d_want = _run(causal_linear_attention_reference, leaves, kw, upcast=True)
    for what, a, b in zip(["out", "state", *leaves], got + d_got, want + d_want):
        _assert_close(a, b, TOL[torch.float32], what)


@needs_kernel
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_fp32_dots_are_3xtf32_unless_pytorch_allows_tf32(monkeypatch: pytest.MonkeyPatch, allow_tf32: bool) -> None:
    """fp32 inputs: 3xTF32 dots (about fp32 accuracy), or plain TF32 where PyTorch's matmuls may use it
    (``set_float32_matmul_precision("high")``); fp16 inputs: TF32 either way. Results stay the reference's."""
    kernel, seen = module._fwd_kernel, []

    class Recorder:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def launch(*args, **kw):  # noqa: ANN002, ANN003, ANN202
                seen.append(kw["PREC"])
                return kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(module, "_fwd_kernel", Recorder())
    before, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, allow_tf32
    try:  # (monkeypatch cannot undo this flag: it is a property of torch's cuBLAS module)
        for dtype in (torch.float32, torch.float16):
            leaves, kw = _case("alibi", dtype)
            got, _ = _run(causal_linear_attention, leaves, kw, upcast=False)
            want, _ = _run(causal_linear_attention_reference, leaves, kw, upcast=True)
            tf32 = allow_tf32 or dtype != torch.float32  # 10-bit mantissas on a GPU (the interpreter: fp32)
            _assert_close(got[0], want[0], 5e-3 if tf32 else TOL[dtype], f"out {dtype}")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert seen == ["tf32" if allow_tf32 else "tf32x3", "tf32"]


@needs_kernel
def test_one_state_per_64_positions_is_kept_and_the_rest_recomputed_exactly() -> None:
    """Chunks of 16: the forward keeps the states before chunks 0, 4, 8 and S_T (not all ten), and the
    backward's recomputed states give the reference's gradients, across a reset at a kept chunk (64) and
    one inside a recomputed stretch (100)."""
    t, m, dv = 150, 16, 17
    g = torch.Generator().manual_seed(3)
    leaves = {
        "q": torch.randn(B, H, t, m, generator=g) / 2,
        "k": torch.randn(B, H, t, m, generator=g) / 2,
        "v": torch.randn(B, H, t, dv, generator=g),
        "log_decay": F.logsigmoid(torch.randn(B, H, t, generator=g) + 3),
        "state": torch.randn(B, H, m, dv, generator=g),
    }
    leaves["log_decay"][0, 1, 64], leaves["log_decay"][1, 0, 100] = INF, INF
    leaves = {n: x.to(DEVICE) for n, x in leaves.items()}
    got, d_got = _run(causal_linear_attention, leaves, {"chunk": 16}, upcast=False)
    want, d_want = _run(causal_linear_attention_reference, leaves, {"chunk": 16}, upcast=True)
    for what, a, b in zip(["out", "state", *leaves], got + d_got, want + d_want):
        _assert_close(a, b, TOL[torch.float32], what)
    x = {n: v.detach().requires_grad_(True) for n, v in leaves.items()}
    out, _ = causal_linear_attention(**x, chunk=16)
    kept = [s for s in out.grad_fn.saved_tensors if s is not None and s.dim() == 4 and s.shape[0] == B * H]
    assert [tuple(s.shape) for s in kept] == [(B * H, 4, m, dv)]  # 3 checkpoints and S_T, fp32


@needs_kernel
def test_a_reset_cuts_the_past_exactly() -> None:
    """After a -inf decay at r, nothing before r reaches an output: bit-identical outputs and zero gradients."""
    leaves, kw = _case("gates", torch.float32)
    r = 21  # mid-chunk
    leaves["log_decay"][:, :, r] = INF
    leaves["state"] = torch.randn(B, H, 32, 20, device=DEVICE)
    out, s = causal_linear_attention(**leaves, **kw)
    changed = {n: t.clone() for n, t in leaves.items()}
    for n in ("q", "k", "v"):
        changed[n][:, :, :r] += 1.0
    changed["state"] += 1.0
    out2, s2 = causal_linear_attention(**changed, **kw)
    assert torch.equal(out[:, :, r:], out2[:, :, r:]) and torch.equal(s, s2)
    x = {n: t.detach().requires_grad_(True) for n, t in leaves.items()}
    out, s = causal_linear_attention(**x, **kw)
    grads = torch.autograd.grad(out[:, :, r:].sum() + s.sum(), [x["k"], x["v"], x["state"], x["log_decay"]])
    assert all(torch.equal(d[:, :, :r], torch.zeros_like(d[:, :, :r])) for d in grads[:2])
    assert torch.equal(grads[2], torch.zeros_like(grads[2])) and (grads[3][:, :, r] == 0).all()
    assert all(torch.isfinite(d).all() for d in grads)


def _causal_sums_case(kernel: bool) -> None:
    """What ``causal_sums`` computes (stabiliser, decay, padded keys, documents, a state, Sq < T) fed to
    ``fn``: the same numerators, denominators and new state, and the same gradients."""
    g = torch.Generator().manual_seed(3)
    b, h, t, sq, m, dh = 2, 2, 41, 36, 12, 15
    fq, fk = torch.rand(b, h, sq, m, generator=g), torch.rand(b, h, t, m, generator=g)  # positive features
    v, ls = torch.randn(b, h, t, dh, generator=g), torch.randn(b, h, t, generator=g)
    ld = F.logsigmoid(torch.randn(b, h, t, generator=g) + 2)
    keep = torch.ones(b, t, dtype=torch.bool)
    keep[1, :4], keep[0, 30] = False, False
    doc = torch.zeros(b, t, dtype=torch.long)
    doc[0, 19:], doc[1, 10:], doc[1, 33:] = 1, 1, 2  # [B, T] document numbers
    doc0 = torch.tensor([0, 5])  # batch 0 continues the state's document, batch 1 starts a new one
    state = {"s": torch.rand(b, h, m, dh, generator=g), "z": torch.rand(b, h, m, generator=g) + 0.5,
             "m": torch.randn(b, h, generator=g)}  # fmt: skip
    leaves = [x.to(DEVICE).requires_grad_(True) for x in (fq, fk, v, ls, ld)]
    keep, doc, doc0 = keep.to(DEVICE), doc.to(DEVICE), doc0.to(DEVICE)
    state = {n: x.to(DEVICE) for n, x in state.items()}
    fq, fk, v, ls, ld = leaves

    num, den, new = causal_sums(fq, fk, v, ls, ld, keep, doc, doc0, state, chunk=16)
    want = [num, den, new["s"], new["z"]]
    # the same inputs in the kernel's terms: xfam's stabiliser as a decay and key scales, documents as resets
    lsd = torch.where(keep[:, None], ls, ls.amin(-1, keepdim=True)).detach()
    big, la, _ = _stabiliser(lsd, keep, doc, doc0, state["m"])  # [B, H, T]: per document, padding left out
    log_decay = la + ld
    start = doc != torch.cat((doc0[:, None], doc[:, :-1]), 1)  # [B, T]: a document starts here
    log_decay = log_decay.masked_fill(start[:, None], INF)
    key_logscale = (ls - big).masked_fill(~keep[:, None], INF)
    q = F.pad(fq, (0, 0, t - sq, 0))  # [B, H, T, m]: queries aligned with their keys
    v1 = torch.cat((v, torch.ones_like(v[..., :1])), -1)  # [B, H, T, Dh + 1]
    s0 = torch.cat((state["s"], state["z"][..., None]), -1)  # [B, H, m, Dh + 1]
    fn = causal_linear_attention if kernel else causal_linear_attention_reference
    out, s = fn(q, fk, v1, log_decay, key_logscale, s0, chunk=16)
    got = [out[:, :, t - sq :, :dh], out[:, :, t - sq :, dh], s[..., :dh], s[..., dh]]
    for what, a, b_ in zip(["numerators", "denominators", "s", "z"], got, want):
        _assert_close(a, b_, 1e-5, what)
    cot = [torch.randn(x.shape, generator=g).to(DEVICE) for x in want]
    d_got = torch.autograd.grad(sum((a * c).sum() for a, c in zip(got, cot)), leaves)
    d_want = torch.autograd.grad(sum((a * c).sum() for a, c in zip(want, cot)), leaves)
    for what, a, b_ in zip(["dfq", "dfk", "dv", "dls", "dld"], d_got, d_want):
        _assert_close(a, b_, 1e-5, what)


def test_reference_equals_causal_sums() -> None:
    _causal_sums_case(kernel=False)


@needs_kernel
def test_kernel_equals_causal_sums() -> None:
    _causal_sums_case(kernel=True)


def test_refuses_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "why_not", lambda device, interpreted=None: "no GPU here. Fix: backend=auto")
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="cannot run here: no GPU here"):
        causal_linear_attention(x, x, x)


@needs_kernel
def test_rejects_bad_arguments() -> None:
    x = torch.randn(1, 2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="chunk must be a power of two >= 16"):
        causal_linear_attention(x, x, x, chunk=24)
    with pytest.raises(ValueError, match=r"state must be \[B, H, m, Dv\]"):
        causal_linear_attention(x, x, x, state=torch.zeros(1, 2, 8, 7, device=DEVICE))
    with pytest.raises(ValueError, match="log_decay must broadcast"):
        causal_linear_attention(x, x, x, log_decay=torch.zeros(1, 3, 4, device=DEVICE))
