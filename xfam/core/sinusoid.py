"""The Universal Transformer's coordinate embedding (Dehghani et al., ICLR 2019, arXiv:1807.03819, sec. 2.1).

A Universal Transformer applies one weight-shared block T times (with ACT deciding per position when to
stop: the exit slot). Before step t it adds a signal for both coordinates, position i and step t:

    P^t_{i,2j}   = sin(i / 10000^(2j/d)) + sin(t / 10000^(2j/d))
    P^t_{i,2j+1} = cos(i / 10000^(2j/d)) + cos(t / 10000^(2j/d))

so the shared block knows where it is in depth as well as in the sequence. ``TimestepSignal`` is that
signal (position (+) step); with ``positions=False`` it adds the step part only, for models whose ``pos``
slot already encodes positions (RoPE, ALiBi, ...). Like ``pos=sinusoidal`` it is scaled by ``scale``
(default 1/sqrt(d)) because xfam's embeddings are initialised with std 0.02, not multiplied by sqrt(d).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoid_table(positions: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """``[S, dim]`` table with sin on even and cos on odd channels (interleaved as in the paper)."""
    k = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
    angles = positions.float()[:, None] / base ** (k / dim)[None, :]  # [S, ceil(dim/2)]
    # (interleaved by stacking, not by strided writes into an empty table: compiled training ran 12% slower so)
    return torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1).flatten(1)[:, :dim]  # [S, dim]


class TimestepSignal(nn.Module):
    """``x [B, S, D] -> x + scale * (PE(positions) + PE(step))`` (no parameters).

    Args:
        dim: model width d.
        base: wavelength base (10000 in the paper).
        scale: multiplier on the signal; None: 1/sqrt(d).
        positions: include the position part (the paper); False: the step part only.
    """

    def __init__(self, dim: int, base: float = 10000.0, scale: float | None = None, positions: bool = True):
        super().__init__()
        self.dim, self.base, self.positions = dim, base, positions
        self.scale = scale if scale is not None else 1 / math.sqrt(dim)

    def signal(self, positions: Tensor, step: int) -> Tensor:
        """``[S, D]``: the coordinate embedding of ``positions [S]`` at recurrent step ``step`` (0-based)."""
        time = sinusoid_table(torch.tensor([step], device=positions.device), self.dim, self.base)  # [1, D]
        if not self.positions:
            return self.scale * time.expand(len(positions), -1)
        return self.scale * (sinusoid_table(positions, self.dim, self.base) + time)  # [S, D]

    def forward(self, x: Tensor, positions: Tensor, step: int) -> Tensor:
        return x + self.signal(positions, step).to(x.dtype)
