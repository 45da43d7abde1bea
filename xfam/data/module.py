"""The LightningDataModule around a data source: resumable training order, rank sharding.

Lightning's automatic distributed sampler is turned off (``use_distributed_sampler=False``):
xfam shards rows itself so that the training position inside an epoch can be checkpointed and
restored exactly (see ``xfam.data.sampler``). Each DataLoader has its own torch.Generator, so
creating an iterator never draws from the global RNG that dropout uses.

With ``streams`` (the memory slot) validation and test use the stream layout too, so memory is
carried through evaluation; the last ``rows mod (B * ranks)`` rows of a split are then left out.

A streamed train split (``data=hf data.streaming=true``, ``xfam.data.streaming``) is read by an iterable
dataset whose workers tokenise: each batch carries its unit's position, which ``on_before_batch_transfer``
takes off the batch (the model never sees it) and keeps for the checkpoint (``stream_state``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from xfam.core.errors import ConfigError
from xfam.data.base import DataSource, Split
from xfam.data.sampler import ResumableBatchSampler
from xfam.data.streaming import POSITION, StreamCollate, StreamedSplit


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class XfamDataModule(L.LightningDataModule):
    """Serves a prepared ``DataSource``'s splits as batches (see ``xfam.data.base`` for their form)."""

    def __init__(
        self,
        source: DataSource,
        *,
        seed: int,
        streams: bool = False,
        num_workers: int = 0,
        collate: Callable[[list[dict]], dict[str, Any]] | None = None,
    ):
        """``collate``: rows to batches, when the task renders the source's rows its own way (default: the
        source's ``collate``); one with ``set_epoch`` (masked LM) learns the training epoch."""
        super().__init__()
        self.source, self.seed, self.streams, self.num_workers = source, seed, streams, num_workers
        self.collate = collate or source.collate
        # Evaluation batches never change with the training epoch (masked LM: the same masks every validation).
        self.eval_collate = copy.copy(self.collate) if hasattr(self.collate, "set_epoch") else self.collate
        self.train_sampler: ResumableBatchSampler | None = None
        # (batches, epoch, rows per batch over all ranks) a checkpoint says were consumed
        self._resume: tuple[int, int | None, int | None] = (0, None, None)
        # A streamed train split: the position of each unit's last batch trained on, and the batches consumed.
        self._positions: dict[int, dict[str, Any]] = {}
        self._consumed = 0

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        self.source.prepare()  # cached: cheap after prepare_data, and needed in spawned ranks

    def resume_at(
        self, batches: int, epoch: int | None = None, global_batch: int | None = None, stream: dict | None = None
    ) -> None:
        """Skip the ``batches`` batches of epoch ``epoch`` a checkpoint consumed, if training resumes in that
        epoch; ``global_batch``: their rows over all ranks, when it may differ from this run's (a resume on
        another number of processes; ``ResumableBatchSampler.skip``). ``stream``: this rank's ``stream_state``
        in the checkpoint (a streamed train split)."""
        self._resume = (batches, epoch, global_batch)
        if stream is not None:
            self._positions = {int(u): p for u, p in stream["positions"].items()}
            self._consumed = stream["batches"]
        if self.train_sampler is not None:
            self.train_sampler.skip(batches, epoch, global_batch)

    def stream_state(self) -> dict[str, Any] | None:
        """A streamed train split's position on this rank (None otherwise): each unit's last batch trained on."""
        if not isinstance(self.source.split("train"), StreamedSplit):
            return None
        _, world = _dist()
        units = world * max(1, self.num_workers)
        return {"units": units, "batches": self._consumed, "positions": dict(self._positions)}

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, dict) and POSITION in batch:
            position = batch.pop(POSITION)
            self._positions[position["unit"]] = position
            self._consumed += 1
        return batch

    def train_dataloader(self) -> DataLoader:
        rank, world = _dist()
        rows = self.source.split("train")
        if isinstance(rows, StreamedSplit):
            workers = max(1, self.num_workers)
            dataset = rows.dataset(rank, world, dict(self._positions), rotation=self._consumed % workers)
            return DataLoader(
                dataset,
                batch_size=None,
                # (batch_size=None: the collate gets one item; torch types it as a list of them)
                collate_fn=StreamCollate(self.collate),  # type: ignore[arg-type]
                num_workers=self.num_workers,
                persistent_workers=self.num_workers > 0,
            )
        self.train_sampler = ResumableBatchSampler(
            len(rows),
            self.source.batch_size,
            seed=self.seed,
            rank=rank,
            world_size=world,
            shuffle=not self.streams,
            streams=self.streams,
        )
        if len(self.train_sampler) == 0:
            raise ConfigError(
                f"data={self.source.registry_name}: the train split has {len(rows)} rows, fewer than one batch of "
                f"{self.source.batch_size} x {world} ranks. Fix: a smaller data.batch_size or more data."
            )
        self.train_sampler.skip(*self._resume)
        self._resume = (0, None, None)
        collate = _EpochCollate(self.collate, self.train_sampler) if hasattr(self.collate, "set_epoch") else None
        return self._loader(rows, self.train_sampler, collate)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def _eval_loader(self, split: Split) -> DataLoader:
        rank, world = _dist()
        rows = self.source.split(split)
        if isinstance(rows, StreamedSplit):
            raise ConfigError(
                f"data={self.source.registry_name}: the {split} split is streamed (data.streaming=true) and has no "
                f"end, so it cannot be gone through. Fix: split=validation or split=test (held in memory), or prepare "
                f"the corpus (data.streaming=false)."
            )
        bs = self.source.batch_size
        if self.streams:  # memory is carried through evaluation too: the same stream layout as training
            sampler = ResumableBatchSampler(len(rows), bs, rank=rank, world_size=world, shuffle=False, streams=True)
            if len(sampler) == 0:
                raise ConfigError(
                    f"data={self.source.registry_name}: the {split} split has {len(rows)} rows, fewer than one "
                    f"stream per batch row ({bs} x {world} ranks). Fix: a smaller data.batch_size, or a larger "
                    f"{split} split (data.val_fraction / data.test_fraction, data.episodes ...)."
                )
            return self._loader(rows, sampler, self.eval_collate)
        mine = list(range(rank, len(rows), world))  # round-robin shard; every row counted once
        batches = [mine[i : i + bs] for i in range(0, len(mine), bs)]
        return self._loader(rows, batches, self.eval_collate)

    def _loader(self, rows: Any, batch_sampler: Any, collate: Callable | None = None) -> DataLoader:
        return DataLoader(
            rows,
            batch_sampler=batch_sampler,
            collate_fn=collate or self.collate,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
            persistent_workers=self.num_workers > 0,
        )


class _EpochCollate:
    """A collate that depends on the training epoch (masked LM's masks), told the sampler's epoch before each
    batch. (With ``loader.num_workers > 0`` the persistent workers keep the epoch they started in.)"""

    def __init__(self, collate: Any, sampler: ResumableBatchSampler):
        self.collate, self.sampler = collate, sampler

    def __call__(self, rows: list[dict]) -> dict[str, Any]:
        self.collate.set_epoch(self.sampler.epoch)
        return self.collate(rows)
