"""The block path in chunks of query blocks, forward and backward, so that its ``[B, H, nQ, b, Kb]``
temporaries (scores, probabilities and their gradients) exist for one chunk at a time.

Why: run whole, the block path keeps every block's probabilities for the backward pass and makes scores,
probabilities and both their gradients at full size, four tensors of ``B * H * L * Kb`` floats; for a
512-window local attention at L = 8192 (one sequence, 4 heads, tile 256: Kb = 768) that is 100 MB each,
and the step's peak was ~4-6x SDPA's. Here the forward keeps only q, k and v (no copies) and the
backward recomputes each chunk's scores and probabilities (one more ``q k^T`` matmul per chunk) before
forming its gradients, so what lives at once is O(L * Dh) plus one chunk of ``CHUNK_BYTES``.

Exactness: every chunk runs the whole path's operations on the same operands, so the output is bitwise
the whole path's. The gradients are formed as autograd forms them (the same matmuls and softmax
backward) and summed into the keys and values in a fixed order that does not depend on the chunk size
(for a key, over its query blocks in ascending order), so chunked and one-chunk gradients are bitwise
equal; against autograd's whole path they differ only by that summation order (a few ulps).

Used for every call without attention dropout and without a score bias that learns (a bias with
parameters requiring grad needs its own gradient; the engine then runs the path whole).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from xfam.attention._sparse.scores import _additive, _batch_ok, _pairs
from xfam.core.bias import ScoreBias
from xfam.core.mask import AttnMask

#: Bytes of one chunk's scores ``[B, H, c, b, Kb]`` (at least one query block); its probabilities and, in the
#: backward, their gradients are as large. Measured at L = 8192 (one sequence, 4 heads, a 512 window, glibc's
#: default allocator): the step's peak RSS was 139 / 171 / 261 MB at 4 / 8 / 16 MB against SDPA's 128 MB.
CHUNK_BYTES = 8 * 2**20


class Plan(NamedTuple):
    """What every chunk of one call shares."""

    geo: Any  # engine.Geometry
    block: int
    mask: AttnMask
    bias: ScoreBias | None
    chunks: tuple[tuple[int, int], ...]  # query-block ranges [c0, c1)


def applies(bias: ScoreBias | None, dropout: float) -> bool:
    """Whether the chunked path runs: no attention dropout (its masks would not be redrawn alike in
    the backward) and no score bias that needs a gradient: one with trainable parameters, or one that is not a
    module at all (a per-call term computed from the queries, ETC's relative scores), whose gradient the chunked
    backward would not carry."""
    if dropout:
        return False
    if bias is None or not torch.is_grad_enabled():
        return True
    return isinstance(bias, nn.Module) and not any(p.requires_grad for p in bias.parameters())


def plan(q: Tensor, geo: Any, block: int, mask: AttnMask, bias: ScoreBias | None, budget: int | None = None) -> Plan:
    """Cut the ``nQ`` query blocks into chunks whose scores take at most ``budget`` bytes (at least one block)."""
    bsz, h = q.shape[:2]
    n_q, keys = geo.k_pos.shape[1], geo.k_pos.shape[-1]
    per_block = bsz * h * block * keys * q.element_size()
    c = max(1, (CHUNK_BYTES if budget is None else budget) // per_block)
    return Plan(geo, block, mask, bias, tuple((i, min(i + c, n_q)) for i in range(0, n_q, c)))


def attend(q: Tensor, k: Tensor, v: Tensor, p: Plan) -> tuple[Tensor, Tensor | None]:
    """Block attention over ``p``'s chunks: ``out [B, H, Sq, Dh]`` and, with padding or documents, the
    queries that see no key ``[B, Hp, nQ, b]`` (None otherwise: the geometry knows them)."""
    out, empty = _Attend.apply(q, k, v, p)
    return out, (empty if empty.numel() else None)


class _Attend(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, p: Plan) -> tuple[Tensor, Tensor]:
        bsz, h, s_q, d = q.shape
        n_q, b = p.geo.k_pos.shape[1], p.block
        src_k, src_v = _source(k, p), _source(v, p)
        out: Tensor | None = None
        empties = []
        for c0, c1 in p.chunks:
            probs, keep, ok = _probs(q, src_k, k, p, c0, c1)
            o = (probs if keep is None else probs * keep) @ _chunk_keys(src_v, v, p, c0, c1)  # [B, H, c, b, Dh]
            if out is None:
                out = o.new_empty(bsz, h, n_q, b, d)
            out[:, :, c0:c1] = o
            if ok is not None:
                empties.append(~ok.any(-1))  # [B, Hp, c, b]
        ctx.save_for_backward(q, k, v)
        ctx.plan, ctx.autocast = p, _autocast_state(q)
        assert out is not None  # at least one chunk
        empty = torch.cat(empties, dim=2) if empties else q.new_zeros(0, dtype=torch.bool)
        ctx.mark_non_differentiable(empty)
        return out.view(bsz, h, n_q * b, d)[:, :, :s_q], empty

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_out: Tensor, _: Any) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        p: Plan = ctx.plan
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return (*_backward(q, k, v, g_out, p), None)


def _backward(q: Tensor, k: Tensor, v: Tensor, g_out: Tensor, p: Plan) -> tuple[Tensor, Tensor, Tensor]:
    """Per chunk: recompute the probabilities, then the gradients as autograd forms them."""
    bsz, h, s_q, d = q.shape
    n_q, b = p.geo.k_pos.shape[1], p.block
    go = g_out if n_q * b == s_q else F.pad(g_out, (0, 0, 0, n_q * b - s_q))
    go = go.reshape(bsz, h, n_q, b, d)  # [B, H, nQ, b, Dh]
    gq = torch.empty(bsz, h, n_q, b, d, dtype=q.dtype, device=q.device)
    src_k, src_v = _source(k, p), _source(v, p)
    acc_k, acc_v = _Accumulator(k, p), _Accumulator(v, p)
    for c0, c1 in p.chunks:
        probs, keep, ok = _probs(q, src_k, k, p, c0, c1)
        probs_kept = probs if keep is None else probs * keep
        go_c = go[:, :, c0:c1]
        acc_v.add(probs_kept.transpose(-1, -2) @ go_c, c0, c1)  # [B, H, c, Kb, Dh]
        g_p = go_c @ _chunk_keys(src_v, v, p, c0, c1).transpose(-1, -2)  # [B, H, c, b, Kb]
        g_p = g_p if keep is None else g_p * keep
        g_s = torch._softmax_backward_data(g_p, probs, -1, probs.dtype)
        if ok is not None:
            g_s = g_s.masked_fill_(~ok, 0)
        gq[:, :, c0:c1] = g_s @ _chunk_keys(src_k, k, p, c0, c1)
        acc_k.add(g_s.transpose(-1, -2) @ _q_chunk(q, p, c0, c1), c0, c1)
    gq = gq.view(bsz, h, n_q * b, d)[:, :, :s_q].mul_(1 / math.sqrt(d))
    return gq, acc_k.result(), acc_v.result()


def _autocast_state(x: Tensor) -> tuple[str, bool, torch.dtype]:
    dev = x.device.type
    return dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


def _q_chunk(q: Tensor, p: Plan, c0: int, c1: int) -> Tensor:
    """Query blocks ``c0..c1`` scaled by ``1/sqrt(Dh)``, zero-padded past ``Sq``: ``[B, H, c, b, Dh]``
    (the whole path's ``_blocks(q * scale)``, elementwise the same)."""
    bsz, h, s_q, d = q.shape
    b = p.block
    x = q[:, :, c0 * b : min(c1 * b, s_q)] * (1 / math.sqrt(d))
    return F.pad(x, (0, 0, 0, (c1 - c0) * b - x.shape[2])).view(bsz, h, c1 - c0, b, d)


def _source(x: Tensor, p: Plan) -> Tensor:
    """The keys (values) prepared once per call: zero-padded for the band's windows, or as one row
    of ``b * Dh`` per key block for gathering (``engine._keys``)."""
    geo, b = p.geo, p.block
    bsz, h, s, d = x.shape
    if geo.band is not None:
        return x  # each chunk pads its own windows (``_chunk_keys``): no copy of the whole
    n_k = -(-s // b)
    return F.pad(x, (0, 0, 0, n_k * b - s)).reshape(bsz * h * n_k, b * d)


def _band_pads(geo: Any, b: int, s: int) -> tuple[int, int]:
    n_q, kb = geo.idx.shape[1], geo.idx.shape[2] * b
    first = geo.band[0] * b
    return max(0, -first), max(0, first + (n_q - 1) * b + kb - s)


def _chunk_keys(src: Tensor, x: Tensor, p: Plan, c0: int, c1: int) -> Tensor:
    """The keys query blocks ``c0..c1`` visit, block keys then global keys: ``[B, H, c, Kb + G, Dh]``
    (``engine._keys`` restricted to the chunk)."""
    geo, b = p.geo, p.block
    bsz, h, s, d = x.shape
    kb, c = geo.idx.shape[2] * b, c1 - c0
    if geo.band is not None:
        lo = (geo.band[0] + c0) * b
        hi = lo + (c - 1) * b + kb
        seg = src[:, :, max(lo, 0) : min(hi, s)]
        if lo < 0 or hi > s:
            seg = F.pad(seg, (0, 0, max(0, -lo), max(0, hi - s)))
        out = seg.unfold(2, kb, b).transpose(-1, -2)  # [B, H, c, Kb, Dh]
    else:
        n_k = -(-s // b)
        rows = geo.idx[:, c0:c1] + torch.arange(bsz * h, device=x.device).view(bsz, h, 1, 1) * n_k  # [B, H, c, K]
        out = F.embedding(rows, src).view(bsz, h, c, kb, d)
    if not len(geo.g_pos):
        return out.contiguous()
    glob = x[:, :, geo.g_pos, None].transpose(2, 3).expand(bsz, h, c, -1, d)  # [B, H, c, G, Dh]
    return torch.cat((out, glob), dim=-2)


class _Accumulator:
    """Sums the chunks' key (value) gradients ``[B, H, c, Kb + G, Dh]`` into ``[B, H, Sk, Dh]``: the adjoint
    of ``_chunk_keys``, in an order that does not depend on the chunking (see the module docstring)."""

    def __init__(self, x: Tensor, p: Plan):
        self.p, self.shape = p, x.shape
        bsz, h, s, d = x.shape
        geo, b = p.geo, p.block
        if geo.band is not None:
            front, back = _band_pads(geo, b, s)
            self.buf = x.new_zeros(bsz, h, front + s + back, d)
        else:
            self.buf = x.new_zeros(bsz * h * -(-s // b), b * d)
        g = len(geo.g_pos)
        self.glob = x.new_zeros(bsz, h, geo.k_pos.shape[1], g, d) if g else None  # per query block, summed last

    def add(self, g: Tensor, c0: int, c1: int) -> None:
        geo, b = self.p.geo, self.p.block
        bsz, h, s, d = self.shape
        n_blk, kb = geo.idx.shape[2], geo.idx.shape[2] * b
        if self.glob is not None:
            self.glob[:, :, c0:c1] = g[..., kb:, :]
        if geo.band is not None:
            start = geo.band[0] * b + _band_pads(geo, b, s)[0]
            for j in reversed(range(n_blk)):  # for every key: its query blocks in ascending order
                lo = start + (c0 + j) * b
                self.buf[:, :, lo : lo + (c1 - c0) * b].unflatten(2, (c1 - c0, b)).add_(g[:, :, :, j * b : (j + 1) * b])
        else:
            n_k = -(-s // b)
            rows = geo.idx[:, c0:c1] + torch.arange(bsz * h, device=g.device).view(bsz, h, 1, 1) * n_k  # [B, H, c, K]
            blocks = g[..., :kb, :].reshape(bsz, h, c1 - c0, n_blk, b * d)
            self.buf.index_add_(0, rows.reshape(-1), blocks.reshape(-1, b * d).to(self.buf.dtype))

    def result(self) -> Tensor:
        geo, b = self.p.geo, self.p.block
        bsz, h, s, d = self.shape
        if geo.band is not None:
            front = _band_pads(geo, b, s)[0]
            out = self.buf[:, :, front : front + s]
        else:
            out = self.buf.view(bsz, h, -1, d)[:, :, :s]
        if self.glob is not None:
            out = out.index_add(2, geo.g_pos, self.glob.sum(2).to(out.dtype))
        return out


def _probs(
    q: Tensor, src_k: Tensor, k: Tensor, p: Plan, c0: int, c1: int
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Chunk ``c0..c1``'s softmax output ``[B, H, c, b, Kb]``, the factor applied after it (rows that see no
    key: zero), and its allowed pairs where padding or documents take part: the whole path's operations."""
    geo, mask = p.geo, p.mask
    scores = _q_chunk(q, p, c0, c1) @ _chunk_keys(src_k, k, p, c0, c1).transpose(-1, -2)  # [B, H, c, b, Kb]
    if p.bias is not None:
        q_pos, k_pos = geo.q_pos[c0:c1].clamp(max=mask.k_len - 1), geo.k_pos[:, c0:c1].clamp(0, mask.k_len - 1)
        scores = scores + _pairs(p.bias, q_pos[None, :, :, None], k_pos[:, :, None, :]).to(scores.dtype)
    extra = _batch_ok(mask, geo.k_pos[:, c0:c1], geo.q_pos[c0:c1])
    if extra is None:
        probs = torch.softmax(scores.add_(_additive(geo, scores.dtype)[:, c0:c1]), dim=-1)
        keep = None if geo.rows_ok else geo.ok[:, c0:c1].any(-1)[None, ..., None]  # [1, Hp, c, b, 1]
        return probs, keep, None
    ok = geo.ok[None, :, c0:c1] & extra  # [B, Hp, c, b, Kb]
    probs = torch.softmax(scores.masked_fill(~ok, torch.finfo(scores.dtype).min), dim=-1)
    return probs, ok.any(dim=-1, keepdim=True), ok
