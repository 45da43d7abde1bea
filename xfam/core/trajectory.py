"""The packed timestep of a trajectory: the contract between the Decision Transformer's data (``data=gym``,
``xfam.data.episodes``), its embedding (``xfam.model.inputs.DecisionEmbedding``) and its rollouts
(``xfam.eval.rollout``).

One timestep of a window travels as one float vector of ``inputs [B, K, F]`` (ids and steps are exact in
float32 below 2^24), so every slot of the model runs on it unchanged:

    [ R_t / scale | s_t (S values, or 1 id) | a_t (A values, or 1 id) | t ]       F = 1 + S + A + 1

R_t is the return-to-go, t the absolute step within the episode. The model's rows are the 3 tokens of each
step (R_t, s_t, a_t; 2 without returns, behaviour cloning), so its key padding is per token
(``StepLayout.per_token``) and the actions are predicted at the state tokens (``StepLayout.state_rows``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How one timestep is packed and embedded (from the data's input description, ``kind: decision``):
    ``state_dim`` (continuous states) or ``state_vocab`` (discrete), ``action_dim`` (continuous actions) or
    ``num_actions`` (discrete), ``max_timestep`` (steps 0 .. max_timestep - 1 have an embedding) and
    ``returns`` (False: behaviour cloning, no return tokens)."""

    max_timestep: int
    state_dim: int | None = None
    state_vocab: int | None = None
    action_dim: int | None = None
    num_actions: int | None = None
    returns: bool = True

    @classmethod
    def of(cls, inputs: Mapping[str, Any]) -> StepLayout:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in inputs.items() if k in names})

    @property
    def state_width(self) -> int:
        return self.state_dim or 1

    @property
    def action_width(self) -> int:
        return self.action_dim or 1

    @property
    def width(self) -> int:
        """F, the floats of one packed timestep."""
        return 1 + self.state_width + self.action_width + 1

    @property
    def tokens(self) -> int:
        """Tokens per timestep: 3 (R, s, a), or 2 (s, a) without returns."""
        return 3 if self.returns else 2

    @property
    def discrete_actions(self) -> bool:
        return self.num_actions is not None

    def pack(self, returns: Tensor, states: Tensor, actions: Tensor, timesteps: Tensor) -> Tensor:
        """``returns [B, K]`` (scaled returns-to-go), ``states [B, K, S]`` (discrete: ``[B, K]`` ids), ``actions
        [B, K, A]`` (discrete: ``[B, K]`` ids), ``timesteps [B, K]`` -> ``[B, K, F]``."""
        b, k = returns.shape
        parts = (returns[..., None], states.reshape(b, k, -1), actions.reshape(b, k, -1), timesteps[..., None])
        return torch.cat([p.float() for p in parts], dim=-1)

    def unpack(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``[B, K, F]`` -> returns ``[B, K, 1]``, states (``[B, K, S]`` floats or ``[B, K]`` ids), actions
        (``[B, K, A]`` floats or ``[B, K]`` ids), timesteps ``[B, K]`` (long)."""
        if x.shape[-1] != self.width:
            raise ValueError(f"decision inputs take {self.width} values per timestep; got shape {tuple(x.shape)}")
        s, a = self.state_width, self.action_width
        returns, states, actions, steps = x.split((1, s, a, 1), dim=-1)
        states = states if self.state_dim else states[..., 0].long()
        actions = actions if self.action_dim else actions[..., 0].long()
        return returns, states, actions, steps[..., 0].long()

    def per_token(self, steps: Tensor) -> Tensor:
        """Per-timestep values ``[B, K]`` -> per-token ``[B, n K]`` (a step's value on each of its tokens): the
        key padding of a step mask, the document ids of each step's episode."""
        return steps.repeat_interleave(self.tokens, dim=1)

    def state_rows(self, h: Tensor) -> Tensor:
        """The rows of the state tokens, from which the actions are predicted: ``[B, n K, D] -> [B, K, D]``."""
        return h[:, self.tokens - 2 :: self.tokens]
