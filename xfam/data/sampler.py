"""A batch sampler whose position inside an epoch can be saved and restored exactly.

PyTorch's samplers draw their order from the global RNG and cannot skip ahead, so a run resumed
from a mid-epoch checkpoint would see different batches than an uninterrupted one. This sampler
derives each epoch's order from ``(seed, epoch)`` alone, shards batches over ranks itself, and
skips the batches a checkpoint says were already consumed.

Two layouts:

* shuffled (default): a permutation of all rows per epoch; global batch t is rows
  ``perm[t*B*W : (t+1)*B*W]``, rank r takes its ``B`` rows of it.
* contiguous streams (``streams=True``, for the memory slot): the rows (consecutive chunks of one
  token stream) are cut into ``B*W`` streams; row i of batch t+1 continues row i of batch t.
  The order is the same in every epoch, because a stream must stay in order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableBatchSampler(Sampler[list[int]]):
    """Yields lists of row indices for one rank; ``len`` is the full epoch on every rank."""

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        streams: bool = False,
        drop_last: bool = True,
    ):
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.streams, self.drop_last = shuffle, streams, drop_last
        self.epoch = 0
        self._skip: tuple[int | None, int, int | None] = (None, 0, None)  # (epoch, batches, their rows): ``skip``
        global_batch = batch_size * world_size
        if streams:
            self.stream_len = num_rows // global_batch
            self._len = self.stream_len
        else:
            self._len = num_rows // global_batch if drop_last else -(-num_rows // global_batch)

    def __len__(self) -> int:
        return self._len

    @property
    def sampler(self) -> ResumableBatchSampler:
        """Itself. Lightning calls ``set_epoch`` on ``dataloader.sampler`` and ``dataloader.batch_sampler.sampler``,
        never on the batch sampler: without this the epoch stayed 0, every epoch had the first one's order, and
        the rows left over from its last full batch were never trained on."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch (through ``sampler``), a resumed one included."""
        self.epoch = epoch

    def skip(self, batches: int, epoch: int | None = None, global_batch: int | None = None) -> None:
        """Skip the first ``batches`` batches of the next iteration if it is epoch ``epoch`` (a resumed epoch).

        A checkpoint written at an epoch's last batch has consumed the whole epoch, and Lightning resumes it
        in the next one, whose batches must all be seen: the skip applies only to the epoch whose batches were
        consumed. (``epoch=None``, a checkpoint that did not record it: a whole epoch consumed is taken as
        finished.) ``global_batch``: the rows per batch over all ranks when those batches were drawn (None:
        this sampler's); a checkpoint resumed on another number of processes skips the rows it consumed, and
        the rest of the epoch is cut into this sampler's batches. The stream layout cannot be re-cut: its
        rows per batch must be this sampler's (the runner refuses another global batch before launch)."""
        now = self.batch_size * self.world_size
        global_batch = global_batch or now
        if self.streams and global_batch != now:
            raise ValueError(f"streams laid out for {global_batch} rows per batch cannot continue with {now}")
        self._skip = (epoch, batches, global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        (epoch, batches, rows_per), self._skip = self._skip, (None, 0, None)
        global_batch = self.batch_size * self.world_size
        consumed = batches * (rows_per or global_batch)  # rows of the resumed epoch already trained
        same_epoch = self.epoch == epoch if epoch is not None else consumed < self._len * global_batch
        start = consumed if same_epoch else 0
        if self.streams:  # (the same rows per batch: ``skip``)
            for t in range(start // global_batch, self._len):
                yield self._stream_batch(t)
            return
        left = self.num_rows - start
        for t in range(left // global_batch if self.drop_last else -(-left // global_batch)):
            yield self._batch(t, start)

    def _stream_batch(self, t: int) -> list[int]:
        """Batch ``t``: row ``t`` of each of this rank's streams."""
        b, r = self.batch_size, self.rank
        return [s * self.stream_len + t for s in range(r * b, (r + 1) * b)]

    def _batch(self, t: int, start: int = 0) -> list[int]:
        """This rank's rows of batch ``t`` after the first ``start`` rows of the epoch's order."""
        b, r = self.batch_size, self.rank
        global_rows = self._order()[start + t * b * self.world_size : start + (t + 1) * b * self.world_size]
        return global_rows[r * b : (r + 1) * b].tolist()

    def _order(self) -> torch.Tensor:
        if getattr(self, "_order_epoch", None) != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._order_cache = torch.randperm(self.num_rows, generator=g)
            else:
                self._order_cache = torch.arange(self.num_rows)
            self._order_epoch = self.epoch
        return self._order_cache
