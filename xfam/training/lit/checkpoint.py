"""Lightning's side of checkpoints: atomic writes that store the digest, and digest checks on
Lightning's own loads. Metadata, digests, reading and loading without Lightning: ``xfam.model.checkpoint``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from xfam.model.checkpoint import disk_errors, verify, write


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes to ``<path>.tmp``, flushes, then renames over ``<path>``: a crash mid-write leaves
    the previous checkpoint intact instead of a truncated file. The single writer of checkpoints: it
    stores their digest, and Lightning's loads (``trainer.fit(ckpt_path=...)``) verify it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        with disk_errors(path):
            write(checkpoint, path)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return verify(super().load_checkpoint(path, *args, **kwargs), path)
