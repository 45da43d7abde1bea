"""Longformer attention (Beltagy, Peters & Cohan, 2020, "Longformer: The Long-Document Transformer",
arXiv:2004.05150, sec. 3.1 and 4.1).

Query i may see key j (positions are key indices, see ``AttnMask``; ``dist = i - j``) when

* sliding window of size w -- bidirectional: the w/2 keys on each side, ``|dist| <= w/2`` (sec. 3.1:
  "given a fixed window size w, each token attends to 1/2 w tokens on each side"); causal: the whole
  window looks back, ``0 <= dist <= w`` (the autoregressive mode of the authors' kernel). Either way w
  keys besides the query itself, so l layers see l * w positions;
* dilation d of the query's head -- the window has gaps of d: ``dist % d == 0`` and
  ``|dist| <= d * reach`` (reach = w/2, or w causal), the same w keys spread over w * d positions;
* global tokens G (chosen positions, e.g. 0 for a [CLS] token): ``i in G`` sees every key and every
  query sees ``j in G`` (symmetric global attention).

Output ``[B, H, Sq, Dh] = softmax(q k^T / sqrt(Dh) + bias over the allowed keys) v``; cost
O(Sq (w d + |G|) + |G| Sk) through the block engine (a banded window, global rows and columns apart),
never an Sq x Sk matrix. ``window: null`` removes the window (dense attention: the degenerate limit).

Not here: sec. 3.1's second set of projections (Q_g, K_g, V_g) for the global attention, initialised
as copies of the window's. A mechanism receives the projected q, k, v (the model owns projections,
docs/architecture.md), so global rows and columns reuse the window's projections; the pattern is exact.

Per-layer windows (sec. 4.1 grows w with depth) use the shared ``per_layer`` schedule::

    attention: {name: longformer, window: 512, per_layer: {"0-3": {window: 128}, "4-7": {window: 256}}}

Per-head dilation (sec. 4.1: none in the lower layers, a little on 2 heads above): ``dilation`` is one
integer for every head, or a list with one value per head (the engine's per-head layouts)::

    attention: {name: longformer, per_layer: {"6-11": {dilation: [1, 1, 1, 1, 1, 1, 2, 3]}}}

The block path visits the largest dilation's span (max(d) * w positions) for every head of the layer;
where only a few heads are dilated, the ``per_head`` schedule gives each head group its own span
(``per_head: [{heads: 6}, {heads: 2, dilation: 2}]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

import torch
from torch import Tensor

from xfam.attention import _static as static
from xfam.attention._base import ATTENTION
from xfam.attention._sparse import SparseMechanism, SparsePattern, auto_block, band_layout, window_band
from xfam.core.bias import ScoreBias
from xfam.core.registry import NonNegative, Positive, Probability
from xfam.core.state import DecodeState


class LongformerPattern(SparsePattern):
    """Dilated sliding window plus global positions (see the module docstring).

    ``reach``: keys up to ``reach * d`` positions away (None: no window); ``dilation``: one value per
    head (a single value when all heads share it).
    """

    def __init__(self, reach: int | None, dilation: tuple[int, ...], global_positions: tuple[int, ...], block: int):
        self.reach, self.dilation, self.block = reach, dilation, block
        self.heads = len(dilation)
        self.global_positions = global_positions
        self._d = torch.tensor(dilation)  # [Hp]

    def allowed(self, q_pos: Tensor, k_pos: Tensor, head: Tensor | None = None) -> Tensor:
        dist = q_pos - k_pos
        d = self._d.to(dist.device)[head] if head is not None else self.dilation[0]
        ok = dist.remainder(d) == 0
        return ok if self.reach is None else ok & (dist.abs() <= d * self.reach)

    def band(self, offset: int, causal: bool) -> tuple[int, int] | None:
        if self.reach is None:
            return None
        span = max(self.dilation) * self.reach
        return window_band(offset, self.block, span, 0 if causal else span)

    def layout(self, n_q: int, n_k: int, offset: int, causal: bool, device: torch.device) -> Tensor:
        band = self.band(offset, causal)
        if band is None:  # no window: every key block
            return torch.arange(n_k, device=device).expand(1, n_q, n_k)
        return band_layout(n_q, n_k, *band, device)


@ATTENTION.register("longformer")
class Longformer(SparseMechanism):
    """Sliding window with per-head dilation and global tokens (see the module docstring).

    Args:
        window: the paper's w: w/2 keys on each side (bidirectional, so w must be even) or the w
            keys before the query (causal); null for no window (dense: the degenerate limit).
        dilation: gap between window keys, one integer for all heads or one per head.
        global_tokens: positions with global attention (0: a [CLS] token in front). Positions are
            key indices of the whole input, counted from its first token.
        block: tile of the block engine (speed only; the result does not depend on it); null:
            ``auto_block`` of the window's reach.
        backend: ``auto`` (the flash kernel on CUDA, else the block engine), ``block``, ``dense`` (the
            reference) or ``triton``.
        dropout: dropout on the attention probabilities.
    """

    paper = "Beltagy, Peters & Cohan, 2020, arXiv:2004.05150"

    def __init__(
        self,
        *,
        heads: int,
        causal: bool,
        window: Annotated[int, Positive] | None = 512,
        dilation: Annotated[int, Positive] | tuple[Annotated[int, Positive], ...] = 1,
        global_tokens: tuple[Annotated[int, NonNegative], ...] = (0,),
        block: Annotated[int, Positive] | None = None,
        backend: Literal["auto", "block", "dense", "triton"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        per_head = (dilation,) if isinstance(dilation, int) else tuple(dilation)
        if len(set(per_head)) == 1:
            per_head = per_head[:1]  # shared by every head: one pattern row
        reach = None if window is None else window if causal else window // 2
        glob = tuple(sorted(set(global_tokens)))
        block = block or auto_block((reach or 128) * max(per_head))
        super().__init__(pattern=LongformerPattern(reach, per_head, glob, block), backend=backend, dropout=dropout)
        self.window, self.dilation, self.global_tokens = window, per_head, glob

    # -- fixed-shape decoding: the dilated window as a rolling window, the global keys apart -------------
    @property
    def window_pattern(self) -> LongformerPattern:
        return cast(LongformerPattern, self.pattern)

    def static_problem(self) -> str | None:
        return None

    def static_state(self, prefix: DecodeState, capacity: int) -> DecodeState | None:
        """A rolling window of the last ``max(d) * reach + 1`` keys (``xfam.attention._static.ring_state``), the
        global positions' keys apart; None when a global position lies after the prompt (a global query
        sees every key, which no window holds); a dense key/value cache when there is no window."""
        reach = self.window_pattern.reach
        if reach is None:
            return static.kv_state(prefix, capacity)
        if any(g >= prefix["k"].shape[2] for g in self.global_tokens):
            return None
        return static.ring_state(prefix, min(max(self.dilation) * reach + 1, capacity), self.global_tokens)

    def decode_step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None
    ) -> Tensor:
        if self.window_pattern.reach is None:
            return static.kv_step(q, k, v, state, pos, bias)
        heads = torch.arange(len(self.dilation), device=q.device)[:, None] if len(self.dilation) > 1 else None
        return static.ring_step(q, k, v, state, pos, bias, lambda qp, kp: self.window_pattern.allowed(qp, kp, heads))

    def static_write(self, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None) -> None:
        (static.kv_write if self.window_pattern.reach is None else static.ring_write)(k, v, state, pos)

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        out = []
        max_len, causal, heads = ctx.get("max_len"), ctx.get("causal"), ctx.get("heads")
        w, dil = params["window"], params["dilation"]
        if w is not None and causal is False and w % 2:
            out.append(
                f"window={w}: a bidirectional Longformer window puts w/2 keys on each side, so w must be even. "
                f"Fix: attention.window={w + 1} (or {w - 1})."
            )
        if w is not None and max_len is not None and causal is not None:
            limit = max_len if causal else 2 * max_len
            side = "the w keys before each query" if causal else "w/2 keys on each side"
            if w > limit:
                out.append(
                    f"window={w} reaches beyond model.max_len={max_len} ({side}); valid: 1..{limit} "
                    f"({limit} already covers every sequence; or window=null for no window). "
                    f"Fix: set attention.window <= {limit}."
                )
        if not isinstance(dil, int) and heads is not None and len(dil) != heads:
            out.append(
                f"dilation={list(dil)} gives {len(dil)} values for {heads} heads. Fix: one integer for every head, "
                f"or a list of exactly {heads} values."
            )
        if max_len is not None:
            d_max = dil if isinstance(dil, int) else max(dil, default=1)
            if d_max >= max_len > 1:
                out.append(
                    f"dilation={d_max} >= model.max_len={max_len}: the window would hold only the query itself. "
                    f"Fix: a dilation in 1..{max_len - 1}."
                )
            bad = [p for p in params["global_tokens"] if p >= max_len]
            if bad:
                out.append(
                    f"global_tokens {bad} lie beyond model.max_len={max_len}; valid positions: 0..{max_len - 1}. "
                    f"Fix: remove them from attention.global_tokens."
                )
        return out

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        out = super().refusals(params, selection)
        if params.get("global_tokens") and selection.has_memory:
            out.append(
                "attention=longformer: global_tokens are positions of the input, but with memory in front of "
                "each segment they would name memory slots. Fix: attention.global_tokens=[] or memory=none."
            )
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"window": None, "dilation": 1}
