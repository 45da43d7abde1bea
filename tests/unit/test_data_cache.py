"""The data caches of every source kind: keyed by everything that changes the data, and rebuilt (with a
warning) when damaged.

* Keys: for each constructor parameter of each source, a change that alters the data gives another
  fingerprint and other cache files, and preparing it next to the old cache gives exactly what a
  build in an empty cache gives (no stale reuse); a change that leaves the data alone gives the same
  data. A table below names every parameter, so a new one cannot be left out.
* Damage: every cache file of a prepared source truncated (a bad copy), or a cache replaced by a
  valid file holding fewer rows, is rebuilt with a warning naming it, and gives the same data.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from xfam.core.registry import defaults_of
from xfam.data import DATA

SPLITS = ("train", "validation", "test")
WORDS = ["ash", "birch", "cedar", "elm", "fir", "hazel", "larch", "maple", "oak", "pine", "rowan", "yew"]


@contextlib.contextmanager
def cache_at(path: Path) -> Iterator[Path]:
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", path)
        yield path


def write_docs(folder: Path, n: int, seed: int, suffix: str = ".txt") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120)))
        (folder / f"doc{seed}-{i:02d}{suffix}").write_text(f"# {seed}-{i}\n{words}\n")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Text folders and save_to_disk datasets the text/hf sources read."""
    from datasets import Dataset, DatasetDict

    root = tmp_path_factory.mktemp("data")
    write_docs(root / "text", 24, 0)
    write_docs(root / "text", 6, 1, suffix=".md")  # only read with extensions=[.txt, .md]
    write_docs(root / "other", 25, 2)

    def texts(n: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [f"{seed}-{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for i in range(n)]

    def saved(name: str, seed: int) -> str:
        sizes = {"train": 40, "validation": 8, "test": 8, "extra": 30}
        parts = {s: texts(n, seed + k) for k, (s, n) in enumerate(sizes.items())}
        alt = {s: [t.upper() for t in v] for s, v in parts.items()}
        DatasetDict({s: Dataset.from_dict({"text": parts[s], "alt": alt[s]}) for s in parts}).save_to_disk(root / name)
        return str(root / name)

    return {"text": str(root / "text"), "other": str(root / "other"), "hf": saved("hf", 10), "hf2": saved("hf2", 20)}


def base_params(kind: str, data: dict[str, str]) -> dict[str, Any]:
    nums = {"num_train": 30, "num_val": 6, "num_test": 6}
    return {
        "parity": {"seq_len": 8, **nums},
        "listops": {"max_depth": 3, "max_args": 3, "min_length": 3, "max_length": 20, "seq_len": 20, **nums},
        "assoc_recall": {"num_pairs": 2, "num_queries": 2, "num_keys": 4, "num_values": 4, "seq_len": 12, **nums},
        "duplication": {"symbols": 5, "seq_len": 8, **nums},
        "text": {"paths": [data["text"]], "extensions": [".txt"], "val_fraction": 0.2, "test_fraction": 0.2},
        "hf": {"path": data["hf"], "join": "eos"},
        "seq2seq_toy": {"max_digits": 4, **nums},
    }[kind] | ({"seq_len": 16} if kind in ("text", "hf") else {})


NUMS = [("num_train", 31), ("num_val", 7), ("num_test", 7), ("seed", 1)]
PAIRS = {"source_column": "text", "target_column": "alt", "truncate": True}  # data=hf as source/target pairs
TRUNCATING = {"source_len": 3, "target_len": 3, "truncate": True}
#: Per source: (base overrides, the change, whether it changes the data). Every parameter appears.
CHANGES: dict[str, list[tuple[dict, dict, bool]]] = {
    "parity": [
        ({}, {"seq_len": 10}, True),
        ({}, {"min_k": 2}, True),
        ({}, {"max_k": 6}, True),
        ({}, {"test_min_k": 3}, True),
        ({}, {"test_max_k": 5}, True),
        *[({}, {k: v}, True) for k, v in NUMS],
        ({}, {"batch_size": 5}, False),
    ],
    "listops": [
        ({}, {"max_depth": 4}, True),
        ({}, {"max_args": 4}, True),
        ({}, {"min_length": 5}, True),
        ({}, {"max_length": 10}, True),
        *[({}, {k: v}, True) for k, v in NUMS],
        ({}, {"seq_len": 24}, False),  # only bounds the rows (>= max_length); they are the same
        ({}, {"batch_size": 5}, False),
    ],
    "assoc_recall": [
        ({}, {"num_pairs": 3}, True),
        ({}, {"num_queries": 1}, True),
        ({}, {"num_keys": 5}, True),
        ({}, {"num_values": 5}, True),
        ({}, {"seq_len": 14}, True),
        *[({}, {k: v}, True) for k, v in NUMS],
        ({}, {"batch_size": 5}, False),
    ],
    "duplication": [
        ({}, {"symbols": 6}, True),
        ({}, {"seq_len": 10}, True),
        *[({}, {k: v}, True) for k, v in NUMS],
        ({}, {"batch_size": 5}, False),
    ],
    "text": [
        ({}, {"paths": "other"}, True),
        ({}, {"extensions": [".txt", ".md"]}, True),
        ({}, {"tokenizer": "bpe", "bpe_vocab_size": 300}, True),
        ({"tokenizer": "bpe", "bpe_vocab_size": 300}, {"bpe_vocab_size": 280}, True),
        ({}, {"val_fraction": 0.3}, True),
        ({}, {"test_fraction": 0.3}, True),
        ({}, {"max_bytes": 6000}, True),
        ({}, {"seq_len": 20}, True),
        ({}, {"seed": 1}, True),  # the order of the documents in each split
        ({}, {"doc_mask": True}, False),  # collation only
        ({}, {"batch_size": 5}, False),
        ({}, {"num_proc": 2}, False),  # the same shards on any number of processes
    ],
    "hf": [
        ({}, {"path": "hf2"}, True),
        ({}, {"config_name": "other"}, False),  # a hub option: a local folder has no configurations
        ({}, {"text_column": "alt"}, True),
        ({}, {"train_split": "extra"}, True),
        ({}, {"validation_split": None}, True),  # carved from train instead
        ({}, {"test_split": None}, True),
        ({"validation_split": None}, {"val_fraction": 0.3}, True),
        ({"test_split": None}, {"test_fraction": 0.3}, True),
        ({}, {"join": "concat"}, True),
        ({}, {"tokenizer": "bpe", "bpe_vocab_size": 300}, True),
        ({"tokenizer": "bpe", "bpe_vocab_size": 300}, {"bpe_vocab_size": 280}, True),
        ({}, {"seq_len": 20}, True),
        ({"validation_split": None}, {"seed": 1}, True),  # which train rows are carved off
        ({}, {"doc_mask": True}, False),
        ({}, {"batch_size": 5}, False),
        ({}, PAIRS, True),  # language modelling -> pairs
        (PAIRS, {"source_column": "alt"}, True),
        (PAIRS, {"source_len": 100}, True),
        (PAIRS, {"target_len": 100}, True),
        ({**PAIRS, "source_len": 2000, "target_len": 2000, "truncate": False}, {"truncate": True}, False),
        ({}, {"num_proc": 2}, False),
        # streaming reads no cache (tests/unit/test_streaming.py); its settings change nothing prepared
        ({}, {"eval_rows": 10}, False),
        ({}, {"shuffle_buffer": 0}, False),
        ({}, {"exact_resume": False}, False),
        ({}, {"streaming": False}, False),
    ],
    "seq2seq_toy": [
        ({}, {"kind": "addition"}, True),
        ({}, {"min_digits": 2}, True),
        ({}, {"max_digits": 5}, True),
        *[({}, {k: v}, True) for k, v in NUMS],
        (TRUNCATING, {"source_len": 2}, True),
        (TRUNCATING, {"target_len": 2}, True),
        ({}, {"truncate": True}, False),  # every pair fits: nothing is cut
        ({}, {"batch_size": 5}, False),
    ],
}
CASES = [(kind, *case) for kind, cases in CHANGES.items() for case in cases]


def prepared(kind: str, params: dict[str, Any], cache: Path) -> Any:
    with cache_at(cache):
        src = DATA.build({"name": kind, **params})
        src.prepare()
    return src


def contents(src: Any) -> dict[str, Any]:
    """Every row of every split (token shards: the ``[rows, S + 1]`` tokens; else the ``datasets`` rows)."""
    out = {}
    for name in SPLITS:
        split = src.split(name)
        out[name] = split["tokens"].tolist() if hasattr(split, "stream") else split.with_format(None)[:]
    return out


def cache_files(src: Any) -> set[str]:
    """The files a prepared source reads its rows from (its token shards, or its ``datasets`` cache files)."""
    files = set()
    for name in SPLITS:
        split = src.split(name)
        if hasattr(split, "stream"):
            files |= {str(split.stream.folder / f) for f in split.stream.files}
        else:
            files |= {f["filename"] for f in split.cache_files}
    return files


def resolve(params: dict[str, Any], data: dict[str, str]) -> dict[str, Any]:
    """Names of the ``data`` fixture's folders to their paths."""
    out = dict(params)
    if isinstance(out.get("paths"), str):
        out["paths"] = [data[out["paths"]]]
    if out.get("path") in data:
        out["path"] = data[out["path"]]
    return out


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_the_table_names_every_parameter(kind: str) -> None:
    named = {key for _, change, _ in CHANGES[kind] for key in change}
    assert named == set(defaults_of(DATA.get(kind), skip=())), "add the new parameter to CHANGES"


@pytest.mark.parametrize(
    ("kind", "base_extra", "change", "changes_data"),
    CASES,
    ids=[f"{k}-{'+'.join(f'{p}={v}' for p, v in c.items())}" for k, _, c, _ in CASES],
)
def test_a_changed_parameter_never_reads_a_stale_cache(kind, base_extra, change, changes_data, data, tmp_path):
    base = {**base_params(kind, data), **base_extra}
    old = prepared(kind, base, tmp_path / "shared")
    new_params = resolve({**base, **change}, data)
    new = prepared(kind, new_params, tmp_path / "shared")  # next to the old cache
    fresh = prepared(kind, new_params, tmp_path / "fresh")
    assert contents(new) == contents(fresh), "a stale cache was read"
    assert new.fingerprint == fresh.fingerprint
    if changes_data:
        assert contents(new) != contents(old), "the change should alter the data (else this case proves nothing)"
        assert new.fingerprint != old.fingerprint
        if not (set(change) == {"seq_len"} and kind in ("text", "hf")):  # (rows are cut from the same shards)
            assert not cache_files(new) & cache_files(old), "a changed split must not share its cache file"
    else:
        assert contents(new) == contents(old)


SOURCES = ["parity", "listops", "assoc_recall", "duplication", "text", "text-bpe", "hf", "hf-bpe"]


def source_params(label: str, data: dict[str, str]) -> tuple[str, dict[str, Any]]:
    kind, _, bpe = label.partition("-")
    return kind, {**base_params(kind, data), **({"tokenizer": "bpe", "bpe_vocab_size": 300} if bpe else {})}


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def read_arrow(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).read_all()


def shorten(path: Path) -> None:
    """Replace an Arrow cache file by a valid one holding its first half: it reads without an error (a token
    shard: its first half of whole ids)."""
    if path.suffix == ".bin":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 4 * 2])
        return
    table = read_arrow(path)
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.slice(0, len(table) // 2))
    os.replace(tmp, path)


def unit_of(path: Path, cache: Path) -> Path:
    """The cache a file belongs to: its ``generated/<key>`` folder, a split's ``shards/<key>/<split>`` folder,
    else the file itself."""
    rel = path.relative_to(cache / "xfam").parts
    if rel[0] == "generated":
        return cache / "xfam" / "generated" / rel[1]
    return cache / "xfam" / "shards" / rel[1] / rel[2] if rel[0] == "shards" else path


@pytest.mark.parametrize("damage", ["truncated", "short"])
@pytest.mark.parametrize("label", SOURCES)
def test_a_damaged_cache_is_rebuilt_with_a_warning(label, damage, data, tmp_path, caplog):
    kind, params = source_params(label, data)
    cache = tmp_path / "cache"
    expected = contents(prepared(kind, params, cache))
    files = [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size > 0]  # lock files are empty
    if damage == "short":  # every Arrow file with at least two rows, every token shard
        files = [p for p in files if p.suffix == ".bin" or p.suffix == ".arrow" and read_arrow(p).num_rows > 1]
    assert files and all(p.is_relative_to(cache / "xfam") for p in files), "every cache file is xfam's"
    for path in files:
        truncate(path) if damage == "truncated" else shorten(path)
    with caplog.at_level(logging.WARNING, logger="xfam"):
        again = prepared(kind, params, cache)
    assert contents(again) == expected
    warned = " ".join(r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage())
    for unit in {unit_of(p, cache) for p in files}:
        assert str(unit) in warned, f"no warning names {unit}"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xfam"):
        assert contents(prepared(kind, params, cache)) == expected  # the rebuilt cache is good
    assert not caplog.records
