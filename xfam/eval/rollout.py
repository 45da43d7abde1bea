"""Evaluation of a Decision Transformer by rollouts (Chen et al., 2021, arXiv:2106.01345, sec. 3, "Evaluation"):
the model acts in its environment, conditioned on a target return.

At the start of an episode the return-to-go is the target R_1 = G (divided by the data's ``return_scale``,
as in training); at each step the model reads the last K timesteps (R, s, a), left-padded at the start of the
episode exactly as the training windows are (``xfam.data.episodes``); a model with memory (trained on
contiguous chunks, ``data.stream``) reads the current segment of K steps instead, the completed segments
being in its memory (each written once its last action is known), and its prediction at the newest
state token is the action: for discrete actions one drawn from the predicted distribution (the paper's Atari
evaluation samples; ``sample=False``: the arg-max), for continuous ones the tanh-bounded vector mapped back to
the environment's range (deterministic, as the paper's gym evaluation). After the reward r_t,
R_{t+1} = R_t - r_t. The action slot of the newest step holds a placeholder the state token cannot see.

N episodes run side by side, one batched forward per environment step (every still-running episode a row),
each environment reset with its own seed ``seed + i``, sampled actions drawn from a generator seeded with
``seed``: a rollout is reproducible and draws nothing from torch's global RNG (the model is in evaluation
mode), so evaluating during training leaves exact resume intact. The cost is bounded by N x ``max_steps``
(the environment's time limit unless smaller) forwards of K timesteps and logged. Scores are normalised as
in D4RL: ``100 (R - R_random) / (R_expert - R_random)``, with the mean returns of the data's random and expert
behaviour policies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xfam.core.logs import log
from xfam.core.trajectory import StepLayout
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.transformer import XfamModel


@dataclasses.dataclass
class Rollouts:
    """The episodes of one target return: ``returns`` and ``lengths`` per episode, the env ``steps`` and
    ``seconds`` it took, and how many episodes the step bound cut (``truncated``)."""

    target: float
    returns: list[float]
    lengths: list[int]
    steps: int
    seconds: float
    truncated: int = 0

    @property
    def mean(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std(self) -> float:
        return float(np.std(self.returns))


def normalised(value: float, reference: Mapping[str, float] | None) -> float | None:
    """D4RL's normalised score: random behaviour 0, expert behaviour 100 (None without references)."""
    if not reference or reference["expert"] == reference["random"]:
        return None
    return 100.0 * (value - reference["random"]) / (reference["expert"] - reference["random"])


@torch.no_grad()
def rollout(
    model: XfamModel,
    decision: Mapping[str, Any],
    target: float,
    *,
    episodes: int,
    seed: int,
    max_steps: int | None = None,
    sample: bool = False,
) -> Rollouts:
    """Run ``episodes`` episodes of ``model`` (a ``task=decision`` XfamModel) conditioned on the return
    ``target`` in the environment of ``decision`` (the data's ``decision`` info: ``env``, ``return_scale``,
    ``context``); episode i is reset with seed ``seed + i``. ``sample``: draw discrete actions from the
    predicted distribution (a generator seeded with ``seed``) instead of taking the arg-max."""
    from xfam.data.gym_envs import ENVS, make_env, to_env_action  # (gymnasium is imported only by rollouts)

    layout: StepLayout = model.step_layout
    info = ENVS[decision["env"]]
    k, scale = int(decision["context"]), float(decision["return_scale"])
    limit = min(max_steps or info.max_steps, info.max_steps)
    device = next(model.parameters()).device
    draws = torch.Generator(device=device).manual_seed(seed) if sample else None
    was_training = model.training
    model.eval()
    started = time.perf_counter()
    envs = [make_env(decision["env"]) for _ in range(episodes)]
    first = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    n = episodes
    states = torch.zeros(n, limit, layout.state_width, device=device)  # [N, T, S] (discrete: ids in column 0)
    actions = torch.zeros(n, limit, layout.action_width, device=device)  # [N, T, A]
    togo = torch.zeros(n, limit, device=device)  # [N, T] scaled returns-to-go
    steps = torch.arange(limit, device=device).clamp_max(layout.max_timestep - 1)  # [T]
    states[:, 0] = torch.as_tensor(np.stack(first), dtype=torch.float32, device=device).reshape(n, -1)
    togo[:, 0] = target / scale
    returns, lengths = np.zeros(n), np.zeros(n, dtype=int)
    running = np.ones(n, dtype=bool)
    total = 0
    memory = model.init_memory(n, device) if model.uses_memory else None  # (memory: every episode keeps its row)

    def segment(r: torch.Tensor, lo: int, hi: int, pad: int = 0) -> torch.Tensor:
        """Steps ``lo .. hi - 1`` of episodes ``r``, ``pad`` zero steps in front: ``[R, pad + hi - lo, F]``."""
        return layout.pack(
            left_pad(togo[r, lo:hi], pad),
            left_pad(states[r, lo:hi], pad),
            left_pad(actions[r, lo:hi], pad),
            left_pad(steps[lo:hi].expand(len(r), -1), pad),
        )

    for t in range(limit):
        rows = np.arange(n) if memory is not None else np.flatnonzero(running)
        r = torch.as_tensor(rows, device=device)
        if memory is None:  # the last K steps, left-padded at the start of the episode (the training windows)
            lo = max(0, t - k + 1)
            pad = k - (t + 1 - lo)
            step_mask = (torch.arange(k, device=device) >= pad).expand(len(rows), -1)  # [R, K]
            key_padding = layout.per_token(step_mask) if pad else None
            pred = model(segment(r, lo, t + 1, pad), key_padding=key_padding).logits[:, -1]  # [R, A]
        else:  # segment-level recurrence: this segment of K steps, the earlier ones in the memory
            pred = model(segment(r, t // k * k, t + 1), memory=memory).logits[:, -1]
        if not layout.discrete_actions:
            act = pred  # [R, A] in [-1, 1]
        elif sample:
            act = torch.multinomial(pred.float().softmax(-1), 1, generator=draws).float()  # [R, 1]
        else:
            act = pred.argmax(-1, keepdim=True).float()
        actions[r, t] = act
        for j, i in enumerate(rows):
            if not running[i]:
                continue
            a = int(act[j, 0]) if layout.discrete_actions else act[j].cpu().numpy()
            obs, reward, terminated, truncated, _ = envs[i].step(to_env_action(info, a))
            returns[i] += reward
            lengths[i] += 1
            total += 1
            if terminated or truncated or t + 1 == limit:
                running[i] = False
                continue
            states[i, t + 1] = torch.as_tensor(obs, dtype=torch.float32, device=device).reshape(-1)
            togo[i, t + 1] = togo[i, t] - float(reward) / scale
        if memory is not None and (t + 1) % k == 0:  # a completed segment, its actions known, writes the memory
            memory = model(segment(r, t + 1 - k, t + 1), memory=memory).memory
        if not running.any():
            break
    for env in envs:
        env.close()
    model.train(was_training)
    cut = int((lengths == limit).sum()) if limit < info.max_steps else 0
    return Rollouts(float(target), returns.tolist(), lengths.tolist(), total, time.perf_counter() - started, cut)


def left_pad(x: torch.Tensor, pad: int) -> torch.Tensor:
    """``[R, w, ...] -> [R, pad + w, ...]`` with zeros in front (the start of an episode, as in training)."""
    return torch.cat((x.new_zeros(x.shape[0], pad, *x.shape[2:]), x), dim=1)


def targets_of(decision: Mapping[str, Any], targets: Sequence[float] | None) -> list[float]:
    """The target returns to evaluate: the given ones, else the expert behaviour's mean return (the paper
    conditions on expert-level returns), else the best episode return of the training data."""
    if targets:
        return [float(t) for t in targets]
    reference = decision.get("reference_returns")
    if reference:
        return [float(reference["expert"])]
    return [float(decision["max_return"])]


def rollout_metrics(
    model: XfamModel,
    decision: Mapping[str, Any],
    *,
    prefix: str,
    targets: Sequence[float] | None,
    episodes: int,
    seed: int,
    max_steps: int | None = None,
    sample: bool = False,
) -> dict[str, float]:
    """``{prefix}/return``, ``{prefix}/return_std`` and (with reference returns) ``{prefix}/score`` at the first
    target, and ``{prefix}/return@G`` / ``{prefix}/score@G`` at every target G; logs what it cost."""
    out: dict[str, float] = {}
    reference = decision.get("reference_returns")
    for i, target in enumerate(targets_of(decision, targets)):
        res = rollout(model, decision, target, episodes=episodes, seed=seed, max_steps=max_steps, sample=sample)
        score = normalised(res.mean, reference)
        key = f"{target:g}"
        out[f"{prefix}/return@{key}"] = res.mean
        if score is not None:
            out[f"{prefix}/score@{key}"] = score
        if i == 0:
            out[f"{prefix}/return"], out[f"{prefix}/return_std"] = res.mean, res.std
            if score is not None:
                out[f"{prefix}/score"] = score
        log.info(
            f"{prefix} rollouts at target return {key}: {episodes} episodes of {decision['env']}, return "
            f"{res.mean:.1f} +- {res.std:.1f}"
            + (f" (score {score:.1f})" if score is not None else "")
            + f"; {res.steps} env steps in {res.seconds:.1f} s"
            + (f", {res.truncated} cut at {max_steps} steps" if res.truncated else "")
        )
    return out


#: Test rollouts start at this seed offset, so they never repeat validation's episodes.
TEST_SEEDS = 10_000


def task_rollouts(
    model: XfamModel | EncoderDecoder, data_info: Mapping[str, Any], spec: Any, prefix: str, *, test: bool
) -> dict[str, float]:
    """The rollouts of a run's evaluation: ``rollout_metrics`` with the ``task`` section's settings (``spec``: a
    ``TaskSpec``), episode i of validation reset with seed ``rollout_seed + i``, of test ``+ TEST_SEEDS``; none for
    a model without an environment (other tasks, trajectories from a folder with ``env: null``)."""
    decision = data_info.get("decision")
    if not decision or not decision.get("env") or not spec.rollout_episodes:
        return {}
    assert isinstance(model, XfamModel)  # (a decision model)
    return rollout_metrics(
        model,
        decision,
        prefix=prefix,
        targets=spec.target_returns,
        episodes=spec.rollout_episodes,
        seed=spec.rollout_seed + (TEST_SEEDS if test else 0),
        max_steps=spec.rollout_max_steps,
        sample=spec.rollout_sample,
    )
