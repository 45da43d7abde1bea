"""data=duplication (Reformer 0w0w) and data=assoc_recall (MQAR): structure, target masks, reproducibility."""

from __future__ import annotations

import pytest
import torch

from xfam.data import DATA
from xfam.data.assoc_recall import AssocRecall
from xfam.data.duplication import Duplication


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def all_rows(src, split: str = "train") -> dict[str, torch.Tensor]:
    return src.split(split)[:]


def test_duplication_second_copy_equals_first_and_mask_marks_it():
    src = Duplication(symbols=11, seq_len=20, num_train=64, num_val=8, num_test=8)
    src.prepare()
    rows = all_rows(src)
    tokens, mask = rows["tokens"], rows["target_mask"]  # [n, 21], [n, 20]
    assert tokens.shape == (64, 21) and mask.shape == (64, 20)
    half = 10
    assert (tokens[:, [0, half, 20]] == 0).all()
    assert torch.equal(tokens[:, 1:half], tokens[:, half + 1 : 20])
    assert ((tokens[:, 1:half] >= 1) & (tokens[:, 1:half] <= 11)).all() and src.vocab_size == 12
    batch = src.collate([src.split("train")[i] for i in range(64)])
    counted = batch["labels"] != -100  # targets that count
    expected = torch.zeros(20, dtype=torch.bool)
    expected[half : 20 - 1] = True  # target t is tokens[t + 1]: the second copy is tokens[11:20]
    assert (counted == expected).all()
    assert torch.equal(batch["labels"][:, half:19], tokens[:, 1:half])  # the answers are the first copy
    assert torch.equal(batch["input_ids"], tokens[:, :20])


def test_duplication_is_reproducible_and_splits_differ():
    a = Duplication(symbols=50, seq_len=16, num_train=20, num_val=20, num_test=20)
    a.prepare()
    b = Duplication(symbols=50, seq_len=16, num_train=20, num_val=20, num_test=20)
    b.prepare()
    c = Duplication(symbols=50, seq_len=16, num_train=20, num_val=20, num_test=20, seed=1)
    c.prepare()
    assert torch.equal(all_rows(a)["tokens"], all_rows(b)["tokens"])
    assert not torch.equal(all_rows(a)["tokens"], all_rows(c)["tokens"])
    assert not torch.equal(all_rows(a, "validation")["tokens"], all_rows(a, "train")["tokens"])
    assert a.token_bytes is None and a.task == "lm" and not a.contiguous


def test_duplication_refuses_odd_length():
    (problem,) = DATA.check({"name": "duplication", "seq_len": 15}, {})
    assert "odd" in problem and "seq_len=16" in problem


def test_assoc_recall_answers_are_the_stored_values():
    src = AssocRecall(num_pairs=6, num_queries=4, num_keys=10, num_values=7, seq_len=24, num_train=200)
    src.prepare()
    rows = all_rows(src)
    tokens, mask = rows["tokens"], rows["target_mask"]  # [n, 25], [n, 24]
    assert tokens.max() < src.vocab_size == 18
    assert (mask.sum(dim=1) == 4).all() and mask[:, [12, 14, 16, 18]].all()
    batch = src.collate([src.split("train")[i] for i in range(200)])
    for row, labels in zip(tokens.tolist(), batch["labels"].tolist()):
        keys, values = row[0:12:2], row[1:12:2]
        assert len(set(keys)) == 6 and all(1 <= k <= 10 for k in keys) and all(11 <= v <= 17 for v in values)
        store = dict(zip(keys, values))
        queries, answers = row[12:20:2], row[13:20:2]
        assert len(set(queries)) == 4 and all(store[q] == a for q, a in zip(queries, answers))
        assert row[20:] == [0] * 5  # padding
        counted = [t for t, y in enumerate(labels) if y != -100]
        assert counted == [12, 14, 16, 18]  # the targets that are answers
        assert [labels[t] for t in counted] == answers


def test_assoc_recall_reproducible_and_cached():
    a = AssocRecall(num_train=50, num_val=10, num_test=10)
    a.prepare()
    b = AssocRecall(num_train=50, num_val=10, num_test=10)
    b.prepare()
    assert a.fingerprint == b.fingerprint and a.split("test").cache_files == b.split("test").cache_files
    c = AssocRecall(num_train=50, num_val=10, num_test=10, seed=3)
    c.prepare()
    assert not torch.equal(all_rows(a)["tokens"], all_rows(c)["tokens"])


def test_assoc_recall_check():
    cfg = {"name": "assoc_recall", "num_pairs": 8, "num_queries": 9, "num_keys": 5, "seq_len": 20}
    problems = DATA.check(cfg, {})
    assert len(problems) == 3 and all("Fix:" in p for p in problems)
    assert "num_keys >= 8" in problems[0] and "num_queries <= 8" in problems[1] and "seq_len >= 33" in problems[2]
