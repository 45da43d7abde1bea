"""The checkpoint file: reading it safely and verifying its digest, and rebuilding its model with a
given builder. Below the model builder, which reads checkpoints too (a resumed run's data check;
SPALM's query encoder, a model of its own); ``xfam.model.checkpoint`` is the public face (it adds
provenance metadata and ``load_model``) and re-exports all of this.

A checkpoint holds, under ``checkpoint["xfam_digest"]``, a digest of everything else, checked on every
read, so a file changed after it was written (a bad disk, a bad copy) is refused instead of silently
resumed. A sharded checkpoint (a folder, ``xfam.model.sharded``) is read the same way: its ``meta.pt`` holds
that digest, and the digests of its shard files, checked too.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from xfam.core.errors import ConfigError
from xfam.core.logs import log
from xfam.model import exported, sharded

#: Bump when the config layout changes in a way old checkpoints need translating for.
CONFIG_VERSION = 1
#: Top-level key of the digest of the rest of the checkpoint (not itself hashed).
DIGEST_KEY = "xfam_digest"


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
            # (numpy's stubs declare an array a buffer only on Python 3.12+)
            h.update(t.view(torch.uint8).numpy())  # type: ignore[arg-type]
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


def write(checkpoint: dict[str, Any], path: str | Path) -> None:
    """Write ``checkpoint`` with its digest to ``path`` atomically: into ``<path>.tmp``, flushed to disk, then
    renamed over ``path``, so a crash mid-write leaves the previous file intact instead of a truncated one.
    (Raises ``OSError`` as the disk does; callers turn a full disk into ``disk_full``.)"""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _save_synced({**checkpoint, DIGEST_KEY: digest(checkpoint)}, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left after a failed write


def _save_synced(obj: dict[str, Any], path: Path) -> None:
    """``torch.save`` to ``path``, flushed to the disk before returning."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def seal(tmp: Path, path: Path, meta: dict[str, Any], digests: dict[str, list] | None = None) -> None:
    """Finish a sharded checkpoint once every shard is in ``tmp``: write ``meta.pt`` (``meta`` with the digests of
    the shards and its own), then rename ``tmp`` to ``path``, so ``path`` is whole or absent. A folder already at
    ``path`` (the same step saved again) is moved aside first and removed after. ``digests``: those the ranks
    computed of their own shards (``sharded.rank_digests``); the other files are hashed here."""
    meta = {**meta, sharded.SHARDS_KEY: sharded.shard_digests(tmp, digests)}
    _save_synced({**meta, DIGEST_KEY: digest(meta)}, tmp / sharded.META_FILE)
    old = path.with_name(path.name + ".replaced")
    if path.exists() or path.is_symlink():
        sharded.remove(old)
        os.replace(path, old)
    os.replace(tmp, path)
    sharded.remove(old)


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


def read(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file (CPU) with a clear error when it is not an xfam checkpoint."""
    path = Path(path)
    if exported.is_exported(path):
        raise ConfigError(
            f"{str(path)!r} is an exported model folder (`xfam export`): the model's weights and config, without the "
            f"training state (optimizer, step, data order) a training checkpoint holds. It evaluates, generates and "
            f"loads with xfam.load_model; it does not resume or convert. Fix: pass the training checkpoint it was "
            f"exported from (a .ckpt file or a sharded checkpoint's folder)."
        )
    if path.is_dir() and not sharded.is_sharded(path):
        raise ConfigError(
            f"checkpoint {str(path)!r} is a folder but not a sharded checkpoint (it has no {sharded.META_FILE}). "
            f"Fix: pass the path of a .ckpt file or of a sharded checkpoint's folder."
        )
    if path.is_symlink() and not path.exists():
        raise ConfigError(
            f"checkpoint {str(path)!r} is a link to {os.readlink(path)!r}, which does not exist. "
            f"Fix: pass the path of a .ckpt file."
        )
    if not path.is_file() and not path.is_dir():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist. Fix: pass the path of a .ckpt file.")
    try:
        ckpt = sharded.load_meta(path) if path.is_dir() else torch.load(path, map_location="cpu", weights_only=True)
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
    check_config_version(ckpt["xfam"], path)
    ckpt = verify(ckpt, path)
    if path.is_dir():
        problem = _checked_shards(path, ckpt.pop(sharded.SHARDS_KEY, {}))
        if problem is not None:
            raise ConfigError(
                f"sharded checkpoint {str(path)!r} is corrupted: {problem} (a disk or copy error, or a copy of "
                f"part of the folder). Fix: use another checkpoint (e.g. the previous step-*.ckpt), or copy the "
                f"whole folder again from its source."
            )
    return ckpt


_shards_ok: set[tuple] = set()  # folders (with every file's name, size and mtime) whose shards were checked here


def _checked_shards(folder: Path, recorded: dict[str, list]) -> str | None:
    """``sharded.shard_problem``, hashed once per folder in this process while none of its files changes (name,
    size, modification time): ``ckpt_path=auto`` and the resume check read the same checkpoint one after the
    other, and hashing every shard is the cost of a read."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    key = (str(folder.resolve()), tuple(files))
    if key in _shards_ok:
        return None
    problem = sharded.shard_problem(folder, recorded)
    if problem is None:
        _shards_ok.add(key)
    return problem


def weights(path: str | Path, ckpt: dict[str, Any]) -> dict[str, Any]:
    """The LightningModule's weights of a checkpoint ``read`` returned: its ``state_dict``, assembled from the
    shards of a sharded checkpoint (``xfam.model.sharded``)."""
    if "state_dict" in ckpt:
        return ckpt["state_dict"]
    return sharded.full_state(path, {"state_dict"})["state_dict"]


def model_weights(path: str | Path, ckpt: dict[str, Any]) -> dict[str, Any]:
    """The model's ``state_dict`` in a checkpoint: the LightningModule's ``model.*`` weights without that prefix."""
    return {k.removeprefix("model."): v for k, v in weights(path, ckpt).items() if k.startswith("model.")}


def model_state(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The ``xfam`` metadata, the model's ``state_dict`` and the training step of a checkpoint (a file or a sharded
    folder) or of an exported model folder (``xfam export``, read without pickle: ``xfam.model.exported``)."""
    if exported.is_exported(path):
        meta, state = exported.read_folder(path)
        check_config_version(meta, path)
        return meta, state, int(exported.read_config(path).get("step") or 0)
    ckpt = read(path)
    return ckpt["xfam"], model_weights(path, ckpt), int(ckpt.get("global_step", 0))


def check_config_version(meta: dict[str, Any], path: str | Path) -> None:
    """Refuse metadata that a newer xfam wrote (its config may mean something this version does not know)."""
    if meta["config_version"] > CONFIG_VERSION:
        raise ConfigError(
            f"{str(path)!r} was written by a newer xfam (config version {meta['config_version']} > "
            f"{CONFIG_VERSION}). Fix: upgrade xfam."
        )


def short_reason(err: Exception) -> str:
    """The gist of a load error. PyTorch's own text advises loading with ``weights_only=False``: for a
    hostile file that runs its code, so that advice is never repeated."""
    text = str(err).split("WeightsUnpickler error:", 1)[-1].strip()
    first = re.split(r"(?<=\.)\s|\n", text, maxsplit=1)[0].strip().rstrip(".")
    first = first.removesuffix(" was not an allowed global by default")
    if not first or re.search(r"weights_only|trust|safe_globals|allowlist", first, re.IGNORECASE):
        return type(err).__name__
    return f"{type(err).__name__}: {first[:120]}"


M = TypeVar("M", bound=torch.nn.Module)


def load_model_with(
    path: str | Path, build: Callable[[dict[str, Any], dict[str, Any]], M], device: str | torch.device
) -> tuple[M, dict[str, Any]]:
    """The model of a checkpoint, rebuilt by ``build(config, data_info)`` (``xfam.model.build.build_model``),
    with its weights, in eval mode on ``device``; and the checkpoint's ``xfam`` metadata. ``path`` may also be an
    exported model folder (``xfam export``), read without pickle (``xfam.model.exported``)."""
    meta, state, _ = model_state(path)
    model = build(meta["config"], meta["data_info"])
    model.load_state_dict(state)
    return model.to(device).eval(), meta
