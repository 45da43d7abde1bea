"""Sinusoidal absolute positions (Vaswani et al., 2017, "Attention Is All You Need", sec. 3.5).

PE(i, 2k) = sin(i / base^(2k/d)), PE(i, 2k+1) = cos(i / base^(2k/d)), added to the input.
Vaswani et al. multiply the embeddings by sqrt(d) so that they and the unit-amplitude sinusoids are
of comparable size; xfam initialises embeddings with std 0.02 instead, so it scales the sinusoids
by ``scale`` (default 1/sqrt(d)) rather than the embedding: a scaled PE vector then has norm about 0.7,
an embedding about 0.02 sqrt(d) (0.32 at d = 256), the same order though not the paper's exact ratio.
"""

from __future__ import annotations

import math
from typing import Annotated

from torch import Tensor

from xfam.core.registry import Positive
from xfam.core.sinusoid import sinusoid_table
from xfam.pos._base import POS, PositionalEncoding


@POS.register("sinusoidal")
class Sinusoidal(PositionalEncoding):
    """Fixed sinusoidal encoding added to the token embeddings.

    Args:
        dim: model width (injected).
        base: the wavelength base (10000 in the paper).
        scale: multiplier on the table; null means 1/sqrt(dim) (see the module docstring).
    """

    paper = "Vaswani et al., 2017, arXiv:1706.03762"

    kind = "input"

    def __init__(self, *, dim: int, base: Annotated[float, Positive] = 10000.0, scale: float | None = None):
        super().__init__()
        self.dim, self.base = dim, base
        self.scale = scale if scale is not None else 1 / math.sqrt(dim)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + self.scale * sinusoid_table(positions, self.dim, self.base).to(x.dtype)
