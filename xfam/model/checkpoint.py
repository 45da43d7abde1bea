"""Checkpoints without Lightning or Hydra: provenance metadata, digests, reading, and loading a model.

Every checkpoint carries, under ``checkpoint["xfam"]``, the resolved config, the config format
version, xfam's version, the git commit, package versions and the data fingerprint, so a result
can be traced to exactly what produced it and a model can be rebuilt from the file alone; and,
under ``checkpoint["xfam_digest"]``, a digest of everything else, checked on every read, so a file
changed after it was written (a bad disk, a bad copy) is refused instead of silently resumed.
Checkpoint files are written by ``write`` (atomic, with the digest), in training through Lightning's
checkpoint IO (``xfam.training.lit.checkpoint``); sharded checkpoints (folders, ``trainer=fsdp``) are
described in ``xfam.model.sharded``. Everything here runs without Lightning. Reading, writing and the digest
live in ``xfam.model.checkpoint_file`` (below the model builder, which reads checkpoints too) and are
re-exported here: import any of it from this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import importlib.metadata
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import xfam
from xfam.core.errors import ConfigError
from xfam.model.build import build_model
from xfam.model.checkpoint_file import (
    CONFIG_VERSION,
    DIGEST_KEY,
    digest,
    load_model_with,
    read,
    seal,
    short_reason,
    verify,
    weights,
    write,
)
from xfam.model.spec import ModelSpec

__all__ = [
    "ARCHITECTURE",
    "CONFIG_VERSION",
    "DIGEST_KEY",
    "DISK_MARGIN",
    "DiskFullError",
    "architecture_diff",
    "digest",
    "disk_errors",
    "disk_full",
    "free_bytes",
    "git_commit",
    "is_disk_full",
    "load_model",
    "metadata",
    "package_versions",
    "read",
    "seal",
    "short_reason",
    "verify",
    "weights",
    "write",
]

#: Sections that define the architecture: a checkpoint only resumes into the same ones.
ARCHITECTURE = ("model", "attention", "pos", "memory", "exit")
#: Room kept free besides the checkpoints (logs, metrics, the loss curve).
DISK_MARGIN = 64 * 2**20


class DiskFullError(ConfigError):
    """The disk of a run is full, or too full to hold its checkpoints: one line naming the path, the
    free space and the fix, never a traceback; the same message refuses a retry before it trains."""


def free_bytes(path: str | Path) -> int:
    """Free space on the disk that holds ``path`` (or would: its nearest existing folder)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_full(path: str | Path, need: int | None = None) -> DiskFullError:
    """The one-line message of a full disk at ``path`` (``need``: the bytes a run needs there)."""
    needs = f", this run needs about {need / 2**20:.0f} MB" if need else ""
    return DiskFullError(
        f"not enough space on the disk of {path}: {free_bytes(path) / 2**20:.1f} MB free{needs}. Nothing "
        f"half-written was left. Fix: free space on that disk and run again (ckpt_path=auto continues a run from "
        f"its last checkpoint), or put runs on another disk with XFAM_RUNS=<a folder there>."
    )


def is_disk_full(err: OSError) -> bool:
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def disk_errors(path: str | Path) -> Iterator[None]:
    """Writing ``path`` (a checkpoint, a run's record): a full disk becomes ``disk_full``'s one line."""
    try:
        yield
    except OSError as err:
        if is_disk_full(err):
            raise disk_full(path) from err
        raise


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

    Returns the model (eval mode) and the checkpoint's ``xfam`` metadata (config, data info, ...). ``path``: a
    ``.ckpt`` file, a sharded checkpoint's folder, or a model folder written by ``xfam export``, which is read
    without pickle (JSON and safetensors; ``xfam.model.exported``) and gives the same model and metadata.
    """
    return load_model_with(path, build_model, device)
