"""``data=gym``: offline reinforcement-learning trajectories for the Decision Transformer (Chen et al., 2021,
"Decision Transformer: Reinforcement Learning via Sequence Modeling", arXiv:2106.01345; ``task=decision``).

The episodes are either generated in one of Gymnasium's classic-control environments (``xfam.data.gym_envs``) by a
mixture of behaviour policies, D4RL-style (Fu et al., 2020, arXiv:2004.07219): ``episodes`` episodes of each of
``policies`` (a scripted expert, the expert with ``noise``, uniform random actions), or read from ``path``, a
local ``datasets`` folder (``save_to_disk``) of D4RL's columns, one row per timestep (``xfam.data.trajectory_folder``:
the columns, and how episodes end). With ``env`` set, a folder's continuous actions are the env's and are
normalised to [-1, 1] like generated ones (``xfam.data.gym_envs.from_env_action``); with ``env: null`` they are taken as
they are (already normalised).

Splits are made of whole episodes: a folder's own ``validation`` / ``test`` splits, or 10 % of the
(training) episodes each, a seeded permutation (generated data: of each policy's episodes, so every split
mixes every policy). Generated episodes are cached, one row per episode, under a key of every generator
setting (``xfam.data.cache.cached_generate``); windows are never stored.

Rows and batches (``xfam.data.episodes``): one left-padded window of K = ``context`` timesteps per timestep of
every episode, of returns-to-go (divided by ``return_scale``), states, actions and timesteps, collated into the
inputs ``xfam.core.trajectory.StepLayout`` packs. ``top_fraction`` < 1 keeps only that fraction of the training
episodes, the best by return (filtered behaviour cloning, "%BC" in the paper's sec. 5.3); validation and test
are unchanged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from importlib.metadata import version
from typing import Annotated, Any, Literal, get_args

import numpy as np
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.core.logs import log
from xfam.core.registry import Range
from xfam.core.trajectory import StepLayout
from xfam.data.base import DATA, DataSource, Task
from xfam.data.cache import cached_generate
from xfam.data.episodes import Chunks, Episodes, Windows, collate_decision, split_indices
from xfam.data.gym_envs import ENVS, POLICY_KINDS, EnvInfo, from_env_action, make_env, policy, run_episode
from xfam.data.packing import FORMAT, SPLITS, get_split
from xfam.data.tokenize import short_hash
from xfam.data.trajectory_folder import episode_lengths, flat, folder_env_problems, folder_inputs, load_folder

VERSION = "gym-episodes-1"
EnvName = Literal["cartpole", "acrobot", "mountaincar", "pendulum"]
PolicyName = Literal["expert", "noisy", "random"]
assert set(get_args(EnvName)) == set(ENVS), "EnvName must list xfam.data.gym_envs.ENVS"


# --- generation -------------------------------------------------------------------------------------------


def _generator_params(params: dict[str, Any]) -> dict[str, Any]:
    keys = ("env", "episodes", "policies", "noise", "seed")
    return {"version": VERSION, "gymnasium": version("gymnasium"), **{k: params[k] for k in keys}}


def _episode_rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    """One row per episode of ``split``: for each policy, its episodes that the split holds (``split_indices``),
    each from its own random stream ``[seed, policy kind, episode]`` (the env's reset seed is drawn from it)."""
    name = params["env"]
    env = make_env(name)
    try:
        for kind in params["policies"]:
            salt = POLICY_KINDS.index(kind)
            for i in split_indices(params["episodes"], params["seed"], salt)[split].tolist():
                rng = np.random.default_rng([params["seed"], salt, i])
                env_seed = int(rng.integers(2**31 - 1))
                ep = run_episode(env, policy(name, kind, params["noise"], rng), seed=env_seed)
                yield {
                    "policy": kind,
                    "episode": i,
                    "env_seed": env_seed,
                    "observations": ep["observations"].reshape(-1),  # [T * S], row-major
                    "actions": ep["actions"].reshape(-1),  # [T] ids or [T * A]
                    "rewards": ep["rewards"],
                    "terminal": bool(ep["terminals"][-1]),
                    "timeout": bool(ep["timeouts"][-1]),
                    "return": float(ep["rewards"].astype(np.float64).sum()),
                    "length": len(ep["rewards"]),
                }
    finally:
        env.close()


def _episode_features(info: EnvInfo) -> Any:
    from datasets import Features, List, Value

    return Features(
        {
            "policy": Value("string"),
            "episode": Value("int64"),
            "env_seed": Value("int64"),
            "observations": List(Value("float32")),
            "actions": List(Value("int64" if info.discrete else "float32")),
            "rewards": List(Value("float32")),
            "terminal": Value("bool"),
            "timeout": Value("bool"),
            "return": Value("float64"),
            "length": Value("int64"),
        }
    )


def _episodes_check(rows: int, info: EnvInfo) -> Any:
    """A cached split is usable when it holds ``rows`` episodes whose columns agree with their lengths."""

    def check(ds: Any) -> str | None:
        if len(ds) != rows:
            return f"{len(ds)} episodes where this stage makes {rows}"
        table = ds.with_format("arrow")[:]
        steps = int(table["length"].to_numpy().sum())
        widths = {"observations": info.state_dim, "actions": info.action_dim or 1, "rewards": 1}
        for column, width in widths.items():
            if len(flat(table, column)) != steps * width:
                return f"column {column!r} holds {len(flat(table, column))} values, not {steps} steps x {width}"
        return None

    return check


def _read_generated(ds: Any, info: EnvInfo) -> Episodes:
    table = ds.with_format("arrow")[:]
    states = flat(table, "observations").astype(np.float32).reshape(-1, info.state_dim)
    actions = flat(table, "actions")
    if info.discrete:
        actions = actions.astype(np.int64)
    else:
        assert info.action_dim is not None  # (continuous)
        actions = actions.astype(np.float32).reshape(-1, info.action_dim)
    rewards = flat(table, "rewards").astype(np.float32)
    lengths = table["length"].to_numpy().astype(np.int64)
    return Episodes(states, actions, rewards, lengths, table["policy"].to_pylist())


# --- the source -------------------------------------------------------------------------------------------


def _stats(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
    v = values.astype(np.float64)
    return {"mean": float(v.mean()), "std": float(v.std()), "min": float(v.min()), "max": float(v.max())}


@DATA.register("gym")
class GymTrajectories(DataSource):
    """Offline trajectories of a classic-control environment (or a local D4RL-style folder) as Decision
    Transformer windows of (return-to-go, state, action, timestep); see the module docstring.

    Args:
        env: the environment (``xfam.data.gym_envs.ENVS``): of the generated episodes, and of rollouts; with
            ``path`` it may be null (no rollouts).
        path: a local ``datasets`` save_to_disk folder of per-timestep D4RL columns; null: generate.
        episodes: generated episodes per policy (each split gets 10 % of them, at least one, for validation
            and test).
        policies: the behaviour policies generating episodes: ``expert``, ``noisy``, ``random``.
        noise: the noisy policy's probability of a random action (discrete), or its Gaussian noise std as a
            fraction of half the action range (continuous).
        context: K, timesteps per window.
        returns: give the model the returns-to-go (false: behaviour cloning, no return tokens).
        top_fraction: keep this fraction of the training episodes, the best by return (filtered BC).
        return_scale: the returns-to-go are divided by it; null: the largest absolute episode return of the
            training split (before ``top_fraction``).
        stream: rows are the consecutive K-step chunks of the episodes laid end to end (``xfam.data.episodes.Chunks``),
            so batches can be contiguous streams for the memory slot; false: one left-padded window per timestep.
        batch_size: windows per batch.
        seed: the episodes' random streams and the split; the same seed gives the same data.
    """

    task = "decision"
    paper = "Chen et al., 2021 (Decision Transformer); Gymnasium classic control"

    def __init__(
        self,
        *,
        env: EnvName | None = "cartpole",
        path: str | None = None,
        episodes: Annotated[int, Range(ge=3)] = 100,
        policies: list[PolicyName] = ["expert", "noisy", "random"],  # noqa: B006  (copied, never mutated; YAML mirrors it)
        noise: Annotated[float, Range(ge=0, le=1)] = 0.3,
        context: Annotated[int, Range(ge=1)] = 20,
        returns: bool = True,
        top_fraction: Annotated[float, Range(gt=0, le=1)] = 1.0,
        return_scale: Annotated[float, Range(gt=0)] | None = None,
        stream: bool = False,
        batch_size: Annotated[int, Range(ge=1)] = 64,
        seed: int = 0,
    ):
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        args["policies"] = list(policies)
        self.params = {k: v for k, v in args.items() if k != "batch_size"}
        self.seq_len, self.batch_size, self.seed = context, batch_size, seed
        self.vocab_size, self.num_classes, self.target_dim = 0, None, None
        if path is None and env is not None:
            self._set_heads(self.inputs)
        self.decision: dict[str, Any] = {}

    stream_hint = "data.stream=true (rows as consecutive chunks of the episodes)"

    @classmethod
    def task_for(cls, params: dict[str, Any]) -> Task:
        return "decision"

    @classmethod
    def contiguous_for(cls, params: dict[str, Any]) -> bool:
        return bool(params.get("stream"))

    @classmethod
    def documents_for(cls, params: dict[str, Any]) -> bool:
        return bool(params.get("stream"))  # chunks mark their episodes (segments)

    @classmethod
    def inputs_for(cls, params: dict[str, Any]) -> dict[str, Any]:
        info = ENVS.get(params.get("env") or "")
        out: dict[str, Any] = {"kind": "decision"}
        if params.get("path") is None:
            if info is None:
                raise ConfigError(
                    "data=gym: generated data needs an environment. Fix: data.env=<one of " + ", ".join(ENVS) + ">."
                )
            out["state_dim"] = info.state_dim
            out.update({"num_actions": info.num_actions} if info.discrete else {"action_dim": info.action_dim})
            return {**out, "max_timestep": info.max_steps, "returns": params["returns"], "context": params["context"]}
        dims = folder_inputs(params["path"], info)
        longest = dims.pop("longest")
        return {
            **out,
            **dims,
            "max_timestep": max(longest, info.max_steps if info else 0),
            "returns": params["returns"],
            "context": params["context"],
        }

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        problems = []
        if params["path"] is None:
            if params["env"] is None:
                problems.append(
                    "env=null with path=null: generated episodes need an environment. Fix: data.env=<one of "
                    f"{', '.join(ENVS)}>, or data.path=<a save_to_disk folder of trajectories>."
                )
            kinds = params["policies"]
            if not kinds or len(set(kinds)) != len(kinds):
                problems.append(
                    f"policies={kinds}: name each behaviour policy once, at least one. Fix: data.policies=<a list of "
                    f"distinct {', '.join(POLICY_KINDS)}>."
                )
            return problems
        try:
            arrays, _ = load_folder(params["path"])
            dims = folder_inputs(params["path"], None)
        except ConfigError as err:
            return [str(err)]
        if not any(len(a["rewards"]) for a in arrays.values()):
            problems.append(f"data.path={params['path']!r} holds no timestep. Fix: a folder with trajectories.")
        elif params["env"] is not None:
            problems += folder_env_problems(params["path"], dims, arrays, params["env"])
        return problems

    def _set_heads(self, inputs: dict[str, Any]) -> None:
        """``num_classes``: the discrete action count (the action head's classes), else None; ``target_dim``:
        the continuous action width, else None."""
        self.num_classes, self.target_dim = inputs.get("num_actions"), inputs.get("action_dim")

    @property
    def layout(self) -> StepLayout:
        """How a timestep is packed (``xfam.core.trajectory``); read once per prepared source."""
        return getattr(self, "_layout", None) or StepLayout.of(self.inputs)

    # -- prepare ------------------------------------------------------------------------------------------

    def _generate(self) -> tuple[dict[str, Episodes], str]:
        info, gen = ENVS[self.params["env"]], _generator_params(self.params)
        key, features = short_hash(FORMAT, self.registry_name, gen), _episode_features(info)
        sizes = split_indices(gen["episodes"], 0, 0)  # (the sizes do not depend on the seed)
        counts = {name: len(idx) * len(gen["policies"]) for name, idx in sizes.items()}
        started, out = time.perf_counter(), {}
        for name in SPLITS:
            kwargs = {"params": gen, "split": name}
            check = _episodes_check(counts[name], info)
            ds = cached_generate(_episode_rows, kwargs, features, name, short_hash(key, name), check)
            out[name] = _read_generated(ds, info)
        log.info("data=gym: %s episodes ready in %.1f s", info.gym_id, time.perf_counter() - started)
        return out, key

    def _from_folder(self) -> tuple[dict[str, Episodes], str]:
        path, env = self.params["path"], self.params["env"]
        if problems := self.check(self.params, {}):
            raise ConfigError(problems)
        arrays, fingerprints = load_folder(path)
        info = ENVS[env] if env is not None else None
        episodes = {}
        for name, a in arrays.items():
            actions = a["actions"]
            if info is not None and not info.discrete:
                actions = from_env_action(info, actions)  # env units -> [-1, 1]
            episodes[name] = Episodes(a["states"], actions, a["rewards"], episode_lengths(a["done"]))
        carve = [name for name in ("validation", "test") if name not in episodes]
        if carve:
            train = episodes["train"]
            if len(train.lengths) < 1 + len(carve):
                raise ConfigError(
                    f"data.path={path!r}: its train split holds {len(train.lengths)} episode(s), too few to carve "
                    f"{' and '.join(carve)} from. Fix: more episodes, or save those splits in the folder."
                )
            parts = split_indices(len(train.lengths), self.seed, 0)
            if len(carve) == 1:  # only one is carved: the other part stays in train
                kept = carve[0]
                other = "test" if kept == "validation" else "validation"
                parts["train"] = np.sort(np.concatenate([parts["train"], parts[other]]))
            for name in carve:
                episodes[name] = train.select(parts[name])
            episodes["train"] = train.select(parts["train"])
        return episodes, short_hash(FORMAT, self.registry_name, "folder", fingerprints, self.params["env"])

    def prepare(self) -> None:
        if getattr(self, "_splits", None):
            return
        generated = self.params["path"] is None
        episodes, data_key = self._generate() if generated else self._from_folder()
        inputs = self.inputs
        self._set_heads(inputs)
        self._layout = StepLayout.of(inputs)
        train = episodes["train"]
        returns = train.returns
        scale = self.params["return_scale"] or float(np.abs(returns).max(initial=0.0)) or 1.0
        kept = max(1, math.ceil(self.params["top_fraction"] * len(returns)))
        best = np.sort(np.argsort(-returns, kind="stable")[:kept])
        served = {**episodes, "train": train.select(best) if kept < len(returns) else train}
        self._episodes = served
        k = self.params["context"]
        rows = {name: Windows(served[name], k, scale) for name in SPLITS}
        if self.params["stream"]:
            rows = {name: Chunks(served[name], k, scale, self.seed) for name in SPLITS}
        self._splits = rows
        self.fingerprint = short_hash(data_key, self.params, scale)

        everything = Episodes.concat([episodes[name] for name in SPLITS])
        reference = None
        per_policy: dict[str, Any] | None = None
        if generated:
            per_policy, means = {}, {}
            kinds = np.array(everything.policies)
            for kind in self.params["policies"]:
                pick = kinds == kind
                per_policy[kind] = {
                    "episodes": int(pick.sum()),
                    **_stats(everything.returns[pick]),
                    "mean_length": float(everything.lengths[pick].mean()),
                }
                means[kind] = per_policy[kind]["mean"]
            reference = {"random": means.get("random"), "expert": means.get("expert")}
        self.decision = {
            "env": self.params["env"],
            "context": self.params["context"],
            "return_scale": scale,
            "reference_returns": reference,
            "max_return": float(returns.max()),  # the best training episode (rollout targets without references)
            "returns": self.params["returns"],
        }
        splits = {}
        for name in SPLITS:
            ep = served[name]
            counts = None if ep.policies is None else {k: ep.policies.count(k) for k in self.params["policies"]}
            splits[name] = {
                "episodes": len(ep.lengths),
                "windows": len(self._splits[name]),
                "returns": _stats(ep.returns),
                **({"policies": counts} if counts is not None else {}),
            }
        self.manifest = {
            "source": "gymnasium" if generated else str(self.params["path"]),
            **({"generator": VERSION, "gymnasium": version("gymnasium")} if generated else {}),
            **self.params,
            "gym_id": ENVS[self.params["env"]].gym_id if self.params["env"] else None,
            "inputs": inputs,
            "policies_returns": per_policy,
            "splits": splits,
            "return_scale": scale,
            "top_fraction_kept": {
                "fraction": self.params["top_fraction"],
                "train_episodes": len(returns),
                "kept": kept,
                "lowest_kept_return": float(returns[best].min()) if len(best) else None,
            },
            "fingerprint": self.fingerprint,
        }

    # -- serving ------------------------------------------------------------------------------------------

    def split(self, name: str) -> Windows:
        """The windows of one prepared split (a torch ``Dataset``: ``len`` and indexing)."""
        return get_split(getattr(self, "_splits", {}), name, self.registry_name)

    def episodes(self, name: str) -> Episodes:
        """The episodes one prepared split serves (train: after ``top_fraction``)."""
        self.split(name)
        return self._episodes[name]

    def collate(self, rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        return collate_decision(rows, self.layout)
