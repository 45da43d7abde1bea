"""Hand-written backward passes for two elementwise-bound block options, where autograd's generic ones make
several more passes over the activations than the mathematics needs (measured in docs/benchmarks.md, "Block
options"). Both equal the composite PyTorch expressions they replace (tests/unit/test_fused_ops.py checks values
and gradients, ``gradcheck`` in float64); neither supports double backward (it raises).

* ``l2_normalize(x, scale)`` = ``scale * F.normalize(x, dim=-1)``: cosine-similarity attention's q and k
  (``attn_qk_norm=l2``). Autograd differentiates the norm, the clamp, the division and the product one by one
  (about eight passes over ``x``); the Jacobian of ``y = s x / ||x||`` is ``(s / ||x||) (I - x^ x^T)``, so
  ``dx = (s / ||x||) g - y (y . g) / (s ||x||)``: one dot product per row and two passes.
* ``glu(h, act)`` = ``act(a) * b`` with ``a, b = h.chunk(2, -1)``: the GLU feed-forwards (``ffn=geglu``,
  ``swiglu``, ``reglu``). The gradient's two halves are written straight into one ``[..., 2H]`` tensor instead
  of being computed apart and concatenated by ``chunk``'s backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

EPS = 1e-12  # F.normalize's default: the norm is clamped to at least this


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor) -> Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # [..., 1]
        inv = scale / norm.clamp_min(EPS)  # [..., 1]: s / ||x||
        y = x * inv
        ctx.save_for_backward(y, inv, norm >= EPS, scale)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor | None]:
        y, inv, unclamped, scale = ctx.saved_tensors
        dot = torch.linalg.vecdot(g, y).unsqueeze(-1)  # [..., 1]: y . g
        # where the norm was clamped it is a constant, and y = x s / eps has the plain gradient s / eps
        dx = torch.addcmul(g * inv, y, dot * inv * unclamped / (scale * scale), value=-1)
        dscale = (dot.sum() / scale).reshape(scale.shape) if ctx.needs_input_grad[1] else None  # y = s x^
        return dx, dscale


def l2_normalize(x: Tensor, scale: Tensor | float = 1.0) -> Tensor:
    """``scale * x / max(||x||, 1e-12)`` over the last dimension; ``scale`` a scalar (a learned one gets its
    gradient)."""
    s = scale if isinstance(scale, Tensor) else torch.tensor(float(scale))
    return _L2Normalize.apply(x, s.to(dtype=x.dtype, device=x.device))


# the activation's backward, written into ``out``: (grad of act(a), a, act(a), out) -> out
_ACT_BACKWARD: dict[Callable, Callable] = {
    F.gelu: lambda g, a, _, out: torch.ops.aten.gelu_backward.grad_input(g, a, grad_input=out),
    F.silu: lambda g, a, _, out: torch.ops.aten.silu_backward.grad_input(g, a, grad_input=out),
    F.relu: lambda g, _, act_a, out: torch.mul(g, act_a > 0, out=out),
}


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, act: Callable) -> Tensor:
        a, b = h.chunk(2, dim=-1)  # [..., H] each
        act_a = act(a)
        ctx.act = act
        ctx.save_for_backward(a, b, act_a)
        return act_a * b

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        a, b, act_a = ctx.saved_tensors
        dh = g.new_empty(*g.shape[:-1], 2 * g.shape[-1])  # [..., 2H]
        da, db = dh.chunk(2, dim=-1)
        torch.mul(g, act_a, out=db)
        _ACT_BACKWARD[ctx.act](g * b, a, act_a, da)
        return dh, None


def glu(h: Tensor, act: Callable) -> Tensor:
    """``act(a) * b`` for ``a, b = h.chunk(2, -1)``; ``act`` one of ``F.gelu``, ``F.silu``, ``F.relu``."""
    if act not in _ACT_BACKWARD:
        raise ValueError(f"glu: no fused backward for {act!r}; choose one of F.gelu, F.silu, F.relu")
    return _GLU.apply(h, act)
