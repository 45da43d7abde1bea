"""Text metrics (xfam/eval/text_metrics.py): BLEU against hand-computed values (Papineni et al., 2002), chrF against
a direct implementation of its definition (Popović, 2015), exact match, empty hypotheses and bad input."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from xfam.core.errors import ConfigError
from xfam.eval.text_metrics import exact_match, text_metrics

HYP = "the cat sat on the mat"
REF = "the cat sat on the red mat"


def test_an_identical_corpus_scores_100_and_matches_exactly() -> None:
    refs = ["the cat sat on the mat .", "a quick brown fox jumps over it", "hello world , again"]
    assert text_metrics(refs, refs) == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0), "exact_match": 1.0}


def test_bleu_by_hand() -> None:
    # Clipped n-gram precisions of HYP against REF: 6/6, 4/5, 3/4, 2/3; brevity penalty exp(1 - 7/6).
    expected = math.exp(1 - 7 / 6) * (1 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25 * 100
    assert text_metrics([HYP], [REF])["bleu"] == pytest.approx(expected, abs=1e-9)


def test_bleu_pools_counts_over_the_corpus() -> None:
    # With "a b c d" matched exactly the pooled precisions are 10/10, 7/8, 5/6, 3/4 and the lengths 10 vs 11;
    # the mean of the two sentence BLEUs would be different.
    expected = math.exp(1 - 11 / 10) * (1 * 7 / 8 * 5 / 6 * 3 / 4) ** 0.25 * 100
    bleu = text_metrics([HYP, "a b c d"], [REF, "a b c d"])["bleu"]
    assert bleu == pytest.approx(expected, abs=1e-9)
    sentence_mean = (math.exp(1 - 7 / 6) * 0.4**0.25 * 100 + 100) / 2
    assert abs(bleu - sentence_mean) > 1


def _chrf(hyps: list[str], refs: list[str], order: int = 6, beta: float = 2.0) -> float:
    """chrF from its definition: character n-grams (whitespace removed) of orders 1..6, counts pooled over the
    corpus (a hypothesis's n-grams of an order its reference lacks are not counted, as in sacreBLEU), precision and
    recall averaged over the orders both sides have, then the F-beta score (x 100)."""
    stats = [[0, 0, 0] for _ in range(order)]  # hyp n-grams, ref n-grams, matches per order
    for hyp, ref in zip(hyps, refs):
        h, r = "".join(hyp.split()), "".join(ref.split())
        for n in range(1, order + 1):
            hc = Counter(h[i : i + n] for i in range(len(h) - n + 1))
            rc = Counter(r[i : i + n] for i in range(len(r) - n + 1))
            stats[n - 1][0] += sum(hc.values()) if rc else 0  # sacreBLEU: no reference n-gram, none counted
            stats[n - 1][1] += sum(rc.values())
            stats[n - 1][2] += sum((hc & rc).values())
    pairs = [(m / nh, m / nr) for nh, nr, m in stats if nh and nr]
    p, r = sum(p for p, _ in pairs) / len(pairs), sum(r for _, r in pairs) / len(pairs)
    return 100 * (1 + beta**2) * p * r / (beta**2 * p + r) if p + r else 0.0


def test_chrf_follows_its_definition() -> None:
    hyps, refs = [HYP, "colour", "ab"], [REF, "color", "abcdefgh"]  # the last has no 3..6-gram: fewer orders
    assert text_metrics(hyps, refs)["chrf"] == pytest.approx(_chrf(hyps, refs), abs=1e-9)
    assert text_metrics([HYP], [REF])["chrf"] == pytest.approx(_chrf([HYP], [REF]), abs=1e-9)


def test_empty_hypotheses_score_as_no_match() -> None:
    some = text_metrics(["", HYP], ["a b c", REF])
    assert all(math.isfinite(v) for v in some.values()) and 0 < some["bleu"] < 100 and some["exact_match"] == 0
    assert text_metrics(["", ""], ["a b c", "d e"]) == {"bleu": 0.0, "chrf": 0.0, "exact_match": 0.0}
    assert text_metrics([""], [""])["exact_match"] == 1.0


def test_exact_match_ignores_only_surrounding_whitespace() -> None:
    assert exact_match([" a b \n", "a  b", "A b"], ["a b", "a b", "a b"]) == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("hyps", "refs", "needle"),
    [([], [], "0 hypotheses"), (["a"], ["a", "b"], "1 hypotheses and 2 references"), ([[1, 2]], ["a"], "list")],
)
def test_bad_input_is_one_clear_error(hyps, refs, needle: str) -> None:
    with pytest.raises(ConfigError, match="Fix:") as err:
        text_metrics(hyps, refs)
    assert needle in str(err.value)
