"""The episodes of ``data=gym`` (``xfam.data.trajectories``) in memory, and the Decision Transformer windows
served from them (Chen et al., 2021, "Decision Transformer: Reinforcement Learning via Sequence Modeling",
arXiv:2106.01345).

Episodes (``Episodes``): the episodes of one split, their steps concatenated, N steps of E episodes in all:
``states [N, S]`` float32 (``[N]`` int64 ids for a discrete state), ``actions [N]`` int64 ids or ``[N, A]`` float32
(normalised to [-1, 1]), ``rewards [N]`` float32 and ``lengths [E]``; episode e holds the steps
``starts[e] .. starts[e] + lengths[e] - 1``. Splits are made of whole episodes (``split_indices``: a seeded
permutation, ``max(1, round(0.1 E))`` episodes each to test and validation).

Rows (``Windows``): one window per timestep t of every episode, the steps ``t - K + 1 .. t`` of that episode (K =
``context``), LEFT-padded when t < K - 1, so every timestep is the last step of exactly one window (a rollout
builds the same left-padded context): ``returns [K]`` the returns-to-go R_t = sum_{t' >= t} r_t' divided by
``return_scale``, ``states [K, S]`` (``[K]`` ids), ``actions [K]`` ids or ``[K, A]`` (normalised),
``timesteps [K]`` (the absolute step within the episode) and ``step_mask [K]`` (True: a real step); padded
steps are zeros. Windows are never stored: they are gathered from the episodes per batch.

With ``stream`` (``Chunks``, for the memory slot), rows are instead the consecutive K-step chunks of the split's
episodes laid end to end (in a seeded order), so row k + 1 continues row k and a memory carries the past across
rows: no padding, an episode may start inside a row, and each row also holds ``episode [K]`` (0 for the row's
first episode, + 1 at each episode start) and ``doc_end`` (its last step ends an episode), from which the batch's
document ids come (``segments``, per token: attention and memory never cross episodes).

Batches (``collate_decision``): ``inputs [B, K, F]`` (``xfam.core.trajectory.StepLayout.pack``), ``labels`` long
``[B, K]`` (discrete actions, -100 on padding) or ``targets`` float ``[B, K, A]``, ``step_mask [B, K]`` and,
when a step is padded, ``key_padding [B, n K]`` (``StepLayout.per_token``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from xfam.core.trajectory import StepLayout

HELD_OUT = 0.1  # the fraction of episodes in each of validation and test, when carved


@dataclasses.dataclass
class Episodes:
    """The episodes of one split, their steps concatenated: ``states [N, S]`` float32 (``[N]`` int64 ids),
    ``actions [N]`` int64 ids or ``[N, A]`` float32 (normalised), ``rewards [N]`` float32, ``lengths [E]`` and,
    for generated data, the behaviour policy of each episode."""

    states: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    lengths: np.ndarray
    policies: list[str] | None = None

    @property
    def starts(self) -> np.ndarray:
        """``[E]`` the first step of each episode."""
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)

    @property
    def returns(self) -> np.ndarray:
        """``[E]`` float64 episode returns."""
        return np.add.reduceat(self.rewards.astype(np.float64), self.starts) if len(self.lengths) else np.zeros(0)

    @property
    def timesteps(self) -> np.ndarray:
        """``[N]`` each step's index within its episode."""
        return np.arange(len(self.rewards)) - np.repeat(self.starts, self.lengths)

    def returns_to_go(self) -> np.ndarray:
        """``[N]`` float64: R_t = sum_{t' >= t} r_t' within each episode."""
        total = np.concatenate([[0.0], np.cumsum(self.rewards, dtype=np.float64)])
        end = np.repeat(self.starts + self.lengths, self.lengths)
        return total[end] - total[:-1]

    def select(self, keep: np.ndarray) -> Episodes:
        """The episodes ``keep`` (indices, in that order)."""
        starts = self.starts
        steps = np.concatenate([np.arange(starts[e], starts[e] + self.lengths[e]) for e in keep] or [np.zeros(0, int)])
        policies = None if self.policies is None else [self.policies[e] for e in keep]
        pick = steps.astype(np.int64)
        return Episodes(self.states[pick], self.actions[pick], self.rewards[pick], self.lengths[keep], policies)

    @classmethod
    def concat(cls, parts: list[Episodes]) -> Episodes:
        policies = None if any(p.policies is None for p in parts) else [x for p in parts for x in p.policies or []]
        cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
        return cls(cat("states"), cat("actions"), cat("rewards"), cat("lengths"), policies)


def split_indices(count: int, seed: int, salt: int) -> dict[str, np.ndarray]:
    """Episode indices ``0 .. count - 1`` per split: a permutation seeded by ``[seed, salt]`` whose first
    ``max(1, round(0.1 count))`` are test, the next as many validation, the rest train (each sorted)."""
    held = max(1, round(HELD_OUT * count))
    order = np.random.default_rng([seed, salt]).permutation(count)
    parts = {"test": order[:held], "validation": order[held : 2 * held], "train": order[2 * held :]}
    return {name: np.sort(idx) for name, idx in parts.items()}


class Windows(torch.utils.data.Dataset):
    """The rows of one split: window i ends at step i of ``episodes`` (module docstring); nothing is stored
    but the episodes."""

    def __init__(self, episodes: Episodes, context: int, return_scale: float):
        self.episodes, self.context, self.return_scale = episodes, context, return_scale
        self.first = np.repeat(episodes.starts, episodes.lengths)  # [N] the first step of each step's episode
        self.rtg = (episodes.returns_to_go() / return_scale).astype(np.float32)  # [N]
        self.steps = episodes.timesteps  # [N]

    def __len__(self) -> int:
        return len(self.first)

    def windows(self, ends: np.ndarray) -> dict[str, np.ndarray]:
        """The windows ending at steps ``ends [B]``: ``returns [B, K]``, ``states [B, K, S]`` (``[B, K]``),
        ``actions [B, K]`` (``[B, K, A]``), ``timesteps [B, K]``, ``step_mask [B, K]``; padding is zeros."""
        pos = ends[:, None] - (self.context - 1) + np.arange(self.context)  # [B, K]
        mask = pos >= self.first[ends][:, None]
        pos = np.where(mask, pos, ends[:, None])  # padded slots read a real step, zeroed below

        def gather(x: np.ndarray) -> np.ndarray:
            m = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
            return np.where(m, x[pos], np.zeros((), dtype=x.dtype))

        return {
            "returns": gather(self.rtg),
            "states": gather(self.episodes.states),
            "actions": gather(self.episodes.actions),
            "timesteps": gather(self.steps),
            "step_mask": mask,
        }

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        return {k: torch.as_tensor(v[0]) for k, v in self.windows(np.array([index])).items()}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Tensor]]:
        """A batch's rows in one gather (a DataLoader calls it in place of ``__getitem__`` per row)."""
        ends = np.asarray(indices, dtype=np.int64)
        if len(ends) and not (ends.min() >= 0 and ends.max() < len(self)):
            raise IndexError(f"windows {ends.min()} to {ends.max()} of {len(self)}")
        batch = {k: torch.from_numpy(v) for k, v in self.windows(ends).items()}
        return [{k: v[i] for k, v in batch.items()} for i in range(len(ends))]


class Chunks(Windows):
    """The rows of one split for contiguous streams (``stream``): chunk i holds the steps ``i K .. i K + K - 1`` of
    the episodes laid end to end in a seeded order (module docstring); a last partial chunk is dropped."""

    def __init__(self, episodes: Episodes, context: int, return_scale: float, seed: int):
        order = np.random.default_rng([seed, 7]).permutation(len(episodes.lengths))
        super().__init__(episodes.select(order), context, return_scale)
        ep = self.episodes
        self.episode = np.repeat(np.arange(len(ep.lengths)), ep.lengths)  # [N] each step's episode
        self.last = np.zeros(len(self.first), dtype=bool)  # [N] the last step of its episode
        self.last[ep.starts + ep.lengths - 1] = True

    def __len__(self) -> int:
        return len(self.first) // self.context

    def windows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Chunks ``rows [B]``: the window fields, all steps real, plus ``episode [B, K]`` and ``doc_end [B]``."""
        pos = rows[:, None] * self.context + np.arange(self.context)  # [B, K]
        episode = self.episode[pos]
        return {
            "returns": self.rtg[pos],
            "states": self.episodes.states[pos],
            "actions": self.episodes.actions[pos],
            "timesteps": self.steps[pos],
            "step_mask": np.ones(pos.shape, dtype=bool),
            "episode": episode - episode[:, :1],
            "doc_end": self.last[pos[:, -1]],
        }


def collate_decision(rows: list[dict[str, Tensor]], layout: StepLayout) -> dict[str, Tensor]:
    """Windows (or chunks) to a batch (module docstring)."""
    stack = lambda key: torch.stack([r[key] for r in rows])  # noqa: E731
    returns, states, actions, steps, mask = (
        stack(k) for k in ("returns", "states", "actions", "timesteps", "step_mask")
    )
    batch = {"inputs": layout.pack(returns, states, actions, steps), "step_mask": mask.bool()}  # [B, K, F], [B, K]
    if layout.discrete_actions:
        batch["labels"] = actions.long().masked_fill(~mask, -100)  # [B, K]
    else:
        batch["targets"] = actions.float()  # [B, K, A], zeros on padding
    if not mask.all():
        batch["key_padding"] = layout.per_token(mask)  # [B, n K]
    if "episode" in rows[0]:  # chunks of contiguous streams: documents are episodes
        batch["segments"] = layout.per_token(stack("episode"))  # [B, n K]
        batch["doc_end"] = stack("doc_end").bool()  # [B]
    return batch
