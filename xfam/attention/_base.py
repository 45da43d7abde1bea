"""Contract of the attention slot: a mechanism maps ``(q, k, v, mask, bias, modifier)`` to outputs.

The model owns projections, the head split, rotary application, memory concatenation and the
output projection; a mechanism sees heads-first tensors:

    q: [B, H, Sq, Dh]    k, v: [B, Hkv, Sk, Dh]  (Hkv divides H: grouped-query attention)
    returns [B, H, Sq, Dh]

Keys may extend in front of the queries (persistent keys, memory, decode cache): see ``AttnMask``.
Capabilities are class attributes read by the build-time compatibility check; ``forward`` never
asserts them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask
from xfam.core.registry import Component, Registry
from xfam.core.state import DecodeState


class AttentionMechanism(nn.Module, Component):
    """Base of every ``attention`` component.

    Capabilities:
        causal / bidirectional: which masks the mechanism can honour.
        accepts_bias: adds a ``ScoreBias`` to its scores.
        hosts_modifiers: forms the full ``[B, H, Sq, Sk]`` score matrix, so a ``ScoreModifier`` can run inside it.
        accepts_memory: keys may include memory or cache in front of the queries.
        accepts_persistent_kv: keys may lead with ``mask.persistent`` position-free keys that every
            query sees (``model.num_mem_kv``); its ``decode`` keeps them out of its state.
        shared_keys: honours the ``SHARED`` document id of ``AttnMask`` (keys every document sees:
            memory tokens in packed rows); mechanisms that treat documents as runs of equal ids do not.
        fixed_length: needs every sequence to have exactly ``max_len`` tokens.
        aux_loss: returns auxiliary losses (``aux_losses``), which need a normal autograd graph.
        backends: the implementations behind ``backend`` (``auto`` picks, and logs once).
        cross_attention: can serve as an encoder-decoder's cross-attention: queries over keys of
            another sequence (``AttnMask.cross``: Sq and Sk independent, key padding only). A mechanism
            whose pattern is defined by positions shared between queries and keys (a causal window, blocks
            of one sequence, buckets of shared query-keys) cannot.

    ``aux_tokens`` (set by a constructor): how many learned global tokens the model must prepend to every
    input for this mechanism (ETC's ``global_tokens``; 0 for all others). A mechanism that asks for them
    refuses, in its ``refusals``, what cannot hold them (memory, memory tokens, per-token exits).
    """

    causal: ClassVar[bool] = True
    bidirectional: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    hosts_modifiers: ClassVar[bool] = False
    accepts_memory: ClassVar[bool] = True
    accepts_persistent_kv: ClassVar[bool] = False
    shared_keys: ClassVar[bool] = True
    fixed_length: ClassVar[bool] = False
    aux_loss: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("torch",)
    cross_attention: ClassVar[bool] = False
    aux_tokens: int = 0

    def new_step(self) -> None:
        """Called by the model once at the start of every training forward (a training step; each micro-batch
        under gradient accumulation), before any layer runs. A mechanism with a step schedule (random-feature
        redraws) advances it here, not in ``forward``, which can run more than once per step: ACT's shared
        block, a reversible stack's recomputation in backward. Default: nothing."""

    def aux_losses(self) -> dict[str, Tensor]:
        """Auxiliary losses of the last ``forward`` (e.g. an L1 span penalty), already weighted;
        the model adds them to its output's ``aux`` as ``attention/<name>`` (summed over layers)."""
        return {}

    def model_objective(self) -> Any:
        """A training objective the mechanism poses over the whole model, not inside its layer (None: none): a
        callable ``objective(model, inputs, key_padding, segments) -> Tensor`` (already weighted) with a ``name``,
        which the model calls after every forward without a decode cache and returns in its ``aux`` as
        ``attention/<name>``. For objectives that change the model's input or run it more than once (ETC's CPC,
        ``xfam.attention._etc_cpc``, masks whole sentences of the input). Default: none."""
        return None

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        """Parameters under which the mechanism equals dense softmax attention on sequences of
        ``seq_len`` (window covering the sequence, one bucket, ...): its degenerate limit, which
        the contract tests compare against the reference. Exact mechanisms need none."""
        return {}

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        raise NotImplementedError  # abstract

    def decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: DecodeState | None,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> tuple[Tensor, DecodeState]:
        """Attend new queries to the cached keys plus the new ones; returns output and new state.

        ``q, k, v`` hold only the new tokens (after the ``mask.persistent`` persistent keys, which lead
        every call's keys and are never cached); ``mask`` describes all keys (cache + new), so
        ``mask.offset`` is the cache length. The default keeps a key/value cache (Hkv heads);
        mechanisms with other state (running sums, a rolling window) override this.
        """
        p = mask.persistent
        kp, vp, k, v = k[:, :, :p], v[:, :, :p], k[:, :, p:], v[:, :, p:]  # [B, Hkv, P | Sq, Dh]
        if state is not None:
            k = torch.cat((state["k"], k), dim=2)  # [B, Hkv, T + Sq, Dh]
            v = torch.cat((state["v"], v), dim=2)
        keys = torch.cat((kp, k), dim=2) if p else k  # [B, Hkv, P + T + Sq, Dh]
        values = torch.cat((vp, v), dim=2) if p else v
        return self(q, keys, values, mask, bias, modifier), {"k": k, "v": v}

    # -- early exit: state propagation (``xfam.model.propagate``) ---------------------------------------------
    def propagate_problem(self) -> str | None:
        """Why a token that left the stack early cannot pass this layer by updating the decode state alone, without
        attending (None: it can, through ``propagate`` and ``decode_propagated``). The default: it can when the
        mechanism keeps the default key/value cache; one that overrides ``decode`` (running sums, buckets) cannot
        unless it overrides these three too (its exited tokens then attend as before)."""
        if type(self).decode is AttentionMechanism.decode:
            return None
        return f"attention={self.registry_name} keeps its own decode state (no key/value-only update)"

    def propagate(self, k: Tensor, v: Tensor, state: DecodeState | None) -> DecodeState:
        """The decode state after new tokens that do not attend: their keys and values ``k, v [B, Hkv, Sq, Dh]``
        (no persistent keys) join ``state`` as ``decode`` would add them (an early-exited token's copied state,
        which later tokens read: CALM's state propagation). The default: appended to the key/value cache."""
        if state is not None:
            k = torch.cat((state["k"], k), dim=2)  # [B, Hkv, T + Sq, Dh]
            v = torch.cat((state["v"], v), dim=2)
        return {"k": k, "v": v}

    def decode_propagated(
        self,
        q: Tensor,
        state: DecodeState,
        rows: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        """``decode``'s output for the batch rows ``rows [R]`` of a state that ``propagate`` already gave their new
        keys and values: ``q [R, H, Sq, Dh]`` (their new queries), ``mask`` describes those rows' keys. The default
        attends over the rows' key/value cache."""
        return self(q, state["k"].index_select(0, rows), state["v"].index_select(0, rows), mask, bias, modifier)

    # -- fixed-shape decoding (``xfam.attention._static``, ``xfam.model.static_cache``) ------------------
    def static_problem(self) -> str | None:
        """Why this mechanism has no fixed-shape decode step (None: it has one, ``static_state`` and
        ``decode_step``). The default: it has none."""
        return f"attention={self.registry_name} keeps no fixed-shape decode state"

    def static_state(self, prefix: DecodeState, capacity: int) -> DecodeState | None:
        """The fixed-shape state of ``decode_step``, preallocated for ``capacity`` tokens in all and holding
        ``prefix``, the state an eager ``decode`` call left (the prompt's); None when this prefix cannot
        continue in fixed shape (the caller then decodes eagerly from ``prefix``)."""
        return None

    def decode_step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None
    ) -> Tensor:
        """One new token at position ``pos`` (a 0-dim long tensor): ``q [B, H, 1, Dh]``, ``k, v [B, Hkv, 1, Dh]``;
        updates ``state`` (from ``static_state``) in place and returns ``[B, H, 1, Dh]``. No mask, padding,
        persistent keys or score modifier reach it (the static cache refuses models that need them). Abstract:
        called only for a mechanism whose ``static_problem`` is None, which implements it."""
        raise NotImplementedError(self.static_problem())  # abstract (a mechanism without a fixed-shape step)

    def static_write(self, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None) -> None:
        """``decode_step``'s update of ``state`` for a token that does not attend (an early-exited token's copied
        state, which later tokens read: ``xfam.model.propagate``): its key and value ``[B, Hkv, 1, Dh]`` at ``pos``
        (``bias``: a distance decay of running sums applies to the update too). Abstract, as ``decode_step``."""
        raise NotImplementedError(self.static_problem())  # abstract (a mechanism without a fixed-shape step)


ATTENTION: Registry[AttentionMechanism] = Registry("attention", AttentionMechanism)
