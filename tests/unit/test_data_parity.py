"""data=parity (ACT, Graves 2016, sec. 3.1): the definition, difficulty k, reproducibility, errors, training."""

from __future__ import annotations

import math

import lightning as L
import numpy as np
import pytest
import torch

from tests.integration.helpers import compose_cfg
from xfam.core.errors import ConfigError
from xfam.data import DATA
from xfam.data.parity import MINUS, PAD, PLUS, ZERO, Parity, _rows, difficulty, parity_rows
from xfam.training.runner import train

SMALL = {"seq_len": 10, "num_train": 3000, "num_val": 200, "num_test": 200}


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """A fresh datasets cache per test: every prepare really generates."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def prepared(**params) -> Parity:
    src = Parity(**{**SMALL, **params})
    src.prepare()
    return src


def table(src: Parity, split: str = "train") -> dict[str, torch.Tensor]:
    return src.split(split)[:]  # input_ids [n, S], label [n], difficulty [n]


def test_rows_follow_the_definition():
    src = prepared()
    rows = table(src)
    ids, labels, ks = rows["input_ids"], rows["label"], rows["difficulty"]
    assert ids.shape == (3000, 10) and src.vocab_size == 4 and src.num_classes == 2 and src.task == "classify"
    assert set(ks.tolist()) == set(range(1, 11))  # k covers exactly 1..seq_len
    for row, label, k in zip(ids.tolist(), labels.tolist(), ks.tolist()):
        assert all(t in (PLUS, MINUS) for t in row[:k]) and row[k:] == [ZERO] * (10 - k)  # exactly the first k
        assert label == row.count(PLUS) % 2  # parity of the number of +1 entries
    assert torch.equal(difficulty(ids), ks)  # k is recoverable from the tokens
    signs = ids[ids != ZERO]
    n = len(signs)
    assert abs((signs == PLUS).sum().item() - n / 2) < 4 * math.sqrt(n / 4)  # +1 and -1 equally likely
    assert abs(labels.sum().item() - 1500) < 4 * math.sqrt(3000 / 4)  # so the two classes are balanced


def test_difficulty_is_uniform_over_the_range_and_test_range_is_its_own():
    src = prepared(min_k=3, max_k=8, test_min_k=9, test_max_k=10)
    train_k = table(src)["difficulty"].numpy()
    counts = np.bincount(train_k, minlength=11)
    assert counts[:3].sum() == 0 and counts[9:].sum() == 0
    expected = 3000 / 6  # k uniform in 3..8
    assert all(abs(c - expected) < 5 * math.sqrt(expected) for c in counts[3:9]), counts
    assert set(table(src, "validation")["difficulty"].tolist()) == set(range(3, 9))  # validation: training range
    assert set(table(src, "test")["difficulty"].tolist()) == {9, 10}
    assert src.manifest["splits"]["test"]["k_range"] == [9, 10]
    assert src.manifest["splits"]["train"]["difficulty"] == {"min": 3, "mean": pytest.approx(train_k.mean()), "max": 8}


def test_generator_bounds_by_hand():
    rng = np.random.default_rng(0)
    ids, labels, ks = parity_rows(6, 6, 6, 50, rng)  # k = size: no zero entry
    assert (ks == 6).all() and not (ids == ZERO).any() and not (ids == PAD).any()
    ids, labels, ks = parity_rows(6, 1, 1, 50, rng)  # k = 1: one sign, the label says whether it is +1
    assert (ids[:, 1:] == ZERO).all() and np.array_equal(labels, (ids[:, 0] == PLUS).astype(int))


def test_same_seed_same_data_other_seed_other_data_and_splits_differ(tmp_path, monkeypatch):
    import datasets

    a = {s: table(prepared(), s) for s in ("train", "validation", "test")}
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "another_cache")  # generated anew
    b = {s: table(prepared(), s) for s in ("train", "validation", "test")}
    for split in a:
        assert all(torch.equal(a[split][c], b[split][c]) for c in ("input_ids", "label", "difficulty"))
    other = table(prepared(seed=1))
    assert not torch.equal(other["input_ids"], a["train"]["input_ids"])
    val, test = a["validation"]["input_ids"], a["test"]["input_ids"]
    assert not torch.equal(val, test) and not torch.equal(val, a["train"]["input_ids"][:200])
    # Each split is its own stream: the evaluation sets do not move with num_train.
    fewer = prepared(num_train=100)
    assert torch.equal(table(fewer, "test")["input_ids"], test)
    assert torch.equal(table(fewer, "validation")["input_ids"], val)


def test_prepare_stores_exactly_the_generator_rows():
    src = prepared(num_val=30)
    direct = list(_rows({"version": "", **src.params}, "validation"))
    rows = table(src, "validation")
    assert rows["input_ids"].tolist() == [r["input_ids"].tolist() for r in direct]
    assert rows["label"].tolist() == [r["label"] for r in direct]


def test_collate_carries_difficulty_and_needs_no_padding():
    src = prepared()
    rows = [src.split("train")[i] for i in range(16)]
    batch = src.collate(rows)
    assert batch["input_ids"].shape == (16, 10) and "key_padding" not in batch  # fixed length
    assert batch["difficulty"].dtype == torch.long and batch["difficulty"].tolist() == [
        int(r["difficulty"]) for r in rows
    ]
    assert torch.equal(batch["difficulty"], difficulty(batch["input_ids"]))
    assert batch["label"].tolist() == [int(r["label"]) for r in rows]


def test_encode_decode_round_trip():
    src = Parity()
    assert src.encode("+1 -1 0 0") == [PLUS, MINUS, ZERO, ZERO] == src.encode("1 -1 0 0")
    assert src.decode([PLUS, MINUS, ZERO, ZERO]) == "+1 -1 0 0"


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"seq_len": 8, "max_k": 9}, ["max_k=9 > seq_len=8", "data.max_k <= 8"]),
        ({"seq_len": 8, "min_k": 10}, ["min_k..max_k is 10..8", "range of k is empty", "data.min_k <= 8."]),
        ({"max_k": 4, "test_min_k": 5}, ["test_min_k..test_max_k is 5..4", "data.test_max_k >= 5"]),
        ({"seq_len": 8, "test_max_k": 12}, ["test_max_k=12 > seq_len=8"]),
        ({"min_k": 0}, ["data.min_k=0: must be >= 1"]),
        ({"max_k": 2.5}, ["data.max_k=2.5"]),
        ({"size": 64}, ["unknown key 'size'", "Valid keys: seq_len"]),
    ],
)
def test_bad_settings_are_config_errors_that_name_the_fix(params, expected):
    problems = DATA.check({"name": "parity", **params}, {})
    assert len(problems) == 1, problems
    for text in expected:
        assert text in problems[0], problems[0]
    with pytest.raises(ConfigError):
        DATA.build({"name": "parity", **params})


def test_every_problem_at_once():
    problems = DATA.check(
        {"name": "parity", "seq_len": 8, "max_k": 9, "min_k": 10, "test_min_k": 6, "test_max_k": 5}, {}
    )
    assert len(problems) == 3 and all("Fix:" in p for p in problems)


class _Batches(L.Callback):
    def __init__(self):
        self.difficulties: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        assert torch.equal(batch["difficulty"], difficulty(batch["input_ids"]))
        self.difficulties.append(batch["difficulty"])


def test_a_tiny_classifier_trains_through_the_normal_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XFAM_RUNS", str(tmp_path / "runs"))
    cfg = compose_cfg(
        [
            "data=parity",
            "data.seq_len=8",
            "data.num_train=64",
            "data.num_val=16",
            "data.num_test=16",
            "data.batch_size=8",
            "model.dim=32",
            "model.layers=2",
            "model.heads=2",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
            "optim.warmup_steps=1",
            "callbacks.every_n_steps=4",
            "callbacks.progress_bar=none",
            "callbacks.loss_curve=false",
            "trainer.log_every_n_steps=1",
        ]
    )
    seen = _Batches()
    metrics = train(cfg, tmp_path / "run", callbacks=[seen])
    assert metrics["step"] == 4 and len(seen.difficulties) == 4
    assert math.isfinite(metrics["val/loss"]) and math.isfinite(metrics["test/loss"])
    assert 0.0 <= metrics["val/acc"] <= 1.0
    assert {int(k) for d in seen.difficulties for k in d} <= set(range(1, 9))
