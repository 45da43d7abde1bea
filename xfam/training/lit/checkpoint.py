"""Checkpoints: atomic writes, provenance metadata, and loading without Lightning or Hydra.

Every checkpoint carries, under ``checkpoint["xfam"]``, the resolved config, the config format
version, xfam's version, the git commit, package versions and the data fingerprint, so a result
can be traced to exactly what produced it and a model can be rebuilt from the file alone; and,
under ``checkpoint["xfam_digest"]``, a digest of everything else, checked on every read, so a file
changed after it was written (a bad disk, a bad copy) is refused instead of silently resumed.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import xfam
from xfam.core.errors import ConfigError
from xfam.core.logs import log
from xfam.model.spec import ModelSpec

#: Bump when the config layout changes in a way old checkpoints need translating for.
CONFIG_VERSION = 1
#: Sections that define the architecture: a checkpoint only resumes into the same ones.
ARCHITECTURE = ("model", "attention", "pos", "memory", "exit")
#: Top-level key of the digest of the rest of the checkpoint (not itself hashed).
DIGEST_KEY = "xfam_digest"
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


def digest(checkpoint: Mapping[str, Any]) -> str:
    """blake2b of a checkpoint's structure and every tensor's bytes, in the order it holds them (dict
    order survives ``torch.save``/``torch.load``), leaving out ``DIGEST_KEY``. Deterministic and fast:
    one pass over the bytes (15 ms on one CPU core for the 10 MB of the main job's weights and AdamW
    moments, about what torch.save takes to serialise them)."""
    h = hashlib.blake2b(digest_size=16)

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(x.shape)}:".encode())
            h.update(t.view(torch.uint8).numpy())
        elif isinstance(x, Mapping):
            items = [(key, value) for key, value in x.items() if key != DIGEST_KEY]
            h.update(b"{%d" % len(items))
            for key, value in items:
                walk(key)
                walk(value)
        elif isinstance(x, (list, tuple)):
            h.update(b"[%d" % len(x))
            for value in x:
                walk(value)
        else:  # str, numbers, None, dtypes: what a safe load returns; sets in a fixed order
            text = repr(sorted(map(repr, x))) if isinstance(x, (set, frozenset)) else repr(x)
            h.update(b"%s%d:%s" % (type(x).__name__.encode(), len(text), text.encode()))

    walk(checkpoint)
    return h.hexdigest()


_unverified: set[str] = set()  # files written before digests, noted once each


def verify(checkpoint: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """Check (and drop) the digest written with ``checkpoint``; a mismatch means the file changed after
    it was written, and is refused like an unreadable file."""
    if DIGEST_KEY not in checkpoint:
        if str(Path(path).resolve()) not in _unverified:
            _unverified.add(str(Path(path).resolve()))
            log.info("checkpoint %s was written before xfam stored digests: its contents cannot be verified", path)
        return checkpoint
    if checkpoint.pop(DIGEST_KEY) != digest(checkpoint):
        raise ConfigError(
            f"checkpoint {str(path)!r} is corrupted: its contents do not match the digest written with it "
            f"(the file changed after it was written: a disk or copy error). Fix: use another checkpoint (e.g. "
            f"the previous step-*.ckpt), or copy this file again from its source."
        )
    return checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes to ``<path>.tmp``, flushes, then renames over ``<path>``: a crash mid-write leaves
    the previous checkpoint intact instead of a truncated file. The single writer of checkpoints: it
    stores their digest, and Lightning's loads (``trainer.fit(ckpt_path=...)``) verify it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save({**checkpoint, DIGEST_KEY: digest(checkpoint)}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as err:
            if is_disk_full(err):
                raise disk_full(path) from err
            raise
        finally:
            tmp.unlink(missing_ok=True)  # only left after a failed write

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return verify(super().load_checkpoint(path, *args, **kwargs), path)


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
    if path.is_dir():
        raise ConfigError(f"checkpoint {str(path)!r} is a folder, not a file. Fix: pass the path of a .ckpt file.")
    if path.is_symlink() and not path.exists():
        raise ConfigError(
            f"checkpoint {str(path)!r} is a link to {os.readlink(path)!r}, which does not exist. "
            f"Fix: pass the path of a .ckpt file."
        )
    if not path.is_file():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist. Fix: pass the path of a .ckpt file.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated, corrupted or hostile file: any unpickling error
        raise ConfigError(
            f"checkpoint {str(path)!r} cannot be read: it is not a checkpoint xfam can read safely (truncated, "
            f"corrupted or not a torch checkpoint; {short_reason(err)}). Fix: use another checkpoint (e.g. the "
            f"previous step-*.ckpt)."
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
    return verify(ckpt, path)


def short_reason(err: Exception) -> str:
    """The gist of a load error. PyTorch's own text advises loading with ``weights_only=False``: for a
    hostile file that runs its code, so that advice is never repeated."""
    text = str(err).split("WeightsUnpickler error:", 1)[-1].strip()
    first = re.split(r"(?<=\.)\s|\n", text, maxsplit=1)[0].strip().rstrip(".")
    first = first.removesuffix(" was not an allowed global by default")
    if not first or re.search(r"weights_only|trust|safe_globals|allowlist", first, re.IGNORECASE):
        return type(err).__name__
    return f"{type(err).__name__}: {first[:120]}"


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
    from xfam.model.build import build_model

    ckpt = read(path)
    meta = ckpt["xfam"]
    model = build_model(meta["config"], meta["data_info"])
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(state)
    return model.to(device).eval(), meta
