"""Contracts of the positional slot: encodings, additive score biases and score modifiers.

A positional encoding declares its ``kind`` (used only by the build-time compatibility check)
and implements the hooks of that kind; the model calls every hook and the others are no-ops,
so no code outside the registry switches on a name or a kind:

* ``input``    -- ``embed`` adds a vector to the token embeddings (sinusoidal, learned), or
                  ``layer_embedding`` one to the input of every layer (learned_per_layer);
* ``rotary``   -- ``rotary_tables`` + ``rotate`` rotate q and k before attention (RoPE);
* ``bias``     -- ``score_bias`` returns a :class:`ScoreBias`, an additive term that depends only
                  on (head, query position, key position) (ALiBi, T5, dynamic bias);
* ``modifier`` -- ``score_modifier`` returns a :class:`ScoreModifier` for terms that depend on q
                  or k, reweight probabilities or change the values (Shaw, Transformer-XL, DA);
* ``none``     -- no position information at all.

Positions are key indices over [memory | cache | segment] (see ``xfam.core.mask``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.registry import Component, Registry

KINDS = ("none", "input", "rotary", "bias", "modifier")


class PositionalEncoding(nn.Module, Component):
    """Base of every ``pos`` component; see the module docstring for the kinds and hooks.

    Capabilities (class attributes):
        kind: one of ``KINDS``.
        relative: positions enter only through differences, so keys carried in memory keep
            their meaning in the next segment (required by the memory slot).
        bounded: positions at or beyond ``max_len`` cannot be encoded (a learned table).
        hosts: for a ``modifier``: the mechanisms it can run inside (None: any mechanism with
            ``hosts_modifiers``); ``hosts_why`` says why only those (shown in the refusal).
        decays: for a ``bias``: its ``ScoreBias.decay()`` is not None (a pure distance decay), so
            kernelised attention can host it as decayed prefix sums.
    """

    kind: ClassVar[str] = "none"
    relative: ClassVar[bool] = False
    bounded: ClassVar[bool] = False
    hosts: ClassVar[frozenset[str] | None] = None
    hosts_why: ClassVar[str] = ""
    decays: ClassVar[bool] = False

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x [B, S, D]`` plus the encoding of ``positions [S]``."""
        return x

    def layer_embedding(self, positions: Tensor, layer: int) -> Tensor | None:
        """``[S, D]`` added to the input rows at ``positions [S]`` of layer ``layer`` (the step the stack runs:
        a shared block's every run has its own index) before the block runs; None: nothing (every encoding
        but one learned per layer)."""
        return None

    def rotary_tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...] | None:
        """Tables ``[S, ...]`` (indexed by position along dim 0) that ``rotate`` needs for ``positions [S]``
        (computed once per forward)."""
        return None

    def rotate(self, x: Tensor, tables: tuple[Tensor, ...], key: bool = False) -> Tensor:
        """Rotate ``x [B, H, S, Dh]`` with the rows of ``rotary_tables`` at its positions: queries, or
        keys when ``key`` (xPos scales the two differently)."""
        return x

    def score_bias(self) -> ScoreBias | None:
        return None

    def score_modifier(self, layer: int) -> ScoreModifier | None:
        return None


POS: Registry[PositionalEncoding] = Registry("pos", PositionalEncoding)
