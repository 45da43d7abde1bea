"""Building blocks shared by every model: norms and feed-forward networks."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from xfam.model.spec import ModelSpec


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.dim, eps=1e-6)
    return nn.LayerNorm(spec.dim, bias=spec.bias)


class FeedForward(nn.Module):
    """Position-wise FFN: ``W2 act(W1 x)`` (GELU) or ``W2 (silu(W1 x) * W3 x)`` (SwiGLU, Shazeer 2020)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        hidden = spec.ffn_hidden
        self.glu = spec.ffn == "swiglu"
        self.up = nn.Linear(spec.dim, hidden * (2 if self.glu else 1), bias=spec.bias)
        self.down = nn.Linear(hidden, spec.dim, bias=spec.bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(x)  # [B, S, hidden or 2*hidden]
        if self.glu:
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        else:
            h = F.gelu(h)
        return self.down(h)
