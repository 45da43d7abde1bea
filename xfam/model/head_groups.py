"""Head groups: one layer's heads split among several mechanisms (the ``per_head`` schedule).

Each group gets its own slice of query heads, the matching key/value heads and the matching heads
of the score bias; outputs are concatenated back in group order. The group's capabilities are
the intersection of its members' (the compatibility check reads them off the members).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from xfam.attention._base import AttentionMechanism
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask
from xfam.core.state import DecodeState
from xfam.core.typed import TypedModuleList


class HeadGroups(AttentionMechanism):
    """Runs ``members[g]`` on heads ``[start_g, start_g + heads_g)`` and concatenates the outputs."""

    def __init__(self, members: list[AttentionMechanism], head_counts: list[int], heads: int, kv_heads: int):
        super().__init__()
        self.members = TypedModuleList(members)
        self.head_counts = head_counts
        self.per_kv = heads // kv_heads

    def _slices(self) -> Iterator[tuple[AttentionMechanism, int, int]]:
        start = 0
        for member, n in zip(self.members, self.head_counts, strict=True):
            yield member, start, start + n
            start += n

    def _kv(self, x: Tensor, start: int, stop: int) -> Tensor:
        return x[:, start // self.per_kv : stop // self.per_kv]  # [B, Hkv_g, Sk, Dh]

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        outs = [
            member(q[:, a:b], self._kv(k, a, b), self._kv(v, a, b), mask, bias and bias.select_heads(a, b), modifier)
            for member, a, b in self._slices()
        ]
        return torch.cat(outs, dim=1)  # [B, H, Sq, Dh]

    def aux_losses(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for member in self.members:
            for k, v in member.aux_losses().items():
                out[k] = out.get(k, 0.0) + v
        return out

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
        states = state["groups"] if state is not None else [None] * len(self.members)
        outs, new = [], []
        for (member, a, b), st in zip(self._slices(), states, strict=True):
            out, st = member.decode(
                q[:, a:b], self._kv(k, a, b), self._kv(v, a, b), st, mask, bias and bias.select_heads(a, b), modifier
            )
            outs.append(out)
            new.append(st)
        return torch.cat(outs, dim=1), {"groups": new}

    # -- fixed-shape decoding: each group's own state (``xfam.model.static_cache``) ---------------------------
    def static_problem(self) -> str | None:
        problems = [why for member in self.members if (why := member.static_problem()) is not None]
        return "; ".join(problems) if problems else None

    def static_state(self, prefix: DecodeState, capacity: int) -> DecodeState | None:
        groups = [m.static_state(st, capacity) for m, st in zip(self.members, prefix["groups"], strict=True)]
        return None if any(g is None for g in groups) else {"groups": groups}

    def decode_step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None
    ) -> Tensor:
        outs = []
        for (member, a, b), st in zip(self._slices(), state["groups"], strict=True):
            part = bias and bias.select_heads(a, b)
            outs.append(member.decode_step(q[:, a:b], self._kv(k, a, b), self._kv(v, a, b), st, pos, part))
        return torch.cat(outs, dim=1)  # [B, H, 1, Dh]

    def static_write(self, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None) -> None:
        for (member, a, b), st in zip(self._slices(), state["groups"], strict=True):
            member.static_write(self._kv(k, a, b), self._kv(v, a, b), st, pos, bias and bias.select_heads(a, b))
