"""Building blocks shared by every model: norms and feed-forward networks."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.model.fused import glu
from xfam.model.spec import GLU_FFNS, ModelSpec


class ScaleNorm(nn.Module):
    """ScaleNorm (Nguyen & Salazar, 2019, "Transformers without Tears", arXiv:1910.05895, sec. 2.2):
    ``g x / max(||x||, eps)`` with one learned scalar g, initialised at sqrt(D)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.g, self.eps = nn.Parameter(torch.tensor(math.sqrt(dim))), eps

    def forward(self, x: Tensor) -> Tensor:
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps)


def make_norm(spec: ModelSpec, dim: int | None = None) -> nn.Module:
    """The model's norm over ``dim`` channels (default: the model width)."""
    dim = dim or spec.dim
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6)
    if spec.norm == "simple_rmsnorm":  # RMSNorm without its gain
        return nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
    if spec.norm == "scalenorm":
        return ScaleNorm(dim)
    return nn.LayerNorm(dim, bias=spec.bias)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "relu2": lambda h: F.relu(h).square(),  # So et al., 2021, "Primer", arXiv:2109.08668
    "swiglu": F.silu,
    "geglu": F.gelu,
    "reglu": F.relu,
}


class FeedForward(nn.Module):
    """Position-wise FFN: ``W2 act(W1 x)`` (GELU, ReLU, ReLU^2) or a gated linear unit ``W2 (act(W1 x) * W3 x)``
    (SwiGLU, GEGLU, ReGLU: Shazeer, 2020, "GLU Variants Improve Transformer", arXiv:2002.05202).
    ``model.ffn_post_act_norm`` normalises the hidden activations (NormFormer's FFN norm) and
    ``model.ffn_dropout`` drops them."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        hidden = spec.ffn_hidden
        self.glu, self.act = spec.ffn in GLU_FFNS, ACTIVATIONS[spec.ffn]
        self.up = nn.Linear(spec.dim, hidden * (2 if self.glu else 1), bias=spec.bias)
        self.down = nn.Linear(hidden, spec.dim, bias=spec.bias)
        self.post_act_norm = make_norm(spec, hidden) if spec.ffn_post_act_norm else None
        self.drop = nn.Dropout(spec.ffn_dropout) if spec.ffn_dropout else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(x)  # [B, S, hidden or 2*hidden]
        if self.glu:
            h = glu(h, self.act)  # [B, S, hidden]: act(a) * b for a, b = h.chunk(2, -1)
        else:
            h = self.act(h)
        if self.post_act_norm is not None:
            h = self.post_act_norm(h)
        if self.drop is not None:
            h = self.drop(h)
        return self.down(h)
