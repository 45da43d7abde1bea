"""Learned absolute positions (Gehring et al., 2017, "Convolutional Sequence to Sequence
Learning"; the GPT/BERT embedding table): one trained vector per position, added to the input.
Positions at or beyond the table size cannot be encoded; the config check refuses such lengths."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xfam.core.errors import ConfigError
from xfam.pos._base import POS, PositionalEncoding


@POS.register("learned")
class Learned(PositionalEncoding):
    """A learned table of ``max_len`` position vectors added to the token embeddings (init N(0, 0.02)).

    Args:
        dim: model width (injected).
        max_len: number of positions in the table (injected from ``model.max_len``).
    """

    paper = "Gehring et al., 2017, arXiv:1705.03122"

    kind = "input"
    bounded = True

    def __init__(self, *, dim: int, max_len: int):
        super().__init__()
        self.table = nn.Embedding(max_len, dim)
        nn.init.normal_(self.table.weight, std=0.02)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        check_in_table(positions, self.table.num_embeddings, "pos=learned")
        return x + self.table(positions)


def check_in_table(positions: Tensor, size: int, name: str, what: str = "table") -> None:
    """Refuse ``positions [S]`` past a learned ``what`` of ``size`` rows (one host sync: the last position).

    Skipped under ``torch.compile`` (``trainer.compile``): the host sync would split the compiled forward into a
    graph per layer. A position past the table still fails there, in the lookup itself (an index error on CPU, a
    device-side assert on CUDA), with a less helpful message; the run's eager evaluation checks it as here."""
    if torch.compiler.is_compiling():
        return
    last = int(positions[-1]) if len(positions) else 0
    if last >= size:
        raise ConfigError(
            f"{name}: position {last} is past the learned {what} ({size} positions). Fix: keep sequences <= "
            f"model.max_len, or use pos=rope or pos=alibi, which extrapolate."
        )
