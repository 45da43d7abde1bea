"""Sparse Sinkhorn attention (Tay et al., 2020, "Sparse Sinkhorn Attention", ICML; arXiv:2002.11296).

The sequence is cut into ``nB`` blocks of ``b`` positions (``block``). A meta sorting network reads a
summary of every key block and scores block pairs, ``R = P(psi(K)) [nB, nB]`` with the paper's
two-layer network ``P(x) = W_B relu(W_P x + b_P) + b_B`` (one per key/value head; its output width is
the number of blocks of ``max_len``, truncated to the blocks present, as the LRA code). The summary
``psi`` is the sum of a block's keys (the paper sums the layer input; keys are a linear map of it, so
this only re-parameterises ``W_P``). Gumbel-Sinkhorn turns R into a (near) doubly stochastic
matrix: ``S = exp(L_n)``, ``L_0 = (R + g) / tau`` (Gumbel noise g in training only), and n times a
row then a column normalisation in log space. The sorted key blocks are ``K_S[i] = sum_j S_ij K[j]``
(values likewise), and query block i attends to its own block and its sorted block under one
softmax over the 2b keys (so a single block, where S = [1] and K_S = K, is exactly dense attention;
the LRA code adds two separately normalised outputs, which doubles it).

Causal (the paper's causal variant): block i may only mix blocks j < i, which lie entirely before
every query of block i; its summary is the mean of the keys up to the block's first position; and
causal Sinkhorn balancing normalises column j for row i over rows i' <= i only, so no row depends
on a later block's summary. Block 0 has no past block and attends to its own block only.

Masks: key padding removes padded keys from the mixtures (each sorted slot renormalised over the
unpadded keys it mixes; a slot mixing only padding is masked). A sorted block may only mix blocks
whose every key is visible to every query of block i: the window, and documents (all keys of block
j in the document of block i's first position; queries of block i in a later document use their own
block only). Sorted slots are mixtures of positions, so an additive position bias has no pair to
apply to: ``accepts_bias`` is off. SortCut is not implemented. Cost O(L * b) for the attention plus
O(nB^2 * b * Dh) for the mixtures, no L x L tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.attention._base import ATTENTION, AttentionMechanism
from xfam.attention.lsh import _pair_ok
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.logs import log_once
from xfam.core.mask import AttnMask
from xfam.core.registry import Positive, Probability

NEG = -1e9  # log-space mask inside Sinkhorn (computed in fp32 at least)


def sinkhorn(logits: Tensor, allowed: Tensor, iters: int, causal: bool) -> Tensor:
    """``iters`` row-then-column normalisations of ``exp(logits)`` restricted to ``allowed`` (log space).

    ``logits [..., n, n]`` (rows: query blocks, columns: key blocks). Causal: the column
    normalisation of row i sums over rows <= i only. Rows with nothing allowed come out all zero.
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)).masked_fill(~allowed, NEG)
    for _ in range(iters):
        x = (x - x.logsumexp(-1, keepdim=True)).masked_fill(~allowed, NEG)
        col = x.logcumsumexp(-2) if causal else x.logsumexp(-2, keepdim=True)
        x = (x - col).masked_fill(~allowed, NEG)
    return x.exp() * allowed


def _runs(seg: Tensor) -> Tensor:
    """First position of the document run of every position: ``seg [B, S] -> [B, S]``."""
    pos = torch.arange(seg.shape[1], device=seg.device).expand_as(seg)
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return torch.where(start, pos, 0).cummax(dim=1).values


@ATTENTION.register("sinkhorn")
class Sinkhorn(AttentionMechanism):
    """Sparse Sinkhorn attention (see the module docstring).

    Args:
        block: block length b; each query attends to 2b keys (its block and its sorted block).
        sinkhorn_iters: row/column normalisation rounds.
        temperature: tau of Gumbel-Sinkhorn.
        gumbel_noise: add Gumbel noise to R in training (Gumbel-Sinkhorn); never in evaluation.
        backend: ``auto`` (blocked), ``block`` or ``dense`` (explicit [Sq, Sk + nB*b] scores of the same rule).
        dropout: dropout on the attention probabilities.
    """

    decay_params = ("w_p", "w_b")  # the sorting network's matrices decay, its biases not (xfam.training.lit.optim)

    paper = "Tay et al., 2020, arXiv:2002.11296"
    accepts_bias = False
    accepts_memory = False
    shared_keys = False  # its blocks and sorting follow runs of equal document ids
    backends = ("block", "dense")

    def __init__(
        self,
        *,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        block: Annotated[int, Positive] = 64,
        sinkhorn_iters: Annotated[int, Positive] = 7,
        temperature: Annotated[float, Positive] = 0.75,
        gumbel_noise: bool = True,
        backend: Literal["auto", "block", "dense"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        super().__init__()
        self.block, self.iters, self.temperature, self.gumbel = block, sinkhorn_iters, temperature, gumbel_noise
        self.backend, self.dropout, self.max_blocks = backend, dropout, -(-max_len // block)
        scale = 1 / math.sqrt(head_dim)
        self.w_p = nn.Parameter(torch.randn(kv_heads, head_dim, head_dim) * scale)
        self.b_p = nn.Parameter(torch.zeros(kv_heads, 1, head_dim))
        self.w_b = nn.Parameter(torch.randn(kv_heads, head_dim, self.max_blocks) * scale)
        self.b_b = nn.Parameter(torch.zeros(kv_heads, 1, self.max_blocks))

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        max_len = ctx.get("max_len")
        if max_len is not None and params["block"] > max_len:
            return [
                f"block={params['block']} is larger than model.max_len={max_len}; valid: 1..{max_len} "
                f"(block = max_len is dense attention). Fix: set attention.block <= {max_len}."
            ]
        return []

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"block": seq_len}

    def sort_matrix(self, k: Tensor, mask: AttnMask) -> tuple[Tensor, Tensor | None]:
        """The block mixing matrix ``S [B, Hkv, nB, nB]`` (rows: query blocks) and the document of each
        block's first position ``[B, nB]`` (None without documents)."""
        bsz, hkv, s_k, d = k.shape
        b, n = self.block, -(-s_k // self.block)
        if n > self.max_blocks:
            raise ValueError(f"attention=sinkhorn: {s_k} keys need {n} blocks; the sorting network has "
                             f"{self.max_blocks} (model.max_len). Fix: raise model.max_len.")  # fmt: skip
        keep = torch.ones(bsz, s_k, dtype=torch.bool, device=k.device)
        keep = keep if mask.key_padding is None else keep & mask.key_padding.to(k.device)
        seg = None if mask.segments is None else mask.segments.to(k.device)
        first = torch.arange(n, device=k.device) * b  # [nB] first position of each block
        start = _runs(seg)[:, first] if seg is not None else torch.zeros(bsz, n, dtype=torch.long, device=k.device)
        w = keep.to(k.dtype)
        if mask.causal:  # mean of the keys from the document start up to the block's first position
            cs = F.pad(torch.cumsum(k * w[:, None, :, None], dim=2), (0, 0, 1, 0))  # [B, Hkv, Sk + 1, Dh]
            cn = F.pad(torch.cumsum(w, dim=1), (1, 0))  # [B, Sk + 1]
            end = first.expand(bsz, n) + 1
            idx = lambda i: i[:, None, :, None].expand(bsz, hkv, n, d)  # noqa: E731
            count = (cn.gather(1, end) - cn.gather(1, start)).clamp_min(1)  # [B, nB]
            summary = (cs.gather(2, idx(end)) - cs.gather(2, idx(start))) / count[:, None, :, None]
        else:  # sum of the block's keys in the document of its first position (the paper's sum pooling)
            if seg is not None:
                w = w * (seg == F.pad(seg, (0, n * b - s_k))[:, first].repeat_interleave(b, 1)[:, :s_k])
            kb = F.pad(k * w[:, None, :, None], (0, 0, 0, n * b - s_k)).view(bsz, hkv, n, b, d)
            summary = kb.sum(3)  # [B, Hkv, nB, Dh]
        # one sorting network per key/value head (repeated when given already-expanded key heads)
        w_p, b_p, w_b, b_b = (
            p.repeat_interleave(hkv // p.shape[0], 0) for p in (self.w_p, self.b_p, self.w_b, self.b_b)
        )
        r = (torch.relu(summary @ w_p + b_p) @ w_b + b_b)[..., :n]  # [B, Hkv, nB (rows: query blocks), nB (key blocks)]
        if self.training and self.gumbel:
            r = r - torch.log(-torch.log(torch.rand_like(r).clamp(1e-10, 1 - 1e-7)))
        allowed = self._block_allowed(n, mask, seg, k.device)
        first_seg = None if seg is None else seg[:, first]
        return sinkhorn(r / self.temperature, allowed, self.iters, mask.causal).to(k.dtype), first_seg

    def _block_allowed(self, n: int, mask: AttnMask, seg: Tensor | None, device: torch.device) -> Tensor:
        """``[B|1, 1, nB, nB]``: block j may be mixed into query block i (every key visible to every query)."""
        b, i = self.block, torch.arange(n, device=device)
        qi, kj = i[:, None], i[None, :]
        ok = kj < qi if mask.causal else torch.ones(n, n, dtype=torch.bool, device=device)
        if mask.window is not None:  # the farthest pair of the two blocks is within the window
            far = torch.maximum(qi * b + b - 1 - kj * b, kj * b + b - 1 - qi * b)
            ok = ok & (far < mask.window)
        ok = ok[None, None]
        if seg is not None:  # block j lies entirely in the document of block i's first position
            blocks = F.pad(seg, (0, n * b - seg.shape[1]), value=-1).view(seg.shape[0], n, b)
            last = seg[:, -1:].expand(-1, n * b - seg.shape[1])
            full = torch.cat((seg, last), 1).view(seg.shape[0], n, b)  # a partial block: its existing keys
            lo, hi, first = full.amin(-1), full.amax(-1), blocks[:, :, 0]
            ok = ok & ((lo == hi)[:, None, :] & (hi[:, None, :] == first[:, :, None]))[:, None]
        if mask.key_padding is not None:  # blocks of padding only stay out of the balancing, rows and columns:
            # otherwise they take mass from the real blocks, and a row's output depends on its batch's width
            pad = F.pad(mask.key_padding.to(device), (0, n * b - mask.k_len))
            real = pad.view(pad.shape[0], n, b).any(-1)  # [B, nB]
            ok = ok & (real[:, None, :, None] & real[:, None, None, :])
        return ok

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        bsz, h, _, d = q.shape
        s_k, off, b, hkv = mask.k_len, mask.offset, self.block, k.shape[1]
        n, rep = -(-s_k // b), h // k.shape[1]
        if self.backend == "auto":
            log_once("attention=sinkhorn backend=auto: block path")
        s, first_seg = self.sort_matrix(k, mask)  # [B, Hkv, nB, nB]
        keep = torch.ones(bsz, s_k, dtype=k.dtype, device=k.device)
        keep = keep if mask.key_padding is None else keep * mask.key_padding.to(k.dtype)
        kw = F.pad(keep, (0, n * b - s_k)).view(bsz, 1, n, b)  # [B, 1, nB, b]: unpadded keys
        den = torch.einsum("bhij,bhjt->bhit", s, kw.expand(-1, hkv, -1, -1))  # [B, Hkv, nB, b]
        mix = lambda x: torch.einsum("bhij,bhjtd->bhitd", s, self._blocks(x, n) * kw[..., None])  # noqa: E731
        tiny = torch.finfo(den.dtype).tiny  # (1e-30 is 0 in fp16: an empty slot's 0 / 0 was NaN)
        ks, vs = (mix(x) / den.clamp_min(tiny)[..., None] for x in (k, v))  # sorted blocks [B, Hkv, nB, b, Dh]
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)  # [B, H, nB, b, Dh]
        q_pos = torch.arange(n * b, device=q.device).view(n, b)  # query slots, key coordinates
        real_q = ((q_pos >= off) & (q_pos < s_k))[..., None]  # [nB, b, 1]
        # a sorted slot is usable if it mixes some unpadded key and (documents) the query is in the
        # document of its block's first position
        slot_ok = (den > 0).repeat_interleave(rep, 1)[:, :, :, None, :] & real_q  # [B, H, nB, b, b]
        if first_seg is not None:
            assert mask.segments is not None  # (first_seg comes from them)
            q_seg = F.pad(mask.segments.to(q.device), (0, n * b - s_k), value=-1).view(bsz, 1, n, b, 1)
            slot_ok = slot_ok & (q_seg == first_seg.view(bsz, 1, n, 1, 1))
        qb = self._blocks(F.pad(q, (0, 0, off, 0)), n) / math.sqrt(d)  # [B, H, nB, b, Dh]
        k_pos = q_pos.clamp(max=s_k - 1)
        if self.backend == "dense":
            out, ok = self._dense(qb, k, v, ks, vs, slot_ok, real_q, mask)
        else:
            own_ok = _pair_ok(mask, k_pos.expand(bsz, 1, n, b)[..., None], k_pos.expand(bsz, 1, n, b)[..., None, :])
            own_ok = own_ok & (q_pos < s_k)[:, None, :] & real_q  # [B, 1, nB, b, b]
            keys = torch.cat((self._blocks(k, n).repeat_interleave(rep, 1), ks), dim=3)  # [B, H, nB, 2b, Dh]
            vals = torch.cat((self._blocks(v, n).repeat_interleave(rep, 1), vs), dim=3)
            ok = torch.cat((own_ok.expand(bsz, h, n, b, b), slot_ok), dim=-1)  # [B, H, nB, b, 2b]
            out = self._probs(qb @ keys.transpose(-1, -2), ok) @ vals
            out, ok = out.view(bsz, h, n * b, d), ok.view(bsz, h, n * b, 2 * b)
        # a query that may see nothing attends to itself (the AttnMask convention)
        own = v.repeat_interleave(rep, 1)[:, :, off:]
        return torch.where(ok[:, :, off:s_k].any(-1, keepdim=True), out[:, :, off:s_k], own)

    def _blocks(self, x: Tensor, n: int) -> Tensor:
        """``[B, H, S, Dh]`` zero-padded to ``n`` blocks and cut into ``[B, H, nB, b, Dh]``."""
        return F.pad(x, (0, 0, 0, n * self.block - x.shape[2])).view(*x.shape[:2], n, self.block, x.shape[-1])

    def _probs(self, scores: Tensor, ok: Tensor) -> Tensor:
        probs = torch.softmax(scores.masked_fill(~ok, torch.finfo(scores.dtype).min), dim=-1)
        return F.dropout(probs, self.dropout) if self.training and self.dropout else probs

    def _dense(self, qb, k, v, ks, vs, slot_ok, real_q, mask) -> tuple[Tensor, Tensor]:
        """Reference: explicit scores of every query slot against all Sk keys (its own block masked in)
        and all nB * b sorted slots (its own sorted block masked in), one softmax."""
        bsz, h, n, b, d = qb.shape
        s_k, rep = mask.k_len, h // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, H, Sk, Dh]
        q = qb.reshape(bsz, h, n * b, d)
        pos = torch.arange(n * b, device=q.device)
        same = pos[:, None] // b == pos[None, :] // b  # [P, P] same block
        qp = pos.clamp(max=s_k - 1).expand(bsz, 1, -1)[..., None]
        own_ok = _pair_ok(mask, qp, pos[:s_k].expand(bsz, 1, 1, -1)) & same[:, :s_k] & real_q.reshape(-1, 1)
        sorted_ok = slot_ok.reshape(bsz, h, n * b, b).repeat(1, 1, 1, n) & same  # [B, H, P, P]
        ok = torch.cat((own_ok.expand(bsz, h, -1, -1), sorted_ok), dim=-1)  # [B, H, P, Sk + P]
        scores = q @ torch.cat((k, ks.reshape(bsz, h, n * b, d)), dim=2).transpose(-1, -2)
        probs = self._probs(scores, ok)
        return probs @ torch.cat((v, vs.reshape(bsz, h, n * b, d)), dim=2), ok
