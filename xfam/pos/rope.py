"""Rotary position embedding, RoPE (Su et al., 2021, "RoFormer", arXiv:2104.09864).

Query and key at position i are rotated by R(i * theta_k) in each 2-D subspace k, with
theta_k = base^(-2k/d); then q_i . k_j depends on positions only through j - i. The paper pairs
channels (2k, 2k+1); xfam pairs channel k with k + d/2 ("rotate half", as GPT-NeoX and
x-transformers do), which is the same rotation after a fixed permutation of head channels that
the learned projections absorb, and is cheaper (two contiguous halves instead of strided pairs).
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from xfam.pos.base import POS, PositionalEncoding
from xfam.registry import Positive


@POS.register("rope")
class Rope(PositionalEncoding):
    """Rotary embedding of q and k in every layer.

    Args:
        head_dim: per-head width Dh (injected); must be even.
        base: theta base (10000 in the paper).
    """

    paper = "Su et al., 2021, RoFormer, arXiv:2104.09864"

    kind = "rotary"
    relative = True

    def __init__(self, *, head_dim: int, base: Annotated[float, Positive] = 10000.0):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [Dh/2]

    @classmethod
    def check(cls, params: dict, ctx: dict) -> list[str]:
        if ctx.get("head_dim", 0) % 2:
            return [f"head_dim={ctx['head_dim']} is odd; RoPE rotates channel pairs. Fix: use an even model.head_dim."]
        return []

    def rotary_tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos [S, Dh]`` and the signed sine ``[-sin | sin]``, so that ``rotate`` is one fused
        multiply-add on the swapped halves (the sign of ``rotate_half`` is folded into the table)."""
        angles = positions.to(self.inv_freq)[:, None] * self.inv_freq[None, :]  # [S, Dh/2]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def rotate(self, x: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
        cos, signed_sin = tables  # [S, Dh], broadcast over [B, H, S, Dh]
        x1, x2 = x.chunk(2, dim=-1)
        # x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = [x2 | x1] * [-sin | sin]
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), signed_sin)
