"""Rollouts of a Decision Transformer (xfam/eval/rollout.py) against a loop written out step by step on the same
fixed-seed environments: the same actions, returns-to-go, returns and lengths; batched episodes independent of
each other; reproducible without drawing from torch's RNG; D4RL's normalised score."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xfam.core.trajectory import StepLayout
from xfam.data.gym_envs import ENVS, make_env, to_env_action
from xfam.eval.rollout import normalised, rollout, targets_of
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel

NONE = {"name": "none"}


def dt(env: str, context: int = 4, seed: int = 0, memory: dict = NONE) -> tuple[XfamModel, dict]:
    info = ENVS[env]
    inputs = {"kind": "decision", "state_dim": info.state_dim, "max_timestep": info.max_steps, "returns": True}
    inputs |= {"num_actions": info.num_actions} if info.discrete else {"action_dim": info.action_dim}
    torch.manual_seed(seed)
    model = XfamModel(
        ModelSpec(dim=16, layers=1, heads=2, max_len=3 * context),
        task="decision",
        vocab_size=0,
        attention={"name": "vanilla"},
        pos={"name": "none"},
        memory=memory,
        exit=NONE,
        inputs=inputs,
    ).eval()
    decision = {"env": env, "context": context, "return_scale": 50.0, "reference_returns": None, "max_return": 77.0}
    return model, decision


def by_hand(model: XfamModel, decision: dict, target: float, seed: int, limit: int) -> tuple[float, int, list]:
    """One episode written out: the window of the last K steps, left-padded, re-read every step."""
    layout: StepLayout = model.embed.layout
    info, k, scale = ENVS[decision["env"]], decision["context"], decision["return_scale"]
    env = make_env(decision["env"])
    obs, _ = env.reset(seed=seed)
    states, actions, togo, total, togos = [obs], [], [target / scale], 0.0, []
    for t in range(limit):
        lo = max(0, t - k + 1)
        pad = k - (t + 1 - lo)
        s = torch.tensor(np.array(states[lo : t + 1]), dtype=torch.float32)  # [w, S]
        a = torch.tensor(np.array([*actions[lo:t], np.zeros(layout.action_width)]), dtype=torch.float32)
        r = torch.tensor(togo[lo : t + 1])
        steps = torch.arange(lo, t + 1)
        x = layout.pack(
            torch.cat((torch.zeros(pad), r))[None],
            torch.cat((torch.zeros(pad, s.shape[1]), s))[None],
            torch.cat((torch.zeros(pad, a.shape[1]), a))[None],
            torch.cat((torch.zeros(pad, dtype=torch.long), steps))[None],
        )
        mask = torch.arange(k)[None] >= pad
        with torch.no_grad():
            pred = model(x, key_padding=layout.per_token(mask) if pad else None).logits[0, -1]
        act = [float(pred.argmax())] if layout.discrete_actions else pred.numpy()
        env_action = int(act[0]) if layout.discrete_actions else np.asarray(act)
        obs, reward, terminated, truncated, _ = env.step(to_env_action(info, env_action))
        total += reward
        togos.append(togo[-1])
        actions.append(np.asarray(act, dtype=np.float32))
        states.append(obs)
        togo.append(togo[-1] - reward / scale)
        if terminated or truncated:
            return total, t + 1, togos
    return total, limit, togos


@pytest.mark.parametrize("env", ["cartpole", "pendulum"])
def test_rollouts_equal_the_loop_written_out_on_fixed_seed_environments(env):
    model, decision = dt(env)
    res = rollout(model, decision, 40.0, episodes=3, seed=7, max_steps=30)
    for i in range(3):
        total, length, _ = by_hand(model, decision, 40.0, seed=7 + i, limit=30)
        assert res.returns[i] == pytest.approx(total, abs=1e-4) and res.lengths[i] == length
    assert res.steps == sum(res.lengths)


def test_the_return_to_go_falls_by_each_reward():
    model, decision = dt("pendulum")
    _, _, togos = by_hand(model, decision, -100.0, seed=3, limit=6)
    seen = []
    hook = model.embed.register_forward_hook(lambda m, args, out: seen.append(args[0][0, -1, 0].item()))
    rollout(model, decision, -100.0, episodes=1, seed=3, max_steps=6)
    hook.remove()
    assert seen == pytest.approx(togos, abs=1e-6) and seen[0] == pytest.approx(-2.0)  # -100 / scale 50
    assert seen[1] > seen[0]  # pendulum rewards are negative: what is left to collect rises


def test_rollouts_are_reproducible_and_draw_nothing_from_torch():
    model, decision = dt("cartpole")
    state = torch.get_rng_state()
    a = rollout(model, decision, 100.0, episodes=2, seed=0, max_steps=40)
    assert torch.equal(torch.get_rng_state(), state)
    b = rollout(model, decision, 100.0, episodes=2, seed=0, max_steps=40)
    assert a.returns == b.returns and a.lengths == b.lengths
    assert max(a.lengths) <= 40 and model.training is False


def test_normalised_scores_and_default_targets():
    ref = {"random": -1200.0, "expert": -200.0}
    assert normalised(-200.0, ref) == 100.0 and normalised(-1200.0, ref) == 0.0 and normalised(-700.0, ref) == 50.0
    assert normalised(1.0, None) is None
    assert targets_of({"reference_returns": ref}, None) == [-200.0]
    assert targets_of({"reference_returns": None, "max_return": 77.0}, []) == [77.0]
    assert targets_of({"reference_returns": ref}, [1, 2]) == [1.0, 2.0]


def by_hand_with_memory(model, decision, target: float, seed: int, limit: int, carry: bool = True):
    """One episode with segment-level recurrence: the current segment of K steps, the completed ones written to
    the memory once their last action is known (``carry=False``: a fresh memory every segment)."""
    layout, k = model.embed.layout, decision["context"]
    env = make_env(decision["env"])
    obs, _ = env.reset(seed=seed)
    states, actions, togo, total, logits = [obs], [], [target / decision["return_scale"]], 0.0, []
    memory = model.init_memory(1, torch.device("cpu"))

    def pack(lo: int, hi: int, acts: list) -> torch.Tensor:
        return layout.pack(
            torch.tensor(togo[lo:hi])[None],
            torch.tensor(np.array(states[lo:hi]), dtype=torch.float32)[None],
            torch.tensor(np.array(acts[lo:hi]), dtype=torch.float32).reshape(1, hi - lo, -1),
            torch.arange(lo, hi)[None],
        )

    for t in range(limit):
        lo = t // k * k
        with torch.no_grad():
            pred = model(pack(lo, t + 1, [*actions, [0.0]]), memory=memory).logits[0, -1]
        logits.append(pred)
        act = int(pred.argmax())
        obs, reward, terminated, truncated, _ = env.step(act)
        total += reward
        actions.append([float(act)])
        states.append(obs)
        togo.append(togo[-1] - reward / decision["return_scale"])
        if (t + 1) % k == 0:
            with torch.no_grad():
                written = model(pack(lo, t + 1, actions), memory=memory).memory
            memory = written if carry else model.init_memory(1, torch.device("cpu"))
        if terminated or truncated:
            break
    return total, len(actions), torch.stack(logits)


def test_a_model_with_memory_rolls_out_segment_by_segment_with_its_memory():
    model, decision = dt("cartpole", context=3, memory={"name": "xl", "mem_len": 9})
    res = rollout(model, decision, 60.0, episodes=3, seed=4, max_steps=14, sample=False)
    for i in range(3):
        total, length, logits = by_hand_with_memory(model, decision, 60.0, seed=4 + i, limit=14)
        assert res.returns[i] == pytest.approx(total) and res.lengths[i] == length
    _, _, fresh = by_hand_with_memory(model, decision, 60.0, seed=4, limit=14, carry=False)
    _, _, kept = by_hand_with_memory(model, decision, 60.0, seed=4, limit=14)
    n = min(len(fresh), len(kept))
    assert torch.allclose(fresh[:3], kept[:3]) and not torch.allclose(fresh[3:n], kept[3:n])  # the memory is read
