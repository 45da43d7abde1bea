"""The fused flash attention kernel (kernels/flash_attention.py).

Two links tie the kernel to xfam's semantics: its PyTorch reference equals xfam's own references
(vanilla ``reference_attention`` with ``AttnMask`` and ALiBi / T5 biases, adaptive span's dense formula,
the sparse engine's dense reference through ``geometry``), and the kernel equals that reference, outputs
and every gradient, feature by feature and in combinations, in fp32 and fp16 (Triton's interpreter on
CPU; bf16 on CUDA only). Also: key blocks nobody may see are never read, and the errors are clear.

One file over 400 lines: every case shares the kernel's reference and the case table.
"""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch

from xfam.attention._sparse import dense_sparse_attention
from xfam.attention._sparse.engine import geometry
from xfam.attention.adaptive_span import span_reference
from xfam.attention.bigbird import BigBirdPattern
from xfam.attention.local import WindowPattern
from xfam.attention.strided import StridedPattern
from xfam.attention.vanilla import reference_attention
from xfam.core.mask import SHARED, AttnMask
from xfam.kernels import flash_attention as fa
from xfam.kernels import runtime
from xfam.pos.alibi import AlibiBias
from xfam.pos.t5 import T5Bias, t5_bucket

flash_attention, flash_attention_reference = fa.flash_attention, fa.flash_attention_reference
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_REASON = runtime.why_not(DEVICE)
needs_kernel = pytest.mark.skipif(_REASON is not None, reason=f"Triton kernels cannot run here: {_REASON}")
TOL = {  # (atol, rtol) against the fp32 reference on the same (rounded) inputs
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 5e-2),
}


# -- inputs -----------------------------------------------------------------------------------------------


def qkv(b: int, h: int, h_kv: int, s_q: int, s_k: int, dh: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s_q, dh, generator=g)
    k, v = (torch.randn(b, h_kv, s_k, dh, generator=g) for _ in range(2))
    return [x.to(DEVICE, dtype) for x in (q, k, v)]


def padding(b: int, s_k: int, left: int = 0, right: int = 0) -> torch.Tensor:
    """Row 0 left-padded (its first queries see nothing under a causal mask), row 1 right-padded."""
    kp = torch.ones(b, s_k, dtype=torch.bool)
    kp[0, :left] = False
    kp[1, s_k - right :] = False
    return kp.to(DEVICE)


def documents(b: int, s_k: int) -> torch.Tensor:
    """Packed documents, with ``SHARED`` keys (seen by every document) in row 1."""
    seg = torch.zeros(b, s_k, dtype=torch.long)
    seg[0, s_k // 3 :] = 1
    seg[0, 2 * s_k // 3 :] = 2
    seg[1, :3] = SHARED
    seg[1, s_k // 2 :] = 5
    return seg.to(DEVICE)


def t5(h: int, s_k: int, causal: bool, nb: int = 16, max_distance: int = 40, seed: int = 1):
    table = torch.randn(nb, h, generator=torch.Generator().manual_seed(seed)) * 0.5
    buckets = t5_bucket(torch.arange(-(s_k - 1), s_k), causal, nb, max_distance).to(torch.int32)
    return {"bias_table": table.to(DEVICE), "bias_buckets": buckets.to(DEVICE)}


def sparse_layout(pattern, s_q: int, s_k: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``layout`` of a real xfam pattern: the sparse engine's geometry, without global columns."""
    geo = geometry(pattern, AttnMask(s_q, s_k, causal=causal), DEVICE)
    assert not len(geo.g_pos)
    return geo.idx, geo.ok[..., : geo.idx.shape[-1] * pattern.block]


# -- the reference is xfam's semantics ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("s_q", "s_k", "causal", "window", "pad", "docs"),
    [(30, 30, True, 9, (6, 0), False), (21, 40, False, None, (0, 7), True), (25, 44, True, 12, (0, 5), True)],
)
def test_reference_equals_vanilla_with_mask_and_alibi(s_q, s_k, causal, window, pad, docs):
    q, k, v = qkv(2, 4, 2, s_q, s_k, 16)
    kp, seg = padding(2, s_k, *pad), documents(2, s_k) if docs else None
    mask = AttnMask(s_q, s_k, causal=causal, key_padding=kp, segments=seg, window=window)
    bias = AlibiBias(4, 3).to(DEVICE)  # the last head has no bias
    expected = reference_attention(q, k, v, mask, bias)
    got = flash_attention_reference(
        q, k, v, causal=causal, window=window, key_padding=kp, segments=seg, alibi_slopes=bias.slopes
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_equals_vanilla_with_t5_bias_and_its_gradient(causal):
    s_q, s_k = 20, 34
    q, k, v = qkv(2, 4, 4, s_q, s_k, 16)
    bias = T5Bias(4, causal, num_buckets=16, max_distance=24).to(DEVICE)
    with torch.no_grad():
        bias.table.normal_(0, 0.5)
    mask = AttnMask(s_q, s_k, causal=causal, key_padding=padding(2, s_k, 0, 4))
    table = bias.table.detach().clone().requires_grad_()
    buckets = t5_bucket(torch.arange(-(s_k - 1), s_k, device=DEVICE), causal, 16, 24)
    expected = reference_attention(q, k, v, mask, bias)
    got = flash_attention_reference(
        q, k, v, causal=causal, key_padding=mask.key_padding, bias_table=table, bias_buckets=buckets
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(got)
    (expected_grad,) = torch.autograd.grad((expected * dout).sum(), bias.table)
    (grad,) = torch.autograd.grad((got * dout).sum(), table)
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_equals_adaptive_span_dense_path_and_its_gradient(causal):
    s_q, s_k, ramp = 24, 40, 6.0
    q, k, v = qkv(2, 4, 4, s_q, s_k, 16)
    z = torch.tensor([0.5, 3.7, 11.2, 40.0], device=DEVICE, requires_grad=True)
    mask = AttnMask(s_q, s_k, causal=causal, key_padding=padding(2, s_k, 9, 3))
    expected = span_reference(q, k, v, z, ramp, mask)
    got = flash_attention_reference(q, k, v, causal=causal, key_padding=mask.key_padding, span=z, span_ramp=ramp)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(got)
    (expected_grad,) = torch.autograd.grad((expected * dout).sum(), z)
    (grad,) = torch.autograd.grad((got * dout).sum(), z)
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


PATTERNS = {
    "local": (lambda h, s_k, causal: WindowPattern(11, 8, causal), True),
    "strided": (lambda h, s_k, causal: StridedPattern(6, "union", 8), True),
    "bigbird": (
        lambda h, s_k, causal: BigBirdPattern(
            block=8, window=3, n_global=0, random=1, seed=3, layer=0, heads=h, causal=causal, k_len=s_k
        ),
        False,
    ),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_reference_equals_sparse_engine_dense_path(name):
    make, causal = PATTERNS[name]
    s_q, s_k = 37, 45
    pattern = make(4, s_k, causal)
    q, k, v = qkv(2, 4, 2, s_q, s_k, 16)
    kp = padding(2, s_k, 12, 3)
    expected = dense_sparse_attention(q, k, v, pattern, AttnMask(s_q, s_k, causal=causal, key_padding=kp))
    layout = sparse_layout(pattern, s_q, s_k, causal)
    got = flash_attention_reference(q, k, v, causal=causal, key_padding=kp, layout=layout, block=pattern.block)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_shared_document_id_is_xfams():
    assert fa.SHARED == SHARED


# -- the kernel equals the reference ------------------------------------------------------------------------


def _bigbird(h: int, s_k: int, block: int = 16, causal: bool = False) -> BigBirdPattern:
    """Per-head random blocks (a layout with Hp = H), no global blocks (those are the caller's)."""
    return BigBirdPattern(block=block, window=3, n_global=0, random=1, seed=0, layer=0, heads=h, causal=causal,
                          k_len=s_k)  # fmt: skip


# name: (B, H, Hkv, Sq, Sk, Dh, feature kwargs builder)
CASES = {
    "causal_gqa_odd_length": (1, 4, 2, 77, 77, 32, lambda: {"causal": True}),
    "bidirectional_prefix_padding": (2, 2, 2, 37, 53, 64, lambda: {"key_padding": padding(2, 53, 5, 9)}),
    "causal_alibi_leftpad_gqa4_dh40": (
        2, 4, 1, 40, 40, 40,
        lambda: {"causal": True, "key_padding": padding(2, 40, 7, 0),
                 "alibi_slopes": AlibiBias(4, 4).slopes.to(DEVICE)},
    ),
    "window_documents_prefix": (
        2, 2, 1, 35, 61, 32,
        lambda: {"causal": True, "window": 13, "segments": documents(2, 61), "key_padding": padding(2, 61, 0, 4)},
    ),
    "t5_bidirectional_window_gqa": (1, 2, 1, 80, 80, 32, lambda: {"window": 50, **t5(2, 80, False)}),
    "t5_causal_prefix_scale": (1, 2, 2, 40, 72, 32, lambda: {"causal": True, "scale": 0.3, **t5(2, 72, True)}),
    "span_causal_prefix_padding": (
        2, 4, 2, 33, 57, 32,
        lambda: {"causal": True, "key_padding": padding(2, 57, 30, 0), "span_ramp": 8.0,
                 "span": torch.tensor([0.5, 4.3, 17.6, 60.0], device=DEVICE)},
    ),
    "span_t5_documents_bidirectional": (
        2, 2, 1, 41, 41, 32,
        lambda: {"segments": documents(2, 41), "span": torch.tensor([2.2, 9.5], device=DEVICE), "span_ramp": 5.0,
                 **t5(2, 41, False)},
    ),
    "layout_local_causal_padding": (
        2, 2, 1, 100, 100, 32,
        lambda: {"causal": True, "key_padding": padding(2, 100, 20, 0), "block": 32,
                 "layout": sparse_layout(WindowPattern(72, 32, True), 100, 100, True)},
    ),
    "layout_bigbird_per_head_alibi_gqa": (
        1, 2, 1, 64, 64, 32,
        lambda: {"alibi_slopes": AlibiBias(2, 2).slopes.to(DEVICE), "block": 16,
                 "layout": sparse_layout(_bigbird(2, 64), 64, 64, False)},
    ),
    "layout_sub_tiles_per_head_gqa": (  # (block 32, split into 16-tiles by a test)
        1, 2, 1, 90, 90, 32,
        lambda: {"causal": True, "block": 32, "alibi_slopes": AlibiBias(2, 2).slopes.to(DEVICE),
                 "layout": sparse_layout(_bigbird(2, 90, block=32, causal=True), 90, 90, True)},
    ),
    "layout_strided_prefix_gqa": (
        1, 2, 1, 40, 72, 32,
        lambda: {"causal": True, "block": 16, "layout": sparse_layout(StridedPattern(8, "union", 16), 40, 72, True)},
    ),
}  # fmt: skip
HALF_CASES = ["causal_alibi_leftpad_gqa4_dh40", "t5_bidirectional_window_gqa", "span_causal_prefix_padding",
              "layout_strided_prefix_gqa"]  # fmt: skip


def check_parity(name: str, dtype: torch.dtype) -> None:
    b, h, h_kv, s_q, s_k, dh, features = CASES[name]
    kw = features()
    q, k, v = qkv(b, h, h_kv, s_q, s_k, dh, dtype)
    if name == "bidirectional_prefix_padding":  # strided inputs: [B, S, H, Dh] storage seen heads-first
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    learned = [n for n in ("bias_table", "span") if n in kw]
    for n in learned:
        kw[n] = kw[n].float().requires_grad_()
    leaves = [x.requires_grad_() for x in (q, k, v)] + [kw[n] for n in learned]
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    ref_kw = {**kw, **dict(zip(learned, ref_leaves[3:]))}

    out = flash_attention(q, k, v, **kw)
    expected = flash_attention_reference(*ref_leaves[:3], **ref_kw)
    assert out.dtype == dtype and out.shape == (b, h, s_q, dh)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad((out.float() * dout).sum(), leaves)
    expected_grads = torch.autograd.grad((expected * dout).sum(), ref_leaves)

    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    for label, got, want in zip(["dq", "dk", "dv", *learned], grads, expected_grads):
        assert want.abs().max() > 0, f"{label}: the reference gradient is zero, the check would be empty"
        scale = max(1.0, want.abs().max().item())  # bias / span gradients sum many pairs: relative to their size
        torch.testing.assert_close(got.float(), want, atol=atol * scale, rtol=rtol, msg=lambda m, n=label: f"{n}: {m}")


@needs_kernel
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_reference_fp32(name):
    check_parity(name, torch.float32)


@needs_kernel
@pytest.mark.parametrize("name", HALF_CASES)
def test_kernel_equals_reference_fp16(name):
    check_parity(name, torch.float16)


@needs_kernel
@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 arithmetic is wrong in Triton's interpreter: CUDA only")
@pytest.mark.parametrize("name", HALF_CASES)
def test_kernel_equals_reference_bf16(name):
    check_parity(name, torch.bfloat16)


# -- whole tiles: the ones the kernels run without a positional mask ---------------------------------------


def _visible(s_q: int, s_k: int, w: int, causal: bool) -> torch.Tensor:
    """``[Sq + 128, Sk + 128]`` bool: the pairs in bounds and seen under causality and reach ``w``."""
    i = torch.arange(s_q + 128)[:, None]
    j = torch.arange(s_k + 128)[None, :]
    dist = s_k - s_q + i - j
    see = (i < s_q) & (j < s_k) & (dist.abs() < w)
    return see & (dist >= 0) if causal else see


LOOP_CASES = [  # (Sq, Sk, reach w): lengths, prefixes Sk - Sq of every residue that matters, reaches one below,
    (s_q, s_k, w)  # at and above block multiples
    for s_q, s_k in ((1, 1), (31, 31), (100, 100), (50, 51), (45, 109), (37, 99), (20, 83), (64, 128))
    for w in (1, 2, 15, 16, 17, 31, 33, 47, 64, 97, s_k + 1)
]

if fa.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _ranges_kernel(OUT, SQ, SK, W, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Lane ``c * 16 + p`` of OUT ``[2048, 8]``: for case c (SQ, SK, W), query block p's key loop (lo,
        whole_lo, whole_hi, hi) and key block p's query loop, the kernels' own arithmetic on every lane at once."""
        lane = tl.arange(0, 2048)
        Sq, Sk, w = tl.load(SQ + lane // 16), tl.load(SK + lane // 16), tl.load(W + lane // 16)
        p = lane % 16
        lo, hi = fa._key_blocks(p * BLOCK_M, Sq, Sk, w, CAUSAL, BLOCK_M, BLOCK_N)
        f_lo, f_hi = fa._whole_key_blocks(p * BLOCK_M, Sq, Sk, w, CAUSAL, BLOCK_M, BLOCK_N)
        f_lo, f_hi, hi = fa._nest(lo, f_lo, f_hi, hi)
        i_lo, i_hi = fa._query_blocks(p * BLOCK_N, Sq, Sk, w, CAUSAL, BLOCK_M, BLOCK_N)
        g_lo, g_hi = fa._whole_query_blocks(p * BLOCK_N, Sq, Sk, w, CAUSAL, BLOCK_M, BLOCK_N)
        g_lo, g_hi, i_hi = fa._nest(i_lo, g_lo, g_hi, i_hi)
        for n, x in enumerate((lo, f_lo, f_hi, hi, i_lo, g_lo, g_hi, i_hi)):
            tl.store(OUT + lane * 8 + n, x)


def _check_loop(name: str, visible: torch.Tensor, lo: int, f_lo: int, f_hi: int, hi: int) -> None:
    """``visible [n_tiles, ...]``: every tile with a visible pair lies in ``[lo, hi)``, and the tiles there whose
    every pair is visible are exactly ``[f_lo, f_hi)``."""
    seen, whole = visible.flatten(1).any(-1), visible.flatten(1).all(-1)  # [n_tiles]
    tiles = torch.arange(len(seen))
    assert not seen[(tiles < lo) | (tiles >= hi)].any(), f"{name}: a seen tile outside [{lo}, {hi})"
    assert lo <= f_lo <= f_hi <= hi, (name, lo, f_lo, f_hi, hi)
    want = whole & (tiles >= lo) & (tiles < hi)
    got = (tiles >= f_lo) & (tiles < f_hi)
    assert torch.equal(got, want), f"{name}: whole tiles {tiles[want].tolist()}, loop gives [{f_lo}, {f_hi})"


@needs_kernel
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bm,bn", [(32, 16), (16, 32)])
def test_whole_tile_ranges_are_exact(causal, bm, bn):
    """The loops of all three kernels run unmasked exactly the tiles whose every pair is visible (a tile
    wrongly called whole would leak or read out of bounds; one missed would only cost time), and visit every
    tile with a visible pair: all query and key blocks of ``LOOP_CASES``."""
    cases = LOOP_CASES + [(1, 1, 1)] * (128 - len(LOOP_CASES))  # 128 cases of 16 lanes
    cols = [torch.tensor([c[n] for c in cases], dtype=torch.int32, device=DEVICE) for n in range(3)]
    out = torch.zeros(2048, 8, dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(1,)](out, *cols, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn)
    out = out.view(128, 16, 8).tolist()
    for c, (s_q, s_k, w) in enumerate(LOOP_CASES):
        vis = _visible(s_q, s_k, w, causal)
        for p, (lo, f_lo, f_hi, hi, i_lo, g_lo, g_hi, i_hi) in enumerate(out[c]):
            case = f"Sq={s_q} Sk={s_k} w={w} block {p}"
            if p * bm < s_q:
                rows = vis[p * bm : (p + 1) * bm, : -(-s_k // bn) * bn]  # [BM, nK * BN]
                _check_loop(f"keys of {case}", rows.reshape(bm, -1, bn).transpose(0, 1), lo, f_lo, f_hi, hi)
            if p * bn < s_k:
                keys = vis[: -(-s_q // bm) * bm, p * bn : (p + 1) * bn]  # [nQ * BM, BN]
                _check_loop(f"queries of {case}", keys.reshape(-1, bm, bn), i_lo, g_lo, g_hi, i_hi)


@needs_kernel
@pytest.mark.parametrize("name", ["t5_bidirectional_window_gqa", "layout_bigbird_per_head_alibi_gqa"])
def test_fp32_gpu_way_equals_the_reference(name, monkeypatch):
    """fp32 on a GPU (``F32``) runs every tile through the masked loop and reads delta from torch; the
    interpreter otherwise takes the fp16/bf16 way for every dtype, so force it here, on cases with whole tiles
    and whole layout entries."""
    feature_args = fa._feature_args
    monkeypatch.setattr(fa, "_feature_args", lambda *a: feature_args(*a) | {"F32": True})
    check_parity(name, torch.float32)


class _ShortOfSharedMemory:
    """Stands in for a kernel on a device with ``limit`` bytes of shared memory per block, where the kernel needs
    8 B per score of a tile and its K and V buffers in every pipeline stage: beyond the limit, the launch raises
    OutOfResources as Triton does (before anything runs); within it, the real kernel runs."""

    def __init__(self, kernel, kind: str, limit: int, launched: list) -> None:  # noqa: ANN001
        self.kernel, self.kind, self.limit, self.launched = kernel, kind, limit, launched

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kw) -> None:  # noqa: ANN002, ANN003
            bm, bn, stages = kw["BLOCK_M"], kw["BLOCK_N"], kw["num_stages"]
            need = 8 * bm * bn + 2 * stages * bn * kw["BLOCK_D"] * 4
            self.launched.append((self.kind, bm, bn, stages, need <= self.limit))
            if need > self.limit:
                from triton.runtime import OutOfResources

                raise OutOfResources(need, self.limit, "shared memory")
            self.kernel[grid](*args, **kw)

        return launch


@needs_kernel
def test_tiles_shrink_until_they_fit_the_devices_shared_memory(monkeypatch, caplog):
    """Tiles chosen for an H100 need more shared memory than an RTX 4090 or an L4 has (the T5 forward: 160 KiB
    of 99, docs/kernels.md): each kernel steps down (a stage less, then half a tile) until Triton stops refusing
    the launch, logs each step once, gives the same results, and keeps the tiles that fit for the next call."""
    launched = []
    monkeypatch.setattr(fa, "_tiles", lambda kind, dh, dtype, block: fa._Tiles(64, 64, 4, 3))
    monkeypatch.setattr(fa, "_FITTED", {})
    for kind in ("fwd", "dq", "dkdv"):
        name = f"_{kind}_kernel"
        monkeypatch.setattr(fa, name, _ShortOfSharedMemory(getattr(fa, name), kind, 40_000, launched))
    with caplog.at_level(logging.INFO, logger="xfam.kernels"):
        check_parity("t5_bidirectional_window_gqa", torch.float32)  # Dh 32: 81,920 B, 65,536 B, then 32,768 B
    steps = [(64, 64, 3, False), (64, 64, 2, False), (64, 32, 2, True)]
    assert launched == [(kind, *step) for kind in ("fwd", "dq", "dkdv") for step in steps]
    assert len(caplog.records) == 6 and "out of resource: shared memory, Required: 81920" in caplog.text
    launched.clear()
    check_parity("t5_bidirectional_window_gqa", torch.float32)
    assert launched == [(kind, 64, 32, 2, True) for kind in ("fwd", "dq", "dkdv")]


def test_smaller_tiles_cut_stages_to_two_then_halve_the_larger_tile():
    def ladder(t):  # noqa: ANN001, ANN202
        out = []
        while t is not None:
            out.append((t.block_m, t.block_n, t.warps, t.stages))
            t = fa._smaller(t)
        return out

    assert ladder(fa._Tiles(128, 64, 8, 3)) == [
        (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 8, 2), (64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 1)
    ]  # fmt: skip
    assert ladder(fa._Tiles(32, 64, 8, 2)) == [(32, 64, 8, 2), (32, 32, 8, 2), (32, 32, 8, 1)]
    assert ladder(fa._Tiles(64, 64, 4, 2)) == [(64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2), (32, 32, 4, 1)]
    assert ladder(fa._Tiles(16, 32, 8, 1)) == [(16, 32, 8, 1)]  # fp32 dk/dv at Dh 128: nothing smaller


def test_gpu_tiles_of_a_layout_lie_within_its_block(monkeypatch):
    """On a GPU, every layout's tiles divide its block and are at most 64 wide; fp32 ones are the plain fp32
    tiles within it (whole 64-blocks spilled 2 KiB per thread in fp32 dk/dv at Dh 128, compiled for sm_90)."""
    monkeypatch.setattr(fa.runtime, "interpreting", lambda: False)
    for kind, dh, dtype, block in itertools.product(
        ("fwd", "dq", "dkdv"), (32, 64, 128), (torch.float32, torch.bfloat16), (16, 32, 64, 128, 256)
    ):
        t = fa._tiles(kind, dh, dtype, block)
        assert 16 <= t.block_m <= 64 and 16 <= t.block_n <= 64, (kind, dh, dtype, block, t)
        assert block % t.block_m == 0 and block % t.block_n == 0, (kind, dh, dtype, block, t)
        if dtype == torch.float32:
            plain = fa._tiles(kind, dh, dtype, None)
            assert t == plain._replace(block_m=min(plain.block_m, block), block_n=min(plain.block_n, block))


@needs_kernel
@pytest.mark.parametrize("bm,bn", [(16, 32), (32, 16), (16, 16)])
@pytest.mark.parametrize("name", ["layout_local_causal_padding", "layout_sub_tiles_per_head_gqa"])
def test_layout_blocks_split_into_smaller_tiles_equal_the_reference(name, bm, bn, monkeypatch):
    """Where a GPU lacks the shared memory for a tile as large as the layout's block (block 128 at Dh 128 on
    an RTX 4090: 112 KiB of 99), ``_run`` splits each block into smaller tiles: every entry's sub-tiles, each
    with its rows and columns of the element mask, in all three kernels (whole entries and partial ones)."""
    monkeypatch.setattr(fa, "_tiles", lambda kind, dh, dtype, block: fa._Tiles(bm, bn, 1, 1))
    check_parity(name, torch.float32)


def test_prepared_layout_lists_whole_entries_first_and_transposes():
    """``prepare_layout``: per query block the whole entries (every pair visible, judged with causality and
    the bounds) first, the same set of pairs as before; the transpose lists each key block's entries, whole
    ones first, and every entry with a visible pair once."""
    s_q, s_k, block = 70, 70, 16
    idx, ok = sparse_layout(WindowPattern(40, block, True), s_q, s_k, True)
    lay = fa.prepare_layout((idx, ok), block, s_q, s_k, True, None)
    assert torch.equal(fa.layout_dense(lay, block, s_q, s_k), fa.layout_dense((idx, ok), block, s_q, s_k))
    hp, n_q, slots = lay.idx.shape
    cells = lay.ok.view(hp, n_q, block, slots, block)
    rows = torch.arange(n_q)[:, None] * block + torch.arange(block)  # [nQ, b] query = key position (Sq = Sk)
    keys = lay.idx[..., None] * block + torch.arange(block)  # [Hp, nQ, K, b]
    causal_ok = keys[:, :, None, :, :] <= rows[None, :, :, None, None]  # [Hp, nQ, b, K, b]
    in_bounds = (keys < s_k)[:, :, None] & (rows < s_q)[None, :, :, None, None]
    whole = (cells & causal_ok & in_bounds).all(4).all(2)  # [Hp, nQ, K]
    first = torch.arange(slots) < lay.n_whole[..., None]
    assert torch.equal(whole, first), "whole entries must be exactly the first n_whole of each query block"
    assert 0 < lay.n_whole.sum() < (cells.any(4).any(2)).sum(), "the case must have whole and partial entries"
    n_k = -(-s_k // block)
    for hp_i in range(hp):
        listed = []
        for j in range(n_k):
            entries = lay.k_flat[hp_i, lay.k_start[hp_i, j] : lay.k_start[hp_i, j + 1]].tolist()
            n_w = int(lay.k_whole[hp_i, j] - lay.k_start[hp_i, j])
            for n, e in enumerate(entries):
                qb, slot = divmod(e, slots)
                assert lay.idx[hp_i, qb, slot] == j and bool(cells[hp_i, qb, :, slot].any())
                assert bool(first[hp_i, qb, slot]) == (n < n_w), f"key block {j}: whole entries first"
            listed += entries
        assert sorted(listed) == [q * slots + s for q in range(n_q) for s in range(slots) if cells[hp_i, q, :, s].any()]


def test_a_layout_prepared_for_another_call_is_refused():
    q, k, v = qkv(1, 2, 2, 64, 64, 16)
    idx, ok = sparse_layout(WindowPattern(40, 16, True), 64, 64, True)
    lay = fa.prepare_layout((idx, ok), 16, 64, 64, causal=False, window=None)
    if _REASON is not None:
        pytest.skip(_REASON)
    with pytest.raises(ValueError, match="prepared for .* not for this call"):
        flash_attention(q, k, v, causal=True, layout=lay, block=16)


# -- work skipping and errors -------------------------------------------------------------------------------


def _unlisted_block_layout() -> tuple[torch.Tensor, torch.Tensor]:
    """Every query block of 64 positions (block 16) visits key blocks 1..3 only: block 0 is never listed."""
    idx = torch.tensor([1, 2, 3], device=DEVICE).expand(1, 4, 3).contiguous()
    return idx, torch.ones(1, 4, 16, 48, dtype=torch.bool, device=DEVICE)


SKIP_CASES = {  # (Sq, Sk, n, kwargs): keys 0..n-1 lie in key blocks nobody may see (for tiles up to 128)
    "causal_window": (32, 224, 128, lambda: {"causal": True, "window": 9}),
    "span_bidirectional": (
        32, 224, 128, lambda: {"span": torch.tensor([2.5, 6.0], device=DEVICE), "span_ramp": 4.0}
    ),
    "layout": (64, 64, 16, lambda: {"layout": _unlisted_block_layout(), "block": 16}),
}  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("name", list(SKIP_CASES))
def test_invisible_key_blocks_are_never_read(name):
    """NaN in the invisible keys and values would reach the output (0 * NaN) and gradients if a tile read
    them; the loop bounds (or the layout) must skip their blocks in the forward and both backward kernels."""
    s_q, s_k, n, features = SKIP_CASES[name]
    kw = features()
    q, k, v = qkv(1, 2, 1, s_q, s_k, 32)
    clean = [x.clone().requires_grad_() for x in (q, k, v)]
    k[:, :, :n], v[:, :, :n] = float("nan"), float("nan")
    poisoned = [x.requires_grad_() for x in (q, k, v)]
    out = flash_attention(*poisoned, **kw)
    grads = torch.autograd.grad(out.sum(), poisoned)
    expected = flash_attention_reference(*clean, **kw)
    expected_grads = torch.autograd.grad(expected.sum(), clean)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # dk, dv: exactly 0 on the invisible keys


def test_clear_error_where_the_kernel_cannot_run(monkeypatch):
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with pytest.raises(RuntimeError, match="flash_attention: .*(TRITON_INTERPRET|not installed)"):
        flash_attention(q, k, v)


@needs_kernel
def test_invalid_inputs_are_all_named_before_launch():
    q, k, v = qkv(2, 3, 2, 8, 6, 16)
    with pytest.raises(ValueError) as err:
        flash_attention(q, k, v, window=0, alibi_slopes=torch.ones(2, device=DEVICE), bias_table=torch.ones(4, 3))
    msg = str(err.value)
    for part in ("must divide", "Sk (6) must be >= Sq (8)", "window=0", "alibi_slopes must be [H]", "go together"):
        assert part in msg, (part, msg)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = qkv(1, 2, 2, 5, 5, 16)
    torch.testing.assert_close(
        flash_attention_reference(q, k, v), flash_attention_reference(q, k, v, scale=1 / math.sqrt(16))
    )
