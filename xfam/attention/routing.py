"""Routing attention (Roy et al., 2021, "Efficient Content-Based Sparse Attention with Routing
Transformers", TACL; arXiv:2003.05997, sec. 4).

Queries and keys are normalised without affine terms (``LN(x)``, |x|^2 = Dh) and routed by online
k-means to the nearest of ``n_clusters`` centroids ``mu [H, C, Dh]``, shared by queries and keys
(one set per layer and head); a query attends to the keys of its cluster:
``X'_i = sum_{j: mu(K_j) = mu(Q_i)} A_ij V_j`` with ``A = softmax(Q K^T / sqrt(Dh))`` of the model's q, k
(routing uses the normalised vectors, scores the raw ones, so one cluster is exactly dense attention).

* Bidirectional: balanced assignment as the paper's implementation: each cluster takes the ``window``
  queries and the ``window`` keys nearest its centroid (top-k, so every cluster has the same size);
  a query's outputs are averaged over the clusters that chose it (as the reference code's
  scatter-mean); a query no cluster chose attends to itself.
* Causal: a top-k over the whole sequence lets a future token push a past one out of a cluster (a
  causal leak), so each position is routed once, by its query (the reference LM shares q and k the same
  way), sorted by (cluster, position) and cut into balanced groups of ``window`` consecutive members;
  a query sees its own group and the previous one of its cluster, causally (the bucket-aligned chunk
  engine of ``xfam.attention.lsh``). Group membership depends only on earlier positions.

Centroids are buffers (they travel in checkpoints), updated in training, when autograd records (so
a reversible stack's no-grad forward neither updates twice nor routes its recomputation differently),
by an exponential moving average of the mean of the vectors routed to each cluster:
``mu_c <- decay * mu_c + (1 - decay) * mean{x : mu(x) = c}`` (the paper's eq. adds the sum; the reference
code normalises by EMA counts: the mean keeps centroids on the scale of the normalised vectors);
clusters that received nothing keep their centroid. Under DDP the sums are all-reduced first. The
reference code's commitment loss ``commitment * mean |x - sg(mu(x))|^2`` is returned by ``aux_losses``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from xfam.attention._base import ATTENTION, AttentionMechanism
from xfam.attention.lsh import _gather_rows, _pair_ok, _pairs_bias, bucket_attention, combine_rounds, recompute
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.logs import log_once
from xfam.core.mask import AttnMask
from xfam.core.registry import NonNegative, Positive, Probability
from xfam.core.state import DecodeState, expand_kv


@ATTENTION.register("routing")
class Routing(AttentionMechanism):
    """Content-based sparse attention through online k-means routing (see the module docstring).

    Args:
        n_clusters: centroids per head (the paper uses about sqrt(L)).
        window: cluster size (bidirectional top-k) or group size (causal); the paper sets it to
            ``L / n_clusters``.
        decay: EMA decay of the centroids (the paper's lambda).
        commitment: weight of the commitment loss (0 disables it).
        backend: ``auto`` (grouped gathers), ``grouped`` or ``dense`` (an L x L reference of the same rule).
        dropout: dropout on the attention probabilities.
    """

    paper = "Roy et al., 2021, arXiv:2003.05997"
    accepts_memory = False
    aux_loss = True  # the commitment loss
    backends = ("grouped", "dense")
    centroids: Tensor  # [H, C, Dh], a buffer

    def __init__(
        self,
        *,
        heads: int,
        head_dim: int,
        n_clusters: Annotated[int, Positive] = 4,
        window: Annotated[int, Positive] = 128,
        decay: Annotated[float, Probability] = 0.999,
        commitment: Annotated[float, NonNegative] = 1e-4,
        backend: Literal["auto", "grouped", "dense"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        super().__init__()
        self.n_clusters, self.window, self.decay, self.commitment = n_clusters, window, decay, commitment
        self.backend, self.dropout = backend, dropout
        self.register_buffer("centroids", F.layer_norm(torch.randn(heads, n_clusters, head_dim), (head_dim,)))
        self._aux: dict[str, Tensor] = {}

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        max_len, out = ctx.get("max_len"), []
        for key in ("window", "n_clusters"):
            if max_len is not None and params[key] > max_len:
                out.append(
                    f"{key}={params[key]} is larger than model.max_len={max_len}; valid: 1..{max_len}. "
                    f"Fix: set attention.{key} <= {max_len}."
                )
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"n_clusters": 1, "window": seq_len}

    def aux_losses(self) -> dict[str, Tensor]:
        return self._aux

    def assign(self, x: Tensor) -> Tensor:
        """Nearest centroid ``[B, H, L]`` of normalised vectors ``x [B, H, L, Dh]``."""
        mu = self.centroids.to(x.dtype)
        return (x @ mu.transpose(-1, -2) - 0.5 * mu.pow(2).sum(-1)[:, None]).argmax(-1)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        heads, dense = q.shape[1], self.backend == "dense"
        if self.backend == "auto":
            log_once("attention=routing backend=auto: grouped path")
        k, v = expand_kv(k, heads), expand_kv(v, heads)  # [B, H, Sk, Dh]
        p = self.dropout if self.training else 0.0
        pad = mask.key_padding
        qn = F.layer_norm(q, q.shape[-1:])
        if mask.causal:  # positions are routed by their queries only
            out, q_clusters = self._causal(q, k, v, qn, mask, bias, p, dense)
            routed = []
        else:
            kn = F.layer_norm(k, k.shape[-1:])
            out, q_clusters = self._balanced(q, k, v, qn, kn, mask, bias, p, dense)
            routed = [(kn, self.assign(kn), pad)]
        routed.append((qn, q_clusters, None if pad is None else pad[:, mask.offset :]))
        if self.commitment:
            losses = [self._commitment(x, a, ok) for x, a, ok in routed]
            self._aux = {"routing": self.commitment * cast(Tensor, sum(losses)) / len(losses)}
        if self.training and torch.is_grad_enabled():
            self._update(routed)
        return out

    def _causal(self, q, k, v, qn, mask, bias, p, dense) -> tuple[Tensor, Tensor]:
        off = mask.offset
        if off and self.n_clusters > 1:
            raise ValueError(
                "causal attention=routing routes every position by its query, so keys in front of the queries "
                "(memory) cannot be routed; use decode() for generation (it recomputes the prefix)."
            )
        clusters = self.assign(qn)
        if off:  # one cluster: placeholder queries for the keys in front, their rows dropped below
            q = F.pad(q, (0, 0, off, 0))
            clusters = F.pad(clusters, (off, 0))
            mask = AttnMask(mask.k_len, mask.k_len, True, mask.key_padding, mask.segments, mask.window)
        out, lse = bucket_attention(q, k, v, clusters[:, :, None], self.window, mask, bias, False, p, dense)
        return combine_rounds(out, lse, v)[:, :, off:], clusters[:, :, off:]

    def _balanced(self, q, k, v, qn, kn, mask, bias, p, dense) -> tuple[Tensor, Tensor]:
        """Each cluster takes its ``window`` nearest queries and keys; outputs averaged over clusters."""
        bsz, h, s_q, d = q.shape
        pad = mask.key_padding
        q_idx = self.members(qn, None if pad is None else pad[:, mask.offset :])
        k_idx = self.members(kn, pad)
        q_pos, k_pos = q_idx[..., :, None] + mask.offset, k_idx[..., None, :]  # key coordinates
        ok = _pair_ok(mask, q_pos, k_pos)  # [B, H, C, wq, wk]
        if dense:  # the same rule over all pairs: cluster membership masks, one softmax per cluster
            member = lambda idx, n: idx.new_zeros(*idx.shape[:3], n, dtype=torch.bool).scatter_(-1, idx, True)  # noqa: E731
            all_q, all_k = mask.positions(q.device)
            ok = member(q_idx, s_q)[..., :, None] & member(k_idx, mask.k_len)[..., None, :]
            all_q, all_k = all_q.expand(bsz, 1, 1, -1)[..., None], all_k.expand(bsz, 1, 1, 1, -1)
            ok = ok & _pair_ok(mask, all_q, all_k)  # [B, H, C, Sq, Sk]
            scores = (q @ k.transpose(-1, -2))[:, :, None] / math.sqrt(d)  # [B, H, 1, Sq, Sk]
            if bias is not None:
                scores = scores + bias.dense(mask, scores.dtype)[:, :, None]
            vs, rows = v[:, :, None], member(q_idx, s_q)
        else:
            scores = _gather_rows(q, q_idx) @ _gather_rows(k, k_idx).transpose(-1, -2) / math.sqrt(d)
            if bias is not None:
                scores = scores + _pairs_bias(bias, q_pos, k_pos).to(scores.dtype)
            vs, rows = _gather_rows(v, k_idx), None
        hit = ok.any(-1)  # [B, H, C, wq | Sq]: the row sees a key of this cluster
        probs = torch.softmax(scores.masked_fill(~ok, torch.finfo(scores.dtype).min), dim=-1) * hit[..., None]
        if p:
            probs = F.dropout(probs, p)
        o = probs @ vs  # [B, H, C, wq | Sq, Dh]
        if dense:
            hit = hit & rows
            total, count = o.sum(2), hit.sum(2)
        else:
            flat = q_idx + (torch.arange(bsz * h, device=q.device) * s_q).view(bsz, h, 1, 1)
            total = torch.zeros(bsz * h * s_q, d, dtype=o.dtype, device=o.device).index_add(
                0, flat.flatten(), o.reshape(-1, d)
            )
            count = torch.zeros(bsz * h * s_q, dtype=o.dtype, device=o.device).index_add(
                0, flat.flatten(), hit.flatten().to(o.dtype)
            )
            total, count = total.view(bsz, h, s_q, d), count.view(bsz, h, s_q)
        own = v[:, :, mask.offset :]
        out = torch.where(count[..., None] > 0, total / count.clamp_min(1)[..., None], own)
        return out, self.assign(qn)

    def members(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        """Balanced assignment: the ``window`` positions nearest each centroid, ascending,
        ``[B, H, C, window]`` (padded positions, ``keep`` False, are never preferred)."""
        mu = self.centroids.float()  # (fp32: CPU cdist has no bf16/fp16 kernel)
        dist = torch.cdist(x.detach().float(), mu[None].expand(x.shape[0], -1, -1, -1))  # [B, H, L, C]
        if keep is not None:
            dist = dist.masked_fill(~keep[:, None, :, None], float("inf"))
        return dist.topk(min(self.window, x.shape[2]), dim=2, largest=False).indices.transpose(-1, -2).sort(-1).values

    def _commitment(self, x: Tensor, clusters: Tensor, keep: Tensor | None) -> Tensor:
        """``mean |x - sg(mu(x))|^2`` over real (unpadded) positions."""
        mu = self.centroids.to(x.dtype)
        near = mu[torch.arange(mu.shape[0], device=x.device)[:, None], clusters]  # [B, H, L, Dh]
        err = (x - near.detach()).pow(2).mean(-1)  # [B, H, L]
        if keep is None:
            return err.mean()
        w = keep[:, None, :].to(err.dtype).expand_as(err)
        return (err * w).sum() / w.sum().clamp_min(1)

    @torch.no_grad()
    def _update(self, routed: list[tuple[Tensor, Tensor, Tensor | None]]) -> None:
        """EMA of each cluster's mean routed vector (see the module docstring)."""
        h, c, d = self.centroids.shape
        sums = torch.zeros(h, c, d, dtype=self.centroids.dtype, device=self.centroids.device)
        counts = torch.zeros(h, c, dtype=self.centroids.dtype, device=self.centroids.device)
        for x, clusters, keep in routed:
            w = F.one_hot(clusters, c).to(sums.dtype)  # [B, H, L, C]
            if keep is not None:
                w = w * keep[:, None, :, None].to(w.dtype)
            sums += torch.einsum("bhlc,bhld->hcd", w, x.to(sums.dtype))
            counts += w.sum((0, 2))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(counts)
        mean = sums / counts.clamp_min(1)[..., None]
        moved = self.decay * self.centroids + (1 - self.decay) * mean
        self.centroids.copy_(torch.where(counts[..., None] > 0, moved, self.centroids))

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
        """Recompute the prefix (routing groups need every earlier query) and return the new rows."""
        return recompute(self, q, k, v, state, mask, bias)
