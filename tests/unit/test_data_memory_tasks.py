"""data=repeat_segments and data=far_recall (the memory slot's tasks): row layout, contiguity, target
masks, the distance claim, the stream-alignment check, and that the rows survive the streams sampler."""

from __future__ import annotations

import math

import pytest
import torch

from xfam.data import DATA
from xfam.data.far_recall import FarRecall, filler_rule, vocab_ranges
from xfam.data.repeat_segments import RepeatSegments
from xfam.data.sampler import ResumableBatchSampler


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def rows_of(src, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    rows = src.split(split)[:]
    return rows["tokens"], rows["target_mask"]


def assert_contiguous(tokens: torch.Tensor) -> None:
    assert torch.equal(tokens[:-1, -1], tokens[1:, 0]), "row j's last token must be row j+1's first"


# ------------------------------------------------------------------------------------ repeat_segments


def repeat(**kw) -> RepeatSegments:
    params = {"symbols": 7, "seq_len": 10, "num_train": 24, "num_val": 8, "num_test": 8, "batch_size": 2, **kw}
    src = RepeatSegments(**params)
    src.prepare()
    return src


def test_repeat_rows_are_segment_then_copy_and_contiguous():
    src = repeat()
    tokens, mask = rows_of(src)  # [24, 11], [24, 10]
    assert tokens.shape == (24, 11) and mask.shape == (24, 10)
    assert src.contiguous and src.vocab_size == 7 and src.token_bytes is None
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 7
    assert_contiguous(tokens)
    inputs = tokens[:, :-1]  # [24, 10]: row j's segment
    assert torch.equal(inputs[1::2], inputs[0::2]), "row 2k+1 is a copy of row 2k"
    assert not torch.equal(inputs[2::2], inputs[0:-2:2]), "consecutive segments are independent draws"


def test_repeat_mask_counts_exactly_the_predictable_copy_targets():
    src = repeat()
    tokens, mask = rows_of(src)
    assert not mask[0::2].any(), "no target of an original row is predictable"
    assert mask[1::2, :-1].all() and not mask[1::2, -1].any(), "copy rows: all but the next segment's first"
    batch = src.collate([src.split("train")[i] for i in range(24)])
    labels, counted = batch["labels"], batch["labels"] != -100
    assert torch.equal(counted, mask)
    # every counted target equals the symbol seq_len - 1 positions back, which is in the previous row
    prev_inputs = tokens[:-1, :-1]  # [23, 10]
    copy_rows = torch.arange(1, 24, 2)
    assert torch.equal(labels[copy_rows, :-1], prev_inputs[copy_rows - 1, 1:])


def test_repeat_copy_targets_are_unpredictable_within_the_row():
    # Without memory a copy target is a fresh uniform symbol: its empirical conditional entropy given the
    # previous symbol of the row is close to ln(symbols), and ln(symbols) is what memory=none should reach.
    src = repeat(symbols=4, seq_len=16, num_train=2048, batch_size=4)
    tokens, mask = rows_of(src)
    inputs, targets = tokens[:, :-1][mask], tokens[:, 1:][mask]
    joint = torch.zeros(4, 4)
    joint.index_put_((inputs, targets), torch.ones(len(inputs)), accumulate=True)
    cond = joint / joint.sum(1, keepdim=True)
    h = float(-(joint / joint.sum() * cond.clamp_min(1e-12).log()).sum())
    assert abs(h - math.log(4)) < 0.01


def test_repeat_streams_keep_each_pair_in_one_stream_and_in_order():
    src = repeat(num_train=24, batch_size=2)  # 2 streams of 12 rows
    tokens, _ = rows_of(src)
    sampler = ResumableBatchSampler(24, 2, shuffle=False, streams=True)
    batches = list(sampler)
    for t in range(0, len(batches), 2):  # batch t holds originals, batch t+1 their copies, row by row
        for i in range(2):
            assert batches[t][i] % 2 == 0
            assert torch.equal(tokens[batches[t + 1][i], :-1], tokens[batches[t][i], :-1])


def test_repeat_reproducible_and_splits_differ():
    a, b, c = repeat(), repeat(), repeat(seed=1)
    assert torch.equal(rows_of(a)[0], rows_of(b)[0]) and a.fingerprint == b.fingerprint
    assert not torch.equal(rows_of(a)[0], rows_of(c)[0])
    assert not torch.equal(rows_of(a, "validation")[0], rows_of(a, "test")[0])


def test_repeat_refuses_streams_that_cut_a_pair():
    cfg = {"name": "repeat_segments", "num_train": 30, "num_val": 8, "num_test": 8, "batch_size": 2}
    (problem,) = DATA.check(cfg, {})  # 30 // 2 = 15 rows per stream: odd
    assert "num_train=30" in problem and "Fix: set data.num_train=32" in problem
    assert DATA.check({**cfg, "num_train": 32}, {}) == []


# ----------------------------------------------------------------------------------------- far_recall

S, E = 12, 4  # seq_len; rows per episode (gap_rows = 2)
FAR = {
    "num_pairs": 3,
    "num_queries": 2,
    "local_queries": 2,
    "num_keys": 5,
    "num_values": 4,
    "filler_symbols": 3,
    "filler_rule": False,
    "gap_rows": 2,
    "seq_len": S,
    "num_train": 64,
    "num_val": 16,
    "num_test": 16,
    "batch_size": 2,
}


def far(**kw) -> FarRecall:
    src = FarRecall(**{**FAR, **kw})
    src.prepare()
    return src


def episodes(src) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, labels (-100: not counted) and target masks of the train split as ``[episodes, E, S]``."""
    batch = src.collate([src.split("train")[i] for i in range(len(src.split("train")))])
    mask = src.split("train")[:]["target_mask"]
    return batch["input_ids"].view(-1, E, S), batch["labels"].view(-1, E, S), mask.view(-1, E, S)


def test_far_recall_episode_layout_and_vocabulary():
    src = far()
    tokens, _ = rows_of(src)  # [64, 13]
    ids = vocab_ranges(src.params)
    assert src.vocab_size == 2 + 3 + 5 + 4 == ids["values"].stop and src.contiguous
    assert (src.pad_id, src.eos_id) == (0, 1)
    assert_contiguous(tokens)
    inputs, _, _ = episodes(src)
    pairs, filler, queries = inputs[:, 0], inputs[:, 1:3], inputs[:, 3]
    values, keys = pairs[:, 0:6:2], pairs[:, 1:6:2]  # [16, P]: each pair is written value first
    assert all(k in ids["keys"] for k in keys.flatten().tolist())
    assert all(v in ids["values"] for v in values.flatten().tolist())
    assert all(len(set(row)) == 3 for row in keys.tolist()), "the keys of an episode are distinct"
    assert (pairs[:, 10:] == 0).all() and (queries[:, 4:-1] == 0).all(), "the rest of both rows is <pad>"
    assert (queries[:, -1] == 1).all(), "<eos> closes every episode"
    assert all(f in ids["filler"] for f in filler.flatten().tolist())


def test_far_recall_answers_are_the_stored_values_and_only_they_count():
    src = far()
    inputs, labels, _ = episodes(src)
    counted = labels != -100
    expected = torch.zeros(E, S, dtype=torch.bool)
    expected[3, [0, 2]] = True  # far: target t of the query row is the input t + 1, answers at t = 0, 2 (Q = 2)
    expected[0, [6, 8]] = True  # local: after the 3 pairs (6 tokens), answers at t = 6, 8 (R = 2)
    assert (counted == expected).all()
    for ep in range(inputs.shape[0]):
        stored = dict(zip(inputs[ep, 0, 1:6:2].tolist(), inputs[ep, 0, 0:6:2].tolist(), strict=True))  # key: value
        for row, at in ((3, [0, 2]), (0, [6, 8])):
            asked = inputs[ep, row, at].tolist()
            assert len(set(asked)) == 2 and set(asked) <= set(stored), "queries are distinct stored keys"
            assert labels[ep, row, at].tolist() == [stored[q] for q in asked]


def test_far_recall_filler_rule_holds_and_its_targets_count():
    src = far(filler_rule=True, filler_symbols=7)
    inputs, labels, mask = episodes(src)
    filler = inputs[:, 1:3] - vocab_ranges(src.params)["filler"].start  # [episodes, G, S] 0-based
    pi = torch.as_tensor(filler_rule(src.params))
    assert torch.equal(filler[..., 2:], pi[filler[..., :-2]]), "f_t = pi(f_{t-2}) from the third token on"
    assert sorted(pi.tolist()) == list(range(7))
    test = src.split("test")[:]["tokens"][:, :-1].view(-1, E, S)[:, 1:3] - vocab_ranges(src.params)["filler"].start
    assert torch.equal(test[..., 2:], pi[test[..., :-2]]), "one rule for every split"
    expected = torch.zeros(E, S, dtype=torch.bool)
    expected[1:3, 1:-1] = True  # target t of a filler row is its token t + 1: determined for t + 1 >= 2
    expected[3, [0, 2]] = expected[0, [6, 8]] = True
    assert (mask == expected).all()
    assert torch.equal(labels[:, 1:3, 1:-1], inputs[:, 1:3, 2:])
    # the first two tokens of a filler row are free: the rule is not a fixed sequence
    assert len({tuple(r) for r in filler[:, :, :2].reshape(-1, 2).tolist()}) > 10


def test_far_recall_episodes_are_documents():
    src = far()
    batch = src.collate([src.split("train")[i] for i in range(8)])  # two episodes, in stream order
    # <eos> is the last input of an episode and nowhere else, so the streams carry (xfam.training.lit.module: a row
    # ending in <eos> closes its document) starts a new document exactly at every episode's first token
    eos = batch["input_ids"] == src.eos_id  # [8, S]
    assert eos[3::4, -1].all() and eos.sum() == 2
    assert (batch["segments"] == 0).all(), "no boundary inside a row"
    assert "segments" not in far(doc_mask=False).collate([src.split("train")[0]])
    assert far(doc_mask=False).fingerprint == src.fingerprint, "doc_mask changes collation, not the data"


def test_far_recall_distance_exceeds_the_claim():
    src = far()
    tokens, _ = rows_of(src)
    stream = torch.cat([tokens[:, :-1].reshape(-1), tokens[-1:, -1]])
    gap, p = 2, 3
    claim = src.min_distance()
    assert claim == (gap + 1) * S - 2 * p + 1 and claim > gap * S
    distances = []
    for ep in range(stream.numel() // (E * S)):
        base = ep * E * S
        key_at = {int(stream[base + 2 * i + 1]): base + 2 * i + 1 for i in range(p)}
        for j in range(2):
            q_at = base + (gap + 1) * S + 2 * j
            distances.append(q_at - key_at[int(stream[q_at])])
    assert min(distances) >= claim
    # XL with L layers of memory M reaches t + L*M back from query position t: with L*M below the claim
    # no pair is reachable even through the recurrence (the docstring's argument), e.g. L = 2, M = S
    assert claim > 2 * S


def test_far_recall_streams_hold_whole_episodes():
    src = far(num_train=64, batch_size=2)  # 2 streams of 32 rows = 8 episodes each
    _, mask = rows_of(src)
    sampler = ResumableBatchSampler(64, 2, shuffle=False, streams=True)
    for t, batch in enumerate(sampler):
        for row in batch:
            assert row % E == t % E, "row i of batch t is at episode offset t mod E in every stream"
            assert bool(mask[row].any()) == (t % E in (0, E - 1))  # no filler rule: gap rows never count


def test_far_recall_checks():
    base = {"name": "far_recall", **FAR}
    assert DATA.check(base, {}) == []
    problems = DATA.check({**base, "num_keys": 2, "num_queries": 6, "local_queries": 4, "num_train": 60}, {})
    text = "\n".join(problems)
    assert "num_keys=2 < num_pairs=3" in text and "num_queries=6 > num_pairs=3" in text
    assert "local_queries=4 > num_pairs=3" in text
    assert "take 14 tokens" in text and "Fix: set data.seq_len >= 14" in text
    assert "Fix: set data.seq_len >= 13" in text  # 6 far queries and <eos>
    assert "num_train=60" in text and "data.num_train=64" in text  # 30 rows per stream: not whole episodes


def test_far_recall_reproducible_and_cached():
    a, b = far(), far()
    assert a.fingerprint == b.fingerprint and torch.equal(rows_of(a)[0], rows_of(b)[0])
    c = far(gap_rows=1, num_train=48)
    assert c.fingerprint != a.fingerprint and c.manifest["min_distance"] == 2 * S - 6 + 1
    assert not torch.equal(rows_of(a, "validation")[0], rows_of(a, "test")[0])
