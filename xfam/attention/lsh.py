"""LSH attention (Kitaev et al., 2020, "Reformer: The Efficient Transformer", sec. 3).

Shared-QK: the mechanism ignores the projected keys and uses ``k_j = q_j / |q_j|`` (sec. 3, "Shared-QK
Transformer"); scores are ``q_i . k_j / sqrt(Dh)``. Per hash round r, a random rotation
``R_r [Dh, n_buckets/2]`` hashes a position by ``h(x) = argmax([xR; -xR])``; positions are sorted by
(bucket, position) and cut into chunks of ``m`` (``chunk``). A query sees the keys of its own bucket in
its own chunk and the previous one (eq. 4, and ``m_ij = inf`` for j outside the bucket), causally by
original position, never itself unless nothing else is visible (a -1e5 score, as the paper).
Rounds combine by their log-sum-exp normalisers (eqs. 6-7): ``o_i = sum_r exp(z_r(i) - z(i)) o_r(i)``,
with each pair's score lowered by ``log N_ij``, N_ij = the number of rounds visiting (i, j), so the
result is exactly softmax attention over the union of the rounds' visited pairs (the reference code
counts duplicates this way; the paper's eq. counts bucket sharing, which can over-count a pair
that chunking split in some round).

Deviation, for causality: chunks are aligned to bucket starts (chunk = rank within the bucket // m,
as if every bucket were padded to a multiple of m). With the paper's global chunk grid, how many
future tokens hash into earlier buckets moves a past token's chunk boundary, which leaks the future
into a causal model; a rank within the bucket counts only earlier positions.

Paths (no L x L tensor in either chunked one; O(L * m) per round). In sorted order a query's visible
keys are one run of slots (its bucket's slots from the start of its previous rank-chunk to itself, or
to the end of its own rank-chunk when bidirectional). Fast path (plain causal or full masks, no bias,
no dropout; ``xfam.attention._lsh_windows``): a custom autograd function; each sorted query chunk attends
to the window from its first query's first key to its last query's last key (rounded to m/4 slots: ~1.5m
wide typically, at most 4m), chunks grouped by window width and processed a cache-sized tile at a time
(scores, the visible run, -log N_ij from the other rounds' keys, softmax and lse in place); the backward
uses the saved probabilities, index_select for un-sorting and index_add_ for the overlapping windows. General path
(padding, documents, windows, a score bias, dropout): the sorted slots of chunks c-2..c (c+1 when
bidirectional) for query chunk c, with explicit masks; ``backend=dense`` is the L x L reference.

Rotations: redrawn every training forward from the global RNG (the paper; reproducible from the
run seed, and a reversible layer's recomputation restores the RNG), fixed in evaluation by
``seed`` and the layer index (round-major draws, so the first rounds of ``eval_hashes`` rounds equal
those of fewer). Decoding recomputes the prefix (the sort needs every position's query): O(T * m)
per step; keys in front of the queries (memory) would have no query to hash: ``accepts_memory`` is off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.attention._base import ATTENTION, AttentionMechanism
from xfam.attention._lsh_windows import _self_penalty, _sorted_windows
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.logs import log_once
from xfam.core.mask import AttnMask, same_document
from xfam.core.registry import Positive, Probability
from xfam.core.state import DecodeState, expand_kv


def _gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    """``x [B, H, L, D]`` rows at ``idx [B, H, *rest]`` (positions) -> ``[B, H, *rest, D]``."""
    b, h, n, d = x.shape
    base = (torch.arange(b * h, device=x.device) * n).view(b, h, *([1] * (idx.dim() - 2)))
    return x.reshape(-1, d)[idx + base]  # (advanced indexing: its CPU backward beats index_select's)


def _at(t: Tensor, pos: Tensor) -> Tensor:
    """``t [B, L]`` (padding, documents) at positions ``pos [B, ...]`` -> ``[B, ...]``."""
    return t.gather(1, pos.reshape(pos.shape[0], -1)).view(pos.shape)


def _pairs_bias(bias: ScoreBias, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """The bias of head h on its own pairs: ``q_pos [B, H, ..., n, 1]``, ``k_pos [B, H, ..., 1, w]``."""
    return torch.stack([bias.pairs(q_pos[:, h], k_pos[:, h])[h] for h in range(q_pos.shape[1])], dim=1)


def _pair_ok(mask: AttnMask, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Position, padding and document visibility of broadcast pairs (``q_pos``/``k_pos`` lead with B)."""
    ok = mask.visible(q_pos - mask.offset, k_pos)
    if mask.key_padding is not None:
        ok = ok & _at(mask.key_padding.to(k_pos.device), k_pos)
    if mask.segments is not None:
        seg = mask.segments.to(k_pos.device)
        ok = ok & same_document(_at(seg, q_pos), _at(seg, k_pos))
    return ok


def route(buckets: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sort positions by (bucket, position). Returns ``perm [..., L]`` (sorted slot -> position), the
    rank-chunk ``rank within its bucket // chunk`` of every position in original order, and in
    sorted order the buckets and the ranks within the bucket."""
    n = buckets.shape[-1]
    pos = torch.arange(n, device=buckets.device)
    perm = (buckets * n + pos).argsort(dim=-1)
    sb = buckets.gather(-1, perm).contiguous()
    rank = pos - torch.searchsorted(sb, sb)
    rc = torch.empty_like(rank).scatter_(-1, perm, torch.div(rank, chunk, rounding_mode="floor"))
    return perm, rc, sb, rank


def bucket_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    buckets: Tensor,
    chunk: int,
    mask: AttnMask,
    bias: ScoreBias | None = None,
    shared_self: bool = False,
    dropout: float = 0.0,
    dense: bool = False,
) -> tuple[Tensor, Tensor]:
    """Attention within buckets and bucket-aligned chunks, per round (see the module docstring).

    ``q, k, v [B, H, L, Dh]`` (one query per key position, ``mask`` with Sq = Sk), ``buckets
    [B, H, R, L]``. Returns per-round outputs ``[B, H, R, L, Dh]`` and log-normalisers ``[B, H, R, L]``
    (``-inf`` where a round visits no key). Pairs visited by several rounds are down-weighted by
    ``log N``; ``shared_self`` applies the self penalty. ``dense`` is the L x L reference path.
    """
    bsz, h, n, d = q.shape
    rounds, m = buckets.shape[2], min(chunk, n)
    with torch.no_grad():
        perm, rc, sb, rank = route(buckets, m)
    keys = (buckets * (n + 1) + rc).to(torch.int32)  # round r visits (i, j) iff key_r(i) - key_r(j) is 0 or 1
    if not dense and bias is None and not dropout and (mask.is_full or mask.is_plain_causal):
        return _sorted_windows(q, k, v, perm, rank, sb, keys, m, mask.causal, shared_self)
    at = lambda r, p: keys[:, :, r].gather(-1, p.reshape(bsz, h, -1)).view(p.shape)  # noqa: E731
    visits = lambda r, qp, kp: ((at(r, qp) - at(r, kp)) & -2) == 0  # noqa: E731
    with torch.no_grad():
        if dense:  # from the definitions, over all pairs
            q_pos = torch.arange(n, device=q.device).view(1, 1, 1, n, 1).expand(bsz, h, rounds, n, 1)
            k_pos = q_pos.transpose(-1, -2)  # [B, H, R, 1, L]
            own = torch.stack([visits(r, q_pos, k_pos)[:, :, r] for r in range(rounds)], dim=2)
            ok, itself = own & _pair_ok(mask, q_pos, k_pos), q_pos == k_pos
        else:  # query chunk c against the sorted slots of chunks c-2 .. c (c+1 bidirectional), in slot arithmetic
            n_c, wide = -(-n // m), 3 if mask.causal else 4
            pad = lambda x, v: F.pad(x, (2 * m, n_c * m - n + (wide - 3) * m), value=v)  # noqa: E731
            k_pos = pad(perm, 0).unfold(-1, wide * m, m)[..., None, :]  # [B, H, R, nC, 1, Wm]
            q_pos = F.pad(perm, (0, n_c * m - n)).view(bsz, h, rounds, n_c, m, 1)
            # within a bucket slot order is position order: key window column j holds slot cm - 2m + j, so
            # "rank-chunk equal or one before" is j >= i + m - rho and causality j <= i + 2m (rho: rank % m)
            rho = F.pad(rank % m, (0, n_c * m - n)).view(bsz, h, rounds, n_c, m, 1)
            i, j = torch.arange(m, device=q.device)[:, None], torch.arange(wide * m, device=q.device)
            hi = i + 2 * m if mask.causal else i + 3 * m - 1 - rho
            qb = F.pad(sb, (0, n_c * m - n), value=-2).view(bsz, h, rounds, n_c, m, 1)
            ok = (pad(sb, -1).unfold(-1, wide * m, m)[..., None, :] == qb) & (j >= i + m - rho) & (j <= hi)
            if not mask.is_full and not mask.is_plain_causal:  # padding, documents, window
                ok &= _pair_ok(mask, q_pos, k_pos)
            itself = j == i + 2 * m
        add = torch.zeros((), dtype=q.dtype, device=q.device)
        if shared_self:
            add = add - itself.to(q.dtype) * _self_penalty(q.dtype)  # (a float times a bool tensor is fp32)
        if rounds > 1:  # N_ij: the rounds that visit the pair
            count = cast(Tensor, sum(visits(r, q_pos, k_pos).to(torch.uint8) for r in range(rounds)))
            add = add - torch.log(torch.arange(rounds + 1, device=q.device, dtype=q.dtype).clamp_min(1))[count.long()]
        add = torch.where(ok, add, add.new_tensor(torch.finfo(q.dtype).min / 2))  # /2: room for a bias
    if dense:
        qs, ks, vs = (x[:, :, None].expand(bsz, h, rounds, n, d) for x in (q, k, v))  # [B, H, R, L, Dh]
    else:
        qs = _gather_rows(q, q_pos[..., 0])  # [B, H, R, nC, m, Dh]
        ks, vs = _gather_rows(k, k_pos[..., 0, :]), _gather_rows(v, k_pos[..., 0, :])  # [B, H, R, nC, Wm, Dh]
    scores = (qs * (1 / math.sqrt(d))) @ ks.transpose(-1, -2) + add  # [B, H, R, (nC,) m|L, Wm|L]
    if bias is not None:
        qp, kp = q_pos.expand_as(q_pos), k_pos
        scores = scores + _pairs_bias(bias, qp.clamp(max=n - 1), kp.clamp(max=n - 1)).to(scores.dtype)
    probs = torch.softmax(scores, dim=-1)
    lse = scores.logsumexp(-1) if rounds > 1 else scores.new_zeros(()).expand(scores.shape[:-1])
    lse = lse.masked_fill(~ok.any(-1), float("-inf"))  # [B, H, R, (nC,) m|L]
    if dropout:
        probs = F.dropout(probs, dropout)
    out = probs @ vs
    if dense:
        return out, lse
    inv = perm.argsort(dim=-1)  # position -> sorted slot
    slot = inv + torch.arange(rounds, device=q.device)[:, None] * (n_c * m)  # into the rounds' sorted slots
    out = _gather_rows(out.reshape(bsz, h, -1, d), slot.flatten(2))
    return out.view(bsz, h, rounds, n, d), lse.reshape(bsz, h, rounds, -1).gather(-1, inv)


def combine_rounds(out: Tensor, lse: Tensor, v: Tensor) -> Tensor:
    """``sum_r softmax_r(lse) o_r`` (eq. 6); a query no round lets see anything attends to itself
    (the ``AttnMask`` convention). ``out [B, H, R, L, Dh]``, ``lse [B, H, R, L]``, ``v [B, H, L, Dh]``."""
    empty = torch.isinf(lse).all(dim=2)  # [B, H, L]
    w = torch.softmax(lse.masked_fill(empty[:, :, None], 0.0), dim=2)
    return torch.where(empty[..., None], v, (w[..., None] * out).sum(dim=2))


@ATTENTION.register("lsh")
class LSH(AttentionMechanism):
    """Reformer LSH attention (see the module docstring).

    Args:
        n_hashes: hash rounds in training (and in evaluation unless ``eval_hashes`` is set).
        eval_hashes: hash rounds in evaluation (the Reformer's duplication task varies it); null:
            ``n_hashes``.
        n_buckets: buckets per round (1, or even: argmax over [xR; -xR]); null: the paper's
            ``2 * ceil(max_len / chunk)``, so buckets hold chunk/2 positions on average.
        chunk: chunk length m; a query sees at most its own and the previous chunk of its bucket.
        shared_qk: keys are the normalised queries (the paper). False uses the model's keys and
            needs ``n_buckets=1`` (one sort order serves queries and keys only when they are shared).
        seed: seeds the evaluation rotations (with the layer index).
        redraw: draw fresh rotations every training forward (the paper); False: always the seeded ones.
        backend: ``auto`` (chunked), ``chunked`` or ``dense`` (an L x L reference of the same rule).
        dropout: dropout on the attention probabilities.
    """

    paper = "Kitaev et al., 2020, arXiv:2001.04451"
    accepts_memory = False
    backends = ("chunked", "dense")

    def __init__(
        self,
        *,
        max_len: int,
        layer: int = 0,
        n_hashes: Annotated[int, Positive] = 2,
        eval_hashes: Annotated[int, Positive] | None = None,
        n_buckets: Annotated[int, Positive] | None = None,
        chunk: Annotated[int, Positive] = 64,
        shared_qk: bool = True,
        seed: int = 0,
        redraw: bool = True,
        backend: Literal["auto", "chunked", "dense"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        super().__init__()
        self.n_hashes, self.eval_hashes, self.chunk = n_hashes, eval_hashes or n_hashes, chunk
        self.n_buckets = n_buckets if n_buckets is not None else 2 * -(-max_len // chunk)
        self.shared_qk, self.seed, self.layer, self.redraw = shared_qk, seed, layer, redraw
        self.backend, self.dropout = backend, dropout
        self._fixed: dict[Any, Tensor] = {}

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        max_len, out = ctx.get("max_len"), []
        nb = params["n_buckets"]
        if max_len is not None and params["chunk"] > max_len:
            out.append(
                f"chunk={params['chunk']} is larger than model.max_len={max_len}; valid: 1..{max_len}. "
                f"Fix: set attention.chunk <= {max_len}."
            )
        if nb is not None and nb > 1 and nb % 2:
            out.append(f"n_buckets={nb} is odd; argmax([xR; -xR]) gives an even count. Fix: n_buckets=1 or even.")
        if nb is not None and max_len is not None and nb > max_len:
            out.append(f"n_buckets={nb} exceeds model.max_len={max_len} positions. Fix: n_buckets <= {max_len}.")
        if not params["shared_qk"] and nb != 1:
            out.append(
                "shared_qk=false needs n_buckets=1: with separate keys, queries and keys would need different "
                "sort orders (Reformer sec. 3). Fix: attention.shared_qk=true, or attention.n_buckets=1."
            )
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"n_buckets": 1, "chunk": seq_len, "shared_qk": False}

    def _rotations(self, heads: int, rounds: int, ref: Tensor) -> Tensor:
        """``[H, R, Dh, n_buckets/2]`` random rotations (see the module docstring)."""
        shape = (rounds, heads, ref.shape[-1], self.n_buckets // 2)
        if self.training and self.redraw:
            return torch.randn(shape, device=ref.device, dtype=ref.dtype).transpose(0, 1)
        key = (heads, rounds, ref.device, ref.dtype)
        if key not in self._fixed:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.layer)
            self._fixed[key] = torch.randn(shape, generator=g).to(ref).transpose(0, 1)
        return self._fixed[key]

    def hash(self, q: Tensor, rounds: int) -> Tensor:
        """Buckets ``[B, H, R, L]`` of ``q [B, H, L, Dh]``: ``argmax([xR; -xR])`` per round."""
        b, h, n, _ = q.shape
        if self.n_buckets == 1:
            return torch.zeros(b, h, rounds, n, dtype=torch.long, device=q.device)
        with torch.no_grad():  # argmax([xR; -xR]) without concatenating: the larger of max(xR) and -min(xR)
            rot = torch.einsum("bhld,hrdn->bhrln", q, self._rotations(h, rounds, q))
            (hi, up), (lo, down) = rot.max(dim=-1), rot.min(dim=-1)
            return torch.where(hi >= -lo, up, down + rot.shape[-1])

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        heads, off = q.shape[1], mask.offset
        if off and (self.shared_qk or self.n_buckets > 1):
            raise ValueError(
                "attention=lsh hashes every position by its query, so keys in front of the queries (memory) "
                "cannot be placed; use decode() for generation (it recomputes the prefix)."
            )
        keys = F.normalize(q, dim=-1) if self.shared_qk else expand_kv(k, heads)  # [B, H, Sk, Dh]
        v = expand_kv(v, heads)
        if off:  # one bucket: placeholder queries for the keys in front, their rows dropped below
            q = F.pad(q, (0, 0, off, 0))
            mask = AttnMask(mask.k_len, mask.k_len, mask.causal, mask.key_padding, mask.segments, mask.window)
        rounds = self.n_hashes if self.training else self.eval_hashes
        dense = self.backend == "dense"
        if self.backend == "auto":
            log_once("attention=lsh backend=auto: chunked path")
        out, lse = bucket_attention(
            q, keys, v, self.hash(q, rounds), self.chunk, mask, bias, self.shared_qk,
            self.dropout if self.training else 0.0, dense,
        )  # fmt: skip
        return combine_rounds(out, lse, v)[:, :, off:]

    def decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: DecodeState | None,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> tuple[Tensor, DecodeState]:
        """Recompute the whole prefix (every position's query is needed to sort it) and return the
        new rows; the causal design makes them equal to the full forward's."""
        return recompute(self, q, k, v, state, mask, bias)


def recompute(
    mech: AttentionMechanism,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: DecodeState | None,
    mask: AttnMask,
    bias: ScoreBias | None,
) -> tuple[Tensor, DecodeState]:
    """Decoding by full recomputation: keep every query, key and value; run ``mech`` over the whole
    prefix and return the rows of the new tokens (exact for mechanisms without causal leaks)."""
    new = {"q": q, "k": k, "v": v}
    if state is not None:
        new = {name: torch.cat((state[name], x), dim=2) for name, x in new.items()}  # [B, H|Hkv, T, Dh]
    t = mask.k_len
    full = AttnMask(t, t, mask.causal, mask.key_padding, mask.segments, mask.window)
    return mech(new["q"], new["k"], new["v"], full, bias)[:, :, t - q.shape[2] :], new
