"""The factorised path of ``strided`` and ``fixed`` (``xfam.attention._factorized``, whose docstring describes
it): each subset of keys computed in the layout where it is dense, one softmax across the layouts, and the
hand-written backward (``_Attend``) that keeps only the probabilities.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.bias import ScoreBias
from xfam.core.mask import AttnMask, same_document
from xfam.core.state import expand_kv

#: Under a causal mask the query rows are cut into this many chunks, each visiting only the keys
#: before its end (A(2) of later rows is in the future): the A(2) work falls to (1 + 1/C) / 2.
CAUSAL_CHUNKS = 4


class Factor(Protocol):
    """One subset's visited keys for a chunk of ``m`` queries, in the factor's own score layout
    ``[B, H, *rows, K]`` (its ``rows`` dims hold the chunk's queries, maybe permuted). ``q_pos`` and
    ``k_pos`` are the positions of the visited pairs; they broadcast to ``[*rows, K]``."""

    q_pos: Tensor
    k_pos: Tensor

    def prepare(self, x: Tensor) -> Tensor:
        """Keys or values ``[B, H, N, Dh]`` in the layout ``scores`` and ``apply`` read."""

    def scores(self, q: Tensor, kf: Tensor) -> Tensor:
        """``q [B, H, m, Dh]`` against the prepared keys: ``[B, H, *rows, K]``."""

    def apply(self, p: Tensor, vf: Tensor) -> Tensor:
        """Weights ``[B, H, *rows, K]`` on the prepared values: ``[B, H, m, Dh]``."""

    def scatter(self, a: Tensor, x: Tensor, out: Tensor) -> None:
        """``out[key] += sum_i a[i, key] x[i]`` (``a [B, H, *rows, K]``, ``x [B, H, m, Dh]``,
        ``out [B, H, N, Dh]``): the gradient of ``scores`` and ``apply`` for the keys and values."""

    def rows(self, x: Tensor) -> Tensor:
        """Per-query values ``[*, m]`` onto the score layout: ``[*, *rows, 1]``."""

    def to_query(self, y: Tensor) -> Tensor:
        """Per-row values ``[*, *rows]`` back in query order: ``[*, m]``."""


class FactorizedPattern(Protocol):
    """What the path runs on (``xfam.attention._factorized.FactorizedPattern``): query blocks of ``stride``
    rows, and for a chunk of them the ``(factor, rule)`` of each subset of keys it visits."""

    stride: int

    def factors(self, q0: int, q1: int, n: int, causal: bool, device: torch.device) -> list[tuple[Any, Any]]: ...


class Chunk(NamedTuple):
    """Position-only tensors of the queries at grid positions ``q0 .. q1 - 1`` (whole rows)."""

    q0: int
    q1: int
    factors: list  # Factor
    oks: list  # per factor [*rows, K] bool: pattern & causal/window & key in range
    empty: Tensor | None  # [m] queries that may see no key (None: every query sees one)
    additive: dict  # dtype -> per factor ``ok`` as 0 / dtype-min


class Geometry(NamedTuple):
    n: int  # grid length: Sk rounded up to whole rows of l
    base: int  # grid position of the first row holding a query
    chunks: list[Chunk]


def geometry(pattern: FactorizedPattern, mask: AttnMask, device: torch.device) -> Geometry:
    """Cached on the pattern (position-only, shared by every layer and step with this mask shape)."""
    cache = pattern.__dict__.setdefault("_factor_cache", {})
    key = (mask.q_len, mask.k_len, mask.causal, mask.window, str(device))
    if key not in cache:
        if len(cache) >= 8:
            cache.pop(next(iter(cache)))
        cache[key] = _geometry(pattern, mask, device)
    return cache[key]


def _geometry(pattern: FactorizedPattern, mask: AttnMask, device: torch.device) -> Geometry:
    stride = pattern.stride
    rows, first = -(-mask.k_len // stride), mask.offset // stride
    n_chunks = min(CAUSAL_CHUNKS if mask.causal else 1, rows - first)
    bounds = [first + round(j * (rows - first) / n_chunks) for j in range(n_chunks + 1)]
    chunks = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        factors, oks, seen = [], [], None
        for f, rule in pattern.factors(a * stride, b * stride, rows * stride, mask.causal, device):
            qp, kp = f.q_pos, f.k_pos
            ok = rule(qp, kp) & mask.visible(qp - mask.offset, kp) & (kp >= 0) & (kp < mask.k_len)
            ok = ok.expand(torch.broadcast_shapes(qp.shape, kp.shape)).contiguous()  # [*rows, K]
            factors.append(f)
            oks.append(ok)
            seen = f.to_query(ok.any(-1)) if seen is None else seen | f.to_query(ok.any(-1))
        assert seen is not None  # (a pattern has at least one factor)
        empty = ~seen  # [m]
        chunks.append(Chunk(a * stride, b * stride, factors, oks, empty if empty.any() else None, {}))
    return Geometry(rows * stride, first * stride, chunks)


def _pairs(f: Factor, fn: Any) -> Tensor:
    """``fn(q_pos, k_pos)`` with leading dims ``*L`` expanded to the factor's ``[*L, *rows, K]``."""
    x = fn(f.q_pos, f.k_pos)
    shape = torch.broadcast_shapes(f.q_pos.shape, f.k_pos.shape)
    return x.expand(*x.shape[: x.dim() - len(shape)], *shape)


def _batch_ok(mask: AttnMask, ch: Chunk, n: int) -> list[Tensor]:
    """Per factor, padding and document constraints on the visited pairs ``[B, 1, *rows, K]``."""
    out = []
    pad = None if mask.key_padding is None else F.pad(mask.key_padding, (0, n - mask.k_len), value=False)
    seg = None if mask.segments is None else F.pad(mask.segments, (0, n - mask.k_len), value=-1)  # [B, N]
    for f, ok in zip(ch.factors, ch.oks):
        if pad is not None:
            ok = ok & _pairs(f, lambda q, k: pad[:, k.clamp(0, n - 1)])
        if seg is not None:
            ok = ok & _pairs(f, lambda q, k: same_document(seg[:, q.clamp(0, n - 1)], seg[:, k.clamp(0, n - 1)]))
        out.append(ok[:, None])
    return out


def _additive(ch: Chunk, dtype: torch.dtype) -> list[Tensor]:
    """The chunk's position-only masks as 0 / dtype-min (cached per dtype)."""
    if dtype not in ch.additive:
        ch.additive[dtype] = [
            torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, torch.finfo(dtype).min)
            for ok in ch.oks
        ]
    return ch.additive[dtype]


def factorized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: FactorizedPattern,
    mask: AttnMask,
    bias: ScoreBias | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """Attention restricted to ``pattern`` through its factors: ``[B, H, Sq, Dh]`` (module docstring)."""
    bsz, h, s_q, d = q.shape
    k, v = expand_kv(k, h), expand_kv(v, h)  # [B, H, Sk, Dh]
    geo = geometry(pattern, mask, q.device)
    off, n, base, tail = mask.offset, geo.n, geo.base, geo.n - mask.k_len
    qg = q * (1 / math.sqrt(d))
    if off > base or tail:  # queries on the rows of the key grid they occupy: [B, H, N - base, Dh]
        qg = F.pad(qg, (0, 0, off - base, tail))
    kg, vg = (F.pad(k, (0, 0, 0, tail)), F.pad(v, (0, 0, 0, tail))) if tail else (k, v)  # [B, H, N, Dh]
    plans, biases, empty, last = [], [], None, mask.k_len - 1
    for ch in geo.chunks:
        if mask.key_padding is None and mask.segments is None:
            masks, rows = _additive(ch, q.dtype), ch.empty  # [m] or None
        else:
            masks = _batch_ok(mask, ch, n)
            seen = [f.to_query(m.any(-1)) for f, m in zip(ch.factors, masks)]
            rows = ~torch.stack(seen).any(0)  # [B, 1, m]
            rows = rows if rows.any() else None
        if rows is not None:
            empty = torch.zeros(bsz, 1, n - base, dtype=torch.bool, device=q.device) if empty is None else empty
            empty[..., ch.q0 - base : ch.q1 - base] |= rows
        plans.append((masks, None if rows is None else ~rows))  # [m] or [B, 1, m]
        for f in ch.factors:  # the bias on the visited pairs; positions outside the sequence are masked
            pairs = None if bias is None else _pairs(f, lambda i, j: bias.pairs(i.clamp(0, last), j.clamp(0, last)))
            biases.append(None if pairs is None else pairs.to(q.dtype))  # [H, *rows, K]
    out = _Attend.apply(qg, kg, vg, geo, plans, dropout, *biases)  # [B, H, N - base, Dh]
    if empty is not None:  # the AttnMask convention: a query that may see nothing attends to itself
        out = torch.where(empty[..., None], vg[:, :, base:], out)
    return out[:, :, off - base : off - base + s_q]


class _Attend(torch.autograd.Function):
    """One softmax over the factors of every chunk, each in its own layout (no concatenated copy),
    with a hand-written backward that keeps only the probabilities and accumulates the key and value
    gradients in place (autograd would allocate a full-length gradient for every chunk's slice)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, geo: Geometry, plans: list, r: float, *biases: Any):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # [B, H, N - base, Dh]
        saved, at = [], 0
        for ch, (masks, rows_ok) in zip(geo.chunks, plans):
            qs = q[:, :, ch.q0 - geo.base : ch.q1 - geo.base]  # [B, H, m, Dh]
            kfs, vfs = [f.prepare(k) for f in ch.factors], [f.prepare(v) for f in ch.factors]
            ss = [f.scores(qs, kf) for f, kf in zip(ch.factors, kfs)]  # [B, H, *rows, K] each
            for s, m, b in zip(ss, masks, biases[at : at + len(ss)]):
                if b is not None:
                    s += b
                s.masked_fill_(~m, torch.finfo(s.dtype).min) if m.dtype == torch.bool else s.add_(m)
            at += len(ss)
            top = torch.stack([f.to_query(s.amax(-1)) for f, s in zip(ch.factors, ss)]).amax(0)  # [B, H, m]
            for f, s in zip(ch.factors, ss):
                s.sub_(f.rows(top)).exp_()
            inv = 1 / sum(f.to_query(s.sum(-1)) for f, s in zip(ch.factors, ss))  # [B, H, m]
            inv = inv if rows_ok is None else inv * rows_ok  # rows that see nothing: zeros
            ps = [s.mul_(f.rows(inv)) for f, s in zip(ch.factors, ss)]  # the probabilities
            keeps = [torch.rand_like(p) >= r for p in ps] if r else [None] * len(ps)
            pds = [p if m is None else p * m / (1 - r) for p, m in zip(ps, keeps)]
            out[:, :, ch.q0 - geo.base : ch.q1 - geo.base] = sum(
                f.apply(p, vf) for f, p, vf in zip(ch.factors, pds, vfs)
            )
            saved.append((ps, keeps, kfs, vfs))
        ctx.save_for_backward(q, k, v)
        ctx.geo, ctx.saved, ctx.r = geo, saved, r
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor):
        q, k, v = ctx.saved_tensors
        geo, r = ctx.geo, ctx.r
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dbias, need = [], iter(ctx.needs_input_grad[6:])
        for ch, (ps, keeps, kfs, vfs) in zip(geo.chunks, ctx.saved):
            rows = slice(ch.q0 - geo.base, ch.q1 - geo.base)
            qs, do = q[:, :, rows], dout[:, :, rows]  # [B, H, m, Dh]
            dss = []
            for f, p, m, vf in zip(ch.factors, ps, keeps, vfs):
                f.scatter(p if m is None else p * m / (1 - r), do, dv)
                dp = f.scores(do, vf)  # dO V^T: [B, H, *rows, K]
                dss.append(dp if m is None else dp.mul_(m / (1 - r)))
            dot = sum(f.to_query(torch.linalg.vecdot(p, dp)) for f, p, dp in zip(ch.factors, ps, dss))  # [B, H, m]
            for f, p, ds in zip(ch.factors, ps, dss):
                ds.sub_(f.rows(dot)).mul_(p)  # softmax backward: dS = P (dP - sum P dP)
                dbias.append(ds.sum(0) if next(need) else None)
            dq[:, :, rows] = sum(f.apply(ds, kf) for f, ds, kf in zip(ch.factors, dss, kfs))
            for f, ds in zip(ch.factors, dss):
                f.scatter(ds, qs, dk)
        return dq, dk, dv, None, None, None, *dbias
