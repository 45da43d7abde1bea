"""A local ``datasets`` folder of D4RL-style trajectories for ``data=gym`` (``xfam.data.trajectories``): D4RL's
columns (Fu et al., 2020, "D4RL: Datasets for Deep Data-Driven Reinforcement Learning", arXiv:2004.07219), written
by ``save_to_disk``, one row per timestep:

    observations  list of floats (a discrete state: one int id)      actions  int id, or list of floats
    rewards       float       terminals  bool       timeouts  bool (optional)

where an episode ends at a step whose terminal or timeout is true (or at the end of the data). A folder is either
a ``DatasetDict`` with a ``train`` split (``validation`` / ``test`` optional) or a lone ``Dataset`` (``train``).
It is read once per version of the folder (``load_folder``) into raw per-step arrays, checked column by column
with one message for every problem, and measured (``folder_inputs``) and checked against an environment
(``folder_env_problems``) without building episodes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from xfam.core.errors import ConfigError
from xfam.data.gym_envs import ENVS, EnvInfo
from xfam.data.packing import SPLITS

COLUMNS = {
    "observations": "a list of floats, or an int for a discrete state",
    "actions": "an int for a discrete action, or a list of floats",
    "rewards": "a float",
    "terminals": "a bool",
    "timeouts": "a bool, optional",
}
ACCEPTED = {
    "observations": ("float list", "int list", "int"),
    "actions": ("int", "float list"),
    "rewards": ("float", "int"),
    "terminals": ("bool",),
    "timeouts": ("bool",),
}


def flat(table: Any, column: str) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.list_flatten(table[column]).to_numpy(zero_copy_only=False)


def _kind(feature: Any) -> str:
    """``int``, ``float``, ``bool``, ``int list``, ``float list`` or the feature's own text."""
    from datasets import Value

    inner = getattr(feature, "feature", None)
    if inner is not None and isinstance(inner, Value):
        base = _kind(inner)
        return f"{base} list" if base in ("int", "float") else str(feature)
    if isinstance(feature, Value):
        dtype = feature.dtype
        if dtype == "bool":
            return "bool"
        if dtype.startswith(("int", "uint")):
            return "int"
        if dtype.startswith("float"):
            return "float"
    return str(feature)


def _open_folder(path: str) -> dict[str, Any]:
    """``{split: Dataset}`` of a ``save_to_disk`` folder (a lone ``Dataset`` is ``train``); ConfigError when
    it is none."""
    import datasets

    folder = Path(path).expanduser()
    fix = (
        "Fix: pass a folder written by datasets' save_to_disk with one row per timestep (columns "
        + ", ".join(f"{c}: {w}" for c, w in COLUMNS.items())
        + "), or data.path=null to generate episodes of data.env."
    )
    if not folder.exists():
        raise ConfigError(f"data.path={path!r} does not exist. {fix}")
    if not ((folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()):
        raise ConfigError(
            f"data.path={path!r} is not a datasets save_to_disk folder (no dataset_dict.json or state.json). {fix}"
        )
    loaded = datasets.load_from_disk(str(folder))
    splits = {"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)
    if "train" not in splits:
        raise ConfigError(
            f"data.path={path!r} has the splits {', '.join(splits)} but no 'train'. Fix: name the training split "
            "'train' (validation and test are optional: carved from train when missing)."
        )
    return {k: v for k, v in splits.items() if k in SPLITS}


def _folder_columns_problem(path: str, splits: dict[str, Any]) -> str | None:
    """One message for every missing or mistyped column of every split, or None."""
    missing: dict[str, list[str]] = {}
    wrong: dict[str, list[str]] = {}
    for name, ds in splits.items():
        for column, accepted in ACCEPTED.items():
            if column not in ds.features:
                if column != "timeouts":
                    missing.setdefault(column, []).append(name)
            elif (kind := _kind(ds.features[column])) not in accepted:
                wrong.setdefault(f"{column} is {kind}, not {COLUMNS[column]}", []).append(name)
    if not missing and not wrong:
        return None
    has = next(iter(splits.values())).column_names
    parts = []
    if missing:
        parts.append(f"no column(s) {', '.join(repr(c) for c in missing)}")
    if wrong:
        parts.append("wrong type(s): " + "; ".join(wrong))
    return (
        f"data.path={path!r}: {' and '.join(parts)} (split(s) {', '.join(splits)}; its columns are "
        f"{', '.join(has)}). A gym folder holds one row per timestep with the columns "
        + ", ".join(f"{c} ({w})" for c, w in COLUMNS.items())
        + ". Fix: rename or cast the columns (Dataset.rename_column, Dataset.cast_column) and save_to_disk again, "
        "or data.path=null to generate episodes of data.env."
    )


def _read_folder_split(ds: Any) -> dict[str, np.ndarray]:
    """The raw per-step arrays of one split: ``states``, ``actions``, ``rewards``, ``done`` (terminal or timeout)."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    out: dict[str, np.ndarray] = {}
    for column, key in (("observations", "states"), ("actions", "actions")):
        col = table[column]
        if _kind(ds.features[column]).endswith("list"):
            widths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
            width = int(widths[0]) if len(widths) else 0
            if len(widths) and (widths != width).any():
                raise ConfigError(
                    f"column {column!r} holds lists of {widths.min()} to {widths.max()} values: every step needs the "
                    "same width. Fix: pad or cut them to one width."
                )
            out[key] = flat(table, column).astype(np.float32).reshape(len(col), width)
        else:
            out[key] = col.to_numpy(zero_copy_only=False).astype(np.int64)
    out["rewards"] = table["rewards"].to_numpy(zero_copy_only=False).astype(np.float32)
    done = table["terminals"].to_numpy(zero_copy_only=False).astype(bool)
    if "timeouts" in table.column_names:
        done = done | table["timeouts"].to_numpy(zero_copy_only=False).astype(bool)
    out["done"] = done
    return out


def episode_lengths(done: np.ndarray) -> np.ndarray:
    """Episode lengths of steps whose ``done`` closes an episode (the data's end closes the last)."""
    ends = np.flatnonzero(done) + 1
    if not len(ends) or ends[-1] != len(done):
        ends = np.append(ends, len(done))
    return np.diff(np.concatenate([[0], ends])).astype(np.int64)


@functools.lru_cache(maxsize=8)
def _folder(path: str, stamp: float) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, str]]:
    """Per split the raw arrays (``_read_folder_split``), and the splits' datasets fingerprints; read once per
    folder version (``stamp``: the modification time of its JSON)."""
    splits = _open_folder(path)
    if problem := _folder_columns_problem(path, splits):
        raise ConfigError(problem)
    try:
        arrays = {name: _read_folder_split(ds) for name, ds in splits.items()}
    except ConfigError as err:
        raise ConfigError(f"data.path={path!r}: {err}") from None
    return arrays, {name: ds._fingerprint for name, ds in splits.items()}


def load_folder(path: str) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, str]]:
    folder = Path(path).expanduser()
    stamps = [p.stat().st_mtime for p in (folder / "dataset_dict.json", folder / "state.json") if p.is_file()]
    return _folder(str(folder.resolve()) if folder.exists() else path, max(stamps, default=0.0))


def folder_inputs(path: str, info: EnvInfo | None) -> dict[str, Any]:
    """The data's dimensions: ``state_dim`` / ``state_vocab``, ``action_dim`` / ``num_actions``, ``longest``."""
    arrays, _ = load_folder(path)
    parts = list(arrays.values())
    out: dict[str, Any] = {"longest": max(int(episode_lengths(p["done"]).max(initial=0)) for p in parts)}
    states, actions = parts[0]["states"], parts[0]["actions"]
    if states.ndim == 2:
        out["state_dim"] = states.shape[1]
    else:
        out["state_vocab"] = max(int(p["states"].max(initial=0)) for p in parts) + 1
    if actions.ndim == 2:
        out["action_dim"] = actions.shape[1]
    else:
        top = max(int(p["actions"].max(initial=0)) for p in parts) + 1
        out["num_actions"] = max(top, info.num_actions or 0) if info is not None else top
    return out


def folder_env_problems(path: str, dims: dict[str, Any], arrays: dict[str, Any], env: str) -> list[str]:
    info, problems = ENVS[env], []
    where = f"data.path={path!r} and data.env={env!r}"
    if dims.get("state_dim") != info.state_dim:
        have = f"states of {dims['state_dim']} values" if "state_dim" in dims else "discrete states (int ids)"
        problems.append(f"{where}: the folder has {have}, {info.gym_id} {info.state_dim}.")
    if info.discrete:
        assert info.num_actions is not None  # (discrete)
        if "num_actions" not in dims:
            problems.append(f"{where}: the folder has continuous actions, {info.gym_id} {info.num_actions} discrete.")
        else:
            low = min(int(p["actions"].min(initial=0)) for p in arrays.values())
            high = max(int(p["actions"].max(initial=0)) for p in arrays.values())
            if low < 0 or high >= info.num_actions:
                problems.append(
                    f"{where}: action ids {low} to {high}, outside {info.gym_id}'s 0 to {info.num_actions - 1}."
                )
    elif dims.get("action_dim") != info.action_dim:
        have = f"actions of {dims['action_dim']} values" if "action_dim" in dims else "discrete actions"
        problems.append(f"{where}: the folder has {have}, {info.gym_id} {info.action_dim} continuous values.")
    return [p + " Fix: data.env=<the folder's environment>, or data.env=null (no rollouts)." for p in problems]
