"""Chunked causal linear attention with per-position decays, forward and backward (Triton).

One file over 400 lines: the three kernels, their launch code (tiles, the custom operators torch.compile sees)
and the reference are read and changed together, and the compile report names the kernels by this module.

Causal kernelised attention (Katharopoulos et al., 2020, "Transformers are RNNs", arXiv:2006.16236) is
the recurrence S_t = a_t S_{t-1} + w_t k_t v_t^T, out_t = q_t S_t over feature maps q, k ``[T, m]``;
with A_t = sum_{u <= t} log a_u and lw_t = log w_t:

    out_t = sum_{j <= t} exp(A_t - A_j + lw_j) (q_t . k_j) v_j  +  exp(A_t) q_t S_0
    S_T   = sum_j exp(A_T - A_j + lw_j) k_j v_j^T  +  exp(A_T) S_0

The decay covers ALiBi on kernelised attention (log a_t = -slope_h), RFA's learned gates (log g_t),
xfam's stabiliser (``xfam.attention._linear.causal_sums``) and document starts (log a_t = -inf: a reset).
It is computed in the chunkwise form (Hua et al., 2022, "Transformer Quality in Linear Time",
arXiv:2202.10447; the gated form of GLA, Yang et al., 2023, arXiv:2312.06635): per chunk of C positions,
the intra-chunk part as masked C x C products and the inter-chunk part through the running state.

Fused, per (batch x head, block of value columns), in one pass over the chunks:
* forward: q k^T, the decay/key-scale/causal weights built in registers from chunk-local cumulative
  log-decays, (q k^T * W) v + qa * (q S), the state update, and a store of each chunk's start state
  (``[B*H, T/C + 1, m, Dv]`` fp32, kept for the backward; the last one is S_T);
* backward: the reverse scan of the state gradient with dq, dk, dv of each chunk; a second small kernel
  sums dq, dk over the value-column blocks and derives d log w_j = k_j . dk_j and the chunk-local
  d log a_u = sum_{i >= u in chunk} (q_i . dq_i - k_i . dk_i) + <S_{c+1}, dS_{c+1}>.
Resets never form -inf - -inf: the cumulative log-decay skips -inf entries and a reset counter masks
every pair with a reset in between, so weights across a reset are exact zeros (gradients at -inf entries
are 0). Everything accumulates in fp32: loads are upcast, dots take fp32 operands on tensor cores, as 3xTF32
(about fp32 accuracy) for fp32 inputs and plain TF32 for fp16/bf16 ones (their own precision, without fp16's
range limit on the running state; IEEE fp32 dots made ptxas take minutes on 64-wide tiles). fp32 inputs take
plain TF32 too where ``torch.backends.cuda.matmul.allow_tf32`` is set (``torch.set_float32_matmul_precision``
"high" or "medium"), as PyTorch's matmuls and the flash kernel do: 3xTF32 keeps three copies of each operand,
and at m = 256 ptxas spilled 2-2.8 KiB per thread for them (TF32: 0-64 B). ``out`` has v's
dtype; S_T is fp32. ``causal_linear_attention_reference``, the plain recurrence in PyTorch, is the ground truth.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xfam.kernels import runtime

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # the reference stays importable; ``runtime.why_not`` explains the kernel's absence
    triton = tl = None

    def _jit(fn):  # noqa: ANN001, ANN202
        return fn


_DECORATED_INTERPRETED = runtime.interpreting()  # the kernels below run in the interpreter iff this is True
# A log-decay below this is a reset: exp(-104) underflows fp32 (denormals included), so every weight across it
# is 0 in fp32 anyway, and skipping it keeps the chunk's cumulative log-decay small (no precision lost after it).
RESET = -104.0


@_jit
def _chunk_weights(
    LD, LW, base, t, t_ok, C: tl.constexpr, HAS_LD: tl.constexpr, HAS_LW: tl.constexpr, RESET: tl.constexpr
):
    """Weights of one chunk (positions ``t [C]``): W ``[C, C]`` (query i, key j), qa, wk ``[C]``, carry."""
    rc = tl.arange(0, C)
    if HAS_LD:
        ld = tl.load(LD + base + t, mask=t_ok, other=0.0).to(tl.float32)  # [C]
        cut = ld < RESET  # a reset: -inf, or so small that every weight across it is 0 in fp32 anyway
        a = tl.cumsum(tl.where(cut, 0.0, ld), 0)  # log-decay since the chunk start, resets skipped: |a| < C * 104
        r = tl.cumsum(cut.to(tl.int32), 0)  # resets since the chunk start: pairs with r_i != r_j weigh 0
    else:
        a = tl.zeros([C], dtype=tl.float32)
        r = tl.zeros([C], dtype=tl.int32)
    if HAS_LW:
        lw = tl.load(LW + base + t, mask=t_ok, other=float("-inf")).to(tl.float32)
    else:
        lw = tl.where(t_ok, 0.0, float("-inf"))  # positions past T are keys of weight 0
    a_last = tl.sum(tl.where(rc == C - 1, a, 0.0), 0)
    r_last = tl.max(r, 0)
    ok = (rc[:, None] >= rc[None, :]) & (r[:, None] == r[None, :])
    w = tl.exp(tl.where(ok, a[:, None] - a[None, :] + lw[None, :], float("-inf")))  # [C, C]
    qa = tl.where(r == 0, tl.exp(a), 0.0)  # decay of the chunk's start state for query i
    wk = tl.where(r == r_last, tl.exp(tl.where(r == r_last, a_last - a + lw, float("-inf"))), 0.0)
    carry = tl.where(r_last == 0, tl.exp(a_last), 0.0)  # decay across the whole chunk
    return w, qa, wk, carry


@_jit
def _fwd_kernel(
    Q, K, V, LD, LW, S0, OUT, STATES,  # q, k [BH, T, M]; v, out [BH, T, DV]; ld, lw [BH, T]; S0 [BH, M, DV]
    T, M, DV, N, NS,  # STATES [BH, NS + 1, M, DV] fp32: the state before chunks 0, E, 2E, ..., then S_T
    C: tl.constexpr, BM: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr, EVERY: tl.constexpr,
    HAS_LD: tl.constexpr, HAS_LW: tl.constexpr, HAS_S0: tl.constexpr, RESET: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    rc, rm = tl.arange(0, C), tl.arange(0, BM)
    rv = tl.program_id(1) * BDV + tl.arange(0, BDV)  # this program's value columns
    s_off = rm[:, None] * DV + rv[None, :]  # [BM, BDV]
    s_ok = (rm[:, None] < M) & (rv[None, :] < DV)
    if HAS_S0:
        s = tl.load(S0 + bh * M * DV + s_off, mask=s_ok, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BM, BDV], dtype=tl.float32)
    for c in range(0, N):
        if c % EVERY == 0:  # a checkpoint: the backward recomputes the states in between
            tl.store(STATES + (bh * (NS + 1) + c // EVERY) * M * DV + s_off, s, mask=s_ok)
        t = c * C + rc
        t_ok = t < T
        qk_ok = t_ok[:, None] & (rm[None, :] < M)
        v_ok = t_ok[:, None] & (rv[None, :] < DV)
        q = tl.load(Q + bh * T * M + t[:, None] * M + rm[None, :], mask=qk_ok, other=0.0).to(tl.float32)
        k = tl.load(K + bh * T * M + t[:, None] * M + rm[None, :], mask=qk_ok, other=0.0).to(tl.float32)
        v = tl.load(V + bh * T * DV + t[:, None] * DV + rv[None, :], mask=v_ok, other=0.0).to(tl.float32)
        w, qa, wk, carry = _chunk_weights(LD, LW, bh * T, t, t_ok, C, HAS_LD, HAS_LW, RESET)
        p = tl.dot(q, tl.trans(k), input_precision=PREC) * w  # [C, C]
        o = tl.dot(p, v, input_precision=PREC) + qa[:, None] * tl.dot(q, s, input_precision=PREC)  # [C, BDV]
        tl.store(OUT + bh * T * DV + t[:, None] * DV + rv[None, :], o.to(OUT.dtype.element_ty), mask=v_ok)
        s = carry * s + tl.dot(tl.trans(k), wk[:, None] * v, input_precision=PREC)  # [BM, BDV]
    tl.store(STATES + (bh * (NS + 1) + NS) * M * DV + s_off, s, mask=s_ok)


@_jit
def _bwd_kernel(
    Q, K, V, LD, LW, STATES, DO, DST,  # as forward; do [BH, T, DV]; dS_T [BH, M, DV]
    DQP, DKP, DVALS, SGP, DS0,  # dq, dk partials [NDV, BH, T, M] fp32; dv [BH, T, DV]; <S, dS> [NDV, BH, N]
    T, M, DV, N, NS, BH,
    C: tl.constexpr, BM: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr, EVERY: tl.constexpr,
    HAS_LD: tl.constexpr, HAS_LW: tl.constexpr, HAS_DST: tl.constexpr, RESET: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(1)
    rc, rm = tl.arange(0, C), tl.arange(0, BM)
    rv = pv * BDV + tl.arange(0, BDV)
    s_off = rm[:, None] * DV + rv[None, :]
    s_ok = (rm[:, None] < M) & (rv[None, :] < DV)
    part = pv * BH + bh  # this program's slot in the partial buffers
    if HAS_DST:  # g: the gradient of the state after the current chunk
        g = tl.load(DST + bh * M * DV + s_off, mask=s_ok, other=0.0).to(tl.float32)
    else:
        g = tl.zeros([BM, BDV], dtype=tl.float32)
    s = tl.load(STATES + (bh * (NS + 1) + NS) * M * DV + s_off, mask=s_ok, other=0.0)  # S_T
    sg = tl.sum(tl.sum(s * g, 1), 0)  # <S_{c+1}, dS_{c+1}> over our columns, for the chunk c below
    for cc in range(0, N):
        c = N - 1 - cc
        tl.store(SGP + part * N + c, sg)
        t = c * C + rc
        t_ok = t < T
        qk_ok = t_ok[:, None] & (rm[None, :] < M)
        v_ok = t_ok[:, None] & (rv[None, :] < DV)
        # S_c: its checkpoint, then the forward's updates of the chunks in between (before this chunk's loads)
        s = tl.load(STATES + (bh * (NS + 1) + c // EVERY) * M * DV + s_off, mask=s_ok, other=0.0)
        for u in range(c - c % EVERY, c):
            tu = u * C + rc
            tu_ok = tu < T
            ku = tl.load(K + bh * T * M + tu[:, None] * M + rm[None, :], mask=tu_ok[:, None] & (rm[None, :] < M),
                         other=0.0).to(tl.float32)  # fmt: skip
            vu = tl.load(V + bh * T * DV + tu[:, None] * DV + rv[None, :], mask=tu_ok[:, None] & (rv[None, :] < DV),
                         other=0.0).to(tl.float32)  # fmt: skip
            _, _, wku, carryu = _chunk_weights(LD, LW, bh * T, tu, tu_ok, C, HAS_LD, HAS_LW, RESET)
            s = carryu * s + tl.dot(tl.trans(ku), wku[:, None] * vu, input_precision=PREC)  # S_c
        q = tl.load(Q + bh * T * M + t[:, None] * M + rm[None, :], mask=qk_ok, other=0.0).to(tl.float32)
        k = tl.load(K + bh * T * M + t[:, None] * M + rm[None, :], mask=qk_ok, other=0.0).to(tl.float32)
        v = tl.load(V + bh * T * DV + t[:, None] * DV + rv[None, :], mask=v_ok, other=0.0).to(tl.float32)
        do = tl.load(DO + bh * T * DV + t[:, None] * DV + rv[None, :], mask=v_ok, other=0.0).to(tl.float32)
        w, qa, wk, carry = _chunk_weights(LD, LW, bh * T, t, t_ok, C, HAS_LD, HAS_LW, RESET)
        pw = tl.dot(q, tl.trans(k), input_precision=PREC) * w  # [C, C]
        dpw = tl.dot(do, tl.trans(v), input_precision=PREC) * w  # [C, C]
        dv = tl.dot(tl.trans(pw), do, input_precision=PREC) + wk[:, None] * tl.dot(k, g, input_precision=PREC)
        dq = tl.dot(dpw, k, input_precision=PREC) + qa[:, None] * tl.dot(do, tl.trans(s), input_precision=PREC)
        dk = tl.dot(tl.trans(dpw), q, input_precision=PREC) + wk[:, None] * tl.dot(v, tl.trans(g), input_precision=PREC)
        tl.store(DVALS + bh * T * DV + t[:, None] * DV + rv[None, :], dv.to(DVALS.dtype.element_ty), mask=v_ok)
        tl.store(DQP + part * T * M + t[:, None] * M + rm[None, :], dq, mask=qk_ok)
        tl.store(DKP + part * T * M + t[:, None] * M + rm[None, :], dk, mask=qk_ok)
        g = carry * g + tl.dot(tl.trans(q), qa[:, None] * do, input_precision=PREC)  # dS_c
        sg = tl.sum(tl.sum(s * g, 1), 0)
    tl.store(DS0 + bh * M * DV + s_off, g, mask=s_ok)


@_jit
def _bwd_finish_kernel(
    Q, K, LD, LW, DQP, DKP, SGP, DQ, DK, DLD, DLW,  # DLD, DLW [BH, T]
    T, M, N, BH, NDV,
    C: tl.constexpr, BM: tl.constexpr, HAS_LD: tl.constexpr, HAS_LW: tl.constexpr, RESET: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    rm = tl.arange(0, BM)
    t = c * C + tl.arange(0, C)
    t_ok = t < T
    ok = t_ok[:, None] & (rm[None, :] < M)
    off = t[:, None] * M + rm[None, :]
    dq = tl.zeros([C, BM], dtype=tl.float32)
    dk = tl.zeros([C, BM], dtype=tl.float32)
    for p in range(0, NDV):  # a fixed order: deterministic
        dq += tl.load(DQP + (p * BH + bh) * T * M + off, mask=ok, other=0.0)
        dk += tl.load(DKP + (p * BH + bh) * T * M + off, mask=ok, other=0.0)
    tl.store(DQ + bh * T * M + off, dq.to(DQ.dtype.element_ty), mask=ok)
    tl.store(DK + bh * T * M + off, dk.to(DK.dtype.element_ty), mask=ok)
    k = tl.load(K + bh * T * M + off, mask=ok, other=0.0).to(tl.float32)
    kdk = tl.sum(k * dk, 1)  # [C]: d lw_j (key j enters only as exp(lw_j) k_j)
    if HAS_LW:
        tl.store(DLW + bh * T + t, kdk.to(DLW.dtype.element_ty), mask=t_ok)
    if HAS_LD:
        q = tl.load(Q + bh * T * M + off, mask=ok, other=0.0).to(tl.float32)
        sg = tl.load(SGP + bh * N + c)
        for p in range(1, NDV):
            sg += tl.load(SGP + (p * BH + bh) * N + c)
        dld = tl.cumsum(tl.sum(q * dq, 1) - kdk, 0, reverse=True) + sg
        ld = tl.load(LD + bh * T + t, mask=t_ok, other=0.0)
        dld = tl.where(ld < RESET, 0.0, dld)
        tl.store(DLD + bh * T + t, dld.to(DLD.dtype.element_ty), mask=t_ok)


def _tiles(t: int, m: int, dv: int, chunk: int) -> tuple[int, int, int, int, int]:
    """(chunk C, padded features BM, value columns per program BDV, warps, pipeline stages). The forward keeps
    the state of every ``_every(C)``-th chunk start; the backward recomputes the ones in between.

    Compiled (GPU): C <= 2048 / BM and BM x BDV <= 1024 fp32 state entries per program, 8 warps, one stage.
    Compiled for sm_90 (``scripts/compile_kernels.py``), the earlier C = 64, BDV = 4096 / BM with Triton's
    default 3 stages asked for up to 390 KiB of shared memory at m = 256 (an H100 or H200 has 227: the launch
    would fail) and spilled 1-6 KiB of registers per thread; these tiles take at most 48 KiB, spill nothing
    for m <= 128 in fp16/bf16, at most 112 B at m = 256 (fp32 with 3xTF32 dots spills at any tile: 2-2.8 KiB
    at m = 256; with TF32 at most 64 B). Untimed: no GPU was at hand (docs/kernels.md). Interpreter: chunks up
    to ``chunk``, up to 128 value columns (fewer, larger steps run faster there)."""
    bm = max(16, triton.next_power_of_2(m))
    c = min(chunk, max(16, triton.next_power_of_2(t)))  # a chunk longer than T: one chunk
    if runtime.interpreting():
        return c, bm, max(16, min(triton.next_power_of_2(dv), 128)), 4, 1
    return max(16, min(c, 2048 // bm)), bm, max(16, min(triton.next_power_of_2(dv), 1024 // bm)), 8, 1


def _every(c: int) -> int:
    """Chunks per kept state: one state per 64 positions whatever the chunk, T / 64 x m x Dv fp32 per (batch,
    head), about q and k together in bf16 at Dv = 65 (every chunk's state at C = 16 was four times that). The
    backward recomputes a state between checkpoints from the one before: (E - 1) / 2 extra state updates per
    chunk on average."""
    return max(1, 64 // c)


# Custom operators (not an autograd.Function), so that torch.compile keeps a model that calls the kernels in one
# graph: dynamo records each op as it is, inductor calls it, the fakes give the outputs' shapes. An absent
# optional gradient comes back as an empty tensor (an operator returns tensors only) and is mapped to None.
def _states_len(t: int, m: int, dv: int, chunk: int) -> int:
    """Chunk-start states the forward keeps, S_T included (``ns + 1``)."""
    c = _tiles(t, m, dv, chunk)[0]
    return triton.cdiv(triton.cdiv(t, c), _every(c)) + 1


@torch.library.custom_op("xfam::causal_linear_attention", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, ld: Tensor | None, lw: Tensor | None, s0: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(out ``[B, H, T, Dv]``, S_T ``[B, H, m, Dv]`` fp32, the kept states ``[B*H, ns + 1, m, Dv]`` fp32)."""
    b, h, t, m = q.shape
    dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ld, lw, s0 = (None if x is None else x.contiguous() for x in (ld, lw, s0))
    c, bm, bdv, warps, stages = _tiles(t, m, dv, chunk)
    n, every = triton.cdiv(t, c), _every(c)
    ns = triton.cdiv(n, every)  # kept states, besides S_T
    out = torch.empty_like(v)  # [B, H, T, Dv]
    states = torch.empty(b * h, ns + 1, m, dv, device=v.device, dtype=torch.float32)
    _fwd_kernel[(b * h, triton.cdiv(dv, bdv))](
        q, k, v, q if ld is None else ld, q if lw is None else lw, q if s0 is None else s0, out, states,
        t, m, dv, n, ns, C=c, BM=bm, BDV=bdv, PREC=_precision(q, k, v), EVERY=every,
        HAS_LD=ld is not None, HAS_LW=lw is not None, HAS_S0=s0 is not None, RESET=RESET,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, states[:, ns].reshape(b, h, m, dv).clone(), states


@_forward_op.register_fake
def _(q, k, v, ld, lw, s0, chunk):  # noqa: ANN001, ANN202
    b, h, t, m = q.shape
    dv = v.shape[-1]
    kept = _states_len(t, m, dv, chunk) if isinstance(t, int) else torch.library.get_ctx().new_dynamic_size()
    f32 = {"dtype": torch.float32}
    return v.new_empty(v.shape), v.new_empty((b, h, m, dv), **f32), v.new_empty((b * h, kept, m, dv), **f32)


def _precision(q: Tensor, k: Tensor, v: Tensor) -> str:
    fp32 = torch.float32 in (q.dtype, k.dtype, v.dtype)
    return "tf32x3" if fp32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"


@torch.library.custom_op("xfam::causal_linear_attention_backward", mutates_args=())
def _backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ld: Tensor | None,
    lw: Tensor | None,
    s0: Tensor | None,
    states: Tensor,
    d_out: Tensor,
    d_last: Tensor | None,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d log_decay, d key_logscale, d state); the last three empty where that input is None."""
    b, h, t, m = q.shape
    dv, bh = v.shape[-1], b * h
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ld, lw, s0 = (None if x is None else x.contiguous() for x in (ld, lw, s0))
    c, bm, bdv, warps, stages = _tiles(t, m, dv, chunk)
    n, every = triton.cdiv(t, c), _every(c)
    ns = triton.cdiv(n, every)
    ndv = triton.cdiv(dv, bdv)
    d_out = d_out.contiguous()
    f32 = {"device": q.device, "dtype": torch.float32}
    dq_part, dk_part = torch.empty(ndv, bh, t, m, **f32), torch.empty(ndv, bh, t, m, **f32)
    sg_part, d_s0 = torch.empty(ndv, bh, n, **f32), torch.empty(b, h, m, dv, **f32)
    d_v = torch.empty_like(v)
    _bwd_kernel[(bh, ndv)](
        q, k, v, q if ld is None else ld, q if lw is None else lw, states, d_out,
        q if d_last is None else d_last.contiguous(), dq_part, dk_part, d_v, sg_part, d_s0,
        t, m, dv, n, ns, bh, C=c, BM=bm, BDV=bdv, PREC=_precision(q, k, v), EVERY=every,
        HAS_LD=ld is not None, HAS_LW=lw is not None, HAS_DST=d_last is not None, RESET=RESET,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    d_q, d_k = torch.empty_like(q), torch.empty_like(k)
    d_ld = q.new_empty(0) if ld is None else torch.empty_like(ld)
    d_lw = q.new_empty(0) if lw is None else torch.empty_like(lw)
    d_s0 = q.new_empty(0) if s0 is None else d_s0.to(s0.dtype)
    if n > 0:  # (T = 0: nothing to finish)
        _bwd_finish_kernel[(bh, n)](
            q, k, q if ld is None else ld, q if lw is None else lw, dq_part, dk_part, sg_part,
            d_q, d_k, q if ld is None else d_ld, q if lw is None else d_lw,
            t, m, n, bh, ndv, C=c, BM=bm, HAS_LD=ld is not None, HAS_LW=lw is not None, RESET=RESET,
        )  # fmt: skip
    return d_q, d_k, d_v, d_ld, d_lw, d_s0


@_backward_op.register_fake
def _(q, k, v, ld, lw, s0, states, d_out, d_last, chunk):  # noqa: ANN001, ANN202
    def like(x: Tensor | None, dtype: torch.dtype | None = None) -> Tensor:
        return q.new_empty(0) if x is None else x.new_empty(x.shape, dtype=dtype or x.dtype)

    return like(q), like(k), like(v), like(ld), like(lw), like(s0)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, ld, lw, s0, chunk = inputs
    ctx.save_for_backward(q, k, v, ld, lw, s0, output[2])
    ctx.chunk, ctx.has = chunk, (ld is not None, lw is not None, s0 is not None)


def _backward(ctx, d_out, d_last, _d_states):  # noqa: ANN001, ANN202
    q, k, v, ld, lw, s0, states = ctx.saved_tensors
    d_out = torch.zeros_like(v) if d_out is None else d_out
    d_q, d_k, d_v, d_ld, d_lw, d_s0 = _backward_op(q, k, v, ld, lw, s0, states, d_out, d_last, ctx.chunk)
    d_ld, d_lw, d_s0 = (g if has else None for g, has in zip((d_ld, d_lw, d_s0), ctx.has, strict=True))
    return d_q, d_k, d_v, d_ld, d_lw, d_s0, None


_forward_op.register_autograd(_backward, setup_context=_setup)


def _check(q: Tensor, k: Tensor, v: Tensor, ld: Tensor | None, lw: Tensor | None, s0: Tensor | None, chunk: int):
    b, h, t, m = q.shape if q.dim() == 4 else (None,) * 4
    problems = []
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        problems.append(f"q, k [B, H, T, m] and v [B, H, T, Dv]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                        f"{tuple(v.shape)}")  # fmt: skip
    for name, x in (("log_decay", ld), ("key_logscale", lw)):
        if x is not None and (x.dim() != 3 or any(n not in (1, w) for n, w in zip(x.shape, (b, h, t)))):
            problems.append(f"{name} must broadcast to [B, H, T] = {(b, h, t)}; got {tuple(x.shape)}")
    if s0 is not None and s0.shape != (b, h, m, v.shape[-1]):
        problems.append(f"state must be [B, H, m, Dv] = {(b, h, m, v.shape[-1])}; got {tuple(s0.shape)}")
    if chunk < 16 or chunk & (chunk - 1):
        problems.append(f"chunk must be a power of two >= 16 (Triton's tl.dot tiles); got {chunk}")
    tensors = [x for x in (q, k, v, ld, lw, s0) if x is not None]
    if any(not x.is_floating_point() for x in tensors) or len({x.device for x in tensors}) > 1:
        problems.append("all tensors must be floating point and on one device")
    if problems:
        raise ValueError("causal_linear_attention: " + "; ".join(problems))


def causal_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    key_logscale: Tensor | None = None,
    state: Tensor | None = None,
    chunk: int = 64,
) -> tuple[Tensor, Tensor]:
    """Causal decayed linear attention: ``out [B, H, T, Dv]`` (v's dtype) and the final state ``[B, H, m, Dv]``
    (fp32), differentiable in every tensor argument.

    q, k ``[B, H, T, m]`` feature maps (query t sees keys <= t), v ``[B, H, T, Dv]`` (append a ones column to
    get the denominators); ``log_decay`` (broadcastable to ``[B, H, T]``) log a_t <= 0 applied when moving to
    position t (-inf, or anything below ``RESET`` = -104: a reset, e.g. a document start); ``key_logscale``
    (same) log w_t <= 0, -inf for a padded key; ``state`` S_0 ``[B, H, m, Dv]``; ``chunk`` a power of two
    >= 16 (a speed parameter only).
    """
    if (reason := runtime.why_not(q.device, _DECORATED_INTERPRETED)) is not None:
        raise RuntimeError(f"the causal linear-attention kernel cannot run here: {reason}")
    _check(q, k, v, log_decay, key_logscale, state, chunk)
    b, h, t, _ = q.shape
    ld = None if log_decay is None else log_decay.broadcast_to(b, h, t)  # autograd sums the broadcast back
    lw = None if key_logscale is None else key_logscale.broadcast_to(b, h, t)
    out, last, _ = _forward_op(q, k, v, ld, lw, state, chunk)
    return out, last


def causal_linear_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    key_logscale: Tensor | None = None,
    state: Tensor | None = None,
    chunk: int = 64,
) -> tuple[Tensor, Tensor]:
    """The same in PyTorch, as the plain recurrence in fp32 (``chunk`` unused): S_t = a_t S_{t-1} + w_t k_t v_t^T,
    out_t = q_t S_t. O(T) small steps: the parity ground truth, not a fast path. Returns out in v's dtype and
    the final state in fp32."""
    b, h, t, m = q.shape
    qf, kf, vf = q.float(), k.float(), v.float()
    a = None if log_decay is None else torch.exp(log_decay.float()).broadcast_to(b, h, t)  # exp(-inf) = 0
    w = None if key_logscale is None else torch.exp(key_logscale.float()).broadcast_to(b, h, t)
    s = qf.new_zeros(b, h, m, v.shape[-1]) if state is None else state.float()  # [B, H, m, Dv]
    outs = []
    for i in range(t):
        kv = kf[:, :, i, :, None] * vf[:, :, i, None, :]  # [B, H, m, Dv]
        s = (s if a is None else a[:, :, i, None, None] * s) + (kv if w is None else w[:, :, i, None, None] * kv)
        outs.append((qf[:, :, i, None, :] @ s)[:, :, 0])  # [B, H, Dv]
    out = torch.stack(outs, 2) if outs else vf.new_zeros(b, h, 0, v.shape[-1])
    return out.to(v.dtype), s
