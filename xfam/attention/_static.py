"""Fixed-shape decode steps: the state a mechanism keeps for one-token decoding, preallocated at its final size
and updated in place, so one traced (compiled) step serves every position (the static cache of PyTorch's
gpt-fast, generalised from the key/value cache to each mechanism's own state).

The query's position ``pos`` is a 0-dim long tensor, never a Python number, so a compiled step does not
specialise on it. Two states live here; running sums (``performer``, ``rfa``) keep their own
(``xfam.attention._linear``):

* ``kv_state`` / ``kv_step`` -- a key/value cache of C slots, slot j holding position j; the query sees slots
  0..pos (``vanilla``). Each step attends over all C slots with the later ones masked: O(C) work whatever
  pos, the price of one shape for all steps.
* ``ring_state`` / ``ring_step`` -- a rolling window of the last R positions (slot ``p % R`` holds position p),
  plus the keys of fixed global positions, for patterns whose keys lie fewer than R positions back
  (``local``, ``longformer``). O(R) per step, whatever the length.

Shapes: B batch, H query heads, Hkv key/value heads, C or R slots, Dh head width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.bias import ScoreBias
from xfam.core.state import DecodeState

#: ``allowed(q_pos [1, 1], k_pos [1, R]) -> [Hp, R]`` (Hp = 1 or H): a sparse pattern's rule at one query.
Allowed = Callable[[Tensor, Tensor], Tensor]


def attend_slots(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor, pos: Tensor, slots: Tensor, bias: ScoreBias | None
) -> Tensor:
    """Softmax attention of one query ``q [B, H, 1, Dh]`` over slots ``k, v [B, Hkv, N, Dh]`` that hold positions
    ``slots [N]``; ``visible [Hp, N]`` (Hp = 1 or H) the slots it may see; ``bias`` at (pos, slot)."""
    add = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    if bias is not None:
        add = add + bias.pairs(pos.view(1, 1), slots.view(1, -1)).to(q.dtype)[:, 0]  # [H, N]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=add[None, :, None], enable_gqa=k.shape[1] != q.shape[1])


def kv_state(prefix: DecodeState, capacity: int) -> DecodeState:
    """A key/value cache of ``capacity`` slots holding ``prefix``'s keys and values (``{"k", "v"}``
    ``[B, Hkv, T, Dh]``, an eager decode call's state) in slots 0..T-1."""
    k, v = prefix["k"], prefix["v"]
    b, h, t, d = k.shape
    out = {"k": k.new_zeros(b, h, capacity, d), "v": v.new_zeros(b, h, capacity, v.shape[-1])}
    out["k"][:, :, :t], out["v"][:, :, :t] = k, v
    return out


def kv_write(k: Tensor, v: Tensor, state: DecodeState, pos: Tensor) -> None:
    """Write the new key and value ``[B, Hkv, 1, Dh]`` into slot ``pos``."""
    state["k"].index_copy_(2, pos.view(1), k)
    state["v"].index_copy_(2, pos.view(1), v)


def kv_step(q: Tensor, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None) -> Tensor:
    """Write the new key and value ``[B, Hkv, 1, Dh]`` into slot ``pos`` and attend over slots 0..pos."""
    kv_write(k, v, state, pos)
    slots = torch.arange(state["k"].shape[2], device=q.device)  # [C]
    return attend_slots(q, state["k"], state["v"], (slots <= pos)[None], pos, slots, bias)


def ring_state(prefix: DecodeState, span: int, global_positions: tuple[int, ...] = ()) -> DecodeState:
    """A rolling window of ``span`` slots holding the last ``span`` of ``prefix``'s T keys and values (position p
    in slot ``p % span``), and the keys and values of ``global_positions`` (each < T) apart."""
    k, v = prefix["k"], prefix["v"]
    b, h, t, d = k.shape
    out = {"k": k.new_zeros(b, h, span, d), "v": v.new_zeros(b, h, span, v.shape[-1])}
    last = torch.arange(max(t - span, 0), t, device=k.device)  # [min(T, R)]
    out["k"][:, :, last % span], out["v"][:, :, last % span] = k[:, :, last], v[:, :, last]
    if global_positions:
        at = torch.tensor(global_positions, device=k.device)
        out["gk"], out["gv"], out["g"] = k[:, :, at], v[:, :, at], at  # [B, Hkv, G, Dh], [G]
    return out


def ring_write(k: Tensor, v: Tensor, state: DecodeState, pos: Tensor) -> None:
    """Write the new key and value into slot ``pos % R`` of the rolling window."""
    at = (pos % state["k"].shape[2]).view(1)
    state["k"].index_copy_(2, at, k)
    state["v"].index_copy_(2, at, v)


def ring_step(
    q: Tensor, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None, allowed: Allowed
) -> Tensor:
    """Write the new key and value into slot ``pos % R`` and attend over the window slots whose positions
    ``allowed`` admits, then the global keys (every query sees them; a global position inside the window
    counts once)."""
    span = state["k"].shape[2]
    ring_write(k, v, state, pos)
    slot = torch.arange(span, device=q.device)
    held = pos - (pos - slot) % span  # [R] the position each slot holds (<= pos, > pos - R)
    visible = (held >= 0) & allowed(pos.view(1, 1), held.view(1, -1))  # [Hp, R]
    keys, values = state["k"], state["v"]
    if "g" in state:
        visible = visible & ~torch.isin(held, state["g"])
        keys, values = torch.cat((state["gk"], keys), dim=2), torch.cat((state["gv"], values), dim=2)
        visible = torch.cat((torch.ones_like(visible[:, :1]).expand(-1, len(state["g"])), visible), dim=1)
        held = torch.cat((state["g"], held))
    return attend_slots(q, keys, values, visible, pos, held, bias)
