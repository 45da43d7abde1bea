"""Rotary position embedding, RoPE (Su et al., 2021, "RoFormer", arXiv:2104.09864).

Query and key at position i are rotated by R(i * theta_k) in each 2-D subspace k, with
theta_k = base^(-2k/d); then q_i . k_j depends on positions only through j - i. The paper pairs
channels (2k, 2k+1); xfam pairs channel k with k + d/2 ("rotate half", as GPT-NeoX and
x-transformers do), which is the same rotation after a fixed permutation of head channels that
the learned projections absorb, and is cheaper (two contiguous halves instead of strided pairs).

Options: ``rotary_dim`` rotates only the first r channels of each head (GPT-NeoX's partial rotary,
x-transformers' ``rotary_emb_dim``; theta_k = base^(-2k/r)), the other Dh - r channels carry no
position; ``interpolation`` divides positions by a factor s (position interpolation, Chen et al.,
2023, arXiv:2306.15595: a model trained at length L reads s L positions within its trained angles).
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from xfam.pos.base import POS, PositionalEncoding
from xfam.registry import Positive, Range


@POS.register("rope")
class Rope(PositionalEncoding):
    """Rotary embedding of q and k in every layer.

    Args:
        head_dim: per-head width Dh (injected); must be even.
        base: theta base (10000 in the paper).
        rotary_dim: channels rotated per head (even, <= Dh); null: all of them.
        interpolation: position interpolation factor s >= 1 (positions / s); 1: none.
    """

    paper = "Su et al., 2021, RoFormer, arXiv:2104.09864"

    kind = "rotary"
    relative = True

    def __init__(
        self,
        *,
        head_dim: int,
        base: Annotated[float, Positive] = 10000.0,
        rotary_dim: Annotated[int, Positive] | None = None,
        interpolation: Annotated[float, Range(ge=1.0)] = 1.0,
    ):
        super().__init__()
        r = rotary_dim or head_dim
        inv_freq = base ** (-torch.arange(0, r, 2, dtype=torch.float32) / r) / interpolation
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [r/2]
        self.rotary_dim, self.partial = r, r < head_dim

    @classmethod
    def check(cls, params: dict, ctx: dict) -> list[str]:
        dh, r = ctx.get("head_dim", 0), params["rotary_dim"]
        if dh % 2:
            return [f"head_dim={dh} is odd; RoPE rotates channel pairs. Fix: use an even model.head_dim."]
        if r is not None and (r % 2 or (dh and r > dh)):
            return [f"rotary_dim={r} must be even and at most head_dim={dh}. Fix: pos.rotary_dim in 2, 4, ..., {dh}."]
        return []

    def rotary_tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos [S, r]`` and the signed sine ``[-sin | sin]``, so that ``rotate`` is one fused
        multiply-add on the swapped halves (the sign of ``rotate_half`` is folded into the table)."""
        angles = positions.to(self.inv_freq)[:, None] * self.inv_freq[None, :]  # [S, r/2]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def rotate(self, x: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
        if self.partial:  # the first r channels rotate, the rest pass through
            r = self.rotary_dim
            return torch.cat((self._rotate(x[..., :r], tables), x[..., r:]), dim=-1)
        return self._rotate(x, tables)

    @staticmethod
    def _rotate(x: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
        cos, signed_sin = tables  # [S, r], broadcast over [B, H, S, r]
        x1, x2 = x.chunk(2, dim=-1)
        # x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = [x2 | x1] * [-sin | sin]
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), signed_sin)
