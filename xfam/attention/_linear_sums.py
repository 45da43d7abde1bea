"""The numerical engine of kernelised (linear) attention: the chunked causal and the bidirectional running
sums, their hand-written backward (``ChunkedPrefix``), the stabiliser, the Triton hand-off and the quadratic
reference path. The math, and the mechanism that calls these (``KernelAttention``), are in
``xfam.attention._linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.bias import ScoreBias
from xfam.core.mask import AttnMask
from xfam.core.state import DecodeState


def doc_index(mask: AttnMask, device: torch.device) -> Tensor | None:
    """``[B, Sk]`` running document number (a new document wherever the segment id changes), or None.

    Packed rows hold contiguous documents (``xfam.data``), so "same id" = "no boundary in between".
    """
    if mask.segments is None:
        return None
    seg = mask.segments.to(device)
    doc = torch.zeros_like(seg, dtype=torch.long)
    doc[:, 1:] = (seg[:, 1:] != seg[:, :-1]).long().cumsum(1)
    return doc


def gaussian_matrix(rows: int, dim: int, orthogonal: bool, gen: torch.Generator, draws: int | None = None) -> Tensor:
    """``[rows, dim]`` (``[draws, rows, dim]`` for independent draws) with N(0, I) rows. ``orthogonal``: blocks
    of ``dim`` exactly orthogonal rows (Haar), each rescaled by an independent chi(dim) length so every
    row stays N(0, I) marginally (Choromanski et al., 2021, sec. 2.4; the authors'
    ``gaussian_orthogonal_random_matrix``)."""
    n = 1 if draws is None else draws
    if not orthogonal:
        out = torch.randn(n, rows, dim, generator=gen)
    else:
        blocks = -(-rows // dim)
        q, r = torch.linalg.qr(torch.randn(n, blocks, dim, dim, generator=gen))
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]  # sign fix: exactly Haar
        lengths = torch.randn(n, rows, dim, generator=gen).norm(dim=-1, keepdim=True)
        out = q.transpose(-1, -2).reshape(n, blocks * dim, dim)[:, :rows] * lengths
    return out[0] if draws is None else out


def finish(num: Tensor, den: Tensor, v_self: Tensor) -> Tensor:
    """``num / den``; a query that sees no key at all (den exactly 0: a left pad under a causal mask)
    attends to itself instead, the rule of ``AttnMask.dense``, so every path agrees and nothing is NaN."""
    empty = (den == 0)[..., None]
    return torch.where(empty, v_self, num / den.masked_fill(den == 0, 1.0)[..., None])


def _b3(x: Tensor) -> Tensor:
    """``[..., R, C]`` -> ``[N, R, C]`` (a view when possible) for ``bmm``."""
    return x.reshape(-1, *x.shape[-2:])


_GRAIN = 32768  # PyTorch's parallel grain: an elementwise op on fewer elements runs on the calling thread


def decayed_scan(x: Tensor, c: Tensor, init: Tensor | None, reverse: bool = False) -> tuple[Tensor, Tensor]:
    """Exclusive decayed prefix sums of ``x [N, n, F]`` with carries ``c [N, n]``:

        y_j = sum_{i<j} (prod_{i<l<j} c_l) x_i + (prod_{l<j} c_l) init,   returns y ``[N, n, F]`` and y_n ``[N, F]``

    i.e. the recurrence y_{j+1} = c_j y_j + x_j, y_0 = init (``reverse``: the same from the end), by in-place
    ``addcmul`` on contiguous slices, n = L / C steps: no graph, no copies. A small step (a few rows) is cut
    into pieces under the parallel grain: n short ops would each wait on a thread barrier otherwise,
    which costs more than the arithmetic on a busy machine.
    """
    big_n, n, f = x.shape
    cols = -(-f // (_GRAIN - 1))
    width = -(-f // cols)
    cut = [(i, slice(a, a + width)) for i in range(big_n) for a in range(0, f, width)] if big_n * cols <= 8 else None
    y = torch.empty_like(x)
    y[:, n - 1 if reverse else 0] = 0.0 if init is None else init
    for j in range(n - 1, 0, -1) if reverse else range(n - 1):
        k = j - 1 if reverse else j + 1
        if cut is None:
            torch.addcmul(x[:, j], y[:, j], c[:, j, None], out=y[:, k])
        for i, cs in cut or ():
            torch.addcmul(x[i, j, cs], y[i, j, cs], c[i, j], out=y[i, k, cs])
    j = 0 if reverse else n - 1
    return y, torch.addcmul(x[:, j], y[:, j], c[:, j, None])


class ChunkedPrefix(torch.autograd.Function):
    """The chunked causal core with a hand-written backward (saves inputs, weights and chunk states only).

    Per (batch, head) and chunk j of C positions, with q ``[n, C, m]``, k ``[n, C, m]``, v ``[n, C, D]``:

        out_j = ((q_j k_j^T) * W_j) v_j + qa_j * (q_j S_j),    S_{j+1} = carry_j S_j + k_j^T (wk_j * v_j)

    W ``[n, C, C]`` the intra-chunk weights (decays, key scales, masks), wk ``[n, C]`` a key's weight at
    its chunk's end, carry ``[n]`` the decay across a chunk, qa ``[n, C]`` the decay from the chunk
    start, s0 ``[m, D]`` the state before the first chunk. Returns out ``[n, C, D]`` and S_n. The states
    S_0..S_{n-1} ``[n, m, D]`` (L / C of them, linear in L) are built in place by a short loop and kept
    for the backward, which runs the reverse recurrence G_j = dS_j + carry_j G_{j+1} the same way.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, wk, carry, qa, s0):  # noqa: ANN001, ANN205
        n = q.shape[-3]
        qk = q @ k.transpose(-1, -2)  # [B, H, n, C, C]
        out = (qk * w) @ v  # inside each chunk: [B, H, n, C, D]
        kv = k.transpose(-1, -2) @ (v * wk[..., None])  # each chunk's sums at its end: [B, H, n, m, D]
        b, h, _, m, dim = kv.shape
        init = None if s0 is None else s0.reshape(b * h, m * dim)
        sb, last = decayed_scan(kv.view(b * h, n, m * dim), carry.reshape(b * h, n), init)
        sb, last = sb.view(kv.shape), last.view(b, h, m, dim)  # S_j the sums before chunk j, S_n after all
        del kv
        out.addcmul_(q @ sb, qa[..., None])  # across chunks, through the sums
        ctx.save_for_backward(q, k, v, w, wk, carry, qa, qk, sb)
        ctx.has_s0 = s0 is not None
        return out, last

    @staticmethod
    def backward(ctx, d_out, d_last):  # noqa: ANN001, ANN205
        q, k, v, w, wk, carry, qa, qk, sb = ctx.saved_tensors
        need = ctx.needs_input_grad
        n, m, dim = q.shape[-3], q.shape[-1], v.shape[-1]
        if d_out is None:
            d_out = v.new_zeros(*q.shape[:-1], dim)
        d_out = d_out.contiguous()
        # inside the chunks
        d_a = d_out @ v.transpose(-1, -2)  # d(qk * w): [B, H, n, C, C]
        d_v = (qk * w).transpose(-1, -2) @ d_out
        d_w = d_a * qk if need[3] else None
        d_qk = d_a.mul_(w)
        d_q, d_k = d_qk @ k, d_qk.transpose(-1, -2) @ q  # [B, H, n, C, m]
        # across chunks: out += qa * (q S_j)
        d_oq = d_out * qa[..., None]
        _b3(d_q).baddbmm_(_b3(d_oq), _b3(sb).transpose(1, 2))
        d_qa = (d_out * (q @ sb)).sum(-1) if need[6] else None
        d_sb = q.transpose(-1, -2) @ d_oq  # [B, H, n, m, D]
        # reverse recurrence: d_kv[j] = G_{j+1}, G_j = dS_j + carry_j G_{j+1}, G_n = d_last (a reverse scan)
        b, h = q.shape[:2]
        init = None if d_last is None else d_last.reshape(b * h, m * dim)
        d_s0: Tensor | None
        d_kv, d_s0 = decayed_scan(d_sb.view(b * h, n, m * dim), carry.reshape(b * h, n), init, reverse=True)
        del d_sb
        d_kv, d_s0 = d_kv.view(sb.shape), d_s0.view(b, h, m, dim) if ctx.has_s0 and need[7] else None
        d_carry = (d_kv * sb).sum((-1, -2)) if need[5] else None
        # kv_j = k_j^T (wk_j * v_j)
        _b3(d_k).baddbmm_(_b3(v * wk[..., None]), _b3(d_kv).transpose(1, 2))
        k_dkv = k @ d_kv  # [B, H, n, C, D]
        d_wk = (k_dkv * v).sum(-1) if need[4] else None
        d_v.addcmul_(k_dkv, wk[..., None])
        return d_q, d_k, d_v, d_w, d_wk, d_carry, d_qa, d_s0


def causal_sums(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    ls: Tensor,
    ld: Tensor | None = None,
    keep: Tensor | None = None,
    doc: Tensor | None = None,
    doc0: Tensor | None = None,
    state: DecodeState | None = None,
    chunk: int = 64,
    stabilise: bool = True,
    kernel: bool = False,
) -> tuple[Tensor, Tensor, DecodeState]:
    """Chunked causal numerators ``[B, H, Sq, Dh]`` and denominators ``[B, H, Sq]``, and the new state.

    fq ``[B, H, Sq, m]`` are the queries of the last Sq of the T keys ``fk [B, H, T, m]``, ``v [B, H, T, Dh]``;
    ``ls [B, H, T]`` key log-scales; ``ld [B|1, H|1, T]`` log-decays (<= 0) applied when moving to position t;
    ``keep [B, T]`` False for padded keys; ``doc [B, T]`` document numbers, ``doc0 [B]`` the document of the
    state's last key; ``state`` the running sums of earlier keys. The key scales exp(ls_t - M_t) never touch
    the ``[T, m]`` features: they ride on the small weights (W, wk) of ``ChunkedPrefix``. ``kernel``: the
    fused Triton kernel instead (``kernels/linear_attention.py``: the same recurrence, a document start as a
    reset of the decay).
    """
    b, h, t, m = fk.shape
    sq, dv, c = fq.shape[2], v.shape[-1], min(chunk, t)  # a chunk longer than T is one chunk
    if stabilise:  # (padded keys count in neither the stabiliser nor the sums: lk below)
        big, la, m_last = _stabiliser(ls.detach(), keep, doc, doc0, state["m"] if state is not None else None)
    else:
        big, la, m_last = torch.zeros_like(ls), torch.zeros_like(ls), None
    if ld is not None:
        la = la + ld
    lk = ls - big  # [B, H, T]: log of key t's scale relative to the running max, <= 0
    if keep is not None:
        lk = lk.masked_fill(~keep[:, None], float("-inf"))  # a padded key weighs 0
    v1 = torch.cat((v, v.new_ones(*v.shape[:-1], 1)), -1)  # [B, H, T, Dh + 1]: the last column gives z
    if kernel:
        return _kernel_sums(fq, fk, v1, la, lk, doc, doc0, state, chunk, m_last)
    n = -(-t // c)
    pad = n * c - t
    qf = F.pad(fq, (0, 0, t - sq, pad)) if pad or t != sq else fq  # queries aligned with their keys
    if pad:
        fk, v1, la = F.pad(fk, (0, 0, 0, pad)), F.pad(v1, (0, 0, 0, pad)), F.pad(la, (0, pad))
        lk = F.pad(lk, (0, pad), value=float("-inf"))
    qc, kc, vc = qf.view(b, h, n, c, m), fk.reshape(b, h, n, c, m), v1.view(b, h, n, c, dv + 1)
    a = la.view(*la.shape[:2], n, c).cumsum(-1)  # log-decay since the chunk start, [B, H, n, C]
    lk = lk.view(b, h, n, c)
    ok = torch.ones(c, c, dtype=torch.bool, device=fk.device).tril()
    wk, carry, qa = torch.exp(a[..., -1:] - a + lk), torch.exp(a[..., -1]), torch.exp(a)
    if doc is not None:
        dp = torch.cat((doc, doc[:, -1:].expand(b, pad)), 1).view(b, 1, n, c)
        last = dp[..., -1]  # [B, 1, n]
        before = torch.cat(((doc0 if doc0 is not None else doc[:, 0]).view(b, 1, 1), last[..., :-1]), -1)
        ok = ok & (dp[..., :, None] == dp[..., None, :])  # [B, 1, n, C, C]
        wk, carry = wk * (dp == last[..., None]), carry * (last == before)
        qa = qa * (dp == before[..., None])
    e = (a[..., :, None] - a[..., None, :] + lk[..., None, :]).masked_fill(~ok, float("-inf"))
    s0 = None if state is None else torch.cat((state["s"], state["z"][..., None]), -1)
    out, s = ChunkedPrefix.apply(qc, kc, vc, torch.exp(e), wk, carry.expand(b, h, n), qa.expand(b, h, n, c), s0)
    out = out.view(b, h, n * c, dv + 1)[:, :, t - sq : t]
    return out[..., :dv], out[..., dv], {"s": s[..., :dv], "z": s[..., dv], "m": m_last}


def _stabiliser(
    lsd: Tensor, keep: Tensor | None, doc: Tensor | None, doc0: Tensor | None, prev: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The running max M_t of the real keys' log-scales ``lsd [B, H, T]`` within each document (continuing the
    state's ``prev [B, H]`` where its document ``doc0`` goes on), as ``big [B, H, T]``; the log-decays
    ``la = M_{t-1} - M_t <= 0`` that rescale the running sums; and M after the last key (-inf: no real key
    yet), the state's next ``prev``. Restarting per document keeps a packed document's keys from underflowing
    under an earlier document's larger scale (fp32: exp below -104 is 0); padded keys never count. Where a
    document has no real key yet, M is the smallest real scale at hand (a key that follows only shrinks the
    sums), and a document start's la is clamped to 0 (the masks drop what crosses it)."""
    run = lsd if keep is None else lsd.masked_fill(~keep[:, None], float("-inf"))
    if prev is not None:  # the state: one key in front, in the document of its last key
        run = torch.cat((prev[..., None], run), -1)
        if doc is not None:
            doc = torch.cat(((doc0 if doc0 is not None else doc[:, 0])[:, None], doc), -1)
    raw = _doc_cummax(run, doc)  # [B, H, (1 +) T]
    floor = run.masked_fill(~run.isfinite(), float("inf")).amin(-1, keepdim=True)
    filled = torch.where(raw.isfinite(), raw, torch.where(floor.isfinite(), floor, 0.0))
    big = filled[..., -lsd.shape[-1] :]
    first = filled[..., :1]  # the state's M, or the first key's own
    la = (torch.cat((first, big[..., :-1]), -1) - big).clamp_max(0.0)  # [B, H, T]
    return big, la, raw[..., -1]


def _doc_cummax(x: Tensor, doc: Tensor | None) -> Tensor:
    """Running max of ``x [B, H, T]`` along T, restarting where ``doc [B, T]`` changes (documents are
    contiguous runs): log2(T) rounds of max with the entry 2^r before, where both share a document."""
    if doc is None:
        return torch.cummax(x, -1).values
    step, t = 1, x.shape[-1]
    while step < t:
        same = (doc[:, step:] == doc[:, :-step])[:, None]  # [B, 1, T - step]
        later = x[..., step:]
        x = torch.cat((x[..., :step], torch.where(same, torch.maximum(later, x[..., :-step]), later)), -1)
        step *= 2
    return x


def _kernel_sums(
    fq: Tensor,
    fk: Tensor,
    v1: Tensor,
    la: Tensor,
    lk: Tensor,
    doc: Tensor | None,
    doc0: Tensor | None,
    state: DecodeState | None,
    chunk: int,
    m_last: Tensor | None,
) -> tuple[Tensor, Tensor, DecodeState]:
    """``causal_sums`` through the Triton kernel: documents become resets of the decay (log a = -inf at a
    document's first key), the queries are aligned with their keys."""
    from xfam.kernels.linear_attention import causal_linear_attention  # imported on first use

    b, t = fk.shape[0], fk.shape[2]
    sq, dv = fq.shape[2], v1.shape[-1] - 1
    if doc is not None:
        before = torch.cat(((doc0 if doc0 is not None else doc[:, 0]).view(b, 1), doc[:, :-1]), dim=1)  # [B, T]
        la = la.masked_fill((doc != before)[:, None], float("-inf"))
    qf = F.pad(fq, (0, 0, t - sq, 0)) if t != sq else fq  # [B, H, T, m]
    s0 = None if state is None else torch.cat((state["s"], state["z"][..., None]), -1).float()
    out, s = causal_linear_attention(qf, fk, v1, la, lk, s0, chunk=chunk)
    out = out[:, :, t - sq :]  # [B, H, Sq, Dh + 1]
    s = s.to(v1.dtype)
    return out[..., :dv], out[..., dv], {"s": s[..., :dv], "z": s[..., dv], "m": m_last}


def bidirectional_sums(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    ls: Tensor,
    keep: Tensor | None,
    doc: Tensor | None,
    chunk: int,
    ld: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Every query sees every (unpadded) key of its document: global sums, or per document when packed.

    The key scales exp(ls - max ls) (one constant per (B, H)) multiply the values ``[T, Dh + 1]``, not the
    features: sums ``[B, H, m, Dh + 1]`` = fk^T (e * [v, 1]). ``ld [1, H, 1]`` a per-head log-rate: key j
    weighs lambda_h^|i - j| for query i (symmetric ALiBi), by a forward and a backward decayed scan.
    """
    if keep is not None:  # padding never raises the stabiliser (and never overflows)
        ls = torch.where(keep[:, None], ls, ls.detach().amin(-1, keepdim=True))
    ls = ls - _doc_max(ls.detach(), doc)  # [B, H, T], <= 0
    e = torch.exp(ls) if keep is None else torch.exp(ls) * keep[:, None]
    if doc is None and ld is None:
        v1 = torch.cat((v, v.new_ones(*v.shape[:-1], 1)), -1) * e[..., None]  # [B, H, T, Dh + 1]
        out = fq @ (fk.transpose(-1, -2) @ v1)  # [B, H, Sq, Dh + 1]
        return out[..., :-1], out[..., -1]
    # An inclusive causal pass plus an inclusive anti-causal pass (per document), minus the self term
    # (weight lambda^0 = 1, counted by both). A constant rate per head reads the same in either direction.
    off = fk.shape[2] - fq.shape[2]
    qf = F.pad(fq, (0, 0, off, 0))
    fwd = causal_sums(qf, fk, v, ls, ld, keep=keep, doc=doc, chunk=chunk, stabilise=False)
    bk, bd = (None if t is None else t.flip(1) for t in (keep, doc))
    bwd = causal_sums(qf.flip(2), fk.flip(2), v.flip(2), ls.flip(2), ld, keep=bk, doc=bd, chunk=chunk, stabilise=False)
    self_w = (qf * fk).sum(-1) * e  # [B, H, T]
    num = fwd[0] + bwd[0].flip(2) - self_w[..., None] * v
    den = fwd[1] + bwd[1].flip(2) - self_w
    return num[:, :, off:], den[:, :, off:]


def _doc_max(x: Tensor, doc: Tensor | None) -> Tensor:
    """The max of ``x [B, H, T]`` over each key's document (``doc [B, T]``, ``doc_index``'s numbers 0, 1, ...;
    None: the row), ``[B, H, T | 1]``: one document's large scales never underflow another's keys."""
    if doc is None:
        return x.amax(-1, keepdim=True)
    idx = doc[:, None].expand_as(x)  # [B, H, T]
    top = x.new_full(x.shape, float("-inf")).scatter_reduce(-1, idx, x, "amax")  # [B, H, T]: per document number
    return top.gather(-1, idx)


def quadratic(
    fq: Tensor | None,
    fk: Tensor | None,
    v: Tensor,
    ls: Tensor | None,
    ld: Tensor | None,
    mask: AttnMask,
    bias: ScoreBias | None,
    logits: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference path: the ``[B, H, Sq, Sk]`` weights written out, with ``mask.dense`` and ``bias.dense``.

    ``w_ij = phi(q_i) . fk_j * exp(ls_j + sum_{j < t <= i} ld_t + b_ij)``; with ``fq = None`` the kernel is
    ``exp(logits)`` instead (the exact softmax kernel, the limit of infinitely many features).
    """
    lg = logits if logits is not None else v.new_zeros(1, 1, 1, 1)
    if ls is not None:
        lg = lg + ls[..., None, :]
    if ld is not None:
        cum = ld.cumsum(-1)  # [B|1, H, Sk]
        lg = lg + (cum[..., mask.offset :, None] - cum[..., None, :])
    if bias is not None:
        lg = lg + bias.dense(mask, v.dtype).to(v.device)
    allowed = mask.dense(v.device)  # [B|1, 1, Sq, Sk] or None
    if allowed is not None:
        lg = lg.masked_fill(~allowed, float("-inf"))
    w = torch.exp(lg - lg.amax(-1, keepdim=True).detach())
    if fq is not None:
        assert fk is not None  # (features of both or neither)
        w = w * (fq @ fk.transpose(-1, -2))
    return w @ v, w.sum(-1)
