"""State propagation for early exit: a layer run for some rows only (``Stack.run_layer_rows``).

After a token exits at layer n its state is frozen and copied to every later layer (CALM, Schuster et al., 2022,
arXiv:2207.07061, sec. 3.3; Elbayad et al., 2020, arXiv:1910.10073, sec. 2.1). A later layer then owes the tokens
after it one thing only: the keys and values of the copied state, which they attend to. Its attention output and
FFN at the exited token are never read (the token's output is its state at the exit), so they are not computed:

* **decoding, one new token per row** (``generate``: each call extends the decode cache by one token): rows still
  running run the whole layer; an exited row only updates its layer's decode state from the copied state (norm,
  key/value projection, QK-norm, rotation, then ``AttentionMechanism.propagate``: the key/value cache appends them).
  At batch 1 an exited token costs one key/value projection per later layer. The running rows attend over the
  updated state (``decode_propagated``), so the cache grows once per layer for the whole batch.
* **a fixed-shape step** (``StaticCache``, one new token per row, the state preallocated; what ``generate`` runs for
  an early-exit model): when every row has exited, their keys and values are written into the state in place
  (``AttentionMechanism.static_write``); while any row runs, the whole layer runs for every row. A decoding step
  reads each weight once whatever the batch, so running the layer for fewer rows saves nearly nothing on a
  CPU, and gathering them costs more (measured: batch 8, 24% of layers skipped per row, 3-13% slower).
* **several rows per call** (a prompt, ``xfam eval``'s whole sequences): later tokens of the same call attend to an
  exited token's keys and values, so the layer's attention runs for every row, as before; the FFN sublayers after
  it (and the residual additions) run on the running rows only, gathered and scattered back.

The outputs equal the full layer's at the running rows, and the decode state equals the full layer's for every row
(same keys and values, computed from the same copied state), so logits, depths and tokens are what running the
whole layer on the copy gives (``tests/unit/test_exit_propagation.py``). What cannot run partly falls back, logged
once with the reason: ``full_layer_problems`` (the whole layer, every row) and ``kv_only_problems`` (exited rows of
a one-token decode call attend as in the several-rows case).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.context import LayerContext
from xfam.core.logs import log_once
from xfam.core.mask import AttnMask
from xfam.core.state import DecodeState
from xfam.model.attn_options import Carry
from xfam.model.block import Block, SelfAttention, _sublayers
from xfam.model.cross import CrossSource

#: In a one-token decode call, exited rows only update the decode state while fewer than this share of the rows
#: still run: the running rows' key/value caches are then copied out to attend. With more running rows, every row
#: attends over its cache where it lies (copying most of the caches costs more than the exited rows' attention),
#: and the FFN runs for the running rows only.
SELECT_BELOW = 0.5


def full_layer_problems(block: Block, carry: Carry | None) -> list[str]:
    """Why layer ``block`` must run for every row (empty: its exited rows may skip work)."""
    out = []
    if block.keeps_rows:
        out.append("model.shift_tokens / model.ffn=sepconv: a sublayer reads the rows before each token at every layer")
    if carry is not None and carry.dual is not None:
        out.append("model.norm_position=resi_dual: its second stream passes through every layer for every token")
    if block.training:
        out.append("the model is in training mode (dropout, stochastic depth)")
    return out


def kv_only_problems(block: Block) -> list[str]:
    """Why an exited row of a one-token decode call must still attend at layer ``block`` (empty: it only updates
    the decode state)."""
    attn, out = block.attn, []
    if problem := attn.mechanism.propagate_problem():
        out.append(problem)
    if attn.persistent_k is not None:
        out.append("model.num_mem_kv: persistent keys change the cached keys' layout")
    if attn.score_options is not None:
        out.append("a score option (residual scores, talking heads, ...) needs every query's scores")
    if block.cross is not None:
        out.append("cross-attention reads the encoder output of every row")
    return out


def layer_rows(
    block: Block,
    h: Tensor,
    running: Tensor,
    ctx: LayerContext,
    state: DecodeState | None,
    carry: Carry | None,
    source: CrossSource | None,
) -> tuple[Tensor, DecodeState | None] | None:
    """Layer ``block`` on ``h [B, S, D]`` for the rows ``running [B, S]`` (some, not all); the others come back
    unchanged, their keys and values in the decode state. Returns the output and the new decode state, or None when
    the layer must run whole (``full_layer_problems``, logged once; or a fixed-shape step with a row still running)."""
    if problems := full_layer_problems(block, carry):
        log_once(f"early exit: exited tokens run the whole layer: {'; '.join(problems)}")
        return None
    if ctx.step is not None:  # a fixed-shape step: work is skipped only when every row has exited (module docstring)
        return None if bool(running.any()) else _write_rows(block, h, ctx, state, carry)
    if ctx.decoding and h.shape[1] == 1:
        if not (problems := kv_only_problems(block)):
            run = running[:, 0]
            r = int(run.sum())
            if r == 0 or r < SELECT_BELOW * run.shape[0]:
                return _decode_rows(block, h, run if r else None, ctx, state, carry)
            return _attend_all(block, h, running, ctx, state, carry, source)
        log_once(f"early exit: exited tokens attend as running ones (their FFN is skipped): {'; '.join(problems)}")
    return _attend_all(block, h, running, ctx, state, carry, source)


def _attend_all(
    block: Block,
    h: Tensor,
    running: Tensor,
    ctx: LayerContext,
    state: DecodeState | None,
    carry: Carry | None,
    source: CrossSource | None,
) -> tuple[Tensor, DecodeState | None]:
    """Attention (and cross-attention) for every row, the FFN sublayers after it for the running rows only."""
    x = _before(block, h)
    new_state = [state]

    def attend(a: Tensor) -> Tensor:
        out, new_state[0] = block.attn(a, ctx, None, state, None, carry)
        return out

    x = block.link_attn(x, attend, block.norm1)
    if block.cross is not None:
        cross, link_cross, norm_cross = block.cross, block.link_cross, block.norm_cross
        assert link_cross is not None and norm_cross is not None  # (built with ``cross``)
        x = link_cross(x, lambda a: cross(a, source), norm_cross)
    idx = running.flatten().nonzero().squeeze(1)  # [N] the running rows of [B * S]
    if idx.numel() == 0:  # (every row has exited: only their keys and values were needed)
        return h, new_state[0]
    rows = _after(block, x.flatten(0, 1).index_select(0, idx).unsqueeze(0)).squeeze(0)  # [N, D]
    return h.flatten(0, 1).index_copy(0, idx, rows).view_as(h), new_state[0]


def _decode_rows(
    block: Block, h: Tensor, run: Tensor | None, ctx: LayerContext, state: DecodeState | None, carry: Carry | None
) -> tuple[Tensor, DecodeState]:
    """One new token per row ``h [B, 1, D]``: every row's keys and values into the state, the rest of the layer for
    the rows ``run [B]`` (None: none)."""
    attn = block.attn
    x = _before(block, h)
    a = block.norm1(x) if block.link_attn.position in ("pre", "sandwich") else x  # the attention's input [B, 1, D]
    k, v = keys_values(attn, a, ctx, carry)
    new_state = attn.mechanism.propagate(k, v, state)
    if run is None:
        return h, new_state
    rows = run.nonzero().squeeze(1)  # [R]
    a_run = a.index_select(0, rows)  # [R, 1, D]
    bias = None if attn.qkv.bias is None else attn.qkv.bias[: attn.q_width]
    q = _heads(F.linear(a_run, attn.qkv.weight[: attn.q_width], bias), attn.heads)  # [R, H, 1, Dh]
    if attn.qk_norm is not None:
        q = attn.qk_norm.q(q)
    if ctx.rotary is not None:
        q = ctx.pos.rotate(q, tuple(t[-1:] for t in ctx.rotary))
    mask = _mask_rows(ctx.mask, rows)
    o = attn.mechanism.decode_propagated(q, new_state, rows, mask, ctx.bias, ctx.pos.score_modifier(attn.layer))
    out = _attention_output(attn, o, a_run)  # [R, 1, D]
    x_run = block.link_attn(x.index_select(0, rows), lambda _a: out, block.norm1)
    return h.index_copy(0, rows, _after(block, x_run)), new_state


def _write_rows(
    block: Block, h: Tensor, ctx: LayerContext, state: DecodeState | None, carry: Carry | None
) -> tuple[Tensor, DecodeState]:
    """Every row of a fixed-shape step ``h [B, 1, D]`` has exited: its key and value into the state, in place."""
    assert state is not None and ctx.step is not None  # (a StaticCache holds every layer's)
    x = _before(block, h)
    a = block.norm1(x) if block.link_attn.position in ("pre", "sandwich") else x  # the attention's input [B, 1, D]
    k, v = keys_values(block.attn, a, ctx, carry)
    block.attn.mechanism.static_write(k, v, state, ctx.step, ctx.bias)
    return h, state


def keys_values(attn: SelfAttention, a: Tensor, ctx: LayerContext, carry: Carry | None) -> tuple[Tensor, Tensor]:
    """The keys and values ``[B, Hkv, S, Dh]`` that ``SelfAttention.forward`` computes from its input ``a [B, S, D]``
    (key/value projection, QK-norm, ResFormer's value residual, rotation), without the queries."""
    k, v = attn._kv_rows(a, attn.qkv.weight, attn.qkv.bias)
    k, v = _heads(k, attn.kv_heads), _heads(v, attn.kv_heads)
    if attn.qk_norm is not None:
        k = attn.qk_norm.k(k)
    if attn.value_residual and carry is not None and carry.values is not None:  # (layer 0 set it: it ran whole)
        v = (v + carry.values) / 2
    if ctx.rotary is not None:
        k = ctx.pos.rotate(k, ctx.rotary, key=True)
    return k, v


def _attention_output(attn: SelfAttention, o: Tensor, a: Tensor) -> Tensor:
    """``SelfAttention.forward``'s tail: heads ``o [R, H, S, Dh]`` -> ``[R, S, D]`` (head scale, gate, output
    projection, attention on attention), ``a [R, S, D]`` the attention's input."""
    if attn.head_scale is not None:
        o = o * attn.head_scale.to(o.dtype)[:, None, None]
    o = o.transpose(1, 2).reshape(o.shape[0], o.shape[2], attn.q_width)
    if attn.gate is not None:
        o = o * torch.sigmoid(attn.gate(a))
    out = attn.out(o)
    return out if attn.aoa is None else attn.aoa(out, a)


def _before(block: Block, x: Tensor) -> Tensor:
    """The FFN sublayers before the attention (macaron's half step), for every row: they feed its keys and values."""
    for sub in _sublayers(block.before):
        x = sub.link(x, sub.ffn, sub.norm)
    return x


def _after(block: Block, x: Tensor) -> Tensor:
    """The FFN sublayers after the attention, on the rows ``x [R, S, D]`` given."""
    if block.ffn is not None:
        assert block.link_ffn is not None and block.norm2 is not None  # (built with ``ffn``)
        x = block.link_ffn(x, block.ffn, block.norm2)
    for sub in _sublayers(block.after):
        x = sub.link(x, sub.ffn, sub.norm)
    return x


def _heads(x: Tensor, n: int) -> Tensor:
    b, s, _ = x.shape
    return x.view(b, s, n, -1).transpose(1, 2)  # [B, S, n*Dh] -> [B, n, S, Dh]


def _mask_rows(mask: AttnMask, rows: Tensor) -> AttnMask:
    """``mask`` for the batch rows ``rows`` (its padding and documents; a fresh memo)."""
    pad = None if mask.key_padding is None else mask.key_padding.index_select(0, rows)
    seg = None if mask.segments is None else mask.segments.index_select(0, rows)
    return dataclasses.replace(mask, key_padding=pad, segments=seg, _memo={})
