"""data=hf on save_to_disk folders (never the network): splits, carving, joins, errors."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from xfam.core.errors import ConfigError
from xfam.data import DATA
from xfam.data.hf import HFSource

WORDS = ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]


@pytest.fixture(scope="module", autouse=True)
def hf_cache(tmp_path_factory):
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_cache"))
        yield


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) for i in range(n)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A DatasetDict (train/validation/test, with an extra column and empty rows) and a single Dataset."""
    from datasets import Dataset, DatasetDict

    root = tmp_path_factory.mktemp("saved")
    parts = {"train": texts(40, 0) + [""], "validation": texts(8, 1), "test": texts(8, 2)}
    DatasetDict({k: Dataset.from_dict({"text": v, "id": list(range(len(v)))}) for k, v in parts.items()}).save_to_disk(
        root / "dict"
    )
    Dataset.from_dict({"text": texts(60, 3)}).save_to_disk(root / "single")
    return {"dict": root / "dict", "single": root / "single", "parts": parts}


def stream_of(src: HFSource, split: str) -> list[int]:
    rows = src.split(split)[:]["tokens"].numpy()  # [n, S + 1]
    return np.concatenate([rows[0]] + [r[1:] for r in rows[1:]]).tolist()


def test_dataset_dict_folder_packs_documents_with_eos(saved):
    src = HFSource(path=str(saved["dict"]), join="eos", seq_len=32)
    assert DATA.check({"name": "hf", "path": str(saved["dict"]), "join": "eos"}, {}) == []
    src.prepare()
    for split in ("train", "validation", "test"):
        expected: list[int] = []
        for doc in saved["parts"][split]:
            if doc:  # empty rows are no document
                expected += list(doc.encode()) + [src.eos_id]
        got = stream_of(src, split)
        assert got == expected[: len(got)] and len(expected) - len(got) < 32
    assert src.manifest["splits"]["train"]["documents"] == 40
    assert src.vocab_size == 257 and src.contiguous


def test_concat_join_has_no_eos(saved):
    src = HFSource(path=str(saved["dict"]), join="concat", seq_len=32)
    src.prepare()
    got = stream_of(src, "validation")
    expected = list("".join(saved["parts"]["validation"]).encode())
    assert got == expected[: len(got)] and src.eos_id is None and 256 not in got


def test_missing_splits_are_carved_from_train_deterministically(saved):
    def carve(seed: int) -> dict[str, set[str]]:
        src = HFSource(path=str(saved["single"]), validation_split=None, test_split=None, join="eos", seed=seed)
        docs, column, _, _ = src.documents()
        return {name: set(ds[column]) for name, ds in docs.items()}

    a, b, c = carve(0), carve(0), carve(1)
    assert a == b and a != c
    assert not (a["train"] & a["validation"]) and not (a["train"] & a["test"]) and not (a["validation"] & a["test"])
    assert a["train"] | a["validation"] | a["test"] == set(texts(60, 3))
    assert len(a["validation"]) == len(a["test"]) == 3  # 5% of 60


def test_fingerprint_is_stable_and_cached(saved):
    a = HFSource(path=str(saved["dict"]), join="eos", seq_len=16)
    a.prepare()
    b = HFSource(path=str(saved["dict"]), join="eos", seq_len=16)
    b.prepare()
    assert a.fingerprint == b.fingerprint and b.split("train").stream.files == a.split("train").stream.files
    c = HFSource(path=str(saved["dict"]), join="eos", seq_len=24)
    c.prepare()
    assert c.fingerprint != a.fingerprint


def test_missing_text_column_lists_the_columns(saved):
    problems = DATA.check({"name": "hf", "path": str(saved["dict"]), "text_column": "body"}, {})
    assert problems and all("Fix:" in p for p in problems)
    assert "'body'" in problems[0] and "id, text" in problems[0]


def test_missing_split_names_the_splits_and_the_fix(saved):
    (problem,) = DATA.check({"name": "hf", "path": str(saved["single"])}, {})[:1]
    assert "'validation'" in problem and "train" in problem and "null" in problem


def test_bad_paths_and_options(tmp_path, saved):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("hello")
    assert "save_to_disk" in DATA.check({"name": "hf", "path": str(tmp_path / "plain")}, {})[0]
    assert "not an existing folder" in DATA.check({"name": "hf", "path": str(tmp_path / "nope")}, {})[0]
    msg = DATA.check({"name": "hf", "path": str(saved["dict"]), "doc_mask": True}, {})[0]
    assert "join=eos" in msg and "Fix:" in msg
    (msg,) = DATA.check({"name": "hf", "path": str(saved["dict"]), "validation_split": "train"}, {})
    assert "validation_split='train' is also train_split" in msg and "data.validation_split=null" in msg
    (msg,) = DATA.check({"name": "hf", "path": str(saved["dict"]), "test_split": "validation"}, {})
    assert "test_split='validation' is also validation_split" in msg


def test_hub_id_offline_fails_fast_with_a_fix(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    src = HFSource(path="xfam-test/no-such-dataset", config_name=None)
    with pytest.raises(ConfigError) as err:
        src.prepare()
    assert "not available offline" in str(err.value) and "save_to_disk" in str(err.value)
