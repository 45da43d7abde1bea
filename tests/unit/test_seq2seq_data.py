"""Sequence-to-sequence data: the batch layouts, fit_pairs, data=seq2seq_toy and data=hf pairs (never the network).

One file for the three because they share the contract of ``xfam.data.seq2seq``: the toy and hf tests check
their rows through the same collate and fit_pairs that the first tests pin down.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from xfam.core.errors import ConfigError
from xfam.data import DATA
from xfam.data.hf import HFPairs, HFSource
from xfam.data.seq2seq import Seq2SeqSource, collate_prefix_lm, collate_seq2seq, fit_pairs
from xfam.data.seq2seq_toy import SPLITS, TOKENS, Seq2SeqToy, _rows

PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module", autouse=True)
def hf_cache(tmp_path_factory):
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_cache"))
        yield


def pair(source: list[int], target: list[int]) -> dict[str, torch.Tensor]:
    return {"source": torch.tensor(source), "target": torch.tensor(target)}


# ---- collate --------------------------------------------------------------------------------------------


def test_collate_seq2seq_layout_is_exact():
    rows = [pair([5, 6, 7], [8, 9]), pair([5], [8, 9, 10, 11])]
    batch = collate_seq2seq(rows, PAD, BOS, EOS)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, PAD, PAD]]
    assert batch["key_padding"].tolist() == [[True, True, True], [True, False, False]]
    assert batch["decoder_input_ids"].tolist() == [[BOS, 8, 9, PAD, PAD], [BOS, 8, 9, 10, 11]]
    assert batch["labels"].tolist() == [[8, 9, EOS, -100, -100], [8, 9, 10, 11, EOS]]
    assert all(t.dtype == torch.long for k, t in batch.items() if k != "key_padding")


def test_collate_seq2seq_labels_are_the_decoder_inputs_shifted_left():
    rng = np.random.default_rng(0)
    rows = [pair(rng.integers(3, 20, rng.integers(1, 9)).tolist(), rng.integers(3, 20, rng.integers(1, 9)).tolist())]
    rows += [pair(rng.integers(3, 20, 4).tolist(), rng.integers(3, 20, n).tolist()) for n in (1, 5, 8)]
    batch = collate_seq2seq(rows, PAD, BOS, EOS)
    for i, r in enumerate(rows):
        n = len(r["target"])
        dec, lab = batch["decoder_input_ids"][i], batch["labels"][i]
        assert dec[0] == BOS and torch.equal(dec[1 : n + 1], r["target"]) and (dec[n + 1 :] == PAD).all()
        assert torch.equal(lab[:n], dec[1 : n + 1]) and lab[n] == EOS and (lab[n + 1 :] == -100).all()


def test_collate_seq2seq_has_no_key_padding_when_no_source_is_padded():
    batch = collate_seq2seq([pair([5, 6], [7]), pair([8, 9], [7, 7, 7])], PAD, BOS, EOS)
    assert "key_padding" not in batch  # targets of other lengths pad the decoder only (causal, right-padded)


def test_collate_prefix_lm_layout_is_exact():
    rows = [pair([5, 6], [8, 9]), pair([5, 6, 7, 4], [10])]
    batch = collate_prefix_lm(rows, PAD, BOS, EOS)
    assert batch["input_ids"].tolist() == [[5, 6, BOS, 8, 9, PAD], [5, 6, 7, 4, BOS, 10]]
    assert batch["labels"].tolist() == [[-100, -100, 8, 9, EOS, -100], [-100, -100, -100, -100, 10, EOS]]
    assert batch["key_padding"].tolist() == [[True] * 5 + [False], [True] * 6]


def test_collate_prefix_lm_each_target_position_predicts_the_next_token():
    """Next-token alignment against a brute-force reference: [s, BOS, t, EOS], position p predicts token p + 1,
    and only BOS and the target positions count."""
    rng = np.random.default_rng(1)
    rows = [pair(rng.integers(3, 20, m).tolist(), rng.integers(3, 20, n).tolist()) for m, n in [(1, 1), (5, 3), (2, 7)]]
    batch = collate_prefix_lm(rows, PAD, BOS, EOS)
    for i, r in enumerate(rows):
        m, n = len(r["source"]), len(r["target"])
        full = [*r["source"].tolist(), BOS, *r["target"].tolist(), EOS]
        expected = [full[p + 1] if m <= p < m + 1 + n else -100 for p in range(batch["labels"].shape[1])]
        assert batch["labels"][i].tolist() == expected
        assert batch["input_ids"][i, : m + 1 + n].tolist() == full[:-1]
    assert (batch["labels"] != -100).sum() == sum(len(r["target"]) + 1 for r in rows)


# ---- fit_pairs ------------------------------------------------------------------------------------------


def pairs_dataset(sources: list[list[int]], targets: list[list[int]]):
    from datasets import Dataset

    return Dataset.from_dict({"source": sources, "target": targets, "id": list(range(len(sources)))})


def test_fit_pairs_refuses_empty_targets_with_count_and_first_row():
    ds = pairs_dataset([[3], [4], [5], [6]], [[7], [], [8], []])
    with pytest.raises(ConfigError) as err:
        fit_pairs(ds, source_len=8, target_len=8, truncate=True, split="validation", owner="toy")
    msg = str(err.value)
    assert "2 of the 4 pairs of the validation split have an empty target" in msg
    assert "first is row 1" in msg and "Fix:" in msg


def test_fit_pairs_keeps_pairs_that_fit_exactly():
    ds = pairs_dataset([[3, 4, 5]], [[6, 7]]).with_format("torch")  # 3 <= source_len, 2 + BOS <= target_len
    out, counts = fit_pairs(ds, source_len=3, target_len=3, truncate=False, split="train", owner="toy")
    assert out is ds and counts == {"source_truncated": 0, "target_truncated": 0}


def test_fit_pairs_truncates_counts_and_logs(caplog):
    sources = [[3, 4, 5, 6], [3], [3, 4, 5]]
    targets = [[7, 8], [7, 8, 9, 10], [7, 8, 9]]
    ds = pairs_dataset(sources, targets).with_format("torch")
    with caplog.at_level(logging.INFO, logger="xfam"):
        out, counts = fit_pairs(ds, source_len=3, target_len=3, truncate=True, split="train", owner="toy")
    assert counts == {"source_truncated": 1, "target_truncated": 2}
    assert "1 sources longer than source_len=3" in caplog.text and "2 targets longer" in caplog.text
    assert out.format["type"] == "torch"  # the input's format
    assert [r.tolist() for r in out["source"]] == [s[:3] for s in sources]
    assert [r.tolist() for r in out["target"]] == [t[:2] for t in targets]  # BOS + 2 ids = target_len
    assert out[:]["id"].tolist() == [0, 1, 2]  # other columns kept


def test_fit_pairs_refuses_long_pairs_without_truncate():
    ds = pairs_dataset([[3, 4, 5, 6], [3]], [[7], [7, 8, 9]])
    with pytest.raises(ConfigError) as err:
        fit_pairs(ds, source_len=3, target_len=3, truncate=False, split="test", owner="toy")
    msg = str(err.value)
    assert "1 sources longer than source_len=3" in msg and "1 targets longer than target_len - 1 = 2" in msg
    assert "Fix: data.truncate=true or larger data.source_len/target_len" in msg
    assert "source_len >= 4, target_len >= 4" in msg


# ---- data=seq2seq_toy -----------------------------------------------------------------------------------


def toy(kind: str, **kw) -> Seq2SeqToy:
    src = DATA.build({"name": "seq2seq_toy", "kind": kind, "num_train": 200, "num_val": 40, "num_test": 40, **kw})
    src.prepare()
    return src


def expected_target(kind: str, source: str) -> str:
    if kind == "addition":
        a, b = source.split("+")
        return str(int(a) + int(b))
    return {"copy": source, "reverse": source[::-1], "sort": "".join(sorted(source))}[kind]


@pytest.mark.parametrize("kind", ["copy", "reverse", "sort", "addition"])
def test_toy_targets_are_the_task_of_the_decoded_source(kind):
    src = toy(kind, min_digits=2, max_digits=5)
    assert isinstance(src, Seq2SeqSource) and src.task == "seq2seq" and src.vocab_size == len(TOKENS)
    for name in SPLITS:
        split = src.split(name)
        assert len(split) == {"train": 200, "validation": 40, "test": 40}[name]
        for row in split:
            source, target = src.decode(row["source"]), src.decode(row["target"])
            assert target == expected_target(kind, source)
            operands = source.split("+") if kind == "addition" else [source]
            assert all(2 <= len(x) <= 5 for x in operands)
            assert kind != "addition" or all(x[0] != "0" for x in operands)  # an operand of k digits has k digits
    assert src.manifest["splits"]["train"]["source_truncated"] == 0


def test_toy_lengths_cover_the_range_and_addition_carries():
    src = toy("addition", min_digits=1, max_digits=3)
    rows = [(src.decode(r["source"]), src.decode(r["target"])) for r in src.split("train")]
    digits = {len(x) for s, _ in rows for x in s.split("+")}
    assert digits == {1, 2, 3}
    assert any(len(t) == 4 for _, t in rows)  # a carry out of the top digit: max_digits + 1 target ids


def test_toy_batch_round_trips_through_collate():
    src = toy("reverse")
    rows = [src.split("validation")[i] for i in range(8)]
    batch = src.collate(rows)
    for i, r in enumerate(rows):
        n = len(r["target"])
        assert batch["decoder_input_ids"][i, 0] == src.bos_id and batch["labels"][i, n] == src.eos_id
        assert src.decode(batch["labels"][i, :n]) == src.decode(r["source"])[::-1]


def test_toy_generation_is_determined_by_the_seed_and_the_split():
    params = {"kind": "sort", "min_digits": 1, "max_digits": 6, "num_train": 50, "num_val": 50, "num_test": 50}

    def rows(seed: int, split: str) -> list:
        return [(r["source"], r["target"]) for r in _rows({**params, "seed": seed}, split)]

    assert rows(3, "train") == rows(3, "train")
    assert rows(3, "train") != rows(4, "train")
    assert rows(3, "train") != rows(3, "validation") != rows(3, "test")
    a = toy("sort", seed=7)
    b = DATA.build({"name": "seq2seq_toy", "kind": "sort", "num_train": 200, "num_val": 40, "num_test": 40, "seed": 7})
    b.prepare()
    assert a.fingerprint == b.fingerprint != toy("sort", seed=8).fingerprint
    assert [r["source"].tolist() for r in a.split("test")] == [r["source"].tolist() for r in b.split("test")]


def test_toy_encode_decode():
    src = Seq2SeqToy()
    assert src.decode(src.encode("123+45")) == "123+45"
    assert src.decode([BOS, *src.encode("7"), EOS, PAD]) == "7"
    with pytest.raises(ConfigError, match=r"\['a'\].*Fix:"):
        src.encode("12a")


def check_toy(**params) -> list[str]:
    return DATA.check({"name": "seq2seq_toy", **params}, {})


def test_toy_check_refuses_impossible_settings():
    (msg,) = check_toy(min_digits=5, max_digits=3)
    assert "min_digits=5 > max_digits=3" in msg and "Fix:" in msg
    # addition: sources up to 2 * 8 + 1 = 17 ids, targets up to 9 ids + BOS = 10 positions
    assert check_toy(kind="addition", max_digits=8, source_len=17, target_len=10) == []
    src_msg, tgt_msg = check_toy(kind="addition", max_digits=8, source_len=16, target_len=9)
    assert "up to 17 ids" in src_msg and "data.source_len >= 17" in src_msg
    assert "10 positions" in tgt_msg and "data.target_len >= 10" in tgt_msg
    assert check_toy(kind="addition", max_digits=8, source_len=16, target_len=9, truncate=True) == []
    (msg,) = check_toy(kind="copy", max_digits=8, source_len=8, target_len=8)
    assert "data.target_len >= 9" in msg
    assert any("target_len" in p and ">= 2" in p for p in check_toy(target_len=1))


def test_toy_truncates_when_asked():
    src = toy("copy", min_digits=6, max_digits=6, source_len=4, target_len=4, truncate=True)
    counts = src.manifest["splits"]["train"]
    assert counts["source_truncated"] == counts["target_truncated"] == 200
    assert {len(r["source"]) for r in src.split("train")} == {4}
    assert {len(r["target"]) for r in src.split("train")} == {3}


# ---- data=hf pairs --------------------------------------------------------------------------------------

QUESTIONS = ["what is two plus two", "name a colour", "héllo", "why", "", "count to five please"]
ANSWERS = ["four", "blue", "wörld", "because it is", "nothing", "one two three four five"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    from datasets import Dataset, DatasetDict

    root = tmp_path_factory.mktemp("pairs")
    cols = {"question": QUESTIONS, "answer": ANSWERS, "n": list(range(len(QUESTIONS)))}
    splits = {"train": Dataset.from_dict(cols), "validation": Dataset.from_dict(cols), "test": Dataset.from_dict(cols)}
    DatasetDict(splits).save_to_disk(root / "dict")
    empty = dict(cols, answer=[*ANSWERS[:3], "", *ANSWERS[4:]])
    Dataset.from_dict(empty).save_to_disk(root / "empty")
    return {"dict": root / "dict", "empty": root / "empty"}


def hf_cfg(saved, **kw) -> dict:
    return {"name": "hf", "path": str(saved["dict"]), "source_column": "question", "target_column": "answer", **kw}


def test_hf_pairs_rows_are_the_byte_ids_of_the_columns(saved):
    assert DATA.check(hf_cfg(saved), {}) == []
    assert HFSource.task_for(hf_cfg(saved)) == "seq2seq" and HFSource.task_for({"name": "hf"}) == "lm"
    src = DATA.build(hf_cfg(saved))
    assert isinstance(src, HFPairs) and isinstance(src, Seq2SeqSource) and src.task == "seq2seq"
    src.prepare()
    assert (src.eos_id, src.bos_id, src.pad_id, src.vocab_size) == (256, 257, 258, 259)
    assert src.token_bytes[:256] == [1] * 256 and src.token_bytes[256:] == [0, 0, 0]
    for name in SPLITS:
        split = src.split(name)
        assert [r["source"].tolist() for r in split] == [list(q.encode()) for q in QUESTIONS]
        assert [r["target"].tolist() for r in split] == [list(a.encode()) for a in ANSWERS]
    batch = src.collate([src.split("train")[i] for i in range(3)])
    assert batch["decoder_input_ids"][:, 0].tolist() == [257] * 3
    assert src.decode(batch["labels"][2]) == "wörld" and src.decode(batch["input_ids"][2]) == "héllo"
    assert src.manifest["special_ids"] == {"eos": 256, "bos": 257, "pad": 258}


def test_hf_pairs_bpe_reserves_bos_and_pad_above_the_tokenizer(saved):
    src = DATA.build(hf_cfg(saved, tokenizer="bpe", bpe_vocab_size=300))
    src.prepare()
    n = src.tokenizer.vocab_size
    assert (src.bos_id, src.pad_id, src.vocab_size, src.eos_id) == (n, n + 1, n + 2, src.tokenizer.eos_id)
    ids = torch.cat([torch.cat([r["source"], r["target"]]) for r in src.split("train")])
    assert int(ids.max()) < n and src.eos_id not in ids.tolist()
    assert [src.decode(r["target"]) for r in src.split("train")] == ANSWERS
    assert src.decode(src.encode("name a colour")) == "name a colour"


def test_hf_language_modelling_is_unchanged_without_columns(saved):
    src = DATA.build({"name": "hf", "path": str(saved["dict"]), "text_column": "answer", "seq_len": 8})
    assert type(src) is HFSource and src.task == "lm" and src.seq_len == 8


def test_hf_pairs_check_names_the_columns(saved):
    problems = DATA.check(hf_cfg(saved, target_column="reply"), {})
    assert len(problems) == 3 and all("Fix: set data.target_column" in p for p in problems)  # one per split
    assert "'reply'" in problems[0] and "answer, n, question" in problems[0]
    (msg, *_) = DATA.check(hf_cfg(saved, source_column="n"), {})
    assert "source_column 'n'" in msg and "not text" in msg and "question, answer" in msg
    (msg,) = DATA.check(hf_cfg(saved, target_column=None), {})
    assert "target_column is null" in msg and "Fix:" in msg
    with pytest.raises(ConfigError, match="pairs need both columns"):
        HFSource(path=str(saved["dict"]), target_column="answer")
    (msg,) = DATA.check(hf_cfg(saved, doc_mask=True), {})
    assert "data.doc_mask=false" in msg


def test_hf_pairs_refuse_an_empty_target(saved):
    cfg = hf_cfg(saved, path=str(saved["empty"]), validation_split=None, test_split=None, val_fraction=0.2)
    src = DATA.build(cfg)
    with pytest.raises(ConfigError, match=r"empty target \(the first is row \d+\).*Fix:"):
        src.prepare()


def test_hf_pairs_truncate_or_refuse_long_pairs(saved, caplog):
    # sources over source_len = 10 bytes, targets over 5 bytes (BOS + 5 ids = target_len 6)
    long_src = sum(len(q.encode()) > 10 for q in QUESTIONS)
    long_tgt = sum(len(a.encode()) > 5 for a in ANSWERS)
    with pytest.raises(ConfigError) as err:
        DATA.build(hf_cfg(saved, source_len=10, target_len=6)).prepare()
    assert f"{long_src} sources longer than source_len=10" in str(err.value)
    assert f"{long_tgt} targets longer than target_len - 1 = 5" in str(err.value)
    assert "Fix: data.truncate=true" in str(err.value)
    src = DATA.build(hf_cfg(saved, source_len=10, target_len=6, truncate=True))
    with caplog.at_level(logging.INFO, logger="xfam"):
        src.prepare()
    assert src.manifest["splits"]["train"]["source_truncated"] == long_src
    assert src.manifest["splits"]["train"]["target_truncated"] == long_tgt
    assert f"{long_src} sources longer" in caplog.text
    assert [r["target"].tolist() for r in src.split("test")] == [list(a.encode())[:5] for a in ANSWERS]
    other = DATA.build(hf_cfg(saved, source_len=10, target_len=7, truncate=True))
    other.prepare()
    assert other.fingerprint != src.fingerprint
