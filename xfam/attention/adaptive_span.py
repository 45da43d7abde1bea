"""Adaptive attention span (Sukhbaatar, Grave, Bojanowski & Joulin, ACL 2019, arXiv:1905.07799).

Each head h learns a span ``z_h`` in ``[0, S]`` (``S = max_span``, by default the model's
``max_len``). A key at distance ``x = i - j`` from query ``i`` is weighted by the soft mask

    m_z(x) = clamp((R + z - x) / R, 0, 1)          (R = ``ramp``: 1 up to x = z, 0 from x = z + R)

and the weights are renormalised after masking (paper eq. 3):

    a_ij = m_z(i - j) exp(s_ij) / sum_k m_z(i - k) exp(s_ik),    s = q k^T / sqrt(Dh) (+ score bias)

The L1 span penalty ``span_loss * mean_h z_h`` (the paper's ``lambda / M * sum_i z_i`` for the M heads
of a layer; the model sums the layers) is returned by ``aux_losses()`` as ``span`` and logged as
``train/attention/span``. Dynamic span (paper sec. 3.2) predicts ``z_t = S sigmoid(v . x_t + b)`` per
head and query; a mechanism sees only q, k and v, so ``x_t`` is the query ``q_t`` of the head (after
any rotary encoding), with ``v [H, Dh]`` and ``b [H]`` learned.

Shapes: q ``[B, H, Sq, Dh]``, k, v ``[B, Hkv, Sk, Dh]`` -> ``[B, H, Sq, Dh]``; spans ``[H]`` (static)
or ``[B, H, Sq]`` (dynamic).

Paths (``backend``):

* ``block`` (fast, O(Sq * window)): a key with ``x >= z + R`` gets ``m = 0``, so only keys less than
  ``window = floor(R + max z) + 1`` positions away are visited (rounded up to a multiple of ``block`` so
  the shapes change only when a span crosses a block boundary: no reshaping every step, at most
  ``(S + R) / block`` distinct shapes for a compiler). The window is re-derived from the spans at
  every call, through the block engine's banded geometry (``xfam.attention._sparse``). The mask
  enters as ``log m`` added to the scores (``softmax(s + log m)`` is the renormalised formula);
  ``x`` is the same for every query block of a band, so a static mask is one ``[H, b, K*b]`` tile.
* ``dense``: the formula literally over ``Sq x Sk`` (``m * exp(s)``, renormalised), the reference.
* ``triton`` (static spans, ``auto`` on CUDA): the flash kernel with the soft mask in-kernel
  (``xfam.attention._fused``): its loops stop at the largest reach, and it returns d z_h itself.

The span is stored, as in the authors' code, as a ratio in ``[0, 1]`` times ``S`` (so an optimiser
moves it by a fraction of S per step) and projected back onto ``[0, 1]`` after each update; here
at the start of the next forward, which gives the same trajectory as clamping after the step.
Keys in front of the queries (memory, decode cache) lie at their key-index distance, so a span
may reach into memory. Bidirectional use (not in the paper, which is about language models) takes
the symmetric distance ``x = |i - j|``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.attention import _fused as fused
from xfam.attention._base import ATTENTION, AttentionMechanism
from xfam.attention._sparse.engine import _additive, _batch_ok, _blocks, _keys, _pairs, _softmax, geometry
from xfam.attention.local import WindowPattern
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask
from xfam.core.registry import NonNegative, Positive, Probability, Range
from xfam.core.state import expand_kv

#: ``log m`` where ``m = 0``: exp underflows to exactly 0 (fp32 and fp64) while the scores stay finite,
#: so a padding row whose visible keys are all out of span cannot turn into NaN.
ZERO_LOG = -1e4


def span_mask(z: Tensor, dist: Tensor, ramp: float) -> Tensor:
    """``m_z(x) = clamp((R + z - x) / R, 0, 1)`` for spans ``z`` and distances ``dist`` (broadcast)."""
    return ((ramp + z - dist) / ramp).clamp(0, 1)


def log_span_mask(z: Tensor, dist: Tensor, ramp: float) -> Tensor:
    """``log m_z(x)``, ``ZERO_LOG`` where ``m = 0`` (finite gradients everywhere)."""
    m = span_mask(z, dist, ramp)
    return torch.where(m > 0, m.clamp_min(1e-30).log(), ZERO_LOG)


def span_band_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    z: Tensor,
    ramp: float,
    pattern: WindowPattern,
    mask: AttnMask,
    bias: ScoreBias | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """Fast path: the keys of ``pattern``'s band (``|i - j| < window``) only, weighted by the span mask.

    ``z``: spans in positions, ``[H]`` or ``[B, H, Sq]``. Mirrors ``block_sparse_attention``'s banded
    path, with the span mask added as ``log m``.
    """
    bsz, h, s_q, d = q.shape
    k, v = expand_kv(k, h), expand_kv(v, h)  # [B, H, Sk, Dh]
    geo = geometry(pattern, mask, q.device)
    b, n_q = pattern.block, geo.k_pos.shape[1]
    qb = _blocks(q * (1 / math.sqrt(d)), n_q, b)  # [B, H, nQ, b, Dh]
    kg, vg = _keys(k, geo, b), _keys(v, geo, b)  # [B, H, nQ, Kb, Dh]
    scores = qb @ kg.transpose(-1, -2)  # [B, H, nQ, b, Kb]
    # Banded layout: key column c of every query block lies at the same distance from query row r.
    dist = (geo.q_pos[0, :, None] - geo.k_pos[0, 0, None, :]).abs().to(z.dtype)  # [b, Kb]
    if z.dim() == 1:
        log_m = log_span_mask(z.view(h, 1, 1, 1), dist, ramp)  # [H, 1, b, Kb]
    else:
        zq = F.pad(z, (0, n_q * b - s_q)).view(bsz, h, n_q, b, 1)  # [B, H, nQ, b, 1]
        log_m = log_span_mask(zq, dist, ramp)  # [B, H, nQ, b, Kb]
    scores = scores.add_(log_m.to(scores.dtype))  # in place: the matmul does not keep its output
    if bias is not None:  # on the visited pairs; out-of-range positions are masked, clamp keeps them defined
        q_pos, k_pos = geo.q_pos.clamp(max=mask.k_len - 1), geo.k_pos.clamp(0, mask.k_len - 1)
        scores = scores + _pairs(bias, q_pos[None, :, :, None], k_pos[:, :, None, :]).to(scores.dtype)
    extra = _batch_ok(mask, geo.k_pos, geo.q_pos)  # padding / documents, or None
    if extra is None:
        probs = torch.softmax(scores.add_(_additive(geo, scores.dtype)), dim=-1)
        empty = None if geo.rows_ok else ~geo.ok.any(-1)[None]  # [1, 1, nQ, b]
        probs = probs if empty is None else probs * ~empty[..., None]
    else:  # a padding query may see only keys beyond its span: it then sees nothing (attends to itself)
        ok = geo.ok[None] & extra & (log_m > ZERO_LOG)  # [B, H, nQ, b, Kb]
        probs, empty = _softmax(scores, ok), ~ok.any(-1)
    if dropout:
        probs = F.dropout(probs, dropout)
    out = (probs @ vg).reshape(bsz, h, n_q * b, d)[:, :, :s_q]  # [B, H, Sq, Dh]
    if empty is not None:  # the AttnMask convention: a query that may see nothing attends to itself
        empty = empty.expand(bsz, h, n_q, b).reshape(bsz, h, n_q * b, 1)[:, :, :s_q]
        out = torch.where(empty, v[:, :, mask.offset : mask.offset + s_q], out)
    return out


def span_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    z: Tensor,
    ramp: float,
    mask: AttnMask,
    bias: ScoreBias | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """The paper's formula over all ``Sq x Sk`` pairs: ``m * exp(s)``, renormalised per query."""
    h = q.shape[1]
    k, v = expand_kv(k, h), expand_kv(v, h)  # [B, H, Sk, Dh]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # [B, H, Sq, Sk]
    if bias is not None:
        s = s + bias.dense(mask, s.dtype)
    q_pos, k_pos = mask.positions(q.device)
    dist = (q_pos[:, None] - k_pos[None, :]).abs().to(z.dtype)  # [Sq, Sk]
    m = span_mask(z.view(h, 1, 1) if z.dim() == 1 else z[..., None], dist, ramp).to(s.dtype)  # [B|1, H, Sq, Sk]
    allowed = mask.dense(q.device)  # [B|1, 1, Sq, Sk] or None
    keep = m > 0 if allowed is None else allowed & (m > 0)
    # Only a padding query can see keys that all lie beyond its span (its own key is always inside):
    # like a query that may see nothing (the AttnMask convention), it attends to itself.
    alone = (q_pos[:, None] == k_pos[None, :]) & ~keep.any(-1, keepdim=True)
    keep, m = keep | alone, torch.where(alone, 1.0, m)
    s = s.masked_fill(~keep, float("-inf"))
    e = torch.exp(s - s.detach().amax(-1, keepdim=True)) * m
    probs = e / e.sum(-1, keepdim=True)
    if dropout:
        probs = F.dropout(probs, dropout)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v)


@ATTENTION.register("adaptive_span")
class AdaptiveSpan(AttentionMechanism):
    """Softmax attention under a learned per-head (or per-query) soft span; see the module docstring.

    Args:
        max_span: S, the largest span; null = ``model.max_len``.
        ramp: R, the length of the mask's linear ramp from 1 to 0 (the paper uses 32).
        init_span: initial span as a fraction of S (the authors' ``adapt_span_init``, 0 in the paper).
        span_loss: coefficient of the L1 span penalty per layer (the paper's lambda, 2e-6 on enwik8).
        dynamic: predict the span of each query from it, ``z_t = S sigmoid(v . q_t + b)``.
        block: tile size of the banded fast path (speed only; the result does not depend on it).
        backend: ``auto`` (the flash kernel on CUDA for static spans, else the banded block path),
            ``block``, ``dense`` (the reference) or ``triton`` (static spans).
        dropout: dropout on the attention probabilities.
    """

    decay_params = ("span_proj",)  # the dynamic span's weights (xfam.training.lit.optim)

    paper = "Sukhbaatar et al., 2019, arXiv:1905.07799"

    aux_loss = True
    backends = ("block", "dense", "triton")

    def __init__(
        self,
        *,
        heads: int,
        head_dim: int,
        max_len: int,
        max_span: Annotated[int, Positive] | None = None,
        ramp: Annotated[int, Positive] = 32,
        init_span: Annotated[float, Range(ge=0, le=1)] = 0.0,
        span_loss: Annotated[float, NonNegative] = 2e-6,
        dynamic: bool = False,
        block: Annotated[int, Positive] = 64,
        backend: Literal["auto", "block", "dense", "triton"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        super().__init__()
        self.max_span, self.ramp, self.span_loss = max_span or max_len, ramp, span_loss
        self.dynamic, self.block, self.backend, self.dropout = dynamic, block, backend, dropout
        if dynamic:
            frac = min(max(init_span, 1e-4), 1 - 1e-4)
            self.span_proj = nn.Parameter(torch.zeros(heads, head_dim))  # v, one per head
            self.span_bias = nn.Parameter(torch.full((heads,), math.log(frac / (1 - frac))))  # b
        else:
            self.span_ratio = nn.Parameter(torch.full((heads,), float(init_span)))  # z / S
        self._aux: dict[str, Tensor] = {}
        self._patterns: dict[tuple[int, bool], WindowPattern] = {}

    def spans(self, q: Tensor | None = None) -> tuple[Tensor, float]:
        """Spans in positions (``[H]``, or ``[B, H, Sq]`` from ``q`` when dynamic) and their maximum.

        A static span ratio outside ``[0, 1]`` (after an optimiser step) is projected back first.
        """
        if self.dynamic:
            assert q is not None  # (dynamic spans are the queries')
            logit = torch.einsum("bhsd,hd->bhs", q, self.span_proj.to(q.dtype)) + self.span_bias.to(q.dtype)[:, None]
            z = self.max_span * torch.sigmoid(logit)  # [B, H, Sq]
            return z, float(z.detach().max())
        lo, hi = torch.stack(torch.aminmax(self.span_ratio.detach())).tolist()
        if lo < 0 or hi > 1:
            self.span_ratio.data.clamp_(0, 1)  # the paper's clamp after each update
            hi = min(max(hi, 0.0), 1.0)
        return self.max_span * self.span_ratio, self.max_span * hi

    def window(self, z_max: float, k_len: int) -> int:
        """Keys at least ``window`` positions away have ``m = 0`` for every head: the band to visit."""
        reach = math.floor(self.ramp + z_max) + 1  # m > 0 exactly when x < R + z
        up = lambda n: -(-n // self.block) * self.block  # noqa: E731
        return min(up(reach), up(k_len))

    def _pattern(self, window: int, causal: bool) -> WindowPattern:
        # One pattern per window: the engine caches its geometry on it. Spans move slowly, so the
        # current and the previous window suffice.
        key = (window, causal)
        if key not in self._patterns:
            if len(self._patterns) >= 2:
                self._patterns.pop(next(iter(self._patterns)))
            self._patterns[key] = WindowPattern(window, self.block, causal)
        return self._patterns[key]

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        z, z_max = self.spans(q)
        self._aux = {"span": self.span_loss * z.mean()}
        p = self.dropout if self.training else 0.0
        dynamic = "per-query (dynamic) spans" if self.dynamic else None
        path = fused.choose("adaptive_span", self.backend, "block", q, mask, bias, p, modifier, dynamic)
        if path == "dense":
            return span_reference(q, k, v, z, self.ramp, mask, bias, p)
        if path == "triton":  # the soft mask in-kernel; keys beyond the largest reach are never visited
            return fused.flash(q, k, v, mask, bias, span=z, span_ramp=float(self.ramp))
        pattern = self._pattern(self.window(z_max, mask.k_len), mask.causal)
        return span_band_attention(q, k, v, z, self.ramp, pattern, mask, bias, p)

    def aux_losses(self) -> dict[str, Tensor]:
        return self._aux

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        dynamic = "per-query (dynamic) spans" if params.get("dynamic") else None  # (as ``forward`` refuses them)
        return fused.triton_refusals(cls, params, selection, "block", (dynamic,))

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        max_len, span = ctx.get("max_len"), params["max_span"]
        if max_len is not None and span is not None and span > max_len:
            return [
                f"max_span={span} is larger than model.max_len={max_len}; valid: 1..{max_len}, or null for "
                f"max_len (a span covering the sequence). Keys farther than max_len exist only with memory in "
                f"front of the segment: then raise model.max_len to memory plus segment length. "
                f"Fix: set attention.max_span <= {max_len} or null."
            ]
        return []

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        # z = S = seq_len: m(x) = 1 for every distance x < seq_len, i.e. dense softmax attention.
        return {"max_span": seq_len, "init_span": 1.0, "dynamic": False}
