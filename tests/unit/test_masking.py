"""BERT / SpanBERT masking: selected share, 80/10/10, specials and padding, labels, span lengths, determinism."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from xfam.core.errors import ConfigError
from xfam.data.base import collate_lm
from xfam.data.masking import (
    IGNORE,
    MaskingCollate,
    batch_seed,
    draw_spans,
    mask_tokens,
    replacement_ids,
    span_length_pmf,
)

VOCAB, MASK, PAD, CLS, SEP = 50, 50, 0, 1, 2
SPECIAL = (PAD, CLS, SEP)


def batch(b: int = 32, s: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[CLS, x.., SEP, x.., SEP, PAD..]`` with random lengths; returns ``(ids [B, S], key_padding [B, S])``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    lengths = torch.randint(s // 4, s + 1, (b,), generator=g)
    ids[:, 0] = CLS
    ids[torch.arange(b), lengths // 2] = SEP
    ids[torch.arange(b), lengths - 1] = SEP
    real = torch.arange(s)[None, :] < lengths[:, None]
    ids[~real] = PAD
    return ids, real


def real_tokens(ids: torch.Tensor, key_padding: torch.Tensor) -> torch.Tensor:
    return key_padding & ~torch.isin(ids, torch.tensor(SPECIAL))


def draw(ids, key_padding, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    return mask_tokens(
        ids, mask_id=MASK, vocab_size=VOCAB, special_ids=SPECIAL, key_padding=key_padding, generator=g, **kw
    )


@pytest.mark.parametrize("span", [False, True])
def test_exact_budget_labels_and_untouched_tokens(span):
    """Each row selects max(1, round(0.15 n)) of its n real tokens; labels are the originals there, -100
    elsewhere; specials and padding are never selected; unselected tokens are unchanged."""
    ids, kp = batch()
    real = real_tokens(ids, kp)
    for seed in range(5):
        inputs, labels = draw(ids, kp, seed, span=span)
        selected = labels != IGNORE
        n = real.sum(1)
        assert selected.sum(1).tolist() == [max(1, round(0.15 * int(k))) for k in n]
        assert not (selected & ~real).any()
        assert torch.equal(labels[selected], ids[selected])
        assert torch.equal(inputs[~selected], ids[~selected])
        assert ((inputs >= 0) & ((inputs < VOCAB) | (inputs == MASK))).all()


def binomial_ok(k: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(k - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


def test_80_10_10_split_over_many_draws():
    """Selected tokens: 80% [MASK], 10% a random id (which equals the original with chance 1/|pool|), 10%
    unchanged; random ids come uniformly from the non-special ids below vocab_size."""
    ids, kp = batch(64, 128)
    pool = replacement_ids(VOCAB, MASK, SPECIAL)
    masked = random_ = same = total = 0
    picked = torch.zeros(VOCAB + 1, dtype=torch.long)
    for seed in range(10):
        inputs, labels = draw(ids, kp, seed)
        sel = labels != IGNORE
        x, orig = inputs[sel], labels[sel]
        total += int(sel.sum())
        masked += int((x == MASK).sum())
        changed = (x != MASK) & (x != orig)
        random_ += int(changed.sum())
        same += int((x == orig).sum())
        picked += torch.bincount(x[changed], minlength=VOCAB + 1)
    p_same_random = 0.1 / len(pool)
    assert binomial_ok(masked, total, 0.8)
    assert binomial_ok(random_, total, 0.1 - p_same_random)
    assert binomial_ok(same, total, 0.1 + p_same_random)
    assert picked[list(SPECIAL) + [MASK]].sum() == 0  # never a special id or the mask id
    counts = picked[pool]
    expected = counts.sum() / len(pool)
    assert (counts > 0).all() and (counts - expected).abs().max() < 6 * expected.sqrt() + 1  # uniform over the pool


def runs(labels: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every maximal run of selected positions."""
    out = []
    for b, row in enumerate((labels != IGNORE).tolist()):
        i = 0
        while i < len(row):
            if row[i]:
                j = i
                while j < len(row) and row[j]:
                    j += 1
                out.append((b, i, j))
                i = j
            else:
                i += 1
    return out


def test_span_decisions_are_80_10_10_per_span():
    """SpanBERT: one decision per span. Each run is wholly [MASK] (80% of runs), wholly unchanged (10%) or
    replaced token by token with random ids (10%; such a run equals the original only by chance)."""
    ids = torch.randint(3, VOCAB, (32, 256))
    masked = changed = kept = total = 0
    for seed in range(12):
        inputs, labels = draw(ids, None, seed, span=True)
        for b, i, j in runs(labels):
            x, orig = inputs[b, i:j], ids[b, i:j]
            is_mask = (x == MASK).tolist()
            assert all(is_mask) or not any(is_mask)
            total += 1
            masked += all(is_mask)
            changed += not any(is_mask) and not torch.equal(x, orig)
            kept += torch.equal(x, orig)
    bias = 0.1 / (VOCAB - 4)  # a one-token random run that drew its own id looks kept
    assert binomial_ok(masked, total, 0.8)
    assert binomial_ok(changed, total, 0.1) and binomial_ok(kept, total, 0.1 + bias)


def test_selection_is_uniform_over_positions():
    """Every real position is selected with the same chance (a sort that favoured early positions would fail)."""
    s, b = 40, 64
    ids = torch.randint(3, VOCAB, (b, s))
    hits = torch.zeros(s)
    for seed in range(25):
        _, labels = draw(ids, None, seed)
        hits += (labels != IGNORE).sum(0)
    n = 25 * b  # draws per position; each selected with p = 6 / 40
    p = round(0.15 * s) / s
    assert all(binomial_ok(int(h), n, p) for h in hits)


def test_span_length_distribution_is_spanbert():
    """Geometric(0.2) on 1..10, renormalised: mean 3.8 as SpanBERT states; drawn lengths follow it."""
    pmf = span_length_pmf()
    assert abs(float((pmf * torch.arange(1, 11)).sum()) - 3.8) < 0.01
    g = torch.Generator().manual_seed(0)
    lengths = []
    for _ in range(40):
        _, drawn = draw_spans(2000, 300, g)
        lengths += drawn[:-1]  # the last span may have been cut at the budget: its drawn length still counts
    counts = torch.bincount(torch.tensor(lengths), minlength=11)[1:].double()
    expected = pmf * counts.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9  # chi-square, 9 degrees of freedom, p = 0.001
    assert max(lengths) <= 10


def test_spans_are_contiguous_runs():
    """Span masking selects runs (mean run length > 3), token masking single tokens (mean run ~1.2)."""
    ids = torch.randint(3, VOCAB, (16, 400))

    _, labels = draw(ids, None, 0, span=True)
    found = runs(labels)
    assert sum(j - i for _, i, j in found) / len(found) > 3
    _, token_labels = draw(ids, None, 0)
    token_runs = runs(token_labels)
    assert sum(j - i for _, i, j in token_runs) / len(token_runs) < 1.5


def test_rows_without_real_tokens_and_bad_fractions():
    ids = torch.tensor([[CLS, SEP, PAD, PAD], [CLS, 7, 8, SEP]])
    inputs, labels = draw(ids, None, 0)
    assert (labels[0] == IGNORE).all() and torch.equal(inputs[0], ids[0])
    assert (labels[1] != IGNORE).sum() == 1
    with pytest.raises(ConfigError, match="mask_frac"):
        draw(ids, None, 0, mask_frac=0.95, random_frac=0.1)
    with pytest.raises(ConfigError, match="rate"):
        draw(ids, None, 0, rate=0.0)
    with pytest.raises(ConfigError, match="random replacement"):
        mask_tokens(ids, mask_id=3, vocab_size=3, special_ids=SPECIAL)


def lm_rows(n: int = 8, s: int = 33, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(3, VOCAB, (s,), generator=g)} for _ in range(n)]


def make_collate(**kw) -> MaskingCollate:
    return MaskingCollate(collate_lm, **{"mask_id": MASK, "vocab_size": VOCAB, "special_ids": SPECIAL, "seed": 1, **kw})


def test_collate_turns_an_lm_batch_into_mlm_and_keeps_other_keys():
    rows = lm_rows()
    rows[0]["tokens"][5] = SEP  # a document boundary: special, and collate_lm(boundary) makes segments
    collate = MaskingCollate(
        lambda r: collate_lm(r, boundary=SEP), mask_id=MASK, vocab_size=VOCAB, special_ids=SPECIAL, seed=1
    )
    plain = collate_lm(rows, boundary=SEP)
    out = collate(rows)
    assert torch.equal(out["segments"], plain["segments"])
    sel = out["labels"] != IGNORE
    assert torch.equal(out["labels"][sel], plain["input_ids"][sel])  # originals, not the lm's next tokens
    assert not sel[0, 5] and sel.sum(1).tolist() == [max(1, round(0.15 * n)) for n in [31] + [32] * 7]


def test_collate_masks_are_a_function_of_seed_epoch_and_ids():
    """Same (seed, epoch, ids): same masks, also after pickling (a DataLoader worker's copy) and whatever
    happened before; another epoch or seed: other masks."""
    rows = lm_rows()
    a = make_collate()
    first = a(rows)
    a(lm_rows(seed=5))  # another batch in between changes nothing
    again = a(rows)
    copy = pickle.loads(pickle.dumps(a))
    for out in (again, copy(rows)):
        assert all(torch.equal(first[k], out[k]) for k in first)
    a.set_epoch(1)
    assert not torch.equal(a(rows)["input_ids"], first["input_ids"])
    assert not torch.equal(make_collate(seed=2)(rows)["input_ids"], first["input_ids"])
    b = make_collate()
    b.set_epoch(1)
    assert torch.equal(b(rows)["labels"], a(rows)["labels"])  # a resumed run in epoch 1 draws epoch 1's masks
    ids = first["labels"].clone()
    assert batch_seed(1, 0, ids) != batch_seed(1, 0, ids.flip(0))


def test_collate_respects_key_padding():
    """A padded classification-style batch: padding is never selected."""
    from xfam.data.base import collate_classify

    rows = [{"input_ids": torch.randint(3, VOCAB, (n,)), "label": torch.tensor(0)} for n in (10, 30, 20)]
    collate = MaskingCollate(
        lambda r: collate_classify(r, PAD), mask_id=MASK, vocab_size=VOCAB, special_ids=(CLS, SEP), seed=0
    )
    out = collate(rows)
    assert not ((out["labels"] != IGNORE) & ~out["key_padding"]).any()
    assert torch.equal(out["label"], torch.zeros(3, dtype=torch.long))
