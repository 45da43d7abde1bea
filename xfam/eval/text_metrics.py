"""Corpus-level text metrics for generated sequences: BLEU, chrF and exact match.

BLEU (Papineni et al., "BLEU: a Method for Automatic Evaluation of Machine Translation", ACL 2002) and chrF
(Popović, "chrF: character n-gram F-score for automatic MT evaluation", WMT 2015) are computed with sacreBLEU
(Post, "A Call for Clarity in Reporting BLEU Scores", 2018, arXiv:1804.08771) at its defaults, so the numbers are
comparable with published ones: BLEU with the ``13a`` tokenizer, n-grams up to 4, exponential smoothing and the
brevity penalty over the whole corpus (n-gram counts are summed over sentences, not sentence scores averaged);
chrF with character n-grams up to 6, whitespace removed, beta = 2. Both are on 0..100, as sacreBLEU reports them.
Exact match is the share (0..1) of hypotheses equal to their reference after stripping surrounding whitespace.
"""

from __future__ import annotations

from collections.abc import Sequence

import sacrebleu

from xfam.core.errors import ConfigError


def exact_match(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """The share (0..1) of ``hyps`` equal to their reference, surrounding whitespace ignored."""
    _check(hyps, refs)
    return sum(h.strip() == r.strip() for h, r in zip(hyps, refs)) / len(hyps)


def text_metrics(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    """``{"bleu", "chrf"}`` (corpus-level, 0..100) and ``"exact_match"`` (0..1) of ``hyps`` against one reference
    each. An empty hypothesis scores as no match; an empty corpus is refused."""
    _check(hyps, refs)
    hyps, refs = list(hyps), list(refs)
    return {
        "bleu": float(sacrebleu.corpus_bleu(hyps, [refs]).score),
        "chrf": float(sacrebleu.corpus_chrf(hyps, [refs]).score),
        "exact_match": exact_match(hyps, refs),
    }


def _check(hyps: Sequence[str], refs: Sequence[str]) -> None:
    """One ConfigError for an empty corpus, unequal lengths or a non-string entry."""
    if len(hyps) == 0 or len(hyps) != len(refs):
        raise ConfigError(
            f"text metrics: {len(hyps)} hypotheses and {len(refs)} references (valid: the same number, at least "
            "one). Fix: pass one decoded hypothesis per reference of a non-empty split."
        )
    kinds = sorted({type(s).__name__ for s in (*hyps, *refs) if not isinstance(s, str)})
    if kinds:
        raise ConfigError(
            f"text metrics: hypotheses and references must be strings; got {', '.join(kinds)}. "
            "Fix: decode token ids to text (the tokenizer's decode) before scoring."
        )
