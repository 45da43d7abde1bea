"""Contracts of the positional slot: encodings, additive score biases and score modifiers.

A positional encoding declares its ``kind`` (used only by the build-time compatibility check)
and implements the hooks of that kind; the model calls every hook and the others are no-ops,
so no code outside the registry switches on a name or a kind:

* ``input``    -- ``embed`` adds a vector to the token embeddings (sinusoidal, learned);
* ``rotary``   -- ``rotary_tables`` + ``rotate`` rotate q and k before attention (RoPE);
* ``bias``     -- ``score_bias`` returns a :class:`ScoreBias`, an additive term that depends only
                  on (head, query position, key position) (ALiBi, T5, dynamic bias);
* ``modifier`` -- ``score_modifier`` returns a :class:`ScoreModifier` for terms that depend on q
                  or k, reweight probabilities or change the values (Shaw, Transformer-XL, DA);
* ``none``     -- no position information at all.

Positions are key indices over [memory | cache | segment] (see ``xfam.attention.mask``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from xfam.registry import Component, Registry

if TYPE_CHECKING:  # xfam.attention imports this module: a run-time import would be circular
    from xfam.attention.mask import AttnMask

KINDS = ("none", "input", "rotary", "bias", "modifier")


class ScoreBias(nn.Module):
    """An additive attention-score bias ``b[h, i, j]`` that depends only on head and positions.

    Subclasses implement ``pairs``; the other forms follow from it and may be overridden where a
    closed form is cheaper or more exact:

    (a) ``dense(mask)``: ``[1, H, Sq, Sk]`` for reference paths (memoised per forward);
    (b) ``pairs(q_pos, k_pos)``: values on gathered index pairs for sparse/bucketed paths;
    (c) ``kernel_params()``: a parametric description the fused kernel evaluates in-kernel
        (``xfam.attention.fused``): ``{"kind": "alibi", "slopes": [H]}`` or ``{"kind": "table",
        "table": [NB, H], "bucket": distances qpos - kpos -> bucket ids}``;
    (d) ``decay()``: per-head rates lambda_h with exp(b[h,i,j]) = lambda_h ** |i - j| on every pair,
        when the bias is a pure, symmetric distance decay (lets kernelised attention host it: causal,
        one decayed prefix sum; bidirectional, a forward plus a backward one).
    """

    heads: int

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bias at broadcast (query, key) positions: returns ``[H, *broadcast(q_pos, k_pos)]``."""
        raise NotImplementedError  # abstract

    def dense(self, mask: AttnMask, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[1, H, Sq, Sk]`` bias for every (query, key) pair described by ``mask``."""
        device = self._device()

        def make() -> Tensor:
            q_pos, k_pos = mask.positions(device)
            return self.pairs(q_pos[:, None], k_pos[None, :])[None].to(dtype)  # [1, H, Sq, Sk]

        return mask.memo(("bias", self, dtype), make)  # the object, not its id (see additive_mask)

    def kernel_params(self) -> dict[str, Any] | None:
        """Description for a fused kernel, or None if the kernel must read ``dense``."""
        return None

    def decay(self) -> Tensor | None:
        """Per-head decay ``[H]`` if the bias equals ``|i - j| * log(decay)`` on every pair, else None."""
        return None

    def select_heads(self, start: int, stop: int) -> ScoreBias:
        """The bias of heads ``start:stop`` only (for a per-head component schedule)."""
        return _HeadSlice(self, start, stop)

    def _device(self) -> torch.device:
        for t in self.buffers():
            return t.device
        for t in self.parameters():
            return t.device
        return torch.device("cpu")


class _HeadSlice(ScoreBias):
    def __init__(self, parent: ScoreBias, start: int, stop: int):
        super().__init__()
        self.parent, self.start, self.stop, self.heads = parent, start, stop, stop - start

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.parent.pairs(q_pos, k_pos)[self.start : self.stop]

    def dense(self, mask: AttnMask, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.parent.dense(mask, dtype)[:, self.start : self.stop]

    def decay(self) -> Tensor | None:
        d = self.parent.decay()
        return None if d is None else d[self.start : self.stop]

    def kernel_params(self) -> dict[str, Any] | None:
        params = self.parent.kernel_params()
        if params is None or params["kind"] not in ("alibi", "table"):
            return None
        if params["kind"] == "alibi":
            return {**params, "slopes": params["slopes"][self.start : self.stop]}
        return {**params, "table": params["table"][:, self.start : self.stop]}


class ScoreModifier(nn.Module):
    """A change to attention that is not an additive position-only bias.

    Hosted only by mechanisms that compute explicit scores (``hosts_modifiers``), and only by
    those named in the positional component's ``hosts`` when it is set. Hooks (identity by default):

    * ``logits(scores, q, k, mask)`` -- pre-softmax, on the scaled scores ``[B, H, Sq, Sk]``
      (Shaw on keys, Transformer-XL's position terms, DA-Transformer's reweighting);
    * ``output(probs, mask)`` -- a term ``[B, H, Sq, Dh]`` added to ``probs @ v`` (Shaw on values).
    """

    def logits(self, scores: Tensor, q: Tensor, k: Tensor, mask: AttnMask) -> Tensor:
        return scores

    def output(self, probs: Tensor, mask: AttnMask) -> Tensor | None:
        return None


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
