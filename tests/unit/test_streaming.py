"""Streamed corpora (xfam.data.streaming): units split the documents disjointly and completely, a unit packs
rows as data=text does, the carved evaluation documents never reach training, a resume from any batch
continues exactly (also with loader workers), and settings that cannot stream are refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.helpers import compose_cfg
from tests.unit.test_data_cache import cache_at
from xfam.config.validation import validate
from xfam.core.errors import ConfigError
from xfam.data import DATA
from xfam.data.hf import HFSource
from xfam.data.module import XfamDataModule
from xfam.data.packing import pack_rows
from xfam.data.streaming import Opener, Packer, carve
from xfam.data.tokenize import ByteTokenizer


def _doc(i: int) -> str:
    return f"document {i} " + "word " * (i % 37 + 5)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("jsonl")
    for k in range(4):
        (folder / f"train-{k}.jsonl").write_text(
            "".join(json.dumps({"text": _doc(k * 100 + i)}) + "\n" for i in range(60))
        )
    for name in ("validation", "test"):  # named splits (datasets reads the split from the file name)
        (folder / f"{name}-0.jsonl").write_text("".join(json.dumps({"text": _doc(9000 + i)}) + "\n" for i in range(30)))
    return folder


def texts(stream) -> list[str]:
    return [e["text"] for e in stream]


@pytest.mark.parametrize("units", [2, 3, 4])
def test_units_split_the_documents_disjointly_and_completely(units: int, jsonl: Path, tmp_path: Path) -> None:
    with cache_at(tmp_path):
        everything = texts(Opener(str(jsonl), None, "train", 0, 0)())
        parts = [texts(Opener(str(jsonl), None, "train", 0, 0)(u, units)) for u in range(units)]
    assert sum(len(p) for p in parts) == len(everything) == 240
    assert sorted(d for p in parts for d in p) == sorted(everything)


@pytest.mark.parametrize("workers", [0, 2])
def test_one_pass_of_the_loader_reads_every_document_once(workers: int, jsonl: Path, tmp_path: Path) -> None:
    """Inside loader workers too: ``datasets`` must not split a unit's shards over the workers again."""
    with cache_at(tmp_path):
        src = stream_source(jsonl, validation_split="validation", test_split="test", seq_len=64, batch_size=8)
        src.prepare()
        dm, seen = XfamDataModule(src, seed=0, num_workers=workers), {}
        for batch in dm.train_dataloader():
            position = batch["stream_position"]
            ids = batch["input_ids"].flatten().tolist()  # a unit's inputs laid end to end are its stream
            seen.setdefault(position["unit"], []).extend(ids)
            if position["passes"] > 1:  # (every unit is well into its second pass by then)
                break
    passes = []
    for ids in seen.values():  # each unit's documents in order, up to the first one it reads again
        found = [int(p.split()[0]) for p in bytes(t for t in ids if t < 256).decode().split("document ")[1:-1]]
        passes.append(found[: found.index(found[0], 1)])
    every = [d for one in passes for d in one]
    assert sorted(every) == sorted(k * 100 + i for k in range(4) for i in range(60))  # every one, once


def test_a_unit_packs_its_documents_like_data_text() -> None:
    docs = [_doc(i) for i in range(30)]
    packer = Packer(ByteTokenizer(), 256, seq_len=8, batch_size=3)
    head, pos, got = np.zeros(0, dtype=np.int64), 0, []
    for d in docs:
        ids = packer.ids(d)
        for rows, rest, at in packer.batches(head, ids, pos):
            got.append(rows)
            head, pos = rest, at
        head, pos = np.concatenate([head, ids[pos:]]), 0
    stream = np.concatenate([packer.ids(d) for d in docs])
    expected = pack_rows(stream, 8)
    assert np.array_equal(np.concatenate(got), expected[: len(got) * 3])


def test_carving_is_a_partition_by_text() -> None:
    fractions = {"validation": 0.2, "test": 0.1}
    names = [carve(_doc(i), fractions) for i in range(2000)]
    share = {n: names.count(n) / 2000 for n in ("train", "validation", "test")}
    assert abs(share["validation"] - 0.2) < 0.03 and abs(share["test"] - 0.1) < 0.03
    assert carve(_doc(7), fractions) == carve(_doc(7).encode(), fractions)


def stream_source(jsonl: Path, **kw) -> HFSource:
    params = {"path": str(jsonl), "config_name": None, "validation_split": None, "test_split": None, "join": "eos"}
    return DATA.build({"name": "hf", **params, "streaming": True, "seq_len": 16, "batch_size": 2, "eval_rows": 4, **kw})


def consume(dm: XfamDataModule, n: int, it=None):
    it = iter(dm.train_dataloader()) if it is None else it
    return [dm.on_before_batch_transfer(next(it), 0)["input_ids"] for _ in range(n)], it


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [1, 5])
def test_a_resume_from_any_batch_continues_exactly(workers: int, stop: int, jsonl: Path, tmp_path: Path) -> None:
    with cache_at(tmp_path):
        src = stream_source(jsonl)
        src.prepare()
        dm = XfamDataModule(src, seed=0, num_workers=workers)
        _, it = consume(dm, stop)
        state = dm.stream_state()
        expected, _ = consume(dm, 6, it)
        resumed = XfamDataModule(src, seed=0, num_workers=workers)
        resumed.resume_at(0, stream=state)
        got, _ = consume(resumed, 6)
    assert state["batches"] == stop and state["units"] == max(1, workers)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_carved_evaluation_documents_never_reach_training(jsonl: Path, tmp_path: Path) -> None:
    with cache_at(tmp_path):
        src = stream_source(jsonl, eval_rows=2, val_fraction=0.3, test_fraction=0.3)
        src.prepare()
        val = bytes(t for t in src.split("validation")["tokens"].flatten().tolist() if t < 256).decode()
        batches, _ = consume(XfamDataModule(src, seed=0), 40)
    train = b"".join(bytes(t for t in b.flatten().tolist() if t < 256) for b in batches).decode()
    val_docs = {int(piece.split()[0]) for piece in val.split("document ")[1:]}  # (the last may be cut: still its id)
    train_docs = {int(piece.split()[0]) for piece in train.split("document ")[1:]}
    assert val_docs and len(train_docs) > 8 and not val_docs & train_docs


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["data.tokenizer=bpe"], "tokenizer=bpe is trained on the whole train split"),
        (["data.shuffle_buffer=100"], "exact_resume=true demands an exact one"),
        (["trainer.max_steps=-1", "trainer.max_epochs=1"], "trainer.max_steps=<steps>"),
        (["trainer.val_check_interval=0.5"], "trainer.val_check_interval=<steps>"),
        (["memory=xl", "pos=xl"], "contiguous streams need a contiguous source"),
        (["data.source_column=a", "data.target_column=b"], "pairs .* are prepared"),
    ],
)
def test_settings_that_cannot_stream_are_refused_before_any_work(extra, match, jsonl: Path) -> None:
    base = ["data=hf", f"data.path={jsonl}", "data.config_name=null", "data.streaming=true", "data.join=eos"]
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg([*base, *extra]))


def test_a_shuffled_stream_is_accepted_when_exactness_is_waived(jsonl: Path) -> None:
    base = ["data=hf", f"data.path={jsonl}", "data.config_name=null", "data.streaming=true", "data.join=eos"]
    validate(compose_cfg([*base, "data.shuffle_buffer=100", "data.exact_resume=false"]))
    with pytest.raises(ConfigError, match="shuffle_buffer shuffles a stream"):
        validate(compose_cfg(["data=hf", f"data.path={jsonl}", "data.shuffle_buffer=10"]))


def test_the_endless_train_split_cannot_be_evaluated(jsonl: Path, tmp_path: Path) -> None:
    with cache_at(tmp_path):
        src = stream_source(jsonl)
        src.prepare()
        dm = XfamDataModule(src, seed=0)
        assert len(dm._eval_loader("validation")) == 2  # eval_rows 4 / batch 2
        with pytest.raises(ConfigError, match="the train split is streamed.*Fix: split=validation"):
            dm._eval_loader("train")


def test_an_uncached_hub_dataset_offline_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with cache_at(tmp_path):
        src = DATA.build({"name": "hf", "path": "nobody/no-such-corpus", "config_name": None, "streaming": True})
        with pytest.raises(ConfigError, match="not available offline.*Fix:"):
            src.prepare()
