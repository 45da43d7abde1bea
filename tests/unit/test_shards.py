"""Token shards (xfam.data.shards): rows read from memory-mapped shards equal packing the whole stream in memory,
parallel preparation equals serial, an interrupted preparation continues without redoing finished shards and
never leaves a shard training would read half-written, and a shard that cannot be read is one clear error."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_data_cache import WORDS, cache_at
from xfam.core.errors import ConfigError
from xfam.data import shards
from xfam.data.packing import pack_rows
from xfam.data.text import TextSource


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder, rng = tmp_path_factory.mktemp("corpus"), random.Random(0)
    for i in range(60):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
        (folder / f"doc{i:02d}.txt").write_text(f"# {i}\n{words}\n")
    return folder


@pytest.fixture(autouse=True)
def small_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "SHARD_BYTES", 2000)  # many shards from a small corpus


def source(corpus: Path, **kw) -> TextSource:
    return TextSource(paths=[str(corpus)], extensions=[".txt"], seq_len=24, val_fraction=0.2, test_fraction=0.2, **kw)


def prepared(corpus: Path, cache: Path, **kw) -> TextSource:
    with cache_at(cache):
        src = source(corpus, **kw)
        src.prepare()
    return src


def whole_stream(src: TextSource, name: str) -> np.ndarray:
    """The split's stream built in memory: its documents in order, each followed by eos."""
    docs = src.documents()[0][name]
    ids = [np.append(np.frombuffer(d, dtype=np.uint8).astype(np.int64), src.eos_id) for d in docs["text"]]
    return np.concatenate(ids)


def test_memory_mapped_rows_equal_packing_the_stream_in_memory(corpus: Path, tmp_path: Path) -> None:
    src = prepared(corpus, tmp_path)
    for name in ("train", "validation", "test"):
        rows = src.split(name)
        with cache_at(tmp_path):
            expected = pack_rows(whole_stream(src, name), 24)
        assert len(rows.stream.files) > 1 or name != "train", "the test needs rows that cross shards"
        assert np.array_equal(rows["tokens"].numpy(), expected)
        assert all(np.array_equal(rows[i]["tokens"].numpy(), expected[i]) for i in range(len(rows)))
        picked = rows.__getitems__([3, 0, len(rows) - 1])
        assert [r["tokens"].tolist() for r in picked] == [expected[i].tolist() for i in (3, 0, len(rows) - 1)]
        assert np.array_equal(rows[2:7]["tokens"].numpy(), expected[2:7])
    assert src.manifest["token_dtype"] == "uint16"
    assert sum(len(s["shards"]) for s in src.manifest["splits"].values()) > 3


def test_parallel_preparation_writes_the_same_shards(corpus: Path, tmp_path: Path) -> None:
    one, two = prepared(corpus, tmp_path / "one", num_proc=1), prepared(corpus, tmp_path / "two", num_proc=2)
    assert one.fingerprint == two.fingerprint
    for name in ("train", "validation", "test"):
        a, b = one.split(name).stream, two.split(name).stream
        assert a.files == b.files
        assert all((a.folder / f).read_bytes() == (b.folder / f).read_bytes() for f in a.files)


def test_a_pickled_split_carries_paths_not_tokens(corpus: Path, tmp_path: Path) -> None:
    rows = prepared(corpus, tmp_path).split("train")
    rows[0]  # opens the memory maps
    blob = pickle.dumps(rows)
    assert len(blob) < 4000 < len(rows.stream) * 2
    again = pickle.loads(blob)
    assert np.array_equal(again["tokens"].numpy(), rows["tokens"].numpy())


def test_an_interrupted_preparation_continues_where_it_stopped(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = prepared(corpus, tmp_path / "whole", num_proc=1).split("train")["tokens"]
    write, calls = shards.Encoder.write, []

    def dies_after_three(self, job):
        if len(calls) == 3:  # killed in the middle of the fourth shard: a temporary file is left behind
            job.bin.with_suffix(".bin.999.tmp").write_bytes(b"\x00" * 10)
            raise KeyboardInterrupt
        calls.append((job.split, job.index))
        return write(self, job)

    monkeypatch.setattr(shards.Encoder, "write", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepared(corpus, tmp_path / "split", num_proc=1)
    folder = next((tmp_path / "split" / "xfam" / "shards").glob("*/train"))
    assert not (folder / shards.INDEX).exists(), "an unfinished split must not be sealed"
    assert len(list(folder.glob("shard-*.json"))) == 3 and list(folder.glob("*.tmp"))
    monkeypatch.setattr(
        shards.Encoder, "write", lambda self, job: calls.append((job.split, job.index)) or write(self, job)
    )
    done_before = list(calls)
    again = prepared(corpus, tmp_path / "split", num_proc=1).split("train")
    assert not set(calls[len(done_before) :]) & set(done_before), "finished shards were written again"
    assert not list(folder.glob("*.tmp")) and (folder / shards.INDEX).exists()
    assert np.array_equal(again["tokens"].numpy(), expected.numpy())


def test_an_unsealed_split_is_never_read(corpus: Path, tmp_path: Path) -> None:
    """A record is written after its shard: a shard without one (killed before the record) is written again."""
    src = prepared(corpus, tmp_path, num_proc=1)
    folder = src.split("train").stream.folder
    expected = src.split("train")["tokens"]
    (folder / shards.INDEX).unlink()
    (folder / "shard-00001.json").unlink()
    (folder / "shard-00001.bin").write_bytes(b"\x01\x00" * 3)  # half-written
    again = prepared(corpus, tmp_path, num_proc=1).split("train")
    assert np.array_equal(again["tokens"].numpy(), expected.numpy())
    assert json.loads((folder / "shard-00001.json").read_text())["size"] == (folder / "shard-00001.bin").stat().st_size


def test_a_shard_that_cannot_be_read_is_one_clear_error(tmp_path: Path) -> None:
    unreadable = tmp_path / "shards" / "k" / "train" / "shard-00000.bin"
    unreadable.mkdir(parents=True)  # opening it fails as an unreadable file does
    with pytest.raises(ConfigError, match=r"cannot be read.*Fix: make it readable, or delete the folder"):
        shards.readable(unreadable)


def test_plan_groups_consecutive_documents() -> None:
    assert shards.plan([5, 5, 5, 5, 5], 10) == [(0, 2), (2, 4), (4, 5)]
    assert shards.plan([], 10) == [(0, 0)]
    assert shards.plan([50, 1], 10) == [(0, 1), (1, 2)]  # a document larger than a shard is a shard


def test_loader_workers_and_ranks_read_every_row_once_in_the_same_order(corpus: Path, tmp_path: Path) -> None:
    """Prepared data: the batch sampler stays in the main process, so 2 loader workers deliver exactly the batches
    of none, and 2 ranks' rows of an epoch are disjoint and together every row of its full batches."""
    from unittest import mock

    from xfam.data.module import XfamDataModule

    src = prepared(corpus, tmp_path)
    batches = {}
    for workers in (0, 2):
        loader = XfamDataModule(src, seed=3, num_workers=workers).train_dataloader()
        batches[workers] = [b["input_ids"] for b in loader]
    assert len(batches[0]) > 3 and all(torch.equal(a, b) for a, b in zip(batches[0], batches[2], strict=True))
    rows = len(src.split("train"))
    seen = []
    for rank in (0, 1):
        with mock.patch("xfam.data.module._dist", return_value=(rank, 2)):
            sampler = XfamDataModule(src, seed=3).train_dataloader().batch_sampler
            seen.append([i for batch in sampler for i in batch])
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) + len(seen[1]) == rows // (2 * src.batch_size) * 2 * src.batch_size


def test_an_empty_corpus_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    from xfam.data import DATA

    folder = tmp_path / "empty"
    DatasetDict({s: Dataset.from_dict({"text": ["", None, ""]}) for s in ("train", "validation", "test")}).save_to_disk(
        folder
    )
    with cache_at(tmp_path / "cache"):
        src = DATA.build({"name": "hf", "path": str(folder), "join": "eos"})
        with pytest.raises(ConfigError, match="the train split has no text.*Fix:"):
            src.prepare()
    assert not (tmp_path / "cache" / "xfam" / "shards").exists()
