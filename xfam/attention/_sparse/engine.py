"""The sparse attention engine: one block-gathered fast path and one dense reference for every
pattern (local, strided, fixed, blockwise, Longformer, BigBird ...).

Block path, O(Sq * (K * block + G)) time and memory, no Sq x Sk matrix:

    q [B, H, Sq, Dh] -> query blocks [B, H, nQ, b, Dh]
    k, v             -> the K key blocks of each query block, then the G global keys
                        [B, H, nQ, K*b + G, Dh]   (strided windows or gathered, one copy)
    scores [B, H, nQ, b, K*b + G], masked by the pattern's exact rule, causality, padding and
    documents (one cached additive mask when there are no padding or documents), plus the score
    bias evaluated on the visited (query, key) pairs; global query rows are computed densely over
    all keys (there are few of them).

Dense reference: explicit ``Sq x Sk`` scores with the pattern's rule as a mask (for tests and as
the ground truth). A query that may see no key at all attends to itself on both paths (the
``AttnMask`` convention).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.attention._sparse import chunked
from xfam.attention._sparse.pattern import SparsePattern
from xfam.attention._sparse.scores import _additive, _batch_ok, _pairs, _softmax
from xfam.core.bias import ScoreBias
from xfam.core.mask import AttnMask, same_document
from xfam.core.state import expand_kv

if TYPE_CHECKING:
    from xfam.kernels.flash_attention import BlockLayout


class Geometry(NamedTuple):
    """Position-only tensors of one pattern for one mask shape, cached on the pattern (they do
    not change between steps) and shared by every layer with an equal pattern."""

    band: tuple[int, int] | None  # (first key block of query block 0, K) for banded layouts
    idx: Tensor  # [Hp, nQ, K] key-block indices, clamped into range (``ok`` masks the rest)
    q_pos: Tensor  # [nQ, b] query positions (key coordinates)
    k_pos: Tensor  # [Hp, nQ, K*b + G] visited key positions, the G global keys last (may lie outside [0, Sk))
    ok: Tensor  # [Hp, nQ, b, K*b + G] pattern & causal/window & in range (block part: not a global key)
    rows_ok: bool  # every real query sees at least one key (before padding and documents)
    g_pos: Tensor  # [G] global positions that are keys of this call
    g_rows: Tensor  # [Gq] query indices (0..Sq-1) that are global
    additive: dict  # caches: dtype -> ``ok`` as an additive mask (``_additive``), "kernel" -> ``kernel_layout``


def geometry(pattern: SparsePattern, mask: AttnMask, device: torch.device) -> Geometry:
    cache = pattern.__dict__.setdefault("_geometry_cache", {})
    key = (mask.q_len, mask.k_len, mask.offset, mask.causal, mask.window, str(device))
    if key not in cache:
        if len(cache) >= 8:
            cache.pop(next(iter(cache)))
        cache[key] = _geometry(pattern, mask, device)
    return cache[key]


def _geometry(pattern: SparsePattern, mask: AttnMask, device: torch.device) -> Geometry:
    b, s_q, s_k, off = pattern.block, mask.q_len, mask.k_len, mask.offset
    n_q, n_k = -(-s_q // b), -(-s_k // b)
    band = pattern.band(off, mask.causal)
    within = torch.arange(b, device=device)
    if band is not None:
        first, width = band
        starts = first + torch.arange(n_q, device=device)[:, None] + torch.arange(width, device=device)  # [nQ, K]
        k_pos = (starts[..., None] * b + within).flatten(-2)[None]  # [1, nQ, K*b]
        idx = starts.clamp(0, n_k - 1)[None]
    else:
        layout = pattern.layout(n_q, n_k, off, mask.causal, device).to(device)  # [Hp, nQ, K]
        idx = layout.clamp_min(0)
        k_pos = (idx[..., None] * b + within).flatten(-2)  # [Hp, nQ, K*b]
        k_pos = torch.where((layout >= 0)[..., None].expand(*layout.shape, b).flatten(-2), k_pos, -1)
    q_idx = torch.arange(n_q * b, device=device).view(n_q, b)  # [nQ, b] query indices
    q_pos = q_idx + off
    g_pos = torch.tensor([p for p in pattern.global_positions if p < s_k], dtype=torch.long, device=device)
    is_global = torch.zeros(s_k, dtype=torch.bool, device=device)
    is_global[g_pos] = True
    in_range = (k_pos >= 0) & (k_pos < s_k)
    local_key = in_range & ~is_global[k_pos.clamp(0, s_k - 1)]  # [Hp, nQ, Kb]
    kp, qp = k_pos[:, :, None, :], q_pos[None, :, :, None]  # [Hp, nQ, 1, Kb], [1, nQ, b, 1]
    head = torch.arange(pattern.heads, device=device).view(-1, 1, 1, 1) if pattern.heads > 1 else None
    ok = (
        pattern.allowed(qp, kp, head)
        & mask.visible(qp - off, kp)
        & local_key[:, :, None]
        & (q_idx < s_q)[None, :, :, None]
    )
    if len(g_pos):  # the global keys as G more columns of every query block
        k_pos = torch.cat((k_pos, g_pos.expand(k_pos.shape[0], n_q, -1)), dim=-1)  # [Hp|1, nQ, Kb + G]
        g_ok = mask.visible(q_idx[..., None], g_pos) & (q_idx < s_q)[..., None]  # [nQ, b, G]
        ok = torch.cat((ok, g_ok.expand(ok.shape[0], -1, -1, -1)), dim=-1)  # [Hp|1, nQ, b, Kb + G]
    rows_ok = bool(ok.any(-1).flatten(1)[:, :s_q].all())
    g_rows = g_pos[(g_pos >= off) & (g_pos < off + s_q)] - off
    return Geometry(band, idx, q_pos, k_pos, ok, rows_ok, g_pos, g_rows, {})


def _blocks(x: Tensor, n: int, b: int) -> Tensor:
    """``[B, H, S, Dh]`` zero-padded to ``n * b`` positions and cut into ``[B, H, n, b, Dh]``."""
    bsz, h, s, d = x.shape
    return F.pad(x, (0, 0, 0, n * b - s)).view(bsz, h, n, b, d)


def _keys(x: Tensor, geo: Geometry, b: int) -> Tensor:
    """The keys (or values) each query block visits, its block keys then the global keys:
    ``[B, H, nQ, K*b + G, Dh]``.

    Banded layouts take overlapping windows of the zero-padded sequence (``unfold``, copied once,
    together with the global keys, so the matmuls get contiguous operands); other layouts gather
    their blocks.
    """
    bsz, h, s, d = x.shape
    n_q, kb = geo.idx.shape[1], geo.idx.shape[2] * b
    if geo.band is not None:
        first = geo.band[0] * b
        front = max(0, -first)
        back = max(0, first + (n_q - 1) * b + kb - s)
        xp = F.pad(x, (0, 0, front, back))
        start = first + front
        out = xp[:, :, start : start + (n_q - 1) * b + kb].unfold(2, kb, b).transpose(-1, -2)  # [B, H, nQ, Kb, Dh]
    else:
        # one row of b * Dh per key block; ``embedding`` because its backward (a dense row
        # accumulation) is ~3x faster on CPU than advanced indexing's ``index_put``
        n_k = -(-s // b)
        blocks = F.pad(x, (0, 0, 0, n_k * b - s)).reshape(bsz * h * n_k, b * d)  # [B*H*nK, b*Dh]
        rows = geo.idx + torch.arange(bsz * h, device=x.device).view(bsz, h, 1, 1) * n_k  # [B, H, nQ, K]
        out = F.embedding(rows, blocks).view(bsz, h, n_q, kb, d)
    if not len(geo.g_pos):
        return out.contiguous()
    glob = x[:, :, geo.g_pos, None].transpose(2, 3).expand(bsz, h, n_q, -1, d)  # [B, H, nQ, G, Dh]
    return torch.cat((out, glob), dim=-2)


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: SparsePattern,
    mask: AttnMask,
    bias: ScoreBias | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """Attention restricted to ``pattern``: ``[B, H, Sq, Dh]`` (see the module docstring)."""
    bsz, h, s_q, d = q.shape
    k, v = expand_kv(k, h), expand_kv(v, h)  # [B, H, Sk, Dh]
    geo = geometry(pattern, mask, q.device)
    b, n_q = pattern.block, geo.k_pos.shape[1]
    if chunked.applies(bias, dropout):  # in chunks of query blocks, recomputed in the backward (chunked.py)
        out, empty = chunked.attend(q, k, v, chunked.plan(q, geo, b, mask, bias))
        if empty is None and not geo.rows_ok:
            empty = ~geo.ok.any(-1)[None]  # [1, Hp, nQ, b]
        return _finish(out, empty, q, k, v, geo, mask, bias, dropout)
    qb = _blocks(q * (1 / math.sqrt(d)), n_q, b)  # [B, H, nQ, b, Dh], scaled once here
    kg, vg = _keys(k, geo, b), _keys(v, geo, b)  # [B, H, nQ, Kb, Dh] (Kb: block keys, then global keys)
    scores = qb @ kg.transpose(-1, -2)  # [B, H, nQ, b, Kb]
    extra = _batch_ok(mask, geo.k_pos, geo.q_pos)  # padding / documents, or None
    if bias is not None:
        # Padding positions (outside the sequence) are masked; clamp them to keep the bias defined.
        q_pos, k_pos = geo.q_pos.clamp(max=mask.k_len - 1), geo.k_pos.clamp(0, mask.k_len - 1)
        scores = scores + _pairs(bias, q_pos[None, :, :, None], k_pos[:, :, None, :]).to(scores.dtype)
    if extra is None:  # the common case: one in-place add of the cached mask
        probs = torch.softmax(scores.add_(_additive(geo, scores.dtype)), dim=-1)
        empty = None if geo.rows_ok else ~geo.ok.any(-1)[None]  # [1, Hp, nQ, b]
        probs = probs if empty is None else probs * ~empty[..., None]
    else:
        ok = geo.ok[None] & extra  # [B, Hp, nQ, b, Kb]
        probs, empty = _softmax(scores, ok), ~ok.any(-1)
    if dropout:
        probs = F.dropout(probs, dropout)
    out = probs @ vg  # [B, H, nQ, b, Dh]
    return _finish(out.reshape(bsz, h, n_q * b, d)[:, :, :s_q], empty, q, k, v, geo, mask, bias, dropout)


def _finish(
    out: Tensor,
    empty: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    geo: Geometry,
    mask: AttnMask,
    bias: ScoreBias | None,
    dropout: float,
) -> Tensor:
    """The block part's output ``[B, H, Sq, Dh]`` completed: queries that see no key (``empty
    [B|1, Hp, nQ, b]``) take their own value, global queries their dense rows."""
    bsz, h, s_q, _ = out.shape
    if empty is not None:  # the AttnMask convention: a query that may see nothing attends to itself
        n_q, b = empty.shape[-2:]
        empty = empty.expand(bsz, h, n_q, b).reshape(bsz, h, n_q * b, 1)[:, :, :s_q]
        out = torch.where(empty, v[:, :, mask.offset : mask.offset + s_q], out)
    if len(geo.g_rows):  # global queries see every visible key: a few dense rows
        rows = dense_rows(q[:, :, geo.g_rows], k, v, geo.g_rows, mask, bias, dropout)
        out = out.index_copy(2, geo.g_rows, rows)
    return out


def kernel_layout(geo: Geometry, b: int, mask: AttnMask) -> BlockLayout:
    """The geometry as the flash kernel's block-sparse layout ``(idx [Hp, nQ, K'], ok [Hp, nQ, b, K'*b])``,
    prepared for ``mask``'s calls (``prepare_layout``): the global keys join as the blocks that hold them (only
    their own columns set; the block part never holds a global key, so nothing is counted twice). Cached on
    the geometry (one per mask shape)."""
    from xfam.kernels.flash_attention import prepare_layout  # imported on first use (TRITON_INTERPRET)

    if "kernel" not in geo.additive:
        kb = geo.idx.shape[-1] * b
        idx, ok = geo.idx, geo.ok[..., :kb]
        if len(geo.g_pos):
            blocks = torch.unique(geo.g_pos // b)  # [Gb], sorted
            hp, n_q = idx.shape[:2]
            idx = torch.cat((idx, blocks.to(idx.dtype).expand(hp, n_q, -1)), dim=-1)  # [Hp, nQ, K + Gb]
            col = torch.searchsorted(blocks, geo.g_pos // b) * b + geo.g_pos % b  # [G]: column among the new
            g_ok = geo.ok.new_zeros(*ok.shape[:-1], len(blocks) * b)  # [Hp, nQ, b, Gb*b]
            g_ok[..., col] = geo.ok[..., kb:]
            ok = torch.cat((ok, g_ok), dim=-1)
        layout = (idx.contiguous(), ok.contiguous())
        geo.additive["kernel"] = prepare_layout(layout, b, mask.q_len, mask.k_len, mask.causal, mask.window)
    return geo.additive["kernel"]


def flash_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: SparsePattern, mask: AttnMask, bias: ScoreBias | None = None
) -> Tensor:
    """``block_sparse_attention`` through the flash kernel: the block part and the global keys in-kernel
    (``kernel_layout``), the few global query rows densely, as the block path does."""
    from xfam.attention._fused import flash

    geo = geometry(pattern, mask, q.device)
    out = flash(q, k, v, mask, bias, layout=kernel_layout(geo, pattern.block, mask), block=pattern.block)
    if len(geo.g_rows):  # global queries see every visible key
        h = q.shape[1]
        rows = dense_rows(q[:, :, geo.g_rows], expand_kv(k, h), expand_kv(v, h), geo.g_rows, mask, bias, 0.0)
        out = out.index_copy(2, geo.g_rows, rows)
    return out


def dense_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rows: Tensor,
    mask: AttnMask,
    bias: ScoreBias | None,
    dropout: float,
    pattern: SparsePattern | None = None,
) -> Tensor:
    """Attention of the query rows ``rows`` (indices 0..Sq-1; ``q [B, H, Gq, Dh]``, k and v expanded to
    H heads) over every visible key, or every key ``pattern`` also allows: ``[B, H, Gq, Dh]``."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # [B, H, Gq, Sk]
    q_pos, k_pos = rows + mask.offset, torch.arange(mask.k_len, device=q.device)
    if bias is not None:
        scores = scores + bias.pairs(q_pos[:, None], k_pos[None, :]).to(scores.dtype)
    ok = mask.visible(rows[:, None], k_pos[None, :])[None, None]  # [1, 1, Gq, Sk]
    if pattern is not None:
        ok = ok & pattern.allowed(q_pos[:, None], k_pos[None, :])
    if mask.key_padding is not None:
        ok = ok & mask.key_padding[:, None, None, :]
    if mask.segments is not None:
        ok = ok & same_document(mask.segments[:, None, q_pos, None], mask.segments[:, None, None, :])
    own = q_pos[:, None] == k_pos[None, :]  # a row that may see nothing attends to itself (AttnMask convention)
    ok = ok | (own & ~ok.any(-1, keepdim=True))
    probs = _softmax(scores, ok)
    if dropout:
        probs = F.dropout(probs, dropout)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v)


def pattern_dense(pattern: SparsePattern, mask: AttnMask, device: torch.device) -> Tensor:
    """The pattern's exact rule over all pairs, globals included: ``[Hp, Sq, Sk]`` bool."""
    q_pos, k_pos = mask.positions(device)
    head = torch.arange(pattern.heads, device=device).view(-1, 1, 1) if pattern.heads > 1 else None
    ok = pattern.allowed(q_pos[:, None], k_pos[None, :], head)
    ok = ok if ok.dim() == 3 else ok[None]
    g = torch.tensor(pattern.global_positions, dtype=torch.long, device=device)
    if len(g):
        ok = ok | torch.isin(q_pos, g)[None, :, None] | torch.isin(k_pos, g)[None, None, :]
    return ok


def dense_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: SparsePattern,
    mask: AttnMask,
    bias: ScoreBias | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """Reference: explicit ``Sq x Sk`` scores masked by the pattern (ground truth for the tests)."""
    h = q.shape[1]
    k, v = expand_kv(k, h), expand_kv(v, h)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # [B, H, Sq, Sk]
    if bias is not None:
        scores = scores + bias.dense(mask, scores.dtype)
    ok = pattern_dense(pattern, mask, q.device)[None]  # [1, Hp, Sq, Sk]
    allowed = mask.dense(q.device)
    if allowed is not None:
        ok = ok & allowed
    # A query that may see nothing attends to itself (the AttnMask convention).
    own = torch.arange(mask.q_len, device=q.device)[:, None] + mask.offset == torch.arange(mask.k_len, device=q.device)
    ok = ok | (own & ~ok.any(-1, keepdim=True))
    probs = _softmax(scores, ok)
    if dropout:
        probs = F.dropout(probs, dropout)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v)
