"""Beam search, greedy search and sampling (xfam/eval/beam.py) on toy decoders whose next-token distribution is a
fixed random function of the whole prefix: beam search with a beam wide enough to keep every prefix equals an
exhaustive search over all sequences; the state's rows follow their beams; early stopping with the exact bound
never changes the result; finished hypotheses are not extended; beam_size=1 is greedy search."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.eval.beam import beam_search, gnmt_length_penalty, greedy_search, sample_search

EOS, BOS, PAD = 0, 99, -1


class PrefixDecoder:
    """A decoder whose logits for input ``x`` after tokens ``y_1..y_n`` are a fixed random vector of ``(x, y)``
    (or ``table[(x, y)]`` where given). The state is the history ``[rows, 1 + fed]``: the input id, then every
    token fed, so a row reordered wrongly reads the logits of another prefix."""

    def __init__(self, vocab: int, seed: int = 0, table: dict | None = None, eos_bias: float = 0.0):
        self.vocab, self.seed, self.table, self.eos_bias = vocab, seed, table or {}, eos_bias
        self.reorders: list[Tensor] = []
        self.steps = 0
        self.fed_after_eos = False

    def start(self, batch: int) -> Tensor:
        return torch.arange(batch)[:, None]  # [B, 1] the input ids

    def logits_of(self, x: int, prefix: tuple[int, ...]) -> Tensor:
        key = (x, prefix)
        if key not in self.table:
            g = torch.Generator().manual_seed(hash((self.seed, *key)) % 2**31)
            logits = torch.randn(self.vocab, generator=g, dtype=torch.float64) * 2
            logits[EOS] += self.eos_bias
            self.table[key] = logits
        return self.table[key]

    def log_prob(self, x: int, seq: tuple[int, ...]) -> float:
        return sum(float(self.logits_of(x, seq[:i]).log_softmax(-1)[t]) for i, t in enumerate(seq))

    def step(self, last: Tensor, hist: Tensor) -> tuple[Tensor, Tensor]:
        self.steps += 1
        hist = torch.cat((hist, last[:, None]), dim=1)  # [N, 1 + fed]
        rows = [(int(h[0]), tuple(h[2:].tolist())) for h in hist]  # h[1] is BOS
        self.fed_after_eos |= any(EOS in prefix for _, prefix in rows)
        return torch.stack([self.logits_of(x, prefix) for x, prefix in rows]), hist

    def reorder(self, hist: Tensor, index: Tensor) -> Tensor:
        self.reorders.append(index.clone())
        return hist[index]


def exhaustive(dec: PrefixDecoder, x: int, max_len: int, alpha: float) -> tuple[list[int], float]:
    """The best sequence of input ``x`` over every sequence ending at its first EOS or at ``max_len`` tokens."""
    words = range(1, dec.vocab)  # every non-EOS token
    seqs = [(*p, EOS) for n in range(max_len) for p in itertools.product(words, repeat=n)]
    seqs += list(itertools.product(words, repeat=max_len))
    scored = [(dec.log_prob(x, s) / gnmt_length_penalty(len(s), alpha), s) for s in seqs]
    best, seq = max(scored)
    return list(seq), best


def search(dec: PrefixDecoder, batch: int, **options):
    options = {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD, "batch_size": batch, **options}
    return beam_search(dec.step, dec.start(batch), reorder=dec.reorder, **options)


def unpad(row: Tensor) -> list[int]:
    return [t for t in row.tolist() if t != PAD]


def test_gnmt_length_penalty_is_the_paper_formula() -> None:
    assert gnmt_length_penalty(1, 0.7) == pytest.approx(1.0)  # lp(1) = 1 for every alpha
    assert gnmt_length_penalty(7, 1.0) == pytest.approx(2.0)
    assert gnmt_length_penalty(13, 0.5) == pytest.approx(math.sqrt(3))
    assert gnmt_length_penalty(30, 0.0) == pytest.approx(1.0)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, -0.5])
def test_a_wide_beam_equals_exhaustive_search(alpha: float) -> None:
    vocab, max_len, batch = 4, 4, 3
    dec = PrefixDecoder(vocab, seed=1, eos_bias=-0.5)
    wide = (vocab - 1) ** (max_len - 1) * vocab  # every extension of every live prefix is a candidate
    out = search(dec, batch, beam_size=wide, max_len=max_len, length_penalty=alpha)
    for x in range(batch):
        seq, best = exhaustive(dec, x, max_len, alpha)
        assert unpad(out.tokens[x]) == seq
        assert float(out.scores[x]) == pytest.approx(best, rel=1e-6)
    assert out.tokens.shape[1] == max(len(unpad(r)) for r in out.tokens)  # padded to the longest only


def test_reorder_gets_the_expansion_then_each_survivors_parent_beam() -> None:
    dec = PrefixDecoder(6, seed=2)
    out = search(dec, 2, beam_size=3, max_len=5, length_penalty=0.0, early_stopping=False)
    assert dec.reorders[0].tolist() == [0, 0, 0, 1, 1, 1]  # B rows -> B * K rows
    assert dec.reorders[1].tolist() == [0, 0, 0, 3, 3, 3]  # first step: only beam 0 of each input is live
    for index in dec.reorders[1:]:
        assert (index // 3).tolist() == [0, 0, 0, 1, 1, 1]  # a beam never moves to another input
    assert len(dec.reorders) == 1 + 4  # no reorder after the last step
    # The toy's logits depend on the whole history in the state: had a row not followed its beam, the score
    # summed along the way would not be the log P of the returned tokens.
    for x in range(2):
        assert float(out.scores[x]) == pytest.approx(dec.log_prob(x, tuple(unpad(out.tokens[x]))), rel=1e-9)
    assert dec.steps == 5


def test_beams_are_distinct() -> None:
    dec = PrefixDecoder(8, seed=3)
    seen: list[Tensor] = []
    step = dec.step

    def spy(last: Tensor, hist: Tensor):
        logits, hist = step(last, hist)
        if hist.shape[1] > 2:  # after the first step: the K live prefixes of each input differ
            for x in range(2):
                rows = {tuple(r) for r in hist[x * 4 : (x + 1) * 4, 2:].tolist()}
                seen.append(torch.tensor(len(rows)))
        return logits, hist

    beam_search(spy, dec.start(2), reorder=dec.reorder, batch_size=2, bos_id=BOS, eos_id=EOS, beam_size=4, max_len=4)
    assert seen and all(int(n) == 4 for n in seen)


def test_length_penalty_decides_between_a_short_and_a_long_hypothesis() -> None:
    # Tokens: 0 = EOS, 1 = a, 2 = b. P(EOS) = 0.4, P(a) = 0.6; after a: P(EOS) = 0.6.
    # alpha = 0: EOS scores log 0.4 = -0.916 > a EOS: log 0.36 = -1.022.
    # alpha = 1: lp(1) = 1, lp(2) = 7/6: a EOS scores -1.022 / (7/6) = -0.876 > -0.916.
    table = {
        (0, ()): torch.tensor([0.4, 0.6, 1e-9], dtype=torch.float64).log(),
        (0, (1,)): torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64).log(),
        (0, (2,)): torch.tensor([1.0, 1e-9, 1e-9], dtype=torch.float64).log(),
    }
    dec = PrefixDecoder(3, table=table)
    short = search(dec, 1, beam_size=2, max_len=2, length_penalty=0.0)
    assert unpad(short.tokens[0]) == [EOS] and float(short.scores[0]) == pytest.approx(math.log(0.4), rel=1e-6)
    long = search(dec, 1, beam_size=2, max_len=2, length_penalty=1.0)
    assert unpad(long.tokens[0]) == [1, EOS] and float(long.scores[0]) == pytest.approx(math.log(0.36) * 6 / 7)


def test_the_exact_bound_keeps_searching_where_the_heuristic_would_stop() -> None:
    # K = 1. Step 1: EOS (0.5) finishes with score log 0.5 = -0.693; the live beam "a" has log P = log 0.45.
    # Hugging Face's bound log 0.45 / lp(1) = -0.799 < -0.693 would stop here; the exact bound with
    # max_len = 4, alpha = 1 is log 0.45 / lp(4) = -0.532, so the search goes on and finds "a a a a"
    # (log(0.45 * 0.99^3) / 1.5 = -0.552 > -0.693).
    p = {(): [0.5, 0.45, 0.05]} | {(1,) * n: [0.005, 0.99, 0.005] for n in (1, 2, 3)}
    table = {(0, k): torch.tensor(v, dtype=torch.float64).log() for k, v in p.items()}
    dec = PrefixDecoder(3, table=table)  # prefixes not listed: random, unreachable by the best path
    out = search(dec, 1, beam_size=1, max_len=4, length_penalty=1.0)
    assert unpad(out.tokens[0]) == [1, 1, 1, 1]
    assert float(out.scores[0]) == pytest.approx(math.log(0.45 * 0.99**3) / 1.5)


@pytest.mark.parametrize("alpha", [-4.0, -0.5, 0.0, 0.5, 1.0, 2.0])
def test_early_stopping_never_changes_the_result(alpha: float) -> None:
    # Seed 11 at alpha = -4 is a case where bounding by s / lp(max_len) alone (right for alpha > 0) stops too soon.
    stopped_early = False
    for seed in range(8, 16):
        results = []
        for early in (True, False):
            dec = PrefixDecoder(5, seed=seed, eos_bias=3.0)
            results.append(search(dec, 3, beam_size=3, max_len=7, length_penalty=alpha, early_stopping=early))
            stopped_early |= early and dec.steps < 7
        assert torch.equal(results[0].tokens, results[1].tokens)
        assert torch.equal(results[0].scores, results[1].scores)
    if alpha <= 0:  # nothing to gain from length: every row stops once its K hypotheses are in
        assert stopped_early


def test_finished_hypotheses_are_not_extended() -> None:
    dec = PrefixDecoder(6, seed=4, eos_bias=1.0)
    out = search(dec, 4, beam_size=3, max_len=6, length_penalty=0.5, early_stopping=False)
    assert not dec.fed_after_eos  # no row of the state ever held a hypothesis past its EOS
    for row in out.tokens.tolist():
        if EOS in row:  # everything after the first EOS is padding
            assert all(t == PAD for t in row[row.index(EOS) + 1 :])
        assert PAD not in row[: len(unpad(torch.tensor(row)))]


def test_beam_size_one_is_greedy_search() -> None:
    dec = PrefixDecoder(5, seed=5)
    beam = search(dec, 4, beam_size=1, max_len=6, length_penalty=0.0)
    greedy = greedy_search(dec.step, dec.start(4), batch_size=4, bos_id=BOS, eos_id=EOS, max_len=6, pad_id=PAD)
    assert torch.equal(beam.tokens, greedy.tokens)
    assert torch.allclose(beam.scores, greedy.scores)
    for x in range(4):  # greedy by hand
        seq: tuple[int, ...] = ()
        while len(seq) < 6 and EOS not in seq:
            seq += (int(dec.logits_of(x, seq).argmax()),)
        assert unpad(greedy.tokens[x]) == list(seq)
        assert float(greedy.scores[x]) == pytest.approx(dec.log_prob(x, seq))


class FixedDecoder:
    """Every row, every step: the same logits."""

    def __init__(self, logits: list[float]):
        self.logits = torch.tensor(logits)

    def step(self, last: Tensor, state: None) -> tuple[Tensor, None]:
        return self.logits.expand(len(last), -1), state


def test_sampling_follows_the_tempered_softmax() -> None:
    logits = [0.0, 1.0, -0.5]
    n, temperature = 20000, 0.7
    out = sample_search(
        FixedDecoder(logits).step, None, batch_size=n, bos_id=BOS, eos_id=EOS, max_len=1,
        temperature=temperature, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    freq = torch.bincount(out.tokens[:, 0], minlength=3).double() / n
    expected = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, -1)
    assert torch.allclose(freq, expected, atol=0.015)  # 4+ standard errors at n = 20000 (seeded)
    model_logp = torch.log_softmax(torch.tensor(logits), -1)
    assert torch.allclose(out.scores, model_logp[out.tokens[:, 0]])  # the model's, not the tempered, log P


def test_sampling_with_top_k_one_is_greedy_and_a_generator_makes_it_reproducible() -> None:
    dec = PrefixDecoder(7, seed=6)
    options = {"batch_size": 3, "bos_id": BOS, "eos_id": EOS, "max_len": 6, "pad_id": PAD}
    greedy = greedy_search(dec.step, dec.start(3), **options)
    top1 = sample_search(dec.step, dec.start(3), top_k=1, generator=torch.Generator().manual_seed(1), **options)
    assert torch.equal(top1.tokens, greedy.tokens) and torch.allclose(top1.scores, greedy.scores)
    a, b = (
        sample_search(dec.step, dec.start(3), top_p=0.9, generator=torch.Generator().manual_seed(2), **options)
        for _ in range(2)
    )
    assert torch.equal(a.tokens, b.tokens)
    for x in range(3):  # each sample's score is its log P under the model
        assert float(a.scores[x]) == pytest.approx(dec.log_prob(x, tuple(unpad(a.tokens[x]))))


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda d: search(d, 2, beam_size=0, max_len=3), "beam_size=0"),
        (lambda d: search(d, 2, beam_size=2, max_len=0), "max_len=0"),
        (lambda d: search(d, 2, beam_size=2, max_len=3, eos_id=9), "eos_id=9"),
        (lambda d: sample_search(d.step, d.start(2), batch_size=2, bos_id=0, eos_id=0, max_len=2, top_p=0), "top_p"),
        (lambda d: sample_search(d.step, None, batch_size=2, bos_id=0, eos_id=0, max_len=2, temperature=-1), "temp"),
    ],
)
def test_bad_options_are_one_clear_error(call, needle: str) -> None:
    with pytest.raises(ConfigError, match="Fix:") as err:
        call(PrefixDecoder(4))
    assert needle in str(err.value)
