"""Gymnasium's classic-control environments (pure Python, no download) and scripted behaviour policies of
mixed quality, the offline data of the Decision Transformer (Chen et al., 2021, arXiv:2106.01345; its
D4RL-style mixture of expert, medium and random behaviour, Fu et al., 2020, arXiv:2004.07219).

``ENVS`` describes each environment (``EnvInfo``); ``make_env`` builds it with Gymnasium's ``TimeLimit``
(the registered ``max_episode_steps``). Continuous actions are stored and predicted NORMALISED to [-1, 1]
(``from_env_action``) and mapped back linearly to the env's [low, high] (``to_env_action``); discrete actions
are ids. ``policy`` makes a behaviour policy (an ``obs -> env action`` callable) of one of three kinds:

* ``expert``: a scripted controller per environment (below), near the best returns of each task;
* ``noisy``: the expert, its action replaced with probability ``noise`` by a uniform one (discrete) or with
  N(0, (noise (high - low) / 2)^2) added, then clipped (continuous);
* ``random``: uniform actions.

The scripted experts, with their mean return over 20 episodes (``run_episode`` seeds 0..19; uniform random
actions in brackets):

* CartPole-v1: push toward the side the pole falls, ``theta + 0.5 thetadot + 0.05 x + 0.2 xdot > 0`` (the
  cart terms pull the cart back to the centre): 500, the maximum (random: 22.9).
* Acrobot-v1: pump energy into the swing with the torque of the sign of ``thetadot2 - 0.5 thetadot1``
  (the torque acts at joint 2, whose power is tau thetadot2; in Gymnasium's dynamics the torque of the sign
  of thetadot1 never reached the line in 10 episodes, its opposite made -93.5): -78.8 (random: -486.5).
* MountainCar-v0: push in the direction of the velocity, ``v - 0.01 (x + 0.5) > 0`` (at rest it pushes
  right when left of x = -0.5, else left), which swings the car up: -109.3 (random: -200).
* Pendulum-v1: energy-shaping swing-up ``u = (E* - E) sign(thetadot) / 2`` with E = thetadot^2 / 2 + 15
  cos(theta) (Astrom and Furuta, 2000, "Swinging up a pendulum by energy control") and, near upright
  (cos(theta) > 0.85), a PD balance ``u = -(10 theta + 2 thetadot)``, clipped to [-2, 2]: -143.5 (random: -1245.9).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

PolicyKind = Literal["expert", "noisy", "random"]
POLICY_KINDS: tuple[str, ...] = ("expert", "noisy", "random")


@dataclasses.dataclass(frozen=True)
class EnvInfo:
    """One environment: its Gymnasium id, state width, either ``num_actions`` (discrete) or ``action_dim`` with
    its bounds ``action_low`` / ``action_high`` (continuous), and ``max_steps`` (the ``TimeLimit``)."""

    gym_id: str
    state_dim: int
    max_steps: int
    num_actions: int | None = None
    action_dim: int | None = None
    action_low: tuple[float, ...] | None = None
    action_high: tuple[float, ...] | None = None

    @property
    def discrete(self) -> bool:
        return self.num_actions is not None


ENVS: dict[str, EnvInfo] = {
    "cartpole": EnvInfo("CartPole-v1", state_dim=4, max_steps=500, num_actions=2),
    "acrobot": EnvInfo("Acrobot-v1", state_dim=6, max_steps=500, num_actions=3),
    "mountaincar": EnvInfo("MountainCar-v0", state_dim=2, max_steps=200, num_actions=3),
    "pendulum": EnvInfo(
        "Pendulum-v1", state_dim=3, max_steps=200, action_dim=1, action_low=(-2.0,), action_high=(2.0,)
    ),
}


def env_info(name: str) -> EnvInfo:
    if name not in ENVS:
        raise KeyError(f"unknown environment {name!r}; the environments are {', '.join(ENVS)}")
    return ENVS[name]


def make_env(name: str, seed: int | None = None) -> Any:
    """``gymnasium.make`` of environment ``name`` (with its ``TimeLimit``). With ``seed`` it is reset once with
    ``reset(seed=seed)``, which seeds its random generator (the initial states of this and every later
    ``reset()`` follow from it); ``run_episode`` resets it with a seed per episode instead."""
    import gymnasium as gym

    env = gym.make(env_info(name).gym_id)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


def _bounds(info: EnvInfo) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(info.action_low, dtype=np.float64), np.asarray(info.action_high, dtype=np.float64)


def to_env_action(info: EnvInfo, action: Any) -> Any:
    """A model's action to the env's: a discrete id to ``int``; a continuous action ``[A]`` (or ``[..., A]``)
    normalised to [-1, 1] mapped linearly to [low, high] (clipped first), float32."""
    if info.discrete:
        return int(np.asarray(action).reshape(-1)[0])
    low, high = _bounds(info)
    a = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
    return (low + (a + 1.0) * (high - low) / 2).astype(np.float32)


def from_env_action(info: EnvInfo, action: Any) -> Any:
    """The inverse of ``to_env_action``: an env action to the stored one, an ``int`` id or float32 ``[A]`` (or
    ``[..., A]``) in [-1, 1] (clipped)."""
    if info.discrete:
        return int(np.asarray(action).reshape(-1)[0])
    low, high = _bounds(info)
    a = np.asarray(action, dtype=np.float64)
    return np.clip(2 * (a - low) / (high - low) - 1.0, -1.0, 1.0).astype(np.float32)


# --- scripted experts: obs -> env action -----------------------------------------------------------------


def _cartpole(obs: np.ndarray) -> int:
    x, x_dot, theta, theta_dot = obs
    return int(theta + 0.5 * theta_dot + 0.05 * x + 0.2 * x_dot > 0)


def _acrobot(obs: np.ndarray) -> int:
    _, _, _, _, dtheta1, dtheta2 = obs
    return 2 if dtheta2 - 0.5 * dtheta1 > 0 else 0


def _mountaincar(obs: np.ndarray) -> int:
    position, velocity = obs
    return 2 if velocity - 0.01 * (position + 0.5) > 0 else 0


#: Pendulum-v1's dynamics: thetaddot = 3 g / (2 l) sin(theta) + 3 / (m l^2) u, g = 10, m = l = 1, theta = 0 upright.
_G = 15.0


def _pendulum(obs: np.ndarray) -> np.ndarray:
    cos, sin, theta_dot = obs
    theta = np.arctan2(sin, cos)
    if cos > 0.85:  # near upright: PD balance
        u = -(10.0 * theta + 2.0 * theta_dot)
    else:  # swing up: pump the energy E = thetadot^2 / 2 + G cos(theta) toward the upright's G
        energy = 0.5 * theta_dot**2 + _G * cos
        u = 0.5 * (_G - energy) * np.sign(theta_dot if theta_dot != 0 else 1.0)
    return np.array([np.clip(u, -2.0, 2.0)], dtype=np.float32)


EXPERTS: dict[str, Callable[[np.ndarray], Any]] = {
    "cartpole": _cartpole,
    "acrobot": _acrobot,
    "mountaincar": _mountaincar,
    "pendulum": _pendulum,
}


def policy(name: str, kind: PolicyKind, noise: float, rng: np.random.Generator) -> Callable[[np.ndarray], Any]:
    """A behaviour policy ``obs -> env action`` of environment ``name`` (module docstring); every random draw
    comes from ``rng``, so a seeded ``rng`` makes the same actions."""
    info, expert = env_info(name), EXPERTS[name]
    if kind not in POLICY_KINDS:
        raise ValueError(f"unknown policy kind {kind!r}; the kinds are {', '.join(POLICY_KINDS)}")
    if info.discrete:
        n = info.num_actions
        assert n is not None  # (discrete: it has a number of actions)

        def act(obs: np.ndarray) -> Any:
            if kind == "random" or (kind == "noisy" and rng.random() < noise):
                return int(rng.integers(n))
            return expert(np.asarray(obs, dtype=np.float64))

        return act
    low, high = _bounds(info)

    def act_continuous(obs: np.ndarray) -> Any:
        if kind == "random":
            return rng.uniform(low, high).astype(np.float32)
        a = np.asarray(expert(np.asarray(obs, dtype=np.float64)), dtype=np.float64)
        if kind == "noisy":
            a = a + rng.normal(0.0, noise * (high - low) / 2)
        return np.clip(a, low, high).astype(np.float32)

    return act_continuous


def info_of(env: Any) -> EnvInfo:
    """The ``EnvInfo`` of an env made by ``make_env`` (by its Gymnasium id)."""
    found = [info for info in ENVS.values() if info.gym_id == env.spec.id]
    if not found:
        raise KeyError(f"env {env.spec.id!r} is none of {', '.join(i.gym_id for i in ENVS.values())}")
    return found[0]


def run_episode(env: Any, act: Callable[[np.ndarray], Any], seed: int | None = None) -> dict[str, np.ndarray]:
    """One episode of ``act`` in ``env`` (from ``make_env``), reset with ``seed``: ``observations [T, S]``
    float32 (the state each action was taken in), ``actions [T]`` int64 or ``[T, A]`` float32 (normalised),
    ``rewards [T]`` float32, ``terminals [T]`` bool (True on the last step when the env terminated) and
    ``timeouts [T]`` bool (True on the last step when it was truncated, by the ``TimeLimit``)."""
    info = info_of(env)
    obs, _ = env.reset(seed=seed)
    observations, actions, rewards = [], [], []
    terminated = truncated = False
    while not (terminated or truncated):
        action = act(obs)
        observations.append(np.asarray(obs, dtype=np.float32))
        actions.append(from_env_action(info, action))
        obs, reward, terminated, truncated, _ = env.step(action)
        rewards.append(float(reward))
    steps = len(rewards)
    terminals, timeouts = np.zeros(steps, dtype=bool), np.zeros(steps, dtype=bool)
    terminals[-1], timeouts[-1] = terminated, truncated and not terminated
    return {
        "observations": np.stack(observations).astype(np.float32),
        "actions": np.asarray(actions, dtype=np.int64 if info.discrete else np.float32),
        "rewards": np.asarray(rewards, dtype=np.float32),
        "terminals": terminals,
        "timeouts": timeouts,
    }
