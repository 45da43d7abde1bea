"""LSH attention's fast path (``xfam.attention.lsh``, whose docstring describes it): each sorted query chunk
against one window of sorted keys, tile by tile, with a hand-written backward; and the self penalty m_ii.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

SELF_PENALTY = 1e5  # the paper's m_ii: self only when nothing else is visible


def _self_penalty(dtype: torch.dtype) -> float:
    """m_ii in ``dtype``: 1e5, or an eighth of fp16's largest number (8188; 1e5 overflowed to inf), which
    still puts the query itself above every hidden key (finfo.min / 2) and its exp at 0."""
    return min(SELF_PENALTY, torch.finfo(dtype).max / 8)


TILE = 1 << 21  # scores per tile of the fast path (8 MiB in fp32: cache-resident; few, large ops)


def _rows(x: Tensor, at: Tensor) -> Tensor:
    """Rows ``at`` (any shape) of ``x`` flattened to ``[N, D]`` -> ``[*at.shape, D]``."""
    return x.reshape(-1, x.shape[-1]).index_select(0, at.reshape(-1)).view(*at.shape, x.shape[-1])


class _SortedWindows(torch.autograd.Function):
    """The fast path's core (see ``_sorted_windows``): every query chunk ("unit", in width-class order)
    against its window of sorted keys, tile by tile; saves the probabilities (O(L * width)), the sorted
    inputs and outputs. Sorting and un-sorting are index_select both ways (a permutation's gradient is its
    inverse); only the overlapping windows' key gradients are folded back with index_add_."""

    @staticmethod
    def forward(ctx, q, k, v, at: dict[str, Tensor], plan: list[tuple[int, int, int]], grain: int):
        # q, k, v [B, H, L, Dh]; G = B*H*R sorted sequences of P slots (padded), U = G*nC query units of m.
        # at: "kv" [G*P] rows of k, v [B*H*L] at each slot; "q" [U, m] rows of q; "out" [G*L] the output row
        # [U*m] of each (sequence, position); "lo", "hi" [U, m] each query's first and last visible key slot
        # (flat g*P + s); "start" [U] its window's first slot in grains; optional "other" [R-1, G*P] the
        # other rounds' keys at the slots and "oq" [R-1, U, m, 1] at the queries; "me" [U, m] the query's
        # own slot and "only" [U, m] those that see only themselves (shared-QK). plan: (first unit, count,
        # window width) per width class. Returns per-round outputs [B, H, R, L, Dh] and lse [B, H, R, L].
        b, h, n, d = q.shape
        ks, vs = _rows(k, at["kv"]), _rows(v, at["kv"])  # [G*P, Dh]
        qs = _rows(q * (1 / math.sqrt(d)), at["q"])  # [U, m, Dh]
        m, other, oq = qs.shape[1], at.get("other"), at.get("oq")
        out, lse, probs = torch.empty_like(qs), q.new_empty(qs.shape[:2]), []
        log_n = torch.log(torch.arange(len(other) + 2 if other is not None else 2, dtype=q.dtype))
        for u0, count, wd in plan:
            j = torch.arange(wd, device=q.device)
            kw, vw = ks.unfold(0, wd, grain), vs.unfold(0, wd, grain)  # [windows, Dh, W]
            probs.append(q.new_empty(count, m, wd))
            tile = max(1, TILE // (m * wd))
            for t0 in range(0, count, tile):
                u = slice(u0 + t0, u0 + min(t0 + tile, count))
                st, s = at["start"][u], probs[-1][t0 : t0 + tile]
                torch.bmm(qs[u], kw[st], out=s)  # [t, m, W] scores, then probabilities in place
                base = st[:, None, None] * grain  # flat slot of window column 0
                if other is not None:  # -log N_ij: the other rounds whose keys differ by 0 or 1 for the pair
                    assert oq is not None  # (given with "other")
                    kq, kk = oq[:, u], other.unfold(-1, wd, grain)[:, st, None, :]  # [R-1, t, m|1, 1|W]
                    both = (kk == kq) | (kk == kq - 1)
                    if len(both) == 1:
                        s.add_(both[0], alpha=-log_n[2].item())
                    else:
                        s -= log_n[both.sum(0) + 1]
                hidden = (j < at["lo"][u, :, None] - base) | (j > at["hi"][u, :, None] - base)
                if "me" in at:  # bidirectional shared-QK: itself only when nothing else is visible
                    hidden |= (j == at["me"][u, :, None] - base) & ~at["only"][u, :, None]
                s.masked_fill_(hidden, float("-inf"))
                mx = s.amax(-1, keepdim=True)
                z = s.sub_(mx).exp_().sum(-1, keepdim=True)
                lse[u] = (mx + z.log()).squeeze(-1)
                torch.bmm(s.div_(z), vw[st].transpose(1, 2), out=out[u])
        if "only" in at:  # the paper's m_ii = -1e5 on a query that sees only itself
            lse = torch.where(at["only"], lse - _self_penalty(lse.dtype), lse)
        ctx.save_for_backward(qs, ks, vs, out, *probs)
        ctx.at, ctx.plan, ctx.grain = at, plan, grain
        shape = (b, h, -1, n)
        return _rows(out, at["out"]).view(*shape, d), lse.view(-1)[at["out"]].view(shape)

    @staticmethod
    def backward(ctx, dout, dlse):
        qs, ks, vs, out, *probs = ctx.saved_tensors
        at, grain, (m, d) = ctx.at, ctx.grain, qs.shape[1:]
        do = _rows(dout, at["grad"])  # [U, m, Dh] (padding queries: any row; never read back)
        delta = (do * out).sum(-1) - dlse.reshape(-1)[at["grad"]]  # [U, m] softmax backward, with the lse's own
        dq, dk, dv = torch.empty_like(qs), torch.zeros_like(ks), torch.zeros_like(vs)
        for (u0, count, wd), pw in zip(ctx.plan, probs):
            kw, vw = ks.unfold(0, wd, grain), vs.unfold(0, wd, grain)
            tile = max(1, TILE // (m * wd))
            grains = torch.arange(wd // grain, device=qs.device)
            for t0 in range(0, count, tile):
                u = slice(u0 + t0, u0 + min(t0 + tile, count))
                st, p, do_t = at["start"][u], pw[t0 : t0 + tile], do[u]
                dvw = torch.bmm(p.transpose(1, 2), do_t)  # [t, W, Dh]
                ds = torch.bmm(do_t, vw[st]).sub_(delta[u, :, None]).mul_(p)  # [t, m, W]
                torch.bmm(ds, kw[st].transpose(1, 2), out=dq[u])
                dkw = torch.bmm(ds.transpose(1, 2), qs[u])
                cols = (st[:, None] + grains).view(-1)  # the window's grains of keys
                dk.view(-1, grain, d).index_add_(0, cols, dkw.view(-1, grain, d))
                dv.view(-1, grain, d).index_add_(0, cols, dvw.view(-1, grain, d))
        shape = dout.shape
        dq = _rows(dq, at["out"]).view(shape).sum(2).mul_(1 / math.sqrt(d))
        dk, dv = (_rows(x, at["kv_out"]).view(shape).sum(2) for x in (dk, dv))
        return dq, dk, dv, None, None, None


def _sorted_windows(q, k, v, perm, rank, sb, keys, m: int, causal: bool, shared_self: bool) -> tuple[Tensor, Tensor]:
    """The fast path of ``bucket_attention`` (plain masks, no bias, no dropout). In sorted order a query's
    visible keys are one run of slots: from ``s - min(rank, rank % m + m)`` (its bucket's start or its
    previous rank-chunk's) to itself (causal) or to the end of its rank-chunk and bucket. Each query
    chunk attends to the window from its first query's first key (rounded down to ``grain`` slots) to
    its last query's last key; chunks are grouped by window width (typically ~1.5m, at most 4m)."""
    b, h, rounds, n = perm.shape
    g_n, n_c, grain = b * h * rounds, -(-n // m), max(1, m // 4)
    pk = -(-n_c * m // grain) * grain  # slots per sorted sequence (padded)
    with torch.no_grad():
        s, dev = torch.arange(n, device=q.device), q.device
        lo = s - torch.minimum(rank, rank % m + m)  # [B, H, R, L]
        if causal:
            hi = s.expand_as(rank)
        else:
            end = torch.searchsorted(sb, sb, right=True) - 1  # last slot of the bucket
            hi = torch.minimum(end, s - rank % m + m - 1)
        only = (lo == hi).view(g_n, n)
        if shared_self and causal:  # itself only when nothing else: the run stops before it
            hi = hi - (~only).view_as(hi).long()
        own = torch.arange(n, n_c * m, device=dev)  # padding queries see only their own slot
        flat = torch.arange(g_n, device=dev)[:, None] * pk
        pad = lambda x: torch.cat((x.reshape(g_n, n), own.expand(g_n, -1)), 1) + flat  # noqa: E731
        lo, hi = pad(lo).view(-1, m), pad(hi).view(-1, m)  # [U, m] flat slots
        first, last = lo[:, 0] // grain, hi[:, -1] // grain  # [U] window bounds in grains (monotone in the slot)
        width = last + 1 - first
        widths = width.unique().tolist()
        order = torch.cat([(width == w).nonzero()[:, 0] for w in widths])  # units by window width
        sizes = torch.bincount(width)[widths].tolist()
        plan = [(sum(sizes[:i]), c, int(w) * grain) for i, (w, c) in enumerate(zip(widths, sizes))]
        me = ((order // n_c) * pk + (order % n_c) * m)[:, None] + torch.arange(m, device=dev)  # [U, m] own slots
        bh = torch.arange(b * h, device=dev).repeat_interleave(rounds)[:, None]
        kv = F.pad(perm.reshape(g_n, n) + bh * n, (0, pk - n)).view(-1)  # padding slots: row 0 (masked)
        inv = torch.empty_like(perm).scatter_(-1, perm, s.expand_as(perm)).view(g_n, n)
        unit = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=dev))
        at = {"kv": kv, "q": kv[me], "lo": lo[order], "hi": hi[order], "start": first[order]}
        at["out"] = (unit[inv // m + torch.arange(g_n, device=dev)[:, None] * n_c] * m + inv % m).view(-1)
        at["kv_out"] = (inv + flat).view(-1)
        grad = F.pad(perm.reshape(g_n, n) + flat // pk * n, (0, n_c * m - n)).view(-1)
        at["grad"] = grad[me - me // pk * (pk - n_c * m)]  # [U, m] rows of the [G*L] outputs
        if shared_self and not causal:
            at["me"], at["only"] = me, F.pad(only, (0, pk - n), value=True).view(-1)[me]
        elif shared_self:
            at["only"] = F.pad(only, (0, pk - n), value=True).view(-1)[me]
        if rounds > 1:  # keys of round r' at the slots of round r, r' != r: [R-1, G*P]
            pick = torch.tensor([[o for o in range(rounds) if o != r] for r in range(rounds)], device=dev)
            other = keys[:, :, pick].gather(-1, perm[:, :, :, None].expand(-1, -1, -1, rounds - 1, -1))
            other = F.pad(other.reshape(g_n, rounds - 1, n), (0, pk - n), value=-2).transpose(0, 1)
            other = other.reshape(rounds - 1, -1)
            at["other"], at["oq"] = other, other[:, me, None]
    return _SortedWindows.apply(q, k, v, at, plan, grain)
