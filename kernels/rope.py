"""Fused rotary position embedding (RoPE, Su et al., 2021, arXiv:2104.09864), forward and backward.

xfam rotates "half" pairs (channel k with k + r/2, as GPT-NeoX and x-transformers): with c = cos(p theta_k)
and s = sin(p theta_k) (times the xPos scale when ``pos.xpos``), for the first r channels of a head

    out_k = x_k c_k - x_{k+r/2} s_k,      out_{k+r/2} = x_{k+r/2} c_k + x_k s_k,

and channels r..Dh pass through (partial rotary). The PyTorch path (``xfam.pos.rope.Rope._rotate``) runs
this as four elementwise passes over ``[B, H, S, Dh]`` (two halves, a concatenation, a multiply-add); the
kernel reads x once and writes once. The backward applies the transposed rotation to the incoming gradient
(with xPos-scaled tables the transpose, not the inverse; the tables are buffers, not trained):
dx_k = g_k c_k + g_{k+r/2} s_k, dx_{k+r/2} = g_{k+r/2} c_k - g_k s_k.

Tables come as xfam builds them (``Rope.rotary_tables``): ``cos [S, r]`` with equal halves and the signed
sine ``[-s | s]``; the kernel reads the first half of ``cos`` and the second half of the sine.
Shapes: x ``[B, H, S, Dh]`` -> ``[B, H, S, Dh]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xfam.kernels.runtime import interpreting, why_not

_INTERPRETED = interpreting()  # the kernel below was decorated for Triton's interpreter


@triton.jit
def _rope_kernel(
    X, COS, SIN, OUT,  # x/out [N, S, D] rows, cos/sin [S, R]
    S, D, R,
    stride_xn, stride_xs, stride_on, stride_os, stride_ts,
    HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    BACKWARD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    n, sb = tl.program_id(0), tl.program_id(1)
    rows = sb * BLOCK_S + tl.arange(0, BLOCK_S)  # [BS] positions
    cols = tl.arange(0, BLOCK_H)  # [BH] channel k of the first half
    rok = rows < S
    ok = rok[:, None] & (cols[None, :] < HALF)  # [BS, BH]
    xrow = X + n * stride_xn + rows[:, None] * stride_xs
    x1 = tl.load(xrow + cols[None, :], mask=ok, other=0.0)
    x2 = tl.load(xrow + HALF + cols[None, :], mask=ok, other=0.0)
    c = tl.load(COS + rows[:, None] * stride_ts + cols[None, :], mask=ok, other=0.0)
    s = tl.load(SIN + rows[:, None] * stride_ts + HALF + cols[None, :], mask=ok, other=0.0)
    if UPCAST:  # the interpreter's bf16 arithmetic is wrong: compute in fp32
        x1, x2, c, s = x1.to(tl.float32), x2.to(tl.float32), c.to(tl.float32), s.to(tl.float32)
    if BACKWARD:  # the transposed rotation (the inverse one only without xPos scales)
        o1, o2 = x1 * c + x2 * s, x2 * c - x1 * s
    else:
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    orow = OUT + n * stride_on + rows[:, None] * stride_os
    tl.store(orow + cols[None, :], o1.to(OUT.dtype.element_ty), mask=ok)
    tl.store(orow + HALF + cols[None, :], o2.to(OUT.dtype.element_ty), mask=ok)
    if BLOCK_P > 0:  # channels R..D pass through
        pc = R + tl.arange(0, BLOCK_P)
        pok = rok[:, None] & (pc[None, :] < D)
        tl.store(orow + pc[None, :], tl.load(xrow + pc[None, :], mask=pok, other=0.0), mask=pok)


def _launch(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    b, h, s, d = x.shape
    r = cos.shape[-1]
    x3 = x.reshape(b * h, s, d)  # a view when x is contiguous in its last two dims' order
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    out = torch.empty((b * h, s, d), dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    block_s = 16 if interpreting() else 64
    block_h = triton.next_power_of_2(r // 2)
    block_p = triton.next_power_of_2(d - r) if d > r else 0
    grid = (b * h, triton.cdiv(s, block_s))
    _rope_kernel[grid](
        x3, cos, sin, out, s, d, r,
        x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), cos.stride(0),
        HALF=r // 2, BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_P=block_p,
        BACKWARD=backward, UPCAST=interpreting() and x.dtype == torch.bfloat16,
    )  # fmt: skip
    return out.view(b, h, s, d)


# A custom operator (not an autograd.Function), so that torch.compile keeps a model that calls the kernel in one
# graph: dynamo records the op as it is, inductor calls it, and the fake below gives its output's shape.
@torch.library.custom_op("xfam::rope", mutates_args=())
def _rope_op(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    return _launch(x, cos, sin, backward)


@_rope_op.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    return x.new_empty(x.shape)  # [B, H, S, Dh], contiguous as _launch's


def _rope_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    _, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _rope_backward(ctx, grad):  # noqa: ANN001, ANN202
    cos, sin = ctx.saved_tensors
    return _rope_op(grad.contiguous(), cos, sin, not ctx.backward), None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


def rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate the first ``r`` channels of ``x [B, H, S, Dh]`` by the tables ``cos, signed_sin [S, r]``
    (``Rope.rotary_tables``); the rest pass through. Differentiable in ``x``."""
    if (reason := why_not(x.device, _INTERPRETED)) is not None:
        raise RuntimeError(f"the fused RoPE kernel cannot run here: {reason}")
    if cos.shape != signed_sin.shape or cos.shape[0] != x.shape[2] or cos.shape[1] % 2 or cos.shape[1] > x.shape[3]:
        raise ValueError(f"tables {tuple(cos.shape)} do not fit x {tuple(x.shape)}: [S, r], r even, r <= Dh")
    return _rope_op(x, cos.to(x.dtype), signed_sin.to(x.dtype), False)


def rope_reference(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """The same rotation in PyTorch (as ``xfam.pos.rope.Rope``): the parity ground truth."""
    r = cos.shape[-1]
    x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return torch.cat((x1 * cos[:, : r // 2] - x2 * signed_sin[:, r // 2 :],
                      x2 * cos[:, : r // 2] + x1 * signed_sin[:, r // 2 :], rest), dim=-1)  # fmt: skip
