"""Lightning's side of checkpoints: atomic writes that store the digest, and digest checks on
Lightning's own loads. Metadata, digests, reading and loading without Lightning: ``xfam.model.checkpoint``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from xfam.model.checkpoint import DIGEST_KEY, digest, disk_full, is_disk_full, verify


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
