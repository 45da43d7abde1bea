"""Fused flash attention, forward and backward, in Triton, beside its PyTorch reference.

One file of about 1000 lines: the three kernels share their ``@triton.jit`` helpers and tile conventions with
the launch code (tile sizes, the shared-memory fallback, the layout's CSR transpose, the checks), which must
be read and changed together, and the compile report (``scripts/compile_kernels.py``) names the kernels by
this module (``flash_attention._fwd_kernel``).

Tiled attention with an online softmax (FlashAttention, Dao et al., 2022, arXiv:2205.14135), in the
work split of FlashAttention-2 (Dao, 2023, arXiv:2307.08691): one program per query block walks its
key blocks, keeping a running maximum, sum and fp32 output accumulator, and saves the log-sum-exp of
each query row; the backward recomputes the probabilities from it, in two kernels without atomics on
q, k or v: one program per key block accumulates dk and dv over every query block (and every query
head of its grouped-query kv head) that sees it, one program per query block accumulates dq.

Fused into the tiles (nothing of size Sq x Sk is ever materialised), evaluated on each (query, key)
pair from positions, with query i at key index ``qpos = Sk - Sq + i`` (memory / cache in front):

* causal (``kpos <= qpos``) and window (``|qpos - kpos| < window``): a mask, and loop bounds, so key
  blocks no query of the tile may see are never visited (in the backward, nor query blocks); tiles whose
  every pair is visible ("whole": in bounds, causal, in the window) run first, without the mask tests, as
  in FlashAttention-2 and FlexAttention's full blocks, and the rest (the diagonal, the window's edges, the
  ends past Sq or Sk) with them;
* key padding (``[B, Sk]`` bool) and packed documents (``[B, Sk]`` ids, the ``SHARED`` id seen by every
  document, as ``xfam.core.mask.same_document``): loaded per key block;
* ALiBi (Press et al., 2022): ``-slope_h * |qpos - kpos|`` from the ``[H]`` slopes (no gradient);
* T5 relative bias (Raffel et al., 2020): ``table[buckets[qpos - kpos + Sk - 1], h]``, two gathers per
  pair; its gradient, the sum of dS over the pairs of each bucket, by fp32 atomic adds;
* adaptive span (Sukhbaatar et al., 2019): ``+ log m`` with ``m = clamp((R + z_h - |qpos - kpos|) / R,
  0, 1)`` and ``m = 0`` masked, which is the paper's renormalised ``m * exp(s)``; keys beyond
  ``R + z_h`` bound the loops like a window; d z_h = sum of ``dS / (R m)`` over the ramp (fp32 atomics);
* a block-sparse layout (``xfam.attention._sparse.engine.geometry``): a query block visits only its
  listed key blocks, under the element mask ``block_ok``; the backward visits, for each key block, the
  (query block, slot) pairs that list it (a CSR transpose of the layout built with torch). Whole entries
  (``block_ok`` all True, and whole as above) go first and load no element mask (``prepare_layout``).
  A GPU short of shared memory gets tiles smaller than the layout's block (``_run``), each entry then
  visited as several tiles.

A query that may see no key at all (a left pad under a causal mask, a document-less row, a row of a
sparse layout with nothing visible) attends to itself, as ``AttnMask.dense`` does: its output is its
own value row, its gradient flows to that value only. Scores are in the log2 domain inside the kernels
(``exp2``); accumulation is fp32; fp16 / bf16 tiles go through ``tl.dot`` natively on GPU, and Triton's
interpreter (CPU tests, ``TRITON_INTERPRET=1``) gets bf16 loads upcast to fp32, as its bf16 arithmetic
is wrong. fp32 inputs use TF32 dots on GPU exactly when ``torch.backends.cuda.matmul.allow_tf32`` is set.

Not here (callers take a PyTorch path): attention dropout, persistent (position-free) keys, per-query
(dynamic) spans, the global rows and columns of Longformer / BigBird (the layout holds block columns only),
score modifiers (Shaw, Transformer-XL, DA), and double backward. Bucket ids must lie in ``[0, NB)``: they
are not checked, as that would synchronise with the device.

``flash_attention_reference`` computes the same function with explicit ``[B, H, Sq, Sk]`` scores: the
parity ground truth of the tests, which also tie it to xfam's own references.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import runtime

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still works; flash_attention raises runtime.why_not's reason
    triton = tl = None

#: Document id of keys every document sees (``xfam.core.mask.SHARED``; a test keeps them equal).
#: Not imported: this module must not pull in ``xfam.attention``, which may import it lazily.
SHARED = -2

_jit = triton.jit if triton is not None else (lambda fn: fn)
#: Whether the kernels below were decorated for Triton's interpreter (TRITON_INTERPRET=1 at import).
_INTERPRETED = runtime.interpreting()
_log = logging.getLogger("xfam.kernels")


# -- kernel helpers ---------------------------------------------------------------------------------------


@_jit
def _load_rows(ptr, offs, offs_d, stride_s, stride_d, n, DH, UPCAST: tl.constexpr):
    """Rows ``offs`` of a ``[n, DH]`` matrix as a ``[len(offs), BLOCK_D]`` tile, zero outside."""
    mask = (offs[:, None] < n) & (offs[:, None] >= 0) & (offs_d[None, :] < DH)
    x = tl.load(ptr + offs[:, None] * stride_s + offs_d[None, :] * stride_d, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@_jit
def _reach(window, ramp, Sk, SPAN, h, HAS_SPAN: tl.constexpr):
    """Keys at ``|qpos - kpos| >= reach`` are invisible to head ``h``: the window, and beyond the span
    (``m = 0`` from ``x >= R + z``, so from ``floor(R + z) + 1``)."""
    w = window
    if HAS_SPAN:
        z = tl.load(SPAN + h).to(tl.float32)
        w = tl.minimum(w, tl.maximum(tl.minimum(ramp + z, Sk + 1.0).to(tl.int32) + 1, 1))
    return w


@_jit
def _score_tile(
    qk,  # [BM, BN] fp32: q . k
    offs_m,  # [BM] query indices 0..Sq-1
    offs_n,  # [BN] key indices 0..Sk-1
    ok,  # [BM, BN] bool: the layout's element mask (all True without a layout)
    b,
    h,
    Sq,
    Sk,
    window,
    qk_scale,  # softmax scale * log2(e)
    ramp,
    KP,
    stride_kp,
    SEG,
    stride_seg,
    SLOPES,
    TABLE,
    stride_tn,
    stride_th,
    BUCKETS,
    SPAN,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_SPAN: tl.constexpr,
    BOUNDARY: tl.constexpr,
):
    """Scores of one tile in the log2 domain, ``-inf`` where masked: ``(s2, valid, bucket, span_w)``.

    ``BOUNDARY=False`` promises that every pair of the tile is in bounds, causal and within the window (and,
    with a layout, that ``ok`` is all True): those tests are then not made, and without padding, documents
    or span nothing is masked. ``bucket`` (T5 bucket of each pair) and ``span_w`` (``d s / d z``: ``1 / (R m)``
    on the ramp, else 0) serve the backward; a kernel that does not use them lets the compiler drop them.
    """
    off = Sk - Sq
    dist = (off + offs_m)[:, None] - offs_n[None, :]  # [BM, BN] qpos - kpos
    valid = ok
    if BOUNDARY:
        valid = valid & (offs_m[:, None] < Sq) & (offs_n[None, :] < Sk) & (offs_n[None, :] >= 0)
        if CAUSAL:
            valid = valid & (dist >= 0)
        if HAS_WINDOW:
            valid = valid & (tl.abs(dist) < window)
    if HAS_PAD:
        real = tl.load(KP + b * stride_kp + offs_n, mask=(offs_n < Sk) & (offs_n >= 0), other=0)  # [BN]
        valid = valid & (real != 0)[None, :]
    if HAS_SEG:
        k_doc = tl.load(SEG + b * stride_seg + offs_n, mask=(offs_n < Sk) & (offs_n >= 0), other=-1)  # [BN]
        q_doc = tl.load(SEG + b * stride_seg + off + offs_m, mask=offs_m < Sq, other=-1)  # [BM]
        valid = valid & ((q_doc[:, None] == k_doc[None, :]) | (k_doc[None, :] == -2))  # -2: SHARED
    s = qk * qk_scale
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h).to(tl.float32)
        s = s - (slope * 1.4426950408889634) * tl.abs(dist).to(tl.float32)
    bucket = tl.zeros(qk.shape, dtype=tl.int32)
    if HAS_TABLE:
        bucket = tl.load(BUCKETS + dist + Sk - 1, mask=valid, other=0).to(tl.int32)
        bias = tl.load(TABLE + bucket * stride_tn + h * stride_th, mask=valid, other=0.0).to(tl.float32)
        s = s + bias * 1.4426950408889634
    span_w = tl.zeros(qk.shape, dtype=tl.float32)
    if HAS_SPAN:
        z = tl.load(SPAN + h).to(tl.float32)
        raw = (ramp + z - tl.abs(dist).to(tl.float32)) / ramp
        m = tl.minimum(tl.maximum(raw, 0.0), 1.0)
        valid = valid & (m > 0)
        m_safe = tl.where(m > 0, m, 1.0)
        s = s + tl.log2(m_safe)
        # torch's clamp passes the gradient on 0 <= raw <= 1; raw = 0 is masked here
        span_w = tl.where((raw > 0) & (raw <= 1.0), 1.0 / (ramp * m_safe), 0.0)
    s = tl.where(valid, s, float("-inf"))
    return s, valid, bucket, span_w


@_jit
def _key_blocks(m0, Sq, Sk, w, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks ``[lo, hi)`` that queries ``m0 .. m0 + BLOCK_M - 1`` may see (window reach ``w``)."""
    off = Sk - Sq
    q_first = off + m0
    q_last = off + tl.minimum(m0 + BLOCK_M, Sq) - 1
    k_lo = tl.maximum(q_first - w + 1, 0)
    if CAUSAL:
        k_hi = tl.minimum(q_last + 1, Sk)
    else:
        k_hi = tl.minimum(q_last + w, Sk)
    return k_lo // BLOCK_N, (k_hi + BLOCK_N - 1) // BLOCK_N


@_jit
def _query_blocks(n0, Sq, Sk, w, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks ``[lo, hi)`` that may see keys ``n0 .. n0 + BLOCK_N - 1`` (window reach ``w``)."""
    off = Sk - Sq
    k_last = tl.minimum(n0 + BLOCK_N, Sk) - 1
    if CAUSAL:
        i_lo = n0 - off
    else:
        i_lo = n0 - w + 1 - off
    i_lo = tl.maximum(i_lo, 0)
    i_hi = tl.minimum(k_last + w - off, Sq)
    return i_lo // BLOCK_M, (i_hi + BLOCK_M - 1) // BLOCK_M


@_jit
def _whole_key_blocks(m0, Sq, Sk, w, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks ``[lo, hi)`` that every query of ``m0 .. m0 + BLOCK_M - 1`` sees whole: in bounds, causal,
    ``|qpos - kpos| < w`` for each pair (no positional mask needed); empty when the query block passes Sq."""
    q_first = Sk - Sq + m0
    q_last = q_first + BLOCK_M - 1
    lo = (tl.maximum(q_last - w + 1, 0) + BLOCK_N - 1) // BLOCK_N  # first key >= q_last - w + 1
    hi = Sk // BLOCK_N  # last key < Sk
    if CAUSAL:
        hi = tl.minimum(hi, (q_first + 1) // BLOCK_N)  # last key <= q_first
    else:
        hi = tl.minimum(hi, (q_first + w) // BLOCK_N)  # last key < q_first + w
    return lo, tl.where(m0 + BLOCK_M <= Sq, hi, 0)


@_jit
def _whole_query_blocks(n0, Sq, Sk, w, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks ``[lo, hi)`` that see every key of ``n0 .. n0 + BLOCK_N - 1`` (as ``_whole_key_blocks``);
    empty when the key block passes Sk."""
    off = Sk - Sq
    if CAUSAL:
        lo = (tl.maximum(n0 + BLOCK_N - 1 - off, 0) + BLOCK_M - 1) // BLOCK_M  # first qpos >= last key
    else:
        lo = (tl.maximum(n0 + BLOCK_N - off - w, 0) + BLOCK_M - 1) // BLOCK_M  # first qpos > last key - w
    hi = tl.minimum(Sq // BLOCK_M, tl.maximum(n0 + w - off, 0) // BLOCK_M)  # last query < Sq, < first key + w
    return lo, tl.where(n0 + BLOCK_N <= Sk, hi, 0)


@_jit
def _phase(PHASE: tl.constexpr, lo, whole_lo, whole_hi, hi):
    """Loop bounds of phase 0, the whole tiles ``[whole_lo, whole_hi)``, or phase 1, the masked ones: ``[lo,
    whole_lo)`` then ``[whole_hi, hi)``, numbered on (one loop: a second would cost registers, sm_90)."""
    if PHASE == 0:
        a, z = whole_lo, whole_hi
    else:
        a, z = 0, (whole_lo - lo) + (hi - whole_hi)
    return a, z


@_jit
def _tile(PHASE: tl.constexpr, i, lo, whole_lo, whole_hi):
    """Tile index of iteration ``i`` of phase ``PHASE`` (``_phase``)."""
    if PHASE == 0:
        t = i
    else:
        t = tl.where(i < whole_lo - lo, lo + i, whole_hi + i - (whole_lo - lo))
    return t


@_jit
def _nest(lo, whole_lo, whole_hi, hi):
    """``(whole_lo, whole_hi, hi)`` with ``lo <= whole_lo <= whole_hi <= hi`` (an empty loop stays empty)."""
    hi = tl.maximum(hi, lo)
    whole_lo = tl.minimum(tl.maximum(whole_lo, lo), hi)
    return whole_lo, tl.minimum(tl.maximum(whole_hi, whole_lo), hi), hi


@_jit
def _layout_tile(
    LIDX, LOK, hp, qb, slot, row0, col0, s_ih, s_iq, s_ik, s_oh, s_oq, s_or, s_oc,
    LBLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WHOLE: tl.constexpr,
):  # fmt: skip
    """Key indices ``[BN]`` and element mask ``[BM, BN]`` of the tile at rows ``row0``, columns ``col0`` of
    layout entry ``(hp, qb, slot)``, an ``LBLOCK``-square (all True, not loaded, for a ``WHOLE`` entry)."""
    kb = tl.load(LIDX + hp * s_ih + qb * s_iq + slot * s_ik)
    offs_n = kb * LBLOCK + col0 + tl.arange(0, BLOCK_N)
    if WHOLE:
        ok = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)
    else:
        rows, cols = row0 + tl.arange(0, BLOCK_M), slot * LBLOCK + col0 + tl.arange(0, BLOCK_N)
        ok = tl.load(LOK + hp * s_oh + qb * s_oq + rows[:, None] * s_or + cols[None, :] * s_oc) != 0
    return offs_n, ok


@_jit
def _key_loop(
    pid_m, h, Sq, Sk, window, ramp, SPAN, NWHOLE, s_wh, NKB,
    CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_PER_HEAD: tl.constexpr,
    LBLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The key loop of query tile ``pid_m``, head ``h``: layout head row ``hp`` and the tiles
    ``lo <= whole_lo <= whole_hi <= hi``, those in ``[whole_lo, whole_hi)`` needing no positional mask.
    A layout lists its whole entries first (``NWHOLE [Hp, nQ]`` of them); tile ``t`` is key sub-tile
    ``t % (LBLOCK / BLOCK_N)`` of entry ``t // (LBLOCK / BLOCK_N)`` (``_key_tile``)."""
    if HAS_LAYOUT:
        hp = h if LAYOUT_PER_HEAD else 0
        lo, whole_lo, hi = 0, 0, NKB * (LBLOCK // BLOCK_N)
        whole_hi = tl.load(NWHOLE + hp * s_wh + pid_m * BLOCK_M // LBLOCK) * (LBLOCK // BLOCK_N)
    else:
        hp = 0
        w = _reach(window, ramp, Sk, SPAN, h, HAS_SPAN)
        lo, hi = _key_blocks(pid_m * BLOCK_M, Sq, Sk, w, CAUSAL, BLOCK_M, BLOCK_N)
        whole_lo, whole_hi = _whole_key_blocks(pid_m * BLOCK_M, Sq, Sk, w, CAUSAL, BLOCK_M, BLOCK_N)
        whole_lo, whole_hi, hi = _nest(lo, whole_lo, whole_hi, hi)
    return hp, lo, whole_lo, whole_hi, hi


@_jit
def _key_tile(
    t, hp, pid_m, LIDX, LOK, s_ih, s_iq, s_ik, s_oh, s_oq, s_or, s_oc,
    HAS_LAYOUT: tl.constexpr, WHOLE: tl.constexpr, LBLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key indices ``[BN]`` and layout element mask ``[BM, BN]`` of tile ``t`` of query tile ``pid_m``'s loop."""
    if HAS_LAYOUT:  # tiles may be smaller than the layout's blocks (``_run``: a GPU with less shared memory)
        qb, row0 = pid_m * BLOCK_M // LBLOCK, pid_m * BLOCK_M % LBLOCK
        slot, col0 = t // (LBLOCK // BLOCK_N), t % (LBLOCK // BLOCK_N) * BLOCK_N
        offs_n, ok = _layout_tile(
            LIDX, LOK, hp, qb, slot, row0, col0, s_ih, s_iq, s_ik, s_oh, s_oq, s_or, s_oc, LBLOCK, BLOCK_M, BLOCK_N,
            WHOLE,
        )  # fmt: skip
    else:
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)
    return offs_n, ok


# -- kernels ----------------------------------------------------------------------------------------------


@_jit
def _fwd_kernel(
    Q, K, V, OUT, LSE,
    s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd, s_ob, s_oh, s_os, s_od,
    H, G, Sq, Sk, DH, qk_scale, window, ramp,
    KP, stride_kp, SEG, stride_seg, SLOPES, TABLE, stride_tn, stride_th, BUCKETS, SPAN,
    LIDX, s_ih, s_iq, s_ik, LOK, s_oh_, s_oq, s_or, s_oc, NKB, NWHOLE, s_wh,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, HAS_SEG: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_SPAN: tl.constexpr,
    HAS_LAYOUT: tl.constexpr, LAYOUT_PER_HEAD: tl.constexpr, MAY_BE_EMPTY: tl.constexpr, LBLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    """One program: query block ``pid_m`` of (batch, head) ``pid_bh``; writes OUT ``[BM, Dh]``, LSE ``[BM]``."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    hk = h // G  # the kv head of this query head
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)
    Qh = Q + b64 * s_qb + h64 * s_qh
    Kh = K + b64 * s_kb + hk64 * s_kh
    Vh = V + b64 * s_vb + hk64 * s_vh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Qh, offs_m, offs_d, s_qs, s_qd, Sq, DH, UPCAST)  # [BM, BD]

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max (finite: no inf - inf)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hp, t_lo, whole_lo, whole_hi, t_hi = _key_loop(
        pid_m, h, Sq, Sk, window, ramp, SPAN, NWHOLE, s_wh, NKB,
        CAUSAL, HAS_SPAN, HAS_LAYOUT, LAYOUT_PER_HEAD, LBLOCK, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    if F32:  # no whole-tile loop: the masked loop takes every tile
        whole_hi = whole_lo
    for phase in tl.static_range(1 if F32 else 0, 2):  # the whole tiles (no positional mask), then the masked ones
        a, z = _phase(phase, t_lo, whole_lo, whole_hi, t_hi)
        for i in range(a, z):
            t = _tile(phase, i, t_lo, whole_lo, whole_hi)
            offs_n, ok = _key_tile(
                t, hp, pid_m, LIDX, LOK, s_ih, s_iq, s_ik, s_oh_, s_oq, s_or, s_oc,
                HAS_LAYOUT, phase == 0, LBLOCK, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            k = _load_rows(Kh, offs_n, offs_d, s_ks, s_kd, Sk, DH, UPCAST)  # [BN, BD]
            v = _load_rows(Vh, offs_n, offs_d, s_vs, s_vd, Sk, DH, UPCAST)  # [BN, BD]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
            s, _, _, _ = _score_tile(
                qk, offs_m, offs_n, ok, b, h, Sq, Sk, window, qk_scale, ramp,
                KP, stride_kp, SEG, stride_seg, SLOPES, TABLE, stride_tn, stride_th, BUCKETS, SPAN,
                CAUSAL, HAS_WINDOW, HAS_PAD, HAS_SEG, HAS_ALIBI, HAS_TABLE, HAS_SPAN, phase == 1,
            )  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # [BM, BN], 0 where masked
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new

    empty = l_i == 0.0  # the query saw no key
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    row_ok = (offs_m[:, None] < Sq) & (offs_d[None, :] < DH)
    if MAY_BE_EMPTY:  # AttnMask's convention: such a query attends to itself
        own = tl.load(
            Vh + (Sk - Sq + offs_m)[:, None] * s_vs + offs_d[None, :] * s_vd, mask=row_ok & empty[:, None], other=0.0
        )
        out = tl.where(empty[:, None], own.to(tl.float32), out)
    out_ptr = OUT + b64 * s_ob + h64 * s_oh + offs_m[:, None] * s_os + offs_d[None, :] * s_od
    tl.store(out_ptr, out.to(OUT.dtype.element_ty), mask=row_ok)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # log2 domain; inf: no key
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)


@_jit
def _dq_kernel(
    Q, K, V, OUT, DO, DQ, LSE, DELTA, DTABLE, DSPAN,
    s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd, s_yb, s_yh, s_ys, s_yd,
    s_db, s_dh, s_ds, s_dd,
    H, G, Sq, Sk, DH, NB, qk_scale, window, ramp,
    KP, stride_kp, SEG, stride_seg, SLOPES, TABLE, stride_tn, stride_th, BUCKETS, SPAN,
    LIDX, s_ih, s_iq, s_ik, LOK, s_oh_, s_oq, s_or, s_oc, NKB, NWHOLE, s_wh,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, HAS_SEG: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_SPAN: tl.constexpr,
    HAS_LAYOUT: tl.constexpr, LAYOUT_PER_HEAD: tl.constexpr, TABLE_GRAD: tl.constexpr, SPAN_GRAD: tl.constexpr,
    LBLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    """One program: dq of query block ``pid_m`` of (batch, head) ``pid_bh`` (the forward's key loop), plus
    the pairs' share of d table (``DTABLE [B, H, NB]``) and d span (``DSPAN [B, H]``). First it writes the
    block's ``DELTA = rowsum(dO * O)`` (fp32; O = OUT, the forward's output, strides ``s_y*``) for the dk/dv
    kernel, which runs after it (FlashAttention-2 computes it in a kernel of its own); with ``F32`` it reads it."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)
    Kh = K + b64 * s_kb + hk64 * s_kh
    Vh = V + b64 * s_vb + hk64 * s_vh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b64 * s_qb + h64 * s_qh, offs_m, offs_d, s_qs, s_qd, Sq, DH, UPCAST)  # [BM, BD]
    do = _load_rows(DO + b64 * s_db + h64 * s_dh, offs_m, offs_d, s_ds, s_dd, Sq, DH, UPCAST)  # [BM, BD]
    row = pid_bh.to(tl.int64) * Sq + offs_m
    if F32:  # given (computed in the kernel, it took fp32's FMA dq from 80 registers to 255 and spills at Dh 128)
        delta = tl.load(DELTA + row, mask=offs_m < Sq, other=0.0)  # [BM] rowsum(dO * O)
    else:
        o = _load_rows(OUT + b64 * s_yb + h64 * s_yh, offs_m, offs_d, s_ys, s_yd, Sq, DH, UPCAST)  # [BM, BD]
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # [BM] rowsum(dO * O), 0 past Sq
        tl.store(DELTA + row, delta, mask=offs_m < Sq)
    lse = tl.load(LSE + row, mask=offs_m < Sq, other=float("inf"))  # [BM]

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dspan = tl.zeros([BLOCK_M], dtype=tl.float32)  # per query row, summed at the end
    hp, t_lo, whole_lo, whole_hi, t_hi = _key_loop(
        pid_m, h, Sq, Sk, window, ramp, SPAN, NWHOLE, s_wh, NKB,
        CAUSAL, HAS_SPAN, HAS_LAYOUT, LAYOUT_PER_HEAD, LBLOCK, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    if F32:  # no whole-tile loop: the masked loop takes every tile
        whole_hi = whole_lo
    for phase in tl.static_range(1 if F32 else 0, 2):  # the whole tiles (no positional mask), then the masked ones
        a, z = _phase(phase, t_lo, whole_lo, whole_hi, t_hi)
        for i in range(a, z):
            t = _tile(phase, i, t_lo, whole_lo, whole_hi)
            offs_n, ok = _key_tile(
                t, hp, pid_m, LIDX, LOK, s_ih, s_iq, s_ik, s_oh_, s_oq, s_or, s_oc,
                HAS_LAYOUT, phase == 0, LBLOCK, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            k = _load_rows(Kh, offs_n, offs_d, s_ks, s_kd, Sk, DH, UPCAST)  # [BN, BD]
            v = _load_rows(Vh, offs_n, offs_d, s_vs, s_vd, Sk, DH, UPCAST)  # [BN, BD]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
            s, valid, bucket, span_w = _score_tile(
                qk, offs_m, offs_n, ok, b, h, Sq, Sk, window, qk_scale, ramp,
                KP, stride_kp, SEG, stride_seg, SLOPES, TABLE, stride_tn, stride_th, BUCKETS, SPAN,
                CAUSAL, HAS_WINDOW, HAS_PAD, HAS_SEG, HAS_ALIBI, HAS_TABLE, HAS_SPAN, phase == 1,
            )  # fmt: skip
            p = tl.exp2(s - lse[:, None])  # [BM, BN] probabilities, recomputed
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # [BM, BN]
            ds = p * (dp - delta[:, None])  # dL / d score (natural units)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
            if TABLE_GRAD:
                tl.atomic_add(DTABLE + pid_bh.to(tl.int64) * NB + bucket, ds, mask=valid)
            if SPAN_GRAD:
                dspan += tl.sum(ds * span_w, 1)
    dq = dq * (qk_scale * 0.6931471805599453)  # qk_scale / log2(e): the softmax scale
    row_ok = (offs_m[:, None] < Sq) & (offs_d[None, :] < DH)
    dq_ptr = DQ + b64 * s_db + h64 * s_dh + offs_m[:, None] * s_ds + offs_d[None, :] * s_dd  # DQ has DO's strides
    tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=row_ok)
    if SPAN_GRAD:
        tl.atomic_add(DSPAN + pid_bh, tl.sum(dspan, 0))


@_jit
def _dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, RSTART, RWHOLE, RFLAT, s_rh, s_fh,
    s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd, s_db, s_dh, s_ds, s_dd,
    s_gb, s_gh, s_gs, s_gd,
    H, G, Sq, Sk, DH, qk_scale, window, ramp,
    KP, stride_kp, SEG, stride_seg, SLOPES, TABLE, stride_tn, stride_th, BUCKETS, SPAN,
    LIDX, s_ih, s_iq, s_ik, LOK, s_oh_, s_oq, s_or, s_oc, NKB, NWHOLE, s_wh,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, HAS_SEG: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_SPAN: tl.constexpr,
    HAS_LAYOUT: tl.constexpr, LAYOUT_PER_HEAD: tl.constexpr, LBLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    """One program: dk, dv of key block ``pid_n`` of (batch, kv head) ``pid_bk``, summed over the G query
    heads of the kv head and every query block that sees the keys. DK, DV share strides ``s_g*``."""
    pid_n, pid_bk = tl.program_id(0), tl.program_id(1)
    Hkv = H // G
    b, hk = pid_bk // Hkv, pid_bk % Hkv
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + b64 * s_kb + hk64 * s_kh, offs_n, offs_d, s_ks, s_kd, Sk, DH, UPCAST)  # [BN, BD]
    v = _load_rows(V + b64 * s_vb + hk64 * s_vh, offs_n, offs_d, s_vs, s_vd, Sk, DH, UPCAST)  # [BN, BD]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, G):
        h = hk * G + g
        h64 = h.to(tl.int64)
        Qh = Q + b64 * s_qb + h64 * s_qh
        DOh = DO + b64 * s_db + h64 * s_dh
        if HAS_LAYOUT:  # the (query block, slot) entries listing this key block, whole ones first: a CSR row
            hp = h if LAYOUT_PER_HEAD else 0
            kb, per = pid_n * BLOCK_N // LBLOCK, LBLOCK // BLOCK_M  # per: query tiles of each entry
            t_lo = tl.load(RSTART + hp * s_rh + kb) * per
            whole_lo, whole_hi = t_lo, tl.load(RWHOLE + hp * s_rh + kb) * per
            t_hi = tl.load(RSTART + hp * s_rh + kb + 1) * per
        else:
            w = _reach(window, ramp, Sk, SPAN, h, HAS_SPAN)
            t_lo, t_hi = _query_blocks(pid_n * BLOCK_N, Sq, Sk, w, CAUSAL, BLOCK_M, BLOCK_N)
            whole_lo, whole_hi = _whole_query_blocks(pid_n * BLOCK_N, Sq, Sk, w, CAUSAL, BLOCK_M, BLOCK_N)
            whole_lo, whole_hi, t_hi = _nest(t_lo, whole_lo, whole_hi, t_hi)
        if F32:  # no whole-tile loop: the masked loop takes every tile
            whole_hi = whole_lo
        for phase in tl.static_range(1 if F32 else 0, 2):  # the whole tiles (no positional mask), then the masked ones
            a, z = _phase(phase, t_lo, whole_lo, whole_hi, t_hi)
            for i in range(a, z):
                t = _tile(phase, i, t_lo, whole_lo, whole_hi)
                if HAS_LAYOUT:
                    entry = tl.load(RFLAT + hp * s_fh + t // per)  # query block * NKB + slot
                    qb, slot = entry // NKB, entry % NKB
                    row0 = t % per * BLOCK_M
                    offs_m = qb * LBLOCK + row0 + tl.arange(0, BLOCK_M)
                    _, ok = _layout_tile(
                        LIDX, LOK, hp, qb, slot, row0, pid_n * BLOCK_N % LBLOCK, s_ih, s_iq, s_ik, s_oh_, s_oq, s_or,
                        s_oc, LBLOCK, BLOCK_M, BLOCK_N, phase == 0,
                    )  # fmt: skip
                else:
                    offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
                    ok = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)
                q = _load_rows(Qh, offs_m, offs_d, s_qs, s_qd, Sq, DH, UPCAST)  # [BM, BD]
                do = _load_rows(DOh, offs_m, offs_d, s_ds, s_dd, Sq, DH, UPCAST)  # [BM, BD]
                row = (b64 * H + h64) * Sq + offs_m
                lse = tl.load(LSE + row, mask=offs_m < Sq, other=float("inf"))
                delta = tl.load(DELTA + row, mask=offs_m < Sq, other=0.0)
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
                s, _, _, _ = _score_tile(
                    qk, offs_m, offs_n, ok, b, h, Sq, Sk, window, qk_scale, ramp,
                    KP, stride_kp, SEG, stride_seg, SLOPES, TABLE, stride_tn, stride_th, BUCKETS, SPAN,
                    CAUSAL, HAS_WINDOW, HAS_PAD, HAS_SEG, HAS_ALIBI, HAS_TABLE, HAS_SPAN, phase == 1,
                )  # fmt: skip
                p = tl.exp2(s - lse[:, None])  # [BM, BN]
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
                ds = p * (dp - delta[:, None])
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC)
    dk = dk * (qk_scale * 0.6931471805599453)
    out = b64 * s_gb + hk64 * s_gh + offs_n[:, None] * s_gs + offs_d[None, :] * s_gd
    col_ok = (offs_n[:, None] < Sk) & (offs_d[None, :] < DH)
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=col_ok)


# -- launch -----------------------------------------------------------------------------------------------


class _Tiles(NamedTuple):
    block_m: int
    block_n: int
    warps: int
    stages: int


def _tiles(kind: str, dh: int, dtype: torch.dtype, layout_block: int | None) -> _Tiles:
    """Tile sizes by kernel (``fwd``, ``dq``, ``dkdv``), padded head dim and dtype: a small fixed heuristic
    (no autotuning). ``block_m`` is the query tile, ``block_n`` the key tile; ``dkdv`` keeps its key tile
    resident and streams query tiles. An fp16/bf16 layout sets both tiles to its block, up to 64; an fp32 one
    takes the plain fp32 tiles within its block (``_run`` may split either further). The interpreter runs tiles
    one after the other, so it gets 32 x 16: few iterations, yet whole and masked tiles at test lengths.

    The GPU choices follow Triton's fused-attention tutorial (128-query forward tiles), with 8 warps for
    fp16/bf16: compiled for sm_90 (``scripts/compile_kernels.py``), 4 warps made ptxas spill registers
    once a score bias or span joins (up to 560 B per thread at Dh 128), 8 warps do not for any single
    feature. fp32 (FMA dots) takes 32-wide tiles, 8 warps, and one stage for dk/dv (two spilled 0.5-2.5 KB
    per thread; dk/dv at Dh 128 takes 16 x 32 query x key tiles, as 32 x 32 spilled 100-170 B). Untimed: no
    GPU was at hand when they were chosen (docs/kernels.md). Where a GPU has less shared memory than sm_90's
    227 KiB and the tiles need more, ``_run`` launches smaller ones."""
    size = 4 if dtype == torch.float32 else 2
    if layout_block is not None and (size == 2 or runtime.interpreting()):
        # The block, at most 64 (a larger one is split into tiles, ``_key_tile``): tiles of 128 spilled on sm_90
        # (bf16: 370-400 B per thread at Dh 32, 180-280 B at Dh 128) and asked for up to 160 KiB of shared
        # memory at Dh 128. One pipeline stage when the k and v tiles of two would not fit.
        b = min(layout_block, 64)
        stages = 2 if 2 * 2 * b * dh * size <= 96 * 1024 else 1
        return _Tiles(b, b, 4 if b * dh <= 64 * 64 else 8, stages)
    if runtime.interpreting():
        return _Tiles(32, 16, 1, 1)
    half = size == 2  # fp32 tiles take twice the registers and shared memory
    table = {  # (kind, dh bound) -> (half tiles, fp32 tiles); fp32 (FMA dots) needs more warps for its registers
        ("fwd", 64): (_Tiles(128, 64, 8, 3), _Tiles(64, 32, 8, 2)),
        ("fwd", 128): (_Tiles(128, 64, 8, 3), _Tiles(32, 32, 8, 2)),
        ("fwd", 256): (_Tiles(64, 32, 8, 2), _Tiles(32, 32, 8, 1)),
        ("dq", 64): (_Tiles(64, 64, 8, 2), _Tiles(32, 32, 8, 2)),
        ("dq", 128): (_Tiles(64, 32, 8, 2), _Tiles(32, 32, 8, 1)),
        ("dq", 256): (_Tiles(32, 32, 8, 1), _Tiles(16, 32, 8, 1)),
        ("dkdv", 64): (_Tiles(32, 64, 8, 2), _Tiles(32, 32, 8, 1)),
        ("dkdv", 128): (_Tiles(32, 64, 8, 2), _Tiles(16, 32, 8, 1)),
        ("dkdv", 256): (_Tiles(32, 32, 8, 1), _Tiles(16, 32, 8, 1)),
    }
    bound = 64 if dh <= 64 else 128 if dh <= 128 else 256
    tiles = table[kind, bound][0 if half else 1]
    if layout_block is not None:  # fp32: these tiles, within the block (whole 64-blocks spilled 1-14 KiB per thread)
        tiles = tiles._replace(block_m=min(tiles.block_m, layout_block), block_n=min(tiles.block_n, layout_block))
    return tiles


class _Extras(NamedTuple):
    """The non-differentiable inputs of one call (validated)."""

    causal: bool
    window: int | None
    key_padding: Tensor | None  # [B, Sk] bool
    segments: Tensor | None  # [B, Sk] int
    alibi_slopes: Tensor | None  # [H]
    bias_buckets: Tensor | None  # [2 Sk - 1] int
    span_ramp: float
    layout: BlockLayout | None
    block: int
    scale: float

    def may_be_empty(self, span: Tensor | None) -> bool:
        """Can a query see no key? Causality and windows always leave it its own key."""
        return any(x is not None for x in (self.key_padding, self.segments, self.layout, span))


def _feature_args(q: Tensor, k: Tensor, table: Tensor | None, span: Tensor | None, ex: _Extras) -> dict:
    """The keyword arguments every kernel takes: sizes, feature tensors with their strides, flags."""
    _, h, s_q, dh = q.shape
    s_k = k.shape[2]
    as_bytes = lambda t: None if t is None else t.view(torch.uint8)  # noqa: E731  (bool: no copy)
    lidx, lok, whole = ex.layout[:3] if ex.layout is not None else (None, None, None)
    if q.dtype == torch.float32:
        prec = "tf32" if not runtime.interpreting() and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        prec = None
    # F32 (fp32 on a GPU): one masked loop for every tile and delta = rowsum(dO * O) from torch. The whole-tile
    # loop and the in-kernel delta of the fp16/bf16 tiles took fp32's FMA tiles up to 255 registers and 170-340 B
    # of spills per thread at Dh 128 (sm_90). The interpreter takes the fp16/bf16 way for every dtype, so the
    # fp32 parity tests cover it; test_fp32_gpu_way_equals_the_reference forces this one.
    return dict(
        H=h, G=h // k.shape[1], Sq=s_q, Sk=s_k, DH=dh,
        qk_scale=ex.scale * 1.4426950408889634, window=ex.window or s_k + 1, ramp=float(ex.span_ramp),
        KP=as_bytes(ex.key_padding), stride_kp=0 if ex.key_padding is None else ex.key_padding.stride(0),
        SEG=ex.segments, stride_seg=0 if ex.segments is None else ex.segments.stride(0),
        SLOPES=ex.alibi_slopes, TABLE=table,
        stride_tn=0 if table is None else table.stride(0), stride_th=0 if table is None else table.stride(1),
        BUCKETS=ex.bias_buckets, SPAN=span,
        LIDX=lidx, s_ih=0 if lidx is None else lidx.stride(0), s_iq=0 if lidx is None else lidx.stride(1),
        s_ik=0 if lidx is None else lidx.stride(2),
        LOK=as_bytes(lok), s_oh_=0 if lok is None else lok.stride(0), s_oq=0 if lok is None else lok.stride(1),
        s_or=0 if lok is None else lok.stride(2), s_oc=0 if lok is None else lok.stride(3),
        NKB=0 if lidx is None else lidx.shape[2], NWHOLE=whole, s_wh=0 if whole is None else whole.stride(0),
        CAUSAL=ex.causal, HAS_WINDOW=ex.window is not None, HAS_PAD=ex.key_padding is not None,
        HAS_SEG=ex.segments is not None, HAS_ALIBI=ex.alibi_slopes is not None, HAS_TABLE=table is not None,
        HAS_SPAN=span is not None, HAS_LAYOUT=lidx is not None, LBLOCK=16 if lidx is None else ex.block,
        LAYOUT_PER_HEAD=lidx is not None and lidx.shape[0] > 1,
        BLOCK_D=max(16, triton.next_power_of_2(dh)),
        UPCAST=runtime.interpreting() and q.dtype == torch.bfloat16, DOT_PREC=prec,
        F32=q.dtype == torch.float32 and not runtime.interpreting(),
    )  # fmt: skip


def _smaller(t: _Tiles) -> _Tiles | None:
    """The tiles to try after ``t`` on a device without the shared memory for it, or None: a pipeline stage
    less, down to two; then half the larger tile, down to 32 (a layout's block is then split into tiles); then
    one stage. Each step cuts the K and V buffers or the score-sized scratch (the T5 gathers') by a third to a
    half."""
    if t.stages > 2:
        return t._replace(stages=t.stages - 1)
    if max(t.block_m, t.block_n) > 32:
        return t._replace(block_n=t.block_n // 2) if t.block_n >= t.block_m else t._replace(block_m=t.block_m // 2)
    if t.stages > 1:
        return t._replace(stages=1)
    return None


#: ``_fit_key`` -> the tiles that fit where the preferred ones did not (``_run``).
_FITTED: dict[tuple, _Tiles] = {}


def _fit_key(kind: str, q: Tensor, want: _Tiles, kw: dict) -> tuple:
    """What a kernel's shared memory depends on: kind, device, dtype, padded head dim, tiles and flags set."""
    return kind, q.device, q.dtype, kw["BLOCK_D"], want, *sorted(k for k, v in kw.items() if v is True)


def _run(kernel, kind: str, q: Tensor, ex: _Extras, rows: int, programs: int, *args, **kw) -> None:  # noqa: ANN001
    """Launch ``kernel`` (``kind``: fwd, dq or dkdv) over ``ceil(rows / tile) x programs`` with the tiles of
    ``_tiles``, chosen for an H100 / H200 (227 KiB of shared memory per block). A device with less (an A100:
    163 KiB; RTX 30xx / 40xx, A10, L4, L40: 99 KiB) may lack what they need (the T5 forward: up to 192 KiB;
    docs/kernels.md): Triton then raises OutOfResources before anything runs, and ``_smaller`` tiles are
    tried, each step logged once; those that fit are kept for the device and specialisation."""
    t = want = _tiles(kind, kw["BLOCK_D"], q.dtype, ex.block if ex.layout is not None else None)
    if _FITTED:  # (empty where the preferred tiles fit: no lookup)
        t = _FITTED.get(_fit_key(kind, q, want, kw), want)
    while True:
        grid = (triton.cdiv(rows, t.block_n if kind == "dkdv" else t.block_m), programs)
        try:
            kernel[grid](*args, **kw, BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages)
            return
        except triton.runtime.OutOfResources as e:
            smaller = _smaller(t)
            if smaller is None:
                raise
            _log.info("flash_attention %s: %s with %s; trying %s", kind, e, t, smaller)
            _FITTED[_fit_key(kind, q, want, kw)] = t = smaller


class BlockLayout(NamedTuple):
    """A block-sparse layout prepared for the kernels by ``prepare_layout``, for one call shape (``shape``)."""

    idx: Tensor  # [Hp, nQ, K] int: key block of each entry, each query block's whole entries first
    ok: Tensor  # [Hp, nQ, block, K*block] bool: element mask (rows: queries, columns: the entries' keys)
    n_whole: Tensor  # [Hp, nQ] int32: entries 0..n-1 of the query block are whole (every pair visible)
    k_start: Tensor  # [Hp, nK + 1] int32: the entries listing key block j are k_flat[k_start[j] : k_start[j + 1]],
    k_whole: Tensor  # [Hp, nK + 1] int32: ... the whole ones first, k_flat[k_start[j] : k_whole[j]]
    k_flat: Tensor  # [Hp, nQ * K] int32: (query block * K + slot) of each entry, by key block
    shape: tuple  # (block, Sq, Sk, causal, window) the whole entries were judged for


def prepare_layout(
    layout: tuple[Tensor, Tensor], block: int, s_q: int, s_k: int, causal: bool, window: int | None
) -> BlockLayout:
    """``(idx [Hp, nQ, K], ok [Hp, nQ, block, K*block])`` ready for the kernels: the entries whose every pair
    is visible (in bounds, causal, in the window, ``ok`` all True) go first in their query block, and skip the
    element mask and positional tests in-kernel; the transpose (for dk, dv) lists, for each key block, the
    entries that see it, whole ones first. ``flash_attention`` prepares a plain layout on each call: callers
    that repeat one (xfam's sparse engine, benchmarks) prepare it once."""
    idx, ok = layout
    hp, n_q, slots = idx.shape
    n_k = -(-s_k // block)
    dev = idx.device
    q_first = (s_k - s_q + torch.arange(n_q, device=dev) * block).view(1, n_q, 1)  # [1, nQ, 1]
    q_last = q_first + block - 1
    k_first = idx.long() * block  # [Hp, nQ, K]
    k_last = k_first + block - 1
    whole = (q_last - (s_k - s_q) < s_q) & (k_first >= 0) & (k_last < s_k)
    if causal:
        whole &= k_last <= q_first
    if window is not None:
        whole &= (q_last - k_first < window) & (k_last - q_first < window)
    cells = ok.view(hp, n_q, block, slots, block)
    whole &= cells.all(dim=4).all(dim=2)  # [Hp, nQ, K]
    order = torch.sort((~whole).to(torch.int8), dim=-1, stable=True).indices  # whole entries first
    idx = idx.gather(-1, order).contiguous()
    ok = cells.gather(3, order.view(hp, n_q, 1, slots, 1).expand_as(cells)).view(hp, n_q, block, slots * block)
    n_whole = whole.sum(-1, dtype=torch.int32)  # [Hp, nQ]
    # the transpose: entries sorted by (key block, partial), unused ones (nothing visible) last
    used = cells.any(dim=4).any(dim=2).gather(-1, order)  # [Hp, nQ, K]
    partial = torch.arange(slots, device=dev) >= n_whole[..., None]
    keyed = torch.where(used, idx.long() * 2 + partial, 2 * n_k).reshape(hp, n_q * slots)
    keyed, flat = keyed.sort(dim=-1, stable=True)
    bounds = (torch.arange(n_k + 1, device=dev) * 2).expand(hp, -1).contiguous()
    start, mid = torch.searchsorted(keyed, bounds), torch.searchsorted(keyed, bounds + 1)  # [Hp, nK + 1]
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    shape = (block, s_q, s_k, causal, window)
    return BlockLayout(idx, ok.contiguous(), n_whole, i32(start), i32(mid), i32(flat), shape)


# Custom operators (not an autograd.Function), so that torch.compile keeps a model that calls the kernels in one
# graph: dynamo records each op as it is, inductor calls it, the fakes give the outputs' shapes. An operator takes
# tensors and scalars only, so the call's ``_Extras`` travel flattened (``_flat``) and are rebuilt inside
# (``_unflat``); an absent gradient comes back as an empty tensor and is mapped to None.
def _flat(ex: _Extras) -> tuple:
    lay = ex.layout
    layout = (None,) * 6 if lay is None else (lay.idx, lay.ok, lay.n_whole, lay.k_start, lay.k_whole, lay.k_flat)
    tensors = (ex.key_padding, ex.segments, ex.alibi_slopes, ex.bias_buckets, *layout)
    return *tensors, ex.causal, ex.window, float(ex.span_ramp), ex.block, float(ex.scale)


def _unflat(q: Tensor, k: Tensor, flat: tuple) -> _Extras:
    kp, seg, slopes, buckets, *rest = flat
    layout, (causal, window, span_ramp, block, scale) = rest[:6], rest[6:]
    lay = None
    if layout[0] is not None:
        lay = BlockLayout(*layout, shape=(block, q.shape[2], k.shape[2], causal, window))  # type: ignore[misc]
    return _Extras(causal, window, kp, seg, slopes, buckets, span_ramp, lay, block, scale)


@torch.library.custom_op("xfam::flash_attention", mutates_args=())
def _forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor | None,
    span: Tensor | None,
    key_padding: Tensor | None,
    segments: Tensor | None,
    alibi_slopes: Tensor | None,
    bias_buckets: Tensor | None,
    l_idx: Tensor | None,
    l_ok: Tensor | None,
    l_n_whole: Tensor | None,
    l_k_start: Tensor | None,
    l_k_whole: Tensor | None,
    l_k_flat: Tensor | None,
    causal: bool,
    window: int | None,
    span_ramp: float,
    block: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """(out ``[B, H, Sq, Dh]``, the rows' log-sum-exp ``[B, H, Sq]`` fp32, log2 domain, inf: no key)."""
    flat = (key_padding, segments, alibi_slopes, bias_buckets, l_idx, l_ok, l_n_whole, l_k_start, l_k_whole, l_k_flat)
    ex = _unflat(q, k, (*flat, causal, window, span_ramp, block, scale))
    bsz, h, s_q, _ = q.shape
    feat = _feature_args(q, k, table, span, ex)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, H, Sq, Dh]
    lse = torch.empty(bsz, h, s_q, dtype=torch.float32, device=q.device)  # log2 domain, inf: no key
    _run(
        _fwd_kernel, "fwd", q, ex, s_q, bsz * h, q, k, v, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), **feat, MAY_BE_EMPTY=ex.may_be_empty(span),
    )  # fmt: skip
    return out, lse


@_forward_op.register_fake
def _(q, k, v, table, span, *extras):  # noqa: ANN001, ANN002, ANN202
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("xfam::flash_attention_backward", mutates_args=())
def _backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    table: Tensor | None,
    span: Tensor | None,
    table_grad: bool,
    span_grad: bool,
    key_padding: Tensor | None,
    segments: Tensor | None,
    alibi_slopes: Tensor | None,
    bias_buckets: Tensor | None,
    l_idx: Tensor | None,
    l_ok: Tensor | None,
    l_n_whole: Tensor | None,
    l_k_start: Tensor | None,
    l_k_whole: Tensor | None,
    l_k_flat: Tensor | None,
    causal: bool,
    window: int | None,
    span_ramp: float,
    block: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d table ``[NB, H]``, d span ``[H]``); the last two empty unless asked for."""
    flat = (key_padding, segments, alibi_slopes, bias_buckets, l_idx, l_ok, l_n_whole, l_k_start, l_k_whole, l_k_flat)
    ex = _unflat(q, k, (*flat, causal, window, span_ramp, block, scale))
    bsz, h, s_q, dh = q.shape
    h_kv, s_k = k.shape[1], k.shape[2]
    do = grad_out.contiguous()  # [B, H, Sq, Dh]; dq shares its strides
    feat = _feature_args(q, k, table, span, ex)
    if feat["F32"]:  # the dq kernel reads rowsum(dO * O); otherwise it writes it
        delta = (do.float() * out.float()).sum(-1)  # [B, H, Sq]
    else:
        delta = torch.empty(bsz, h, s_q, dtype=torch.float32, device=q.device)
    table_grad, span_grad = table is not None and table_grad, span is not None and span_grad
    dq = torch.empty_like(do)
    dtable = torch.zeros(bsz, h, table.shape[0], dtype=torch.float32, device=q.device) if table_grad else None
    dspan = torch.zeros(bsz * h, dtype=torch.float32, device=q.device) if span_grad else None
    _run(
        _dq_kernel, "dq", q, ex, s_q, bsz * h, q, k, v, out, do, dq, lse, delta, dtable, dspan,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *do.stride(),
        NB=0 if table is None else table.shape[0], TABLE_GRAD=table_grad, SPAN_GRAD=span_grad, **feat,
    )  # fmt: skip

    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [B, Hkv, Sk, Dh]
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    lay = ex.layout
    start, whole, flat_k = (None, None, None) if lay is None else (lay.k_start, lay.k_whole, lay.k_flat)
    _run(
        _dkdv_kernel, "dkdv", q, ex, s_k, bsz * h_kv, q, k, v, do, dk, dv, lse, delta, start, whole, flat_k,
        0 if start is None else start.stride(0), 0 if flat_k is None else flat_k.stride(0),
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), **feat,
    )  # fmt: skip
    if ex.may_be_empty(span):  # a query that saw no key copied its own value row
        alone = torch.isinf(lse)[..., None]  # [B, H, Sq, 1]
        own = (do * alone).view(bsz, h_kv, h // h_kv, s_q, dh).sum(2)  # [B, Hkv, Sq, Dh]
        dv[:, :, s_k - s_q :] += own.to(dv.dtype)
    d_table = q.new_empty(0) if dtable is None else dtable.sum(0).t().to(table.dtype)  # [NB, H]
    d_span = q.new_empty(0) if dspan is None else dspan.view(bsz, h).sum(0).to(span.dtype)  # [H]
    return dq, dk, dv, d_table, d_span


@_backward_op.register_fake
def _(q, k, v, out, lse, grad_out, table, span, table_grad, span_grad, *extras):  # noqa: ANN001, ANN002, ANN202
    d_table = table.new_empty(table.shape) if table is not None and table_grad else q.new_empty(0)
    d_span = span.new_empty(span.shape) if span is not None and span_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_table, d_span


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, table, span, *extras = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], table, span, *extras[:10])
    ctx.scalars = tuple(extras[10:])


def _backward(ctx, grad_out, _grad_lse):  # noqa: ANN001, ANN202
    q, k, v, out, lse, table, span, *tensors = ctx.saved_tensors
    wants = ctx.needs_input_grad
    table_grad, span_grad = table is not None and wants[3], span is not None and wants[4]
    dq, dk, dv, d_table, d_span = _backward_op(
        q, k, v, out, lse, grad_out, table, span, table_grad, span_grad, *tensors, *ctx.scalars
    )
    grads = (dq, dk, dv, d_table if table_grad else None, d_span if span_grad else None)
    return *grads, *(None,) * (len(ctx.needs_input_grad) - 5)


_forward_op.register_autograd(_backward, setup_context=_setup)


# -- public API -------------------------------------------------------------------------------------------


def _problems(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    window: int | None,
    key_padding: Tensor | None,
    segments: Tensor | None,
    alibi_slopes: Tensor | None,
    bias_table: Tensor | None,
    bias_buckets: Tensor | None,
    span: Tensor | None,
    span_ramp: float,
    layout: tuple[Tensor, Tensor] | BlockLayout | None,
    block: int,
) -> list[str]:
    """Every reason the inputs are not a valid call (shapes, dtypes, devices); empty when valid."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return [f"q must be [B, H, Sq, Dh] and k, v [B, Hkv, Sk, Dh]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"]  # fmt: skip
    bsz, h, s_q, dh = q.shape
    h_kv, s_k = k.shape[1], k.shape[2]
    out = []
    if k.shape[0] != bsz or k.shape[3] != dh:
        out.append(f"k, v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch or head dim")
    if h % h_kv:
        out.append(f"kv heads ({h_kv}) must divide query heads ({h})")
    if s_k < s_q:
        out.append(f"Sk ({s_k}) must be >= Sq ({s_q}): queries are the last Sq key positions")
    if not 1 <= dh <= 256:
        out.append(f"head dim {dh} is outside 1..256")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        out.append(f"q, k, v must share one of fp32, fp16, bf16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if window is not None and window < 1:
        out.append(f"window={window} must be >= 1 (a query always sees its own position)")
    for name, t in (("key_padding", key_padding), ("segments", segments)):
        if t is not None and tuple(t.shape) != (bsz, s_k):
            out.append(f"{name} must be [B, Sk] = [{bsz}, {s_k}], got {tuple(t.shape)}")
    if key_padding is not None and key_padding.dtype != torch.bool:
        out.append(f"key_padding must be bool (True = real key), got {key_padding.dtype}")
    if segments is not None and (segments.dtype.is_floating_point or segments.dtype == torch.bool):
        out.append(f"segments must hold integer document ids, got {segments.dtype}")
    for name, t in (("alibi_slopes", alibi_slopes), ("span", span)):
        if t is not None and tuple(t.shape) != (h,):
            out.append(f"{name} must be [H] = [{h}], got {tuple(t.shape)}")
    if (bias_table is None) != (bias_buckets is None):
        out.append("bias_table and bias_buckets go together (T5 bias: the table and the bucket of each distance)")
    if bias_table is not None and (bias_table.dim() != 2 or bias_table.shape[1] != h):
        out.append(f"bias_table must be [NB, H] with H = {h}, got {tuple(bias_table.shape)}")
    buckets_ok = bias_buckets is None or (
        tuple(bias_buckets.shape) == (2 * s_k - 1,) and not bias_buckets.dtype.is_floating_point
    )
    if not buckets_ok:
        out.append(f"bias_buckets must be integer [2 Sk - 1] = [{2 * s_k - 1}], got {tuple(bias_buckets.shape)}")
    if span is not None and span_ramp <= 0:
        out.append(f"span_ramp={span_ramp} must be > 0")
    if isinstance(layout, BlockLayout) and layout.shape != (block, s_q, s_k, causal, window):
        out.append(f"the layout was prepared for (block, Sq, Sk, causal, window) = {layout.shape}, not for this "
                   f"call's {(block, s_q, s_k, causal, window)}: prepare_layout it for this call")  # fmt: skip
    if layout is not None:
        idx, ok = layout[:2]
        n_q = -(-s_q // block)
        if block < 16 or block & (block - 1):
            out.append(f"block={block} must be a power of two >= 16 (the kernel's tile)")
        if idx.dim() != 3 or idx.shape[0] not in (1, h) or idx.shape[1] != n_q or idx.dtype.is_floating_point:
            out.append(f"layout block_idx must be integer [Hp, nQ, K] with Hp in (1, {h}), nQ = {n_q}, got "
                       f"{tuple(idx.shape)}")  # fmt: skip
        elif tuple(ok.shape) != (want := (idx.shape[0], n_q, block, idx.shape[2] * block)) or ok.dtype != torch.bool:
            out.append(f"layout block_ok must be bool [Hp, nQ, block, K*block] = {list(want)}, got {tuple(ok.shape)}")
    tensors = (k, v, key_padding, segments, alibi_slopes, bias_table, bias_buckets, span, *(layout or ())[:2])
    if any(t is not None and t.device != q.device for t in tensors):
        out.append(f"every tensor must be on q's device ({q.device})")
    return out


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    key_padding: Tensor | None = None,
    segments: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    bias_table: Tensor | None = None,
    bias_buckets: Tensor | None = None,
    span: Tensor | None = None,
    span_ramp: float = 32.0,
    layout: tuple[Tensor, Tensor] | BlockLayout | None = None,
    block: int = 64,
    scale: float | None = None,
) -> Tensor:
    """Fused softmax attention ``[B, H, Sq, Dh]`` in q's dtype, differentiable in q, k, v, ``bias_table``
    and ``span`` (see the module docstring; the arguments are those of ``flash_attention_reference``;
    a ``layout`` may come ``prepare_layout``d for the call, which saves preparing it on each call).

    Raises RuntimeError where the kernels cannot run (``runtime.why_not``) and ValueError listing every
    problem of the inputs, before anything is launched.
    """
    reason = runtime.why_not(q.device, _INTERPRETED)
    if reason is not None:
        raise RuntimeError(f"flash_attention: {reason}")
    problems = _problems(
        q, k, v, causal, window, key_padding, segments, alibi_slopes, bias_table, bias_buckets, span, span_ramp,
        layout, block,
    )  # fmt: skip
    if problems:
        raise ValueError("flash_attention: " + "; ".join(problems))
    if layout is not None and not isinstance(layout, BlockLayout):
        layout = prepare_layout(layout, block, q.shape[2], k.shape[2], causal, window)
    contiguous = lambda t: None if t is None else t.contiguous()  # noqa: E731  (the kernels step by 1 along Sk, H)
    ex = _Extras(
        causal=causal,
        window=window,
        key_padding=contiguous(key_padding),
        segments=contiguous(segments),
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.detach().float().contiguous(),
        bias_buckets=contiguous(bias_buckets),
        span_ramp=span_ramp,
        layout=layout,
        block=block,
        scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
    )
    return _forward_op(q, k, v, bias_table, contiguous(span), *_flat(ex))[0]


# -- reference --------------------------------------------------------------------------------------------


def layout_dense(layout: tuple[Tensor, Tensor] | BlockLayout, block: int, s_q: int, s_k: int) -> Tensor:
    """A block-sparse layout as the ``[Hp, Sq, Sk]`` bool mask of the pairs it lets a query see."""
    idx, ok = layout[:2]  # [Hp, nQ, K], [Hp, nQ, block, K*block]
    hp, n_q, slots = idx.shape
    within = torch.arange(block, device=idx.device)
    keys = (idx.long()[..., None] * block + within).reshape(hp, n_q, 1, slots * block).expand_as(ok)
    rows = (torch.arange(n_q, device=idx.device)[:, None] * block + within).view(1, n_q, block, 1).expand_as(ok)
    keep = ok & (keys >= 0) & (keys < s_k) & (rows < s_q)
    heads = torch.arange(hp, device=idx.device).view(hp, 1, 1, 1).expand_as(ok)
    dense = torch.zeros(hp, n_q * block, s_k, dtype=torch.bool, device=idx.device)
    dense[heads[keep], rows[keep], keys[keep]] = True
    return dense[:, :s_q]


def flash_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    key_padding: Tensor | None = None,
    segments: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    bias_table: Tensor | None = None,
    bias_buckets: Tensor | None = None,
    span: Tensor | None = None,
    span_ramp: float = 32.0,
    layout: tuple[Tensor, Tensor] | None = None,
    block: int = 64,
    scale: float | None = None,
) -> Tensor:
    """``softmax(q k^T * scale + bias + log m, masked) v`` with explicit ``[B, H, Sq, Sk]`` scores, in fp32.

    Shapes: q ``[B, H, Sq, Dh]``; k, v ``[B, Hkv, Sk, Dh]`` (query head h reads kv head ``h // (H / Hkv)``);
    query i sits at key index ``Sk - Sq + i``. A query sees key j when every given rule allows it: causal
    (``j <= qpos``), window (``|qpos - j| < window``), ``key_padding [B, Sk]`` (True = real), ``segments
    [B, Sk]`` (same document id, or the key's id is ``SHARED``; the queries' ids are the last Sq columns),
    the layout (``layout_dense``), and a span mask ``m > 0``. Scores get ``- alibi_slopes[h] |qpos - j|``,
    ``bias_table[bias_buckets[qpos - j + Sk - 1], h]`` and ``log m``, ``m = clamp((span_ramp + span[h] -
    |qpos - j|) / span_ramp, 0, 1)``. A query that sees no key attends to itself (``AttnMask.dense``).
    """
    bsz, h, s_q, dh = q.shape
    h_kv, s_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    kx = k.float().repeat_interleave(h // h_kv, dim=1)  # [B, H, Sk, Dh]
    vx = v.float().repeat_interleave(h // h_kv, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), kx) * scale  # [B, H, Sq, Sk]
    q_pos = torch.arange(s_q, device=q.device) + (s_k - s_q)
    dist = q_pos[:, None] - torch.arange(s_k, device=q.device)[None, :]  # [Sq, Sk] qpos - kpos
    ok = torch.ones(1, 1, s_q, s_k, dtype=torch.bool, device=q.device)
    if causal:
        ok = ok & (dist >= 0)
    if window is not None:
        ok = ok & (dist.abs() < window)
    if key_padding is not None:
        ok = ok & key_padding[:, None, None, :]  # [B, 1, Sq, Sk]
    if segments is not None:
        q_doc, k_doc = segments[:, None, s_k - s_q :, None], segments[:, None, None, :]
        ok = ok & ((q_doc == k_doc) | (k_doc == SHARED))  # [B, 1, Sq, Sk]
    if layout is not None:
        ok = ok & layout_dense(layout, block, s_q, s_k)[None]  # [B|1, Hp|1, Sq, Sk]
    if alibi_slopes is not None:
        s = s - alibi_slopes.detach().float().view(h, 1, 1) * dist.abs()
    if bias_table is not None:
        s = s + bias_table.float()[bias_buckets.long()[dist + s_k - 1]].permute(2, 0, 1)  # [H, Sq, Sk]
    if span is not None:
        m = ((span_ramp + span.float().view(h, 1, 1) - dist.abs()) / span_ramp).clamp(0, 1)  # [H, Sq, Sk]
        ok = ok & (m > 0)
        s = s + torch.where(m > 0, m, 1.0).log()  # m = 0 is masked; the where keeps its gradient finite
    alone = ~ok.any(-1, keepdim=True) & (dist == 0)  # a query that sees nothing attends to itself
    s = torch.where(ok, s, float("-inf"))
    s = torch.where(alone, 0.0, s)
    probs = torch.softmax(s, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", probs, vx).to(q.dtype)  # [B, H, Sq, Dh]
