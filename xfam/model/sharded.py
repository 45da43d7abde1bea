"""Sharded checkpoints (``trainer=fsdp``, ``trainer=fsdp_cpu``) without Lightning: the folder, its integrity
check, and the full weights and optimizer state assembled in one process.

A sharded checkpoint is a folder named like a checkpoint file (``step-0000020.ckpt/``), written by
``xfam.training.lit.fsdp.ShardedStrategy`` through PyTorch's distributed checkpoint
(``torch.distributed.checkpoint``, DCP), the layout of Lightning's ``ModelParallelStrategy``:

* ``__<rank>_<i>.distcp``: each rank's shards of ``state_dict`` (the LightningModule's weights, by name) and
  ``optimizer_0`` (AdamW's state, by parameter name); ``.metadata``: DCP's index of every tensor's chunks;
* ``meta.pt``: everything else of the checkpoint (the loops, callbacks, ``xfam`` metadata, ``xfam_resume``),
  with two keys of xfam's: ``xfam_shards``, the size and blake2b digest of every other file in the folder,
  and ``xfam_digest``, the digest of ``meta.pt``'s own contents (as in a single-file checkpoint).

The folder is written under ``<name>.tmp`` and renamed when every rank's shards and ``meta.pt`` are on disk,
so a checkpoint is complete or absent; ``read`` checks both digests, so a folder whose files changed after
they were written is refused like a corrupted file (and ``ckpt_path=auto`` passes over it).

DCP saves each tensor once, by name, with its global shape, so the same folder loads into any number of
processes (resharded on load) and, here, into one process with no process group: ``full_state`` assembles
full tensors, which is how ``xfam.load_model``, ``xfam eval`` and ``xfam convert`` read a sharded checkpoint.
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

#: The file of a sharded checkpoint that holds everything but the tensors (Lightning's name).
META_FILE = "meta.pt"
#: Key in ``meta.pt`` of the digests of the folder's other files.
SHARDS_KEY = "xfam_shards"


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint folder (it has ``meta.pt``; the shards are checked by ``read``)."""
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def file_digest(path: Path, h: Any = None) -> str:
    """The digest of a file's bytes, read in 8 MiB blocks: blake2b (16 bytes) unless ``h``, a fresh ``hashlib``
    hash, says otherwise."""
    h = hashlib.blake2b(digest_size=16) if h is None else h
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def shard_digests(folder: Path, known: dict[str, list] | None = None) -> dict[str, list]:
    """``{file name: [size, digest]}`` of every file of ``folder`` but ``meta.pt``; ``known``: digests the ranks
    computed of their own files (``rank_digests``), taken as they are."""
    known = known or {}
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != META_FILE)
    return {p.name: known.get(p.name) or _size_and_digest(p) for p in files}


def rank_digests(folder: Path, rank: int) -> dict[str, list]:
    """The digests of the shard files rank ``rank`` wrote into ``folder`` (DCP names them ``__<rank>_<i>.distcp``),
    so every rank hashes its own in parallel and rank 0 only gathers them."""
    return {p.name: _size_and_digest(p) for p in sorted(folder.glob(f"__{rank}_*.distcp"))}


def _size_and_digest(path: Path) -> list:
    return [path.stat().st_size, file_digest(path)]


def shard_problem(folder: Path, recorded: dict[str, list]) -> str | None:
    """What differs between the folder's files and the digests ``meta.pt`` recorded, or None."""
    found = {p.name for p in folder.iterdir() if p.is_file() and p.name != META_FILE}
    if missing := sorted(set(recorded) - found):
        return f"shard files missing: {', '.join(missing)}"
    for name, (size, expected) in recorded.items():
        if (folder / name).stat().st_size != size or file_digest(folder / name) != expected:
            return f"shard file {name} does not match the digest written with it"
    return None


def full_state(path: str | Path, keys: set[str] | None = None) -> dict[str, Any]:
    """The tensors of a sharded checkpoint as full tensors in this process (no process group needed): the
    ``keys`` of it (``state_dict``, ``optimizer_0``; None: all). The caller has checked the folder (``read``)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "no process group: loading into this process" is what is wanted
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys(keys, checkpoint_id=str(path))


def optimizer_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (DCP's layout, ``get_optimizer_state_dict``) in the layout of
    ``torch.optim.Optimizer.state_dict``: parameters numbered in the order the groups list them."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def optimizer_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of ``optimizer_by_index``: ``names[i]`` is the name of parameter ``i`` of the model the
    optimizer was built over, in the order of its groups."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: value for i, value in state["state"].items()}, "param_groups": groups}


def remove(path: Path) -> None:
    """Remove a file, a link or a folder (a checkpoint of either format)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def load_meta(path: Path) -> Any:
    return torch.load(path / META_FILE, map_location="cpu", weights_only=True)


def to_file(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The single-file checkpoint of a sharded one (``meta``: its verified ``meta.pt``, as ``read`` returns it):
    full weights, and every optimizer's state renumbered as ``torch.optim.Optimizer.state_dict`` numbers it, which
    is how a one-process Lightning run saves and resumes it."""
    state = full_state(folder)
    optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    optimizer_states = [optimizer_by_index(state[k]) for k in optimizers]
    return {**meta, "state_dict": state["state_dict"], "optimizer_states": optimizer_states}


def to_folder(ckpt: dict[str, Any], folder: Path, names: list[list[str]]) -> None:
    """Write the single-file checkpoint ``ckpt`` as a sharded one into ``folder`` (one process: one shard per
    tensor, resharded by whoever loads it). ``names[i]``: the parameter names of optimizer ``i`` in the order of
    its groups (``optimizer_by_name``). The caller writes ``meta.pt`` (with the digests) and renames the folder."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": ckpt["state_dict"]}
    for i, (opt, order) in enumerate(zip(ckpt.get("optimizer_states", []), names)):
        state[f"optimizer_{i}"] = optimizer_by_name(opt, order)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
