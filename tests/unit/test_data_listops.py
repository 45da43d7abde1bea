"""data=listops: labels equal an independent evaluator, LRA generator rules, reproducibility, errors."""

from __future__ import annotations

import random

import numpy as np
import pytest

from xfam.data import DATA
from xfam.data.listops import CLS, OPS, PAD, TOKENS, ListOps, _apply, evaluate, sample_dataset, sample_tree

SMALL = {
    "max_depth": 5,
    "max_args": 5,
    "min_length": 10,
    "max_length": 60,
    "num_train": 300,
    "num_val": 50,
    "num_test": 50,
    "seq_len": 60,
}


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """A fresh datasets cache and generator memo per test: every prepare really generates."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    sample_dataset.cache_clear()


def rows(src: ListOps) -> dict[str, list[tuple[list[int], int]]]:
    out = {}
    for name in ("train", "validation", "test"):
        table = src.split(name)[:]
        out[name] = [(ids.tolist(), int(label)) for ids, label in zip(table["input_ids"], table["label"])]
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[ListOps, dict]:
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_cache"))
        src = ListOps(**SMALL)
        src.prepare()
        return src, rows(src)


def test_every_label_equals_the_evaluated_expression(small):
    _, data = small
    for examples in data.values():
        for ids, label in examples:
            assert ids[0] == CLS and PAD not in ids
            assert evaluate(ids) == label


def test_lengths_strictly_within_bounds_and_sequences_distinct(small):
    src, data = small
    everything = [tuple(ids) for examples in data.values() for ids, _ in examples]
    assert len(everything) == len(set(everything)) == 400  # distinct, so the splits are disjoint
    assert [len(data[n]) for n in ("train", "validation", "test")] == [300, 50, 50]
    for ids in everything:
        assert SMALL["min_length"] < len(ids) - 1 < SMALL["max_length"] and len(ids) <= src.seq_len


def test_manifest_records_majority_class_rate(small):
    src, data = small
    for name, examples in data.items():
        labels = [label for _, label in examples]
        majority = max(labels.count(c) for c in range(10)) / len(labels)
        assert src.manifest["splits"][name]["majority_class_rate"] == pytest.approx(majority)
    assert src.num_classes == 10 and src.vocab_size == len(TOKENS) == 17


def test_same_seed_same_data_other_seed_other_data(small):
    _, data = small
    again = ListOps(**SMALL)  # fresh cache and memo: generated anew
    again.prepare()
    assert rows(again) == data
    other = ListOps(**SMALL, seed=1)
    other.prepare()
    assert rows(other)["train"] != data["train"]


def test_validation_and_test_do_not_depend_on_num_train(small):
    _, data = small
    fewer = ListOps(**{**SMALL, "num_train": 100})
    fewer.prepare()
    got = rows(fewer)
    assert got["validation"] == data["validation"] and got["test"] == data["test"]


@pytest.mark.parametrize(
    "text, value",
    [
        ("[MED 1 2 ]", 1),  # 1.5 truncated
        ("[MED 3 4 5 6 ]", 4),  # 4.5 truncated
        ("[MED 9 0 ]", 4),
        ("[MED 2 9 4 ]", 4),
        ("[SM 5 7 9 ]", 1),
        ("[MIN 3 [MAX 1 8 ] 2 ]", 2),
        ("[MAX [SM 9 9 ] [MED 0 1 ] 3 ]", 8),
        ("7", 7),
    ],
)
def test_operator_semantics_by_hand(text, value):
    assert evaluate(text.split()) == value
    assert evaluate(ListOps().encode(text)) == value


def test_generator_median_equals_numpy_median():
    rng = random.Random(0)
    for _ in range(500):
        args = [rng.randint(0, 9) for _ in range(rng.randint(2, 10))]
        assert _apply("[MED", args) == int(np.median(args))


def test_malformed_sequences_are_refused():
    for bad in ("[MAX 1 2", "1 2", "[SM ]", "]"):
        with pytest.raises(ValueError):
            evaluate(bad.split())


def test_depth_cap_and_children_counts():
    rng = random.Random(0)
    for _ in range(300):
        out: list[str] = []
        sample_tree(rng, 1, 3, 4, out)
        depth, counts = 0, [0]
        for tok in out:
            if tok in OPS:
                counts[-1] += 1
                depth += 1
                counts.append(0)
                assert depth <= 2  # depth 3 is the cap: only leaves there
            elif tok == "]":
                assert 2 <= counts.pop() <= 4
                depth -= 1
            else:
                counts[-1] += 1


def test_collate_pads_and_keeps_cls_first(small):
    src, _ = small
    batch = src.collate([src.split("train")[i] for i in range(8)])
    assert (batch["input_ids"][:, 0] == CLS).all() and batch["label"].shape == (8,)
    lengths = batch["key_padding"].sum(dim=1)
    for i in range(8):
        assert (batch["input_ids"][i, lengths[i] :] == PAD).all()


def test_encode_decode_round_trip():
    text = "[MAX 2 [MIN 4 7 ] 0 ]"
    src = ListOps()
    assert src.decode([CLS] + src.encode(text)) == "<cls> " + text


def test_check_reports_impossible_settings():
    problems = DATA.check({"name": "listops", "seq_len": 100, "max_length": 200}, {})
    assert len(problems) == 1 and "seq_len >= 200" in problems[0]
    problems = DATA.check({"name": "listops", "max_depth": 2, "max_args": 3, "min_length": 20}, {})
    assert "at most 5 tokens" in problems[0] and "Fix:" in problems[0]
    problems = DATA.check({"name": "listops", "min_length": 10, "max_length": 11, "seq_len": 11}, {})
    assert "strictly between" in problems[0]
