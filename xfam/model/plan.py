"""The plan of one forward call: which rows run, at which positions, with which padding and documents.

Every call's rows are ``[aux tokens | input]``: G auxiliary tokens (memory tokens or ETC's global
tokens; G = 0 in most models) in front of the S input tokens. The aux tokens run in the first call
only: later decode calls find their keys and values in the cache, and their rows ride along
unchanged (the head drops them). Keys are ``[persistent | memory or cache | rows]`` (``AttnMask``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from xfam.core.state import DecodeState


@dataclasses.dataclass
class DecodeCache:
    """Incremental-decoding state: tokens seen so far, each layer's mechanism state, the key padding
    ``[B, length]`` of the tokens seen so far (None while nothing was padded), for the decoder of an
    encoder-decoder the encoder's output with its per-layer cross-attention keys and values
    (``xfam.model.cross.CrossSource``, projected in the first call only), and per layer the keys held in
    front of the tokens (``front``: a memory read in the first call, whose keys and values entered the
    state there; None: none)."""

    length: int
    layers: list[DecodeState | None]
    key_padding: Tensor | None = None
    source: Any = None
    front: list[int] | None = None


@dataclasses.dataclass
class StaticCache:
    """Fixed-shape decoding state (``xfam.model.static_cache`` builds it from a prompt's ``DecodeCache``): each
    layer's mechanism state preallocated for ``capacity`` tokens and updated in place (``decode_step``), the
    position of the next token ``pos`` as a 0-dim long tensor (advanced in place by every call), and the
    positional encoding's rotary tables for positions ``0..capacity - 1`` (None for other kinds), so a call
    has the same shapes at every position and one compiled step serves them all. One new row per call, no
    padding, documents or auxiliary tokens."""

    capacity: int
    pos: Tensor
    layers: list[DecodeState]
    rotary: tuple[Tensor, ...] | None = None


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """Index bookkeeping of one call (G aux tokens, S input tokens, T cached tokens).

    Attributes:
        offset: T, the tokens already in the decode cache (0 without one).
        ride: aux rows that ride along unchanged (G in decode calls after the first, else 0).
        lead: aux rows among the rows that run (G in the first call, else 0).
        positions: ``[S]`` the input's own positions (aux tokens take none).
        row_positions: ``[G + S]`` positions of every row, the aux rows counting down from the input's.
        input_padding: ``[B, S]`` the input's key padding (the classifier head pools with it).
        key_padding, segments: ``[B, G + S]`` padding and document ids of every row (aux rows are real;
            their document is ``aux_doc``).
        run_padding, run_segments: the same for the rows that run ``[B, G + S - ride]``.
        cache_padding: ``[B, T + S]`` padding of the keys of a decode call, when any is padded.
        decoding: the call extends a decode cache.
        batch: B.
        step: in a fixed-shape decode call (``StaticCache``), the position of its row, a 0-dim tensor (``offset``
            is then 0: the number of cached tokens is not a Python number).
    """

    offset: int
    ride: int
    lead: int
    positions: Tensor
    row_positions: Tensor
    input_padding: Tensor | None
    key_padding: Tensor | None
    segments: Tensor | None
    run_padding: Tensor | None
    run_segments: Tensor | None
    cache_padding: Tensor | None
    decoding: bool
    batch: int = 1
    step: Tensor | None = None

    @property
    def rows(self) -> int:
        """Rows that run in this call (and enter the decode cache)."""
        return len(self.row_positions) - self.ride


def plan_call(
    inputs: Tensor,
    key_padding: Tensor | None,
    segments: Tensor | None,
    cache: DecodeCache | StaticCache | None,
    aux_tokens: int,
    aux_doc: int,
) -> CallPlan:
    """The plan of a call on ``inputs [B, S, ...]`` (the embedded input, ``[B, S, D]``: S rows whatever the
    input, token ids, vectors or image patches) with ``aux_tokens`` G in front (see ``CallPlan``)."""
    b, s = inputs.shape[:2]
    if isinstance(cache, StaticCache):
        if s != 1 or key_padding is not None or segments is not None or aux_tokens:
            raise ValueError("a StaticCache call takes one new row, without padding, documents or aux tokens")
        at = cache.pos.view(1)  # [1]
        return CallPlan(0, 0, 0, at, at, None, None, None, None, None, None, decoding=True, batch=b, step=cache.pos)
    offset = cache.length if cache is not None else 0
    ride = aux_tokens if offset else 0
    start = offset - ride  # the input's own first position
    positions = torch.arange(start, start + s, device=inputs.device)  # [S]
    row_positions = torch.arange(start - aux_tokens, start + s, device=inputs.device)  # [G + S]
    input_padding = key_padding
    if aux_tokens:  # aux rows are never padding; in packed rows their document is aux_doc
        if key_padding is not None:
            key_padding = torch.cat((key_padding.new_ones(b, aux_tokens), key_padding), dim=1)  # [B, G + S]
        if segments is not None:
            segments = torch.cat((segments.new_full((b, aux_tokens), aux_doc), segments), dim=1)  # [B, G + S]
    run_padding, run_segments = (None if t is None else t[:, ride:] for t in (key_padding, segments))
    cache_padding = None
    if cache is not None and (run_padding is not None or cache.key_padding is not None):
        # Keys are [cache | new rows]: the mask needs the padding of the cached tokens too.
        rows = aux_tokens + s - ride
        past = cache.key_padding if cache.key_padding is not None else inputs.new_ones(b, offset, dtype=torch.bool)
        new = run_padding if run_padding is not None else inputs.new_ones(b, rows, dtype=torch.bool)
        cache_padding = torch.cat((past, new), dim=1)  # [B, T + rows]
    return CallPlan(
        offset=offset,
        ride=ride,
        lead=aux_tokens - ride,
        positions=positions,
        row_positions=row_positions,
        input_padding=input_padding,
        key_padding=key_padding,
        segments=segments,
        run_padding=run_padding,
        run_segments=run_segments,
        cache_padding=cache_padding,
        decoding=cache is not None,
        batch=b,
    )
