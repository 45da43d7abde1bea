"""A kNN-LM datastore on disk: keys (the final layer's FFN input) and values (the next token) of every
target position of a split, with a manifest naming the checkpoint that made them.

    DIR/manifest.json   format, checkpoint (path, step, weights hash), split, count, dim, dtypes
    DIR/keys.bin        [count, dim] float16 or float32, row-major (numpy memmap)
    DIR/values.bin      [count] int32 (token ids)

Row i is the i-th target position of the split, in the order of its evaluation loader (rows in order,
positions in order). The manifest is written last: a directory without one is an unfinished build.
Keys live in one model's representation space, so opening a store for another model is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from xfam.core.errors import ConfigError
from xfam.knnlm.search import Index, exclude_self, make_index

FORMAT = "xfam-knnlm-datastore"
VERSION = 1
KEY_DTYPES = ("float16", "float32")


def checkpoint_identity(path: str | Path, model: nn.Module, config: dict[str, Any]) -> dict[str, Any]:
    """What a datastore must match: the checkpoint's path and step (for messages) and a SHA-256 of the
    model's weights and architecture config (what the keys depend on; optimiser state does not count,
    and a copied or renamed checkpoint still matches)."""
    h = hashlib.sha256()
    arch = {s: config.get(s) for s in ("model", "attention", "pos", "memory", "exit")}
    h.update(json.dumps(arch, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    try:  # the step, lazily: mmap reads no tensor data
        step = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step")
    except Exception:  # a hash still identifies the weights
        step = None
    return {"path": str(Path(path).resolve()), "step": step, "weights_sha256": h.hexdigest()}


@dataclasses.dataclass
class Neighbours:
    """The k nearest store rows of N queries: squared distances ``[N, k]`` (ascending), store rows
    ``[N, k]`` and their values (next tokens) ``[N, k]``."""

    dists: Tensor
    rows: Tensor
    values: Tensor

    def first(self, k: int) -> Neighbours:
        """The k nearest (a prefix: results are sorted)."""
        return Neighbours(self.dists[:, :k], self.rows[:, :k], self.values[:, :k])


class DatastoreWriter:
    """Appends (keys, values) batches to ``DIR`` and writes the manifest on ``finish``."""

    def __init__(self, path: str | Path, dim: int, dtype: str = "float16", overwrite: bool = False):
        if dtype not in KEY_DTYPES:
            raise ConfigError(f"dtype={dtype!r}: keys are stored as {' or '.join(KEY_DTYPES)}. Fix: dtype=float16.")
        self.path, self.dim, self.dtype = Path(path), dim, dtype
        if (self.path / "manifest.json").exists() and not overwrite:
            raise ConfigError(
                f"{self.path} already holds a datastore. Fix: another out=DIR, or overwrite=true to replace it."
            )
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "manifest.json").unlink(missing_ok=True)  # unfinished until finish() writes it again
        self._keys = open(self.path / "keys.bin", "wb")  # noqa: SIM115  (closed in finish)
        self._values = open(self.path / "values.bin", "wb")  # noqa: SIM115
        self.count = 0

    def add(self, keys: Tensor, values: Tensor) -> None:
        """``keys [n, D]``, ``values [n]`` (token ids)."""
        if keys.shape[-1] != self.dim or keys.shape[0] != values.shape[0]:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} do not fit dim {self.dim}")
        self._keys.write(keys.detach().to("cpu", getattr(torch, self.dtype)).contiguous().numpy().tobytes())
        self._values.write(values.detach().to("cpu", torch.int32).contiguous().numpy().tobytes())
        self.count += keys.shape[0]

    def finish(self, **manifest: Any) -> Path:
        """Close the files and write the manifest (``manifest`` adds to count, dim and dtypes)."""
        self._keys.close()
        self._values.close()
        if self.count == 0:
            raise ConfigError(f"no target tokens were found for the datastore in {self.path}. Fix: a non-empty split.")
        info = {"format": FORMAT, "version": VERSION, "count": self.count, "dim": self.dim, "key_dtype": self.dtype}
        info["value_dtype"] = "int32"
        tmp = self.path / "manifest.json.tmp"
        tmp.write_text(json.dumps({**info, **manifest}, indent=1) + "\n")
        tmp.replace(self.path / "manifest.json")
        return self.path


class Datastore:
    """An opened datastore: its manifest, keys (memmap), values and a search index.

    store = Datastore.open("runs/x/knnlm/last_train", index="exact")
    store.check_checkpoint(identity)       # refuse a store of another model
    nb = store.search(queries, k=1024)     # Neighbours: dists [N, k], rows, values
    """

    def __init__(self, path: Path, manifest: dict[str, Any], keys: np.ndarray, values: Tensor, index: Index):
        self.path, self.manifest, self.keys, self.values, self.index = path, manifest, keys, values, index

    @property
    def size(self) -> int:
        return int(self.manifest["count"])

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @classmethod
    def open(
        cls,
        path: str | Path,
        index: str = "exact",
        device: str | torch.device = "cpu",
        checkpoint: dict[str, Any] | None = None,
    ) -> Datastore:
        """Open ``path`` with a search index; with ``checkpoint`` (``checkpoint_identity``), a store of
        another model is refused first, before its keys are read."""
        path = Path(path)
        manifest = read_manifest(path)
        if checkpoint is not None:
            check_checkpoint(path, manifest, checkpoint)
        n, d = manifest["count"], manifest["dim"]
        keys = np.memmap(path / "keys.bin", dtype=manifest["key_dtype"], mode="r", shape=(n, d))
        values = torch.from_numpy(np.fromfile(path / "values.bin", dtype=manifest["value_dtype"]).astype(np.int64))
        if values.numel() != n:
            raise ConfigError(f"{path}/values.bin holds {values.numel()} values, the manifest {n}. Fix: rebuild it.")
        return cls(path, manifest, keys, values.to(device), make_index(index, keys, device))

    def check_checkpoint(self, identity: dict[str, Any]) -> None:
        """Refuse, with both identities and the fix, a store built from another model's weights."""
        check_checkpoint(self.path, self.manifest, identity)

    def search(self, queries: Tensor, k: int, self_rows: Tensor | None = None) -> Neighbours:
        """The k nearest store rows of ``queries [N, D]``. ``self_rows [N]`` (-1 = none): each query's own
        row, excluded (evaluating on the split the store was built from: a token must not retrieve itself)."""
        limit = self.size - (1 if self_rows is not None else 0)
        if k > limit:
            raise ConfigError(
                f"k={k} neighbours asked of a datastore of {self.size} entries"
                f"{' (less the query itself)' if self_rows is not None else ''}. "
                f"Fix: k={limit} or less, or a larger datastore (more of the split: a larger limit=)."
            )
        if self_rows is None:
            dists, rows = self.index.search(queries, k)
        else:
            dists, rows = exclude_self(*self.index.search(queries, k + 1), self_rows.to(queries.device), k)
        return Neighbours(dists, rows, self.values.to(rows.device)[rows])


def check_checkpoint(path: Path, manifest: dict[str, Any], identity: dict[str, Any]) -> None:
    """Refuse, with both identities and the fix, the store at ``path`` when it was built from another
    model's weights than ``identity``'s."""
    mine = manifest["checkpoint"]
    if mine["weights_sha256"] != identity["weights_sha256"]:
        raise ConfigError(
            f"the datastore {path} was built from another model: {mine['path']} (step {mine['step']}, "
            f"weights {mine['weights_sha256'][:12]}), not {identity['path']} (step {identity['step']}, weights "
            f"{identity['weights_sha256'][:12]}); its keys live in that model's representation space. "
            f"Fix: build one for this checkpoint: xfam knnlm build ckpt={identity['path']}"
        )


def read_manifest(path: Path) -> dict[str, Any]:
    file = path / "manifest.json"
    if not file.is_file():
        what = "an unfinished build (no manifest.json)" if (path / "keys.bin").exists() else "not a datastore"
        raise ConfigError(f"{path} is {what}. Fix: pass a directory written by `xfam knnlm build`.")
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{file} is not an xfam kNN-LM manifest. Fix: pass a directory written by xfam knnlm build.")
    if manifest["version"] > VERSION:
        raise ConfigError(
            f"{path} was written by a newer xfam (datastore version {manifest['version']}). Fix: upgrade."
        )
    return manifest
