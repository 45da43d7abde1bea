"""One Transformer block: self-attention (projections, heads, rotary, memory) and the FFN."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.attention.base import AttentionMechanism, DecodeState
from xfam.attention.mask import AttnMask
from xfam.model.layers import FeedForward, make_norm
from xfam.model.spec import ModelSpec
from xfam.pos.base import PositionalEncoding, ScoreBias


@dataclasses.dataclass
class LayerContext:
    """Everything a block needs that is the same for all layers of one forward pass.

    ``rotary`` holds the tables for the keys computed in this call (memory + segment, or the new
    tokens when decoding); queries use its last Sq rows.
    """

    mask: AttnMask
    pos: PositionalEncoding
    bias: ScoreBias | None
    rotary: tuple[Tensor, ...] | None
    decoding: bool = False


class SelfAttention(nn.Module):
    """Projections around a mechanism: ``x [B, S, D] -> [B, S, D]``.

    One fused q/k/v projection; key/value heads may be fewer than query heads (grouped-query
    attention). Memory states ``[B, M, D]`` are projected to keys/values and put in front.
    """

    def __init__(self, spec: ModelSpec, mechanism: AttentionMechanism, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.n_kv_heads, spec.d_head
        self.layer = layer
        self.q_width = self.heads * self.head_dim
        self.kv_width = self.kv_heads * self.head_dim
        self.qkv = nn.Linear(spec.dim, self.q_width + 2 * self.kv_width, bias=spec.bias)
        self.out = nn.Linear(self.q_width, spec.dim, bias=spec.bias)
        self.out.residual_out = True
        self.mechanism = mechanism

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)  # [B, S, n*Dh] -> [B, n, S, Dh]

    def forward(
        self, x: Tensor, ctx: LayerContext, mem: Tensor | None = None, state: DecodeState | None = None
    ) -> tuple[Tensor, DecodeState | None]:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        if mem is not None:
            w = self.qkv.weight[self.q_width :]  # key/value rows only: no queries for memory
            bias = None if self.qkv.bias is None else self.qkv.bias[self.q_width :]
            mk, mv = F.linear(mem, w, bias).split((self.kv_width, self.kv_width), dim=-1)
            k, v = torch.cat((mk, k), dim=1), torch.cat((mv, v), dim=1)  # [B, M + S, Hkv*Dh]
        q, k, v = self._heads(q, self.heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        if ctx.rotary is not None:
            q = ctx.pos.rotate(q, tuple(t[-s:] for t in ctx.rotary))  # tables [Sk_now, ...]: the last S rows
            k = ctx.pos.rotate(k, ctx.rotary, key=True)
        modifier = ctx.pos.score_modifier(self.layer)
        if ctx.decoding:
            o, state = self.mechanism.decode(q, k, v, state, ctx.mask, ctx.bias, modifier)
        else:
            o = self.mechanism(q, k, v, ctx.mask, ctx.bias, modifier)  # [B, H, S, Dh]
        o = o.transpose(1, 2).reshape(b, s, self.q_width)  # [B, H, S, Dh] -> [B, S, H*Dh]
        return self.out(o), state


class Block(nn.Module):
    """Pre-norm ``x + f(norm(x))`` or post-norm ``norm(x + f(x))`` attention and FFN sublayers."""

    def __init__(self, spec: ModelSpec, mechanism: AttentionMechanism, layer: int):
        super().__init__()
        self.pre = spec.norm_position == "pre"
        self.norm1, self.norm2 = make_norm(spec), make_norm(spec)
        self.attn = SelfAttention(spec, mechanism, layer)
        self.ffn = FeedForward(spec)
        self.drop = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()

    def forward(
        self, x: Tensor, ctx: LayerContext, mem: Tensor | None = None, state: DecodeState | None = None
    ) -> tuple[Tensor, DecodeState | None]:
        if self.pre:
            h = self.norm1(x)
            a, state = self.attn(h, ctx, None if mem is None else self.norm1(mem), state)
            x = x + self.drop(a)
            x = x + self.drop(self.ffn(self.norm2(x)))
        else:
            a, state = self.attn(x, ctx, mem, state)
            x = self.norm1(x + self.drop(a))
            x = self.norm2(x + self.drop(self.ffn(x)))
        return x, state
