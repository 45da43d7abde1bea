"""Reversible residual layers (Gomez et al., 2017, "The Reversible Residual Network"; used by the
Reformer, Kitaev et al., 2020, sec. 4): activations are recomputed in the backward pass instead
of being stored, so training memory does not grow with depth.

The model width D is carried as two streams ``(x1, x2)``, both the embedding at the input:

    y1 = x1 + Attention(norm(x2))        x2 = y2 - FFN(norm(y1))
    y2 = x2 + FFN(norm(y1))              x1 = y1 - Attention(norm(x2))      (inversion)

and the output is the mean of the two streams (as lucidrains' reformer-pytorch; the trax Reformer
concatenates them). The FFN runs in ``ffn_chunks`` chunks along the sequence (the Reformer's
chunked feed-forward), so its hidden activations never exist for the whole sequence at once.

One autograd Function spans the whole stack and saves only its output; its backward walks the
blocks from the top, reconstructing each block's input from its output and re-running the two
functions under autograd for their gradients. Dropout draws the same masks in the recomputation
(the RNG state before each function is saved and restored, and the state after the forward is put
back at the end of the backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from xfam.core.context import LayerContext
from xfam.core.state import DecodeState
from xfam.model.block import Block


def _rng_state(device: torch.device) -> tuple[Tensor, Any]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[Tensor, Any], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class RevBlock:
    """The two residual functions of one reversible block: ``f`` (attention), ``g`` (FFN)."""

    def __init__(self, block: Block, ctx: LayerContext, ffn_chunks: int):
        self.block, self.ctx, self.ffn_chunks = block, ctx, ffn_chunks

    def f(self, x2: Tensor, state: DecodeState | None = None) -> tuple[Tensor, DecodeState | None]:
        out, state = self.block.attn(self.block.norm1(x2), self.ctx, None, state)
        return self.block.link_attn.branch(out, None), state  # (its dropout, post-norm, gain)

    def g(self, y1: Tensor) -> Tensor:
        chunks = y1.chunk(self.ffn_chunks, dim=1) if self.ffn_chunks > 1 else (y1,)
        blk = self.block
        assert blk.ffn is not None and blk.link_ffn is not None and blk.norm2 is not None  # (compat: the FFN after)
        return torch.cat([blk.link_ffn.branch(blk.ffn(blk.norm2(c)), None) for c in chunks], dim=1)


class _ReversibleStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, blocks: Sequence[RevBlock], *params: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        states = []
        with torch.no_grad():
            for blk in blocks:
                s_f = _rng_state(x.device)
                x1 = x1 + blk.f(x2)[0]
                s_g = _rng_state(x.device)
                x2 = x2 + blk.g(x1)
                states.append((s_f, s_g))
        ctx.blocks, ctx.states = blocks, states
        out = torch.cat((x1, x2), dim=-1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (out,) = ctx.saved_tensors
        after = _rng_state(grad.device)  # the RNG goes on from here once the replays below are done
        y1, y2 = (t.detach() for t in out.chunk(2, dim=-1))
        dy1, dy2 = grad.chunk(2, dim=-1)
        for blk, (s_f, s_g) in zip(reversed(ctx.blocks), reversed(ctx.states), strict=True):
            with torch.enable_grad():  # g: recover x2, push dy2 through g into y1 and g's weights
                y1.requires_grad_()
                _set_rng_state(s_g, y1.device)
                g_y1 = blk.g(y1)
                torch.autograd.backward(g_y1, dy2)
            with torch.no_grad():
                x2 = y2 - g_y1
                dx1 = dy1 + y1.grad
            with torch.enable_grad():  # f: recover x1, push dx1 through f into x2 and f's weights
                x2.requires_grad_()
                blk.ctx.mask.forget()  # the bias again, with a graph to its parameters
                _set_rng_state(s_f, x2.device)
                f_x2 = blk.f(x2)[0]
                torch.autograd.backward(f_x2, dx1)
            with torch.no_grad():
                x1 = y1 - f_x2
                dx2 = dy2 + x2.grad
            y1, y2, dy1, dy2 = x1.detach(), x2.detach(), dx1, dx2
        _set_rng_state(after, grad.device)  # else the next step's dropout masks repeat this step's
        return (torch.cat((dy1, dy2), dim=-1), None, *([None] * (len(ctx.needs_input_grad) - 2)))


def reversible_stack(
    x: Tensor,
    blocks: Iterable[Block],
    context: Callable[[int], LayerContext],
    ffn_chunks: int = 1,
    states: list[DecodeState | None] | None = None,
) -> Tensor:
    """Run ``blocks`` reversibly on ``x [B, S, D]``; returns the mean of the streams ``[B, S, D]``.

    With ``states`` (incremental decoding, no gradients) each block's attention decode state is
    read and replaced in place.
    """
    rev = [RevBlock(b, context(i), ffn_chunks) for i, b in enumerate(blocks)]
    x2 = torch.cat((x, x), dim=-1)  # [B, S, 2D]: both streams start as the embedding
    if states is None and torch.is_grad_enabled() and x2.requires_grad:
        params = [p for b in blocks for p in b.parameters() if p.requires_grad]
        x2 = _ReversibleStack.apply(x2, rev, *params)
        y1, y2 = x2.chunk(2, dim=-1)
    else:  # no graph to save memory in: run the blocks forward
        y1, y2 = x2.chunk(2, dim=-1)
        for i, blk in enumerate(rev):
            out, st = blk.f(y2, states[i] if states is not None else None)
            if states is not None:
                states[i] = st
            y1 = y1 + out
            y2 = y2 + blk.g(y1)
    return (y1 + y2) / 2
