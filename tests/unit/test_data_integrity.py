"""Cache files that read without an error but hold wrong contents are rebuilt with a warning.

A cache file with the right number of rows but a bad id (past the vocabulary in the middle or at the
end of a stage, negative), a packed row of another length, or the contents of another stage once
made every later run die with ``IndexError: index out of range in self`` in the embedding until the
file was deleted by hand: only the row count was checked. Every corruption below keeps the row count
and writes a valid Arrow file, so only a check of the contents can see it; a token shard rewritten in
place keeps its size, and its modification time gives it away.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from tests.unit.test_data_cache import SPLITS, WORDS, cache_at
from xfam.data import DATA


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A folder of text files (data=text) and a save_to_disk dataset (data=hf)."""
    from datasets import Dataset, DatasetDict

    root, rng = tmp_path_factory.mktemp("data"), random.Random(0)
    (root / "text").mkdir()
    for i in range(20):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120)))
        (root / "text" / f"doc{i:02d}.txt").write_text(f"# {i}\n{words}\n")
    parts = {
        s: [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(n)]
        for s, n in {"train": 40, "validation": 8, "test": 8}.items()
    }
    DatasetDict({s: Dataset.from_dict({"text": t}) for s, t in parts.items()}).save_to_disk(root / "hf")
    return {"text": str(root / "text"), "hf": str(root / "hf")}


def params(kind: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "text": {"paths": [data["text"]], "extensions": [".txt"], "val_fraction": 0.2, "test_fraction": 0.2},
        "hf": {"path": data["hf"], "join": "eos"},
        "parity": {"seq_len": 8, "num_train": 30, "num_val": 6, "num_test": 6},
        "listops": {"max_depth": 3, "max_args": 3, "min_length": 3, "max_length": 20, "seq_len": 20},
    }[kind] | ({"seq_len": 16} if kind in ("text", "hf") else {})


def prepared(kind: str, data: dict[str, str], cache: Path) -> Any:
    with cache_at(cache):
        src = DATA.build({"name": kind, **params(kind, data)})
        src.prepare()
    return src


def contents(src: Any) -> dict[str, Any]:
    return {
        name: src.split(name)["tokens"].tolist()
        if hasattr(src.split(name), "stream")
        else src.split(name).with_format(None)[:]
        for name in SPLITS
    }


def read_arrow(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).read_all()


def write_arrow(path: Path, table: pa.Table) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, path)


def corrupt(table: pa.Table, column: str, how: str, vocab_size: int) -> pa.Table:
    """``table`` with the same number of rows and a wrong ``column`` (lists of ids, or labels)."""
    col = table.column(column).combine_chunks()
    if not pa.types.is_fixed_size_list(col.type) and not pa.types.is_large_list(col.type):  # a label column
        values = col.to_numpy().copy()
        values[len(values) // 2] = vocab_size
        return table.set_column(table.column_names.index(column), column, pa.array(values, col.type))
    values = col.flatten().to_numpy().copy()
    offsets = np.arange(len(col) + 1) * col.type.list_size if pa.types.is_fixed_size_list(col.type) else None
    offsets = np.asarray(col.offsets) if offsets is None else offsets
    keep_metadata = True
    if how == "high-middle":  # one id past the vocabulary halfway through the stage
        values[len(values) // 2] = vocab_size
    elif how == "high-end":  # the last id of the stage
        values[-1] = vocab_size + 40
    elif how == "negative":  # stored signed: the file's own schema says so
        values = values.astype(np.int64)
        values[len(values) // 3] = -1
        keep_metadata = False
    elif how == "short-row":  # one row a token short, the others as they were
        mid = len(col) // 2
        values = np.delete(values, offsets[mid])
        offsets = np.concatenate([offsets[: mid + 1], offsets[mid + 1 :] - 1])
        keep_metadata = False
    new = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values))
    if pa.types.is_fixed_size_list(col.type) and how != "short-row":
        new = pa.FixedSizeListArray.from_arrays(pa.array(values), col.type.list_size)
    if how == "other-stage":  # the other stage's column (ids where rows belong, or rows where ids belong)
        column, keep_metadata = ("ids" if column == "tokens" else "tokens"), False
    out = pa.table({column: new})
    return out.replace_schema_metadata(table.schema.metadata) if keep_metadata else out


@pytest.mark.parametrize("kind", ["text", "hf"])
@pytest.mark.parametrize("how", ["high-middle", "high-end"])
def test_a_token_shard_rewritten_in_place_is_rebuilt_with_a_warning(kind, how, data, tmp_path, caplog):
    """A shard of the same size whose ids were rewritten (past the vocabulary) is seen by its modification
    time, without reading every id at start-up (xfam.data.shards), and written again."""
    cache = tmp_path / "cache"
    src = prepared(kind, data, cache)
    expected = {name: src.split(name)["tokens"].tolist() for name in SPLITS}
    files = sorted((cache / "xfam" / "shards").rglob("shard-*.bin"))
    assert len(files) == 3
    for path in files:
        ids = np.fromfile(path, dtype="<u2")
        ids[len(ids) // 2 if how == "high-middle" else -1] = src.vocab_size + 40
        ids.tofile(path)
    with caplog.at_level(logging.WARNING, logger="xfam"):
        again = prepared(kind, data, cache)
    warned = " ".join(r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage())
    assert all(str(path.parent) in warned and "modified after it was written" in warned for path in files)
    assert {name: again.split(name)["tokens"].tolist() for name in SPLITS} == expected
    for name in SPLITS:
        tokens = again.split(name)["tokens"]
        assert tokens.shape[1] == again.seq_len + 1 and int(tokens.min()) >= 0 and int(tokens.max()) < src.vocab_size
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xfam"):
        prepared(kind, data, cache)  # the rebuilt shards are good
    assert not caplog.records


@pytest.mark.parametrize("kind", ["parity", "listops"])
def test_a_generated_split_with_a_label_out_of_range_is_rebuilt(kind, data, tmp_path, caplog):
    cache = tmp_path / "cache"
    src = prepared(kind, data, cache)
    expected = contents(src)
    files = sorted((cache / "xfam" / "generated").rglob("*.arrow"))
    assert len(files) == 3
    for path in files:
        write_arrow(path, corrupt(read_arrow(path), "label", "high-middle", src.num_classes))
    with caplog.at_level(logging.WARNING, logger="xfam"):
        again = prepared(kind, data, cache)
    assert sum("cannot be read" in r.getMessage() and "'label'" in r.getMessage() for r in caplog.records) == 3
    assert contents(again) == expected


def test_cached_documents_of_other_lengths_are_rebuilt(data, tmp_path, caplog):
    """data=text's documents stage: a document cut short (same row count) is seen, not packed."""
    cache = tmp_path / "cache"
    expected = contents(prepared("text", data, cache))
    for path in sorted((cache / "xfam" / "generated").rglob("*.arrow")):
        table = read_arrow(path)
        texts = table.column("text").to_pylist()
        texts[0] = texts[0][:-5]
        write_arrow(path, table.set_column(1, "text", pa.array(texts, table.schema.field("text").type)))
    shutil.rmtree(cache / "xfam" / "shards")  # so the ids are encoded from the documents again
    with caplog.at_level(logging.WARNING, logger="xfam"):
        again = prepared("text", data, cache)
    assert sum("other lengths than their files" in r.getMessage() for r in caplog.records) == 3
    assert contents(again) == expected
