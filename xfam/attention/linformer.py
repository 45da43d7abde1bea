"""Linformer: self-attention with linear complexity (Wang et al., 2020, arXiv:2006.04768).

Keys and values are projected along the sequence to k << n rows before softmax attention (eq. 7):

    head_i = softmax(q_i (E_i K_i)^T / sqrt(Dh)) (F_i V_i),   E_i, F_i in R^{k x n},  n = max_len

Shapes: q ``[B, H, Sq, Dh]``, k/v ``[B, Hkv, Sk, Dh]`` with Sk <= max_len, projected keys/values
``[B, Hkv, k, Dh]``, scores ``[B, H, Sq, k]``: O(n k) time and memory.

* Sharing (sec. 4): ``none`` (E_i, F_i per key/value head), ``headwise`` (one E, F per layer),
  ``kv`` (one E = F per layer), ``layerwise`` (one E = F for every layer of the model, kept in the
  model's injected ``shared`` dict).
* Projections: ``linear`` (learned E, F, initialised N(0, 1/k) as in the paper's JL construction,
  Theorem 1), and the paper's general projections with kernel = stride = n / k: ``mean`` and
  ``max`` pooling and a strided ``conv`` (a Conv1d over the head dimension's channels, no bias).
* ``init=identity``: E = F = I with k = n, the degenerate limit that equals dense attention.
* Shorter sequences and padding: keys are padded to n with the padding masked out before projecting
  (padded keys and values are zeroed, so they contribute nothing; pooling averages or maximises over
  real keys only), and a projected row that mixes no real key is masked out of the softmax. So any
  length up to n works and key padding is honoured. Packed documents (segments) project each
  document's keys separately; other per-query masks (a window) use the ``reference`` path, where each
  query attends to the projection of exactly the keys it may see (O(n^2 k), for tests).

Linformer mixes positions along the sequence, so it cannot be causal (``causal = False``: a causal
model is refused at build time) and has no (query, key) pairs for a score bias.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.attention._base import ATTENTION, AttentionMechanism
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.logs import log_once
from xfam.core.mask import AttnMask
from xfam.core.registry import Positive, Probability
from xfam.core.state import expand_kv


class SeqProjection(nn.Module):
    """One projection along the sequence: ``[B, Q, Hkv, Sk, Dh]`` keys -> ``[B, Q, h, k, Dh]`` rows.

    ``Q`` is 1 (every query sees the same keys) or Sq (the per-query reference); ``h`` is 1 (shared
    by heads) or Hkv.
    """

    decay_params = (
        "weight",
    )  # the projection matrix decays like a Linear weight (xfam.training.lit.optim.param_groups)

    def __init__(self, kind: str, k: int, max_len: int, heads: int, head_dim: int, init: str):
        super().__init__()
        self.kind, self.k, self.max_len = kind, k, max_len
        if kind == "linear":
            w = torch.eye(k, max_len).expand(heads, k, max_len).clone() if init == "identity" else None
            self.weight = nn.Parameter(w if w is not None else torch.randn(heads, k, max_len) / math.sqrt(k))
        elif kind == "conv":
            r = max_len // k
            self.weight = nn.Parameter(torch.randn(heads, head_dim, head_dim, r) / math.sqrt(head_dim * r))

    def forward(self, x: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """``x [B, Q, Hkv, Sk, Dh]``, ``keep [B, Q, Sk]`` (True: a real, visible key) -> rows and their mask."""
        sk = x.shape[-2]
        x = torch.where(keep[:, :, None, :, None], x, 0.0)  # padded keys contribute nothing
        if self.kind == "linear":
            e = self.weight[..., :sk].to(x.dtype)  # columns past Sk would multiply zero padding
            ok = torch.einsum("hrj,bqj->bqhr", e.abs(), keep.to(x.dtype)) > 0  # [B, Q, h, k]
            return torch.einsum("hrj,bqhjd->bqhrd", e, x), ok
        pad = self.max_len - sk  # pad to n: windows of r = n / k consecutive keys
        x, keep = F.pad(x, (0, 0, 0, pad)), F.pad(keep, (0, pad))
        xw = x.unflatten(-2, (self.k, -1))  # [B, Q, Hkv, k, r, Dh]
        kw = keep.unflatten(-1, (self.k, -1))[:, :, None]  # [B, Q, 1, k, r]
        count = kw.sum(-1)  # [B, Q, 1, k]
        if self.kind == "mean":
            rows = xw.sum(-2) / count.clamp_min(1)[..., None]
        elif self.kind == "max":
            rows = xw.masked_fill(~kw[..., None], float("-inf")).amax(-2)
            rows = torch.where((count > 0)[..., None], rows, 0.0)
        else:  # conv: kernel = stride = r over the sequence, channels = Dh
            rows = torch.einsum("hoiu,bqhkui->bqhko", self.weight.to(x.dtype), xw)
        return rows, count > 0


@ATTENTION.register("linformer")
class Linformer(AttentionMechanism):
    """Softmax attention over k projected keys/values.

    Args:
        k: projected length (1..max_len; a divisor of max_len for pooling/conv).
        sharing: ``none`` | ``headwise`` | ``kv`` | ``layerwise`` (see the module docstring).
        projection: ``linear`` | ``mean`` | ``max`` | ``conv``.
        init: ``normal`` (N(0, 1/k)) or ``identity`` (E = F = I, needs k = max_len; linear only).
        backend: ``auto`` or ``projected`` (shared projections; a window mask falls back to the
            per-query reference, logged once), or ``reference``.
        dropout: dropout on the attention probabilities.
    """

    paper = "Wang et al., 2020, arXiv:2006.04768"

    causal = False
    accepts_bias = False
    accepts_memory = False
    shared_keys = False  # its projected path projects each document's run of keys apart
    cross_attention = True  # E, F project up to max_len keys of any sequence
    backends = ("projected", "reference")

    def __init__(
        self,
        *,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        shared: dict | None = None,
        k: Annotated[int, Positive] = 256,
        sharing: Literal["none", "headwise", "kv", "layerwise"] = "headwise",
        projection: Literal["linear", "mean", "max", "conv"] = "linear",
        init: Literal["normal", "identity"] = "normal",
        backend: Literal["auto", "projected", "reference"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        super().__init__()
        self.max_len, self.backend, self.dropout = max_len, backend, dropout

        def make() -> SeqProjection:
            return SeqProjection(projection, k, max_len, kv_heads if sharing == "none" else 1, head_dim, init)

        if sharing == "layerwise":
            key = ("linformer", projection, k, max_len, head_dim, init)
            shared = shared if shared is not None else {}
            if key not in shared:
                shared[key] = make()
            self.proj_k = self.proj_v = shared[key]
        else:
            self.proj_k = make()
            self.proj_v = self.proj_k if sharing == "kv" else make()

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        if k.shape[2] > self.max_len:
            raise ValueError(f"attention=linformer projects at most max_len={self.max_len} keys, got {k.shape[2]}")
        b, sk = q.shape[0], k.shape[2]
        if self._path(mask) == "reference":
            allowed = mask.dense(q.device)  # [B|1, 1, Sq, Sk] or None
            keep = q.new_ones(1, 1, sk, dtype=torch.bool) if allowed is None else allowed[:, 0]
            return self._attend(q, k[:, None], v[:, None], keep.expand(b, -1, -1))  # [B, Sq, Sk]
        keep = q.new_ones(b, sk, dtype=torch.bool) if mask.key_padding is None else mask.key_padding.to(q.device)
        if mask.segments is None:
            return self._attend(q, k[:, None], v[:, None], keep[:, None])
        seg = mask.segments.to(q.device)
        out = torch.zeros_like(q)
        for doc in torch.unique(seg):  # each document's keys projected on their own
            in_doc = seg == doc  # [B, Sk]
            part = self._attend(q, k[:, None], v[:, None], (keep & in_doc)[:, None])
            out = torch.where(in_doc[:, None, mask.offset :, None], part, out)
        return out

    def _path(self, mask: AttnMask) -> str:
        if self.backend == "reference":
            return "reference"
        if mask.window is None and not mask.causal:
            log_once(f"attention=linformer backend={self.backend}: projected path")
            return "projected"
        # Same mathematics, only slower: logged once, not an error.
        log_once(f"attention=linformer backend={self.backend}: per-query reference path (O(n^2 k)) for a window mask")
        return "reference"

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
        """Attention of ``q [B, H, Sq, Dh]`` over the projections of ``k, v [B, 1, Hkv, Sk, Dh]`` restricted
        to ``keep [B, Q, Sk]`` (Q = 1: one key set for all queries; Q = Sq: one per query)."""
        heads = q.shape[1]
        kp, ok = self.proj_k(k, keep)  # [B, Q, h, k, Dh], [B, Q, h, k]
        vp, _ = self.proj_v(v, keep)  # the same module as proj_k when E = F

        def heads_first(x: Tensor) -> Tensor:  # [B, Q, h, ...] -> [B, H|1, Q, ...]
            x = x.transpose(1, 2)
            return x if x.shape[1] == 1 else expand_kv(x, heads)

        kp, vp, ok = heads_first(kp), heads_first(vp), heads_first(ok)
        ok = ok | ~ok.any(-1, keepdim=True)  # no real key at all: uniform over all-zero rows, output 0
        if keep.shape[1] == 1:
            scores = q @ kp[:, :, 0].transpose(-1, -2)  # [B, H, Sq, k]
            ok = ok[:, :, 0, None]
        else:
            scores = torch.einsum("bhqd,bhqrd->bhqr", q, kp.expand(-1, heads, -1, -1, -1))
        scores = (scores / math.sqrt(q.shape[-1])).masked_fill(~ok, float("-inf"))
        probs = torch.softmax(scores, -1)
        if self.training and self.dropout:
            probs = F.dropout(probs, self.dropout)
        if keep.shape[1] == 1:
            return probs @ vp[:, :, 0]  # [B, H, Sq, Dh]
        return torch.einsum("bhqr,bhqrd->bhqd", probs, vp.expand(-1, heads, -1, -1, -1))

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        n, k = ctx.get("max_len"), params["k"]
        out: list[str] = []
        if n is None:
            return out
        if k > n:
            out.append(f"k={k} exceeds model.max_len={n}; valid: 1..{n}. Fix: set attention.k <= {n}.")
        elif params["projection"] != "linear" and n % k:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            near = sorted(divisors, key=lambda d: abs(d - k))[:4]
            out.append(
                f"projection={params['projection']} pools windows of max_len / k positions, so k must divide "
                f"model.max_len={n}; k={k} does not. Fix: a divisor of {n}, e.g. one of {sorted(near)}."
            )
        if params["init"] == "identity" and (k != n or params["projection"] != "linear"):
            out.append(
                f"init=identity (E = F = I) needs projection=linear and k = model.max_len={n}. "
                f"Fix: set attention.k={n} and attention.projection=linear, or init=normal."
            )
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"k": seq_len, "init": "identity"}
