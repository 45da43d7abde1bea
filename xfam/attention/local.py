"""Local attention: a sliding window (Beltagy et al., 2020, sec. 3.1; causal look-back or
bidirectional radius), or Image Transformer 1D local attention (Parmar et al., 2018, sec. 3.2):
queries in non-overlapping blocks of ``query_block`` positions attend to their own block plus the
``memory`` positions before it. O(L * w) through the block engine (``xfam.attention._sparse``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from xfam.attention import _static as static
from xfam.attention._base import ATTENTION
from xfam.attention._sparse import SparseMechanism, SparsePattern, auto_block, band_layout, window_band
from xfam.core.bias import ScoreBias
from xfam.core.registry import NonNegative, Positive, Probability
from xfam.core.state import DecodeState


class WindowPattern(SparsePattern):
    """Keys less than ``window`` positions away: ``|i - j| < window`` (causality comes from the mask)."""

    def __init__(self, window: int, block: int, causal: bool):
        self.window, self.block, self.causal = window, block, causal

    def allowed(self, q_pos: Tensor, k_pos: Tensor, head: Tensor | None = None) -> Tensor:
        return (q_pos - k_pos).abs() < self.window

    def band(self, offset: int, causal: bool) -> tuple[int, int]:
        return window_band(offset, self.block, self.window - 1, 0 if causal else self.window - 1)

    def layout(self, n_q: int, n_k: int, offset: int, causal: bool, device: torch.device) -> Tensor:
        return band_layout(n_q, n_k, *self.band(offset, causal), device)


class BlockLocalPattern(SparsePattern):
    """Image Transformer 1D: query block ``floor(i / query_block)`` sees its own block and the
    ``memory`` positions before the block's first position."""

    def __init__(self, query_block: int, memory: int, block: int):
        self.query_block, self.memory, self.block = query_block, memory, block

    def allowed(self, q_pos: Tensor, k_pos: Tensor, head: Tensor | None = None) -> Tensor:
        start = torch.div(q_pos, self.query_block, rounding_mode="floor") * self.query_block
        return (k_pos >= start - self.memory) & (k_pos < start + self.query_block)

    def band(self, offset: int, causal: bool) -> tuple[int, int]:
        reach = self.query_block - 1
        return window_band(offset, self.block, self.memory + reach, 0 if causal else reach)

    def layout(self, n_q: int, n_k: int, offset: int, causal: bool, device: torch.device) -> Tensor:
        return band_layout(n_q, n_k, *self.band(offset, causal), device)


@ATTENTION.register("local")
class Local(SparseMechanism):
    """Each query attends to a local neighbourhood only.

    Args:
        mode: ``window`` (sliding window of radius ``window - 1``) or ``block`` (Image Transformer
            query blocks of ``query_block`` positions with ``memory`` preceding positions).
        window: keys less than ``window`` positions away (causal: the query and the
            ``window - 1`` before it).
        query_block / memory: the ``block`` mode's query block length and look-back.
        block: tile size of the block engine (speed only; the result does not depend on it); null:
            ``auto_block`` of the reach (window, or query_block + memory).
        backend: ``auto`` (the flash kernel on CUDA, else the block engine), ``block``, ``dense`` (the
            reference) or ``triton``.
        dropout: dropout on the attention probabilities.
    """

    paper = "Parmar et al., 2018 (Image Transformer); Beltagy et al., 2020 (sliding window)"

    def __init__(
        self,
        *,
        max_len: int,
        causal: bool,
        mode: Literal["window", "block"] = "window",
        window: Annotated[int, Positive] = 256,
        query_block: Annotated[int, Positive] = 128,
        memory: Annotated[int, NonNegative] = 128,
        block: Annotated[int, Positive] | None = None,
        backend: Literal["auto", "block", "dense", "triton"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        if mode == "window":
            pattern: SparsePattern = WindowPattern(window, block or auto_block(window), causal)
        else:
            pattern = BlockLocalPattern(query_block, memory, block or auto_block(query_block + memory))
        super().__init__(pattern=pattern, backend=backend, dropout=dropout)
        # a causal query's keys lie fewer than this many positions back: the rolling window of decoding
        self.lookback = window if mode == "window" else query_block + memory

    def static_problem(self) -> str | None:
        return None

    def static_state(self, prefix: DecodeState, capacity: int) -> DecodeState:
        """A rolling window of the last ``lookback`` keys and values (``xfam.attention._static.ring_state``)."""
        return static.ring_state(prefix, min(self.lookback, capacity))

    def decode_step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None
    ) -> Tensor:
        return static.ring_step(q, k, v, state, pos, bias, self.pattern.allowed)

    def static_write(self, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None) -> None:
        static.ring_write(k, v, state, pos)

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        max_len, out = ctx.get("max_len"), []
        if max_len is not None and params["mode"] == "window" and params["window"] > max_len:
            out.append(
                f"window={params['window']} is larger than model.max_len={max_len}; valid: 1..{max_len} "
                f"(window = max_len is full attention). Fix: set attention.window <= {max_len}."
            )
        if max_len is not None and params["mode"] == "block" and params["query_block"] > max_len:
            out.append(f"query_block={params['query_block']} > model.max_len={max_len}. Fix: a smaller query_block.")
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"mode": "window", "window": seq_len}
