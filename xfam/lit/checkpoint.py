"""Checkpoints: atomic writes, provenance metadata, and loading without Lightning or Hydra.

Every checkpoint carries, under ``checkpoint["xfam"]``, the resolved config, the config format
version, xfam's version, the git commit, package versions and the data fingerprint, so a result
can be traced to exactly what produced it and a model can be rebuilt from the file alone.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import subprocess
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import xfam
from xfam.errors import ConfigError
from xfam.model.spec import ModelSpec

#: Bump when the config layout changes in a way old checkpoints need translating for.
CONFIG_VERSION = 1
#: Sections that define the architecture: a checkpoint only resumes into the same ones.
ARCHITECTURE = ("model", "attention", "pos", "memory", "exit")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes to ``<path>.tmp``, flushes, then renames over ``<path>``: a crash mid-write leaves
    the previous checkpoint intact instead of a truncated file."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # only left after a failed write


@functools.cache
def git_commit() -> str | None:
    """The commit of the xfam checkout (with ``-dirty`` if it has local changes), if any."""
    root = Path(xfam.__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def package_versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "lightning", "hydra-core", "omegaconf", "datasets", "tokenizers", "triton", "wandb"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def metadata(config: dict[str, Any], data_info: dict[str, Any]) -> dict[str, Any]:
    return {
        "xfam_version": xfam.__version__,
        "config_version": CONFIG_VERSION,
        "git_commit": git_commit(),
        "packages": package_versions(),
        "data_fingerprint": data_info.get("fingerprint"),
        "config": config,
        "data_info": data_info,
    }


def read(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file (CPU) with a clear error when it is not an xfam checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist. Fix: pass the path of a .ckpt file.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: any unpickling error
        raise ConfigError(
            f"checkpoint {str(path)!r} cannot be read ({type(err).__name__}: {err}). "
            f"Fix: use another checkpoint (e.g. the previous step-*.ckpt)."
        ) from err
    if not isinstance(ckpt, dict) or "xfam" not in ckpt:
        raise ConfigError(
            f"{str(path)!r} is not an xfam checkpoint (no 'xfam' metadata). Fix: pass a file written by xfam."
        )
    if ckpt["xfam"]["config_version"] > CONFIG_VERSION:
        raise ConfigError(
            f"{str(path)!r} was written by a newer xfam (config version {ckpt['xfam']['config_version']} > "
            f"{CONFIG_VERSION}). Fix: upgrade xfam."
        )
    return ckpt


def architecture_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two configs' architecture sections."""

    def flat(d: Any, prefix: str) -> dict[str, Any]:
        if isinstance(d, dict):
            return {k: v for key, val in d.items() for k, v in flat(val, f"{prefix}.{key}").items()}
        return {prefix: d}

    # a model option missing on one side (a checkpoint written before it existed) is at its default
    defaults = {f"model.{f.name}": f.default for f in dataclasses.fields(ModelSpec)}
    fa = {**defaults, **{k: v for s in ARCHITECTURE for k, v in flat(a.get(s, {}), s).items()}}
    fb = {**defaults, **{k: v for s in ARCHITECTURE for k, v in flat(b.get(s, {}), s).items()}}
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuild the model of a checkpoint and load its weights; no Lightning or Hydra involved.

    Returns the model (eval mode) and the checkpoint's ``xfam`` metadata (config, data info, ...).
    """
    from xfam.build import build_model

    ckpt = read(path)
    meta = ckpt["xfam"]
    model = build_model(meta["config"], meta["data_info"])
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(state)
    return model.to(device).eval(), meta
