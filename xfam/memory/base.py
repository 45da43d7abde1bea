"""Contract of the memory slot: state passed in and returned, never hidden in buffers.

One memory component serves one layer (a schedule may put different ones at different depths).
Per segment the model calls, for each layer:

    mem = memory.read(state)            # [B, M, D] hidden states to prepend as keys/values, or None
    ... the layer runs, its keys/values spanning [mem | segment] ...
    state, losses = memory.write(state, hidden)   # hidden: the layer's input [B, S, D]

``write`` detaches what it stores (stop-gradient between segments, as Transformer-XL does) and
returns auxiliary losses it owns (e.g. a compression reconstruction loss). Positions span
memory plus the current segment (key index coordinates, see ``AttnMask``), so memory entries keep
their relative distance to the queries of the next segment.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from xfam.registry import Component, Registry

#: Opaque per-layer memory state; None means empty.
MemoryState = Any


class Memory(nn.Module, Component):
    """Base of every ``memory`` component.

    Capabilities:
        needs_streams: batches must be contiguous streams (row i of batch t+1 continues row i of
            batch t: ``data.streams=true``), or the memory would mix unrelated text.
        needs_relative_pos: positions must enter through differences only, so stored keys keep
            their meaning in the next segment (absolute input encodings are refused).
    """

    needs_streams: ClassVar[bool] = True
    needs_relative_pos: ClassVar[bool] = True

    def init_state(self, batch_size: int, device: torch.device) -> MemoryState:
        return None

    def read(self, state: MemoryState) -> Tensor | None:
        """Hidden states ``[B, M, D]`` to prepend to this layer's keys/values, or None."""
        return None

    def write(self, state: MemoryState, hidden: Tensor) -> tuple[MemoryState, dict[str, Tensor]]:
        """New state after a segment whose layer input was ``hidden [B, S, D]``; plus aux losses."""
        return state, {}


MEMORY: Registry[Memory] = Registry("memory", Memory)
