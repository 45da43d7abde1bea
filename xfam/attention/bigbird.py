"""BigBird attention, ITC variant (Zaheer et al., 2020, "Big Bird: Transformers for Longer Sequences",
arXiv:2007.14062, sec. 2 and app. D, the blocked form of the reference implementation).

Positions are cut into blocks of b (block ``i`` holds key indices ``i*b .. i*b + b - 1``, see
``AttnMask``). Query block i of head h sees the key blocks

* W(i) = {j : |i - j| <= (w - 1) / 2}: the sliding window of w blocks (w = 3: itself and its neighbours);
* G: the g global blocks, existing blocks made global (ITC): the first ceil(g/2) and the last
  floor(g/2) blocks of the keys. A query in G sees every key and every query sees the keys of G;
* R_h(i): r random blocks drawn from the blocks outside W(i) and G, fixed per layer and head: block j
  ranks by a hash of (seed, layer, h, i, j), so the pattern never changes between steps, survives a
  save/load unchanged (it is not state) and differs between layers.

Output ``[B, H, Sq, Dh] = softmax(q k^T / sqrt(Dh) + bias over the allowed keys) v``, through the
block engine: O(Sq b (w + r) + g b Sk), no Sq x Sk matrix.

Causal variant (not in the paper, whose decoders are dense; documented here): the window is the past
part of W(i), {i - (w - 1) / 2, ..., i}; the r random blocks are drawn from the blocks before the
window; the global blocks are the first g blocks (a block at the end would be invisible to every
earlier query, and would move as the sequence grows). Within a block, causality is per position.
Every choice then depends only on positions before the query, so decoding equals full recompute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from xfam.attention._base import ATTENTION
from xfam.attention._sparse import SparseMechanism, SparsePattern
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask
from xfam.core.registry import NonNegative, Positive, Probability

_P = 2**31 - 1  # hash modulus: products with the multiplier stay far inside int64


def _mix(x: Tensor) -> Tensor:
    for _ in range(3):
        x = (x * 48271) % _P
        x = x ^ (x >> 11)
    return x


def block_ranks(seed: int, layer: int, heads: int, n: int) -> Tensor:
    """``[H, n, n]`` pseudo-random ranks of key block j for query block i: a hash of (seed, layer, h, i, j),
    so the value of a pair does not depend on ``n`` (longer inputs extend the pattern, never redraw it)."""
    h = torch.arange(heads).view(-1, 1, 1)
    i, j = torch.arange(n).view(1, -1, 1), torch.arange(n).view(1, 1, -1)
    x = torch.tensor((seed * 1_000_003 + layer * 7919) % _P)
    for part in (h, i, j):
        x = _mix(x + part)
    return x  # [H, n, n] in [0, 2^31)


class BigBirdPattern(SparsePattern):
    """Window, global and random blocks for keys of length ``k_len`` (the last global blocks, and the
    candidates of the bidirectional random draw, depend on it)."""

    def __init__(
        self,
        *,
        block: int,
        window: int,
        n_global: int,
        random: int,
        seed: int,
        layer: int,
        heads: int,
        causal: bool,
        k_len: int,
    ):
        self.block, self.k_len = block, k_len
        n = -(-k_len // block)
        front, back = (n_global, 0) if causal else (-(-n_global // 2), n_global // 2)
        is_global = torch.zeros(n, dtype=torch.bool)
        is_global[: min(front, n)] = True
        is_global[max(n - back, 0) :] = True
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        self.half = (window - 1) // 2
        near = (i - j).abs() <= self.half  # [n, n] window blocks
        candidates = ~near & ~is_global & ((j < i) if causal else True)  # [n, n]
        self.heads = heads if random else 1
        chosen = torch.zeros(self.heads, n, n, dtype=torch.bool)
        if random:
            ranks = torch.where(candidates, block_ranks(seed, layer, self.heads, n), -1)  # [H, n, n]
            top = ranks.topk(min(random, n), dim=-1)
            chosen.scatter_(-1, top.indices, top.values >= 0)
        self.random_blocks = chosen  # [Hp, n, n]: R_h(i)
        self._table = near | chosen  # [Hp, n, n]: the blocked rule (globals are added by the engine)
        blocks = is_global.nonzero().flatten().tolist()
        self.global_positions = tuple(p for g in blocks for p in range(g * block, min(g * block + block, k_len)))

    def allowed(self, q_pos: Tensor, k_pos: Tensor, head: Tensor | None = None) -> Tensor:
        n = self._table.shape[-1]
        table = self._table.to(q_pos.device)
        qb = torch.div(q_pos, self.block, rounding_mode="floor").clamp(0, n - 1)
        kb = torch.div(k_pos, self.block, rounding_mode="floor").clamp(0, n - 1)
        return table[0, qb, kb] if head is None else table[head, qb, kb]

    def layout(self, n_q: int, n_k: int, offset: int, causal: bool, device: torch.device) -> Tensor:
        n = self._table.shape[-1]
        first = (offset + torch.arange(n_q) * self.block) // self.block  # pattern block of each tile's first query
        last = (first + (offset % self.block > 0)).clamp(max=n - 1)  # a tile may straddle two pattern blocks
        rows = self._table[:, first.clamp(max=n - 1)] | self._table[:, last]  # [Hp, nQ, n]
        cols = torch.arange(n)
        if causal:
            rows &= cols <= last[:, None]
        width = max(int(rows.sum(-1).max()), 1)
        idx = torch.where(rows, cols, n).sort(dim=-1).values[..., :width]  # visited blocks first, in order
        return torch.where(idx == n, -1, idx).to(device)  # [Hp, nQ, K]


@ATTENTION.register("bigbird")
class BigBird(SparseMechanism):
    """Block-sparse window + global + random attention (see the module docstring).

    Args:
        block: the paper's block size b (also the engine's tile).
        window_blocks: w, blocks of the sliding window (odd: the query block and (w - 1) / 2 on each side).
        global_blocks: g, blocks made global (ITC: first and last; causal: the first g).
        random_blocks: r, random key blocks per query block (and head).
        seed: with the injected layer index, fixes the random blocks.
        backend: ``auto`` (the flash kernel on CUDA, else the block engine), ``block``, ``dense`` (the
            reference) or ``triton``.
        dropout: dropout on the attention probabilities.
    """

    paper = "Zaheer et al., 2020, arXiv:2007.14062"

    def __init__(
        self,
        *,
        heads: int,
        max_len: int,
        causal: bool,
        layer: int = 0,
        block: Annotated[int, Positive] = 64,
        window_blocks: Annotated[int, Positive] = 3,
        global_blocks: Annotated[int, NonNegative] = 2,
        random_blocks: Annotated[int, NonNegative] = 3,
        seed: int = 0,
        backend: Literal["auto", "block", "dense", "triton"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        spec: dict[str, Any] = {"block": block, "window": window_blocks, "n_global": global_blocks}
        spec["random"] = random_blocks
        spec.update(seed=seed, layer=layer, heads=heads, causal=causal)
        pattern = BigBirdPattern(**spec, k_len=max_len)
        super().__init__(pattern=pattern, backend=backend, dropout=dropout)
        self.spec, self._patterns = spec, {max_len: pattern}

    def pattern_for(self, k_len: int) -> BigBirdPattern:
        """The pattern for keys of length ``k_len`` (built once per length and kept)."""
        if k_len not in self._patterns:
            if len(self._patterns) >= 16:
                self._patterns.pop(next(iter(self._patterns)))
            self._patterns[k_len] = BigBirdPattern(**self.spec, k_len=k_len)
        return self._patterns[k_len]

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        self.pattern = self.pattern_for(mask.k_len)  # the last global blocks depend on the key length
        return super().forward(q, k, v, mask, bias, modifier)

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        out = super().refusals(params, selection)
        if params.get("global_blocks", 2) and selection.has_memory:
            out.append(
                "attention=bigbird: global_blocks are the first blocks of the keys, and with memory in front of each "
                "segment they would be the oldest memory slots (the segment's own tokens never global). Fix: "
                "attention.global_blocks=0, or memory=none."
            )
        return out

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        out, max_len = [], ctx.get("max_len")
        b, w, g, r = params["block"], params["window_blocks"], params["global_blocks"], params["random_blocks"]
        if w % 2 == 0:
            out.append(
                f"window_blocks={w}: the window is the query block and (w - 1) / 2 blocks on each side, so w must "
                f"be odd. Fix: attention.window_blocks={w + 1} (or {w - 1})."
            )
        if max_len is None:
            return out
        if b > max_len:
            out.append(f"block={b} > model.max_len={max_len}; valid: 1..{max_len}. Fix: attention.block <= {max_len}.")
            return out
        n = -(-max_len // b)
        if w > 2 * n - 1:
            out.append(
                f"window_blocks={w} is wider than the {n} blocks of model.max_len={max_len} (block {b}); valid: "
                f"1..{2 * n - 1} ({2 * n - 1} covers every sequence). Fix: attention.window_blocks <= {2 * n - 1}."
            )
        for key, val in (("global_blocks", g), ("random_blocks", r)):
            if val > n:
                out.append(
                    f"{key}={val} exceeds the {n} blocks of model.max_len={max_len} (block {b}); valid: 0..{n}. "
                    f"Fix: attention.{key} <= {n}."
                )
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        block = max(1, seq_len // 6)
        return {"block": block, "window_blocks": 3, "global_blocks": 2, "random_blocks": -(-seq_len // block)}
