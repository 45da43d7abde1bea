"""The resumable batch sampler: rank shards, exact skipping, contiguous streams."""

from __future__ import annotations

import pytest
import torch

from xfam.data.sampler import ResumableBatchSampler


def epoch(sampler: ResumableBatchSampler, e: int) -> list[list[int]]:
    sampler.set_epoch(e)
    return list(sampler)


def test_shuffled_order_is_a_seeded_permutation_per_epoch() -> None:
    s = ResumableBatchSampler(100, 8, seed=3)
    e0, e1 = epoch(s, 0), epoch(s, 1)
    assert len(e0) == len(s) == 12  # drop_last: 96 rows
    flat = [i for b in e0 for i in b]
    assert len(set(flat)) == 96 and all(0 <= i < 100 for i in flat)
    assert e0 != e1 and epoch(ResumableBatchSampler(100, 8, seed=3), 0) == e0
    assert epoch(ResumableBatchSampler(100, 8, seed=4), 0) != e0


@pytest.mark.parametrize("streams", [False, True])
def test_ranks_split_each_global_batch_without_overlap(streams: bool) -> None:
    ranks = [ResumableBatchSampler(64, 4, seed=0, rank=r, world_size=2, streams=streams) for r in range(2)]
    per_rank = [epoch(s, 0) for s in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == len(ranks[0])
    for b0, b1 in zip(*per_rank):
        assert not set(b0) & set(b1)
    single = epoch(ResumableBatchSampler(64, 8, seed=0, streams=streams), 0)
    assert [sorted(a + b) for a, b in zip(*per_rank)] == [sorted(b) for b in single]


@pytest.mark.parametrize("streams", [False, True])
def test_skip_resumes_exactly_where_the_epoch_stopped(streams: bool) -> None:
    whole = epoch(ResumableBatchSampler(50, 4, seed=1, streams=streams), 2)
    resumed = ResumableBatchSampler(50, 4, seed=1, streams=streams)
    resumed.set_epoch(2)
    resumed.skip(5)
    assert list(resumed) == whole[5:]
    assert len(resumed) == len(whole)  # Lightning counts the epoch in full
    assert list(resumed) == whole  # skipping applies to one iteration only


def test_a_resume_on_another_number_of_processes_skips_the_rows_consumed() -> None:
    """5 steps of 2 ranks x 4 rows, resumed on 1 process reading 4 rows (another global batch) or 8 (the same):
    the rest of the epoch is the rows not yet trained, in the epoch's order, each once."""
    ranks = [ResumableBatchSampler(100, 4, seed=7, rank=r, world_size=2) for r in range(2)]
    before = [i for b0, b1 in list(zip(*[epoch(s, 3) for s in ranks]))[:5] for i in b0 + b1]  # 40 rows
    order = [i for b in epoch(ResumableBatchSampler(100, 4, seed=7), 3) for i in b]  # the epoch's permutation
    assert before == order[:40]
    for batch in (4, 8):
        one = ResumableBatchSampler(100, batch, seed=7)
        one.set_epoch(3)
        one.skip(5, epoch=3, global_batch=8)
        after = [i for b in one for i in b]
        assert after == order[40 : 40 + (60 // batch) * batch]  # (the last partial batch dropped)
        assert not set(after) & set(before)
    streams = ResumableBatchSampler(100, 4, streams=True)
    with pytest.raises(ValueError, match="laid out for 8 rows per batch cannot continue with 4"):
        streams.skip(5, epoch=0, global_batch=8)


def test_streams_continue_row_by_row() -> None:
    s = ResumableBatchSampler(40, 4, streams=True)
    batches = epoch(s, 0)
    assert len(batches) == 10
    for t in range(1, len(batches)):
        assert [i - 1 for i in batches[t]] == batches[t - 1]  # row i of batch t continues row i of t-1
    assert epoch(s, 1) == batches


def test_lightning_gives_every_epoch_its_own_order() -> None:
    """A real fit over 3 epochs: Lightning reaches ``set_epoch`` through ``batch_sampler.sampler``. Before, the
    epoch stayed 0 and all three epochs had the same batches (and the same rows never trained)."""
    import lightning as L
    from torch.utils.data import DataLoader

    seen: list[list[int]] = []

    class Record(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            seen.append(batch.tolist())
            return self.w * 0 + batch.float().mean() * self.w

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.0)

    sampler = ResumableBatchSampler(10, 3, seed=1)
    loader = DataLoader(torch.arange(10), batch_sampler=sampler)
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(accelerator="cpu", max_epochs=3, use_distributed_sampler=False, **quiet)
    trainer.fit(Record(), loader)
    epochs = [sum(seen[i : i + 3], []) for i in range(0, 9, 3)]  # 3 batches of 3 per epoch
    assert sampler.epoch == 2 and len({tuple(e) for e in epochs}) == 3
    for e, rows in enumerate(epochs):
        sampler.set_epoch(e)
        assert rows == sum(list(sampler), [])  # the order of (seed, epoch)
