"""Long-term stores: what a memory component is given when it needs one (``Memory.needs_store``).

A component that retrieves from a store built outside the model (SPALM's kNN long-term memory: a
datastore of (key, next token) pairs and the frozen pretrained model that encodes its queries) does
not open it itself: it says which store it needs per layer (``Memory.store_request`` returns a
``StoreRequest``), the model builder opens it once and passes it to the constructor as
``long_term=`` (injected like a structural size), typed by the ``LongTermStore`` protocol below. The
slot stays free of the datastore, the checkpoint reader and the search code.
Shapes: queries ``[N, D]`` (N = B * S positions), neighbours ``[N, k]``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

from torch import Tensor, nn


@dataclasses.dataclass(frozen=True)
class StoreRequest:
    """The store a memory component asks the model builder to open: a datastore directory (written by
    ``xfam knnlm build``, its manifest names the model that encodes its queries) and the search index."""

    path: str
    index: str = "exact"


class Neighbours(Protocol):
    """The k nearest entries of N queries: squared distances ``[N, k]``, ascending, and the entries'
    values (next-token ids) ``[N, k]``."""

    dists: Tensor
    values: Tensor


class LongTermStore(Protocol):
    """An opened store: entries searched on the CPU, queries encoded by a frozen model that is no
    submodule of the model holding the store (never trained, never saved)."""

    #: The frozen model that encodes the queries (parameters without gradients).
    encoder: nn.Module

    @property
    def path(self) -> Path:
        """Where the store lives (for messages)."""
        ...

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary the values index (None: not recorded)."""
        ...

    def encode(self, tokens: Tensor, key_padding: Tensor | None, segments: Tensor | None) -> Tensor:
        """The queries of every position of ``tokens [B, S]``: ``[B * S, D]`` float32, on the tokens' device."""
        ...

    def search(self, queries: Tensor, k: int) -> Neighbours:
        """The ``k`` nearest entries of ``queries [N, D]`` (on the CPU)."""
        ...
