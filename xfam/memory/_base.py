"""Contract of the memory slot: state passed in and returned, never hidden in buffers.

One memory component serves one layer (the shared ``per_layer`` schedule may put different ones at
different depths, e.g. XL everywhere and a kNN memory at one depth). Per segment the model calls,
for each layer:

    mem = memory.read(state)                  # [B, M, D] states to prepend as keys/values, or None
    docs = memory.read_segments(state)        # [B, M] their document ids, or None
    ... the layer runs, its keys/values spanning [mem | segment]; a memory with
        ``augments_attention`` also combines the layer's output with its own retrieval:
        out = memory.augment(state, q, out, q_segments)          # q, out: [B, H, S, Dh]
    state, losses = memory.write(state, hidden, view)              # hidden: the layer's input [B, S, D]

``write`` detaches what it stores (stop-gradient between segments, as Transformer-XL does) and
returns auxiliary losses it owns (e.g. a compression reconstruction loss). ``view`` (a ``LayerView``)
lends the memory its layer's projections with detached weights: the segment's keys/values for a kNN
store, content attention for a reconstruction loss; and the document ids of the segment.

Positions span memory plus the current segment (key index coordinates, see ``AttnMask``), so memory
entries keep their relative distance to the queries of the next segment. Document ids: when the data
marks documents (``data.doc_mask=true``) a memory keeps the id of each entry, and a query never sees
memory of another document: the memory is reset at document boundaries, to the token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from xfam.core.registry import Component, Registry
from xfam.core.state import LayerView, MemoryState
from xfam.core.store import StoreRequest


class Memory(nn.Module, Component):
    """Base of every ``memory`` component.

    Capabilities:
        needs_streams: batches must be contiguous streams (row i of batch t+1 continues row i of
            batch t: ``data.streams=true``), or the memory would mix unrelated text.
        needs_relative_pos: positions must enter through differences only, so stored keys keep
            their meaning in the next segment (absolute input encodings are refused).
        augments_attention: the memory takes part in its layer's attention (``augment``), rather
            than only prepending states.
        mixes_output: (per instance) the memory mixes into the final hidden state (``retrieve``/``mix``).
        needs_store: the memory retrieves from a long-term store built outside the model (a kNN
            datastore and its query encoder). It never opens one itself: ``store_request`` names the
            store an instance needs, and the model builder opens it and passes it to the constructor
            as ``long_term=`` (an ``xfam.core.store.LongTermStore``).
    """

    needs_streams: ClassVar[bool] = True
    needs_relative_pos: ClassVar[bool] = True
    augments_attention: ClassVar[bool] = False
    #: The final layer's memory mixes retrieved tokens into the head's input (SPALM): the model calls
    #: ``retrieve(tokens, key_padding, segments)`` once per forward and ``mix(h, retrieved, W)`` in the head.
    mixes_output: bool = False
    needs_store: ClassVar[bool] = False

    @classmethod
    def store_request(cls, params: Mapping[str, Any], *, layer: int, num_layers: int) -> StoreRequest | None:
        """``needs_store`` only: the long-term store the instance at ``layer`` (of ``num_layers``) is given as
        ``long_term=``, or None when that instance needs none. ``params``: the layer's memory config.
        Raises ``ConfigError`` when the config names no usable store."""
        return None

    def init_state(self, batch_size: int, device: torch.device) -> MemoryState:
        return None

    def read(self, state: MemoryState) -> Tensor | None:
        """Hidden states ``[B, M, D]`` to prepend to this layer's keys/values, or None."""
        return None

    def read_segments(self, state: MemoryState) -> Tensor | None:
        """Document ids ``[B, M]`` of the states ``read`` returns (None: written without ids)."""
        return None

    def augment(self, state: MemoryState, q: Tensor, out: Tensor, q_segments: Tensor | None) -> Tensor:
        """``augments_attention`` only: the layer's output ``[B, H, S, Dh]`` combined with the memory's
        own attention for queries ``q [B, H, S, Dh]`` (projected, no positions)."""
        return out

    def write(self, state: MemoryState, hidden: Tensor, view: LayerView) -> tuple[MemoryState, dict[str, Tensor]]:
        """New state after a segment whose layer input was ``hidden [B, S, D]``; plus aux losses."""
        return state, {}


MEMORY: Registry[Memory] = Registry("memory", Memory)


def fifo(old: Tensor | None, new: Tensor, keep: int) -> Tensor | None:
    """The last ``keep`` entries of ``[old | new]`` along dim 1 (None when ``keep`` is 0). Copies only the
    entries kept: none when ``new`` alone fills the memory (a segment at least as long as it)."""
    if keep == 0:
        return None
    n = new.shape[1]
    if old is None or n >= keep:
        return new[:, -keep:]
    return torch.cat((old[:, -(keep - n) :], new), dim=1)
