"""``data=far_recall``: associative recall with the pairs several segments before the queries.

Multi-query associative recall (Ba et al., NeurIPS 2016; MQAR, Arora et al. 2023) stretched over
segments, the setting of the Memorizing Transformer (Wu et al., ICLR 2022), where a fact read long
ago must be looked up again: a local window plus a short recurrent memory cannot hold it, an
external store of past (key, value) pairs can.

The split is one token stream of episodes of ``E = gap_rows + 2`` rows of ``S = seq_len`` tokens:

    row 0        v1 k1 ... vP kP  l1 b1 ... lR bR <pad>..   P pairs, value first (keys distinct, values
                                                           with replacement), then R local queries
    rows 1 .. G  f f f ... f                               G = gap_rows rows of filler tokens
    row G + 1    q1 a1 q2 a2 ... qQ aQ <pad>... <eos>      Q far queries; <eos> closes the episode

Queries (local ``l``, far ``q``) are distinct stored keys in random order, each followed by the value
stored with it. A pair is written value first so that, causally, the state at its key can hold its
value (through a previous-token head) and a query can find it by matching its own token: written
``k v``, the key's state cannot see the value that follows, and a value's state must carry its key,
which needs a full induction circuit (see the filler rule).

Rows are consecutive chunks of the stream (``contiguous = True``; see ``xfam.data.periodic``); the
next episode follows. Every episode is one document: with ``doc_mask``
(default) the batch carries document ids, so attention stays inside an episode and every memory is
cleared at episode boundaries, as the Memorizing Transformer clears its store at document boundaries
(the store then never answers a query with a stale pair of an earlier episode).

``target_mask`` is True exactly on the answers: far answers (target t = 0, 2, ..., 2Q-2 of the
query row), local answers (target 2P + 2r of row 0) and, with ``filler_rule``, the filler targets
the rule determines. Chance on answers: ``1 / num_values``.

Filler: uniform random tokens (``filler_rule: false``), or (``filler_rule: true``) a fixed
second-order rule ``f_{t+1} = pi(f_{t-1})`` (pi a random permutation of the filler symbols drawn once
from the seed, the same in every split; the first two tokens of a row are random) whose targets count
from the row's third token on. Why a rule: the loss reaches a layer only through the current segment,
stored states (a memory, a kNN store) are stop-gradient, and recall needs each stored value's state to
carry its value, i.e. a previous-token head below the retrieving layer. With far answers alone nothing
in the current segment rewards such a head and no model learns to recall within a small budget; the
rule's targets need exactly that head (they stand in for the language modelling loss that trains it in
the Memorizing Transformer). Local queries (``local_queries`` R > 0), answerable inside row 0, train the
whole local induction circuit instead (slower to learn). Every model can learn the filler rule and the
local answers: report far answers apart (``scripts/memory_experiments.py recall`` does, by episode row).

Distance: pair i sits at episode offsets 2i (value), 2i+1 (key) and far query j at ``(G+1)*S + 2j``,
so every far query is ``(G+1)*S + 2j - 2i - 1 >= (G+1)*S - 2P + 1`` positions after its key (one more
after its value). Transformer-XL with
memory ``M`` lets a query at segment position t see ``t + M`` positions back in one layer and at
most ``t + L*M`` through L layers of recurrence (the paper's O(N*L) context), so with
``L*M < (G+1)*S - 2P + 1`` no pair is within reach; a Memorizing Transformer store of
``>= (G+1)*S`` positions (one episode, ``E*S``, is plenty) still holds the pairs row at the query row.

Vocabulary: ``<pad>`` 0, ``<eos>`` 1, filler ``2 .. F+1`` (F = ``filler_symbols``), keys
``F+2 .. F+K+1``, values ``F+K+2 .. F+K+V+1``; ``vocab_size = 2 + F + K + V``. No bytes (loss in
nats). Row counts per split must make streams of whole episodes at ``batch_size``
(``xfam.data.periodic.period_problems``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import numpy as np

from xfam.core.registry import Range
from xfam.data.base import DATA
from xfam.data.packing import NUM_KEY, GeneratedSource, masked_lm_features
from xfam.data.periodic import period_problems, split_rng, stream_rows
from xfam.data.tokenize import token_dtype

VERSION = "far-recall-2"
PAD, EOS = 0, 1


def vocab_ranges(p: dict[str, Any]) -> dict[str, range]:
    """Token id ranges of the vocabulary (see the module docstring)."""
    f, k, v = p["filler_symbols"], p["num_keys"], p["num_values"]
    return {
        "pad": range(PAD, PAD + 1),
        "eos": range(EOS, EOS + 1),
        "filler": range(2, 2 + f),
        "keys": range(2 + f, 2 + f + k),
        "values": range(2 + f + k, 2 + f + k + v),
    }


def episode_stream(p: dict[str, Any], rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The stream of ``rows`` rows plus one token (episodes, see the module docstring) and its target mask."""
    s, gap, pairs, queries, local = p["seq_len"], p["gap_rows"], p["num_pairs"], p["num_queries"], p["local_queries"]
    period = gap + 2
    n = -(-rows // period) + 1  # whole episodes, one more: the token after the last row opens the next
    ids = vocab_ranges(p)
    keys = rng.random((n, p["num_keys"])).argsort(axis=1)[:, :pairs] + ids["keys"].start  # [n, P] distinct
    values = rng.integers(0, p["num_values"], size=(n, pairs)) + ids["values"].start  # [n, P]
    which = rng.random((n, pairs)).argsort(axis=1)[:, :queries]  # [n, Q] distinct pair indices
    near = rng.random((n, pairs)).argsort(axis=1)[:, :local]  # [n, R]
    ep = np.full((n, period, s), PAD, dtype=np.int64)  # [n, E, S]
    ep[:, 0, 0 : 2 * pairs : 2], ep[:, 0, 1 : 2 * pairs : 2] = values, keys  # value first (module docstring)
    lq = slice(2 * pairs, 2 * (pairs + local), 2)  # local queries, then their answers one to the right
    la = slice(2 * pairs + 1, 2 * (pairs + local), 2)
    ep[:, 0, lq], ep[:, 0, la] = np.take_along_axis(keys, near, axis=1), np.take_along_axis(values, near, axis=1)
    ep[:, 1 : 1 + gap] = filler_rows(p, (n, gap), rng) + ids["filler"].start
    ep[:, gap + 1, 0 : 2 * queries : 2] = np.take_along_axis(keys, which, axis=1)
    ep[:, gap + 1, 1 : 2 * queries : 2] = np.take_along_axis(values, which, axis=1)
    ep[:, gap + 1, s - 1] = EOS
    answer = np.zeros((period, s), dtype=bool)  # per episode position: an answer (a target that counts)
    answer[gap + 1, 1 : 2 * queries : 2] = True
    answer[0, la] = True
    if p["filler_rule"]:
        answer[1 : 1 + gap, 2:] = True  # f_t for t >= 2 is pi(f_{t-2})
    stream = ep.reshape(-1)[: rows * s + 1]  # [rows * S + 1]
    mask = np.broadcast_to(answer, (n, period, s)).reshape(-1)[: rows * s + 1]
    return stream, mask


def filler_rule(p: dict[str, Any]) -> np.ndarray:
    """The permutation pi of the filler rule ``f_{t+1} = pi(f_{t-1})`` (filler indices, 0-based): one per seed."""
    return np.random.default_rng([p["seed"], 7919]).permutation(p["filler_symbols"])


def filler_rows(p: dict[str, Any], shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """``[*shape, S]`` filler indices (0-based): uniform, or following the rule after two random tokens."""
    s, f = p["seq_len"], p["filler_symbols"]
    rows = rng.integers(0, f, size=(*shape, s))
    if p["filler_rule"]:
        pi = filler_rule(p)
        for t in range(2, s):
            rows[..., t] = pi[rows[..., t - 2]]
    return rows


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    rows = params[NUM_KEY[split]]
    stream, mask = episode_stream(params, rows, split_rng(params, split))
    yield from stream_rows(stream, mask, params["seq_len"], rows)


@DATA.register("far_recall")
class FarRecall(GeneratedSource):
    """Associative recall across ``gap_rows`` segments of filler (for memory beyond the local window).

    Args:
        num_pairs: key-value pairs per episode (``2 * num_pairs <= seq_len``).
        num_queries: far queries per episode (distinct stored keys, ``<= num_pairs``), in the last row.
        local_queries: queries in the pairs row itself, after the pairs (``<= num_pairs``;
            ``2 * (num_pairs + local_queries) <= seq_len``): they train the recall circuit.
        num_keys / num_values: sizes of the key and value vocabularies (``num_keys >= num_pairs``).
        filler_symbols: size of the filler vocabulary of the gap rows.
        filler_rule: filler follows ``f_{t+1} = pi(f_{t-1})`` and its determined targets count (trains
            the previous-token head recall needs); false: uniform filler that never counts.
        gap_rows: filler rows between the pairs row and the query row (G; an episode is G + 2 rows).
        seq_len: tokens per row (segment).
        doc_mask: each episode is a document: attention stays inside it and memory is cleared at
            its end (collation only: the tokens are the same either way).
        num_train / num_val / num_test: rows per split (an episode is ``gap_rows + 2`` rows); with
            streams each split makes ``batch_size`` streams of whole episodes.
        batch_size: rows per batch.
        seed: data seed.
    """

    task = "lm"
    paper = "Ba et al., 2016; Arora et al., 2023 (MQAR); the setting of Wu et al., ICLR 2022"
    contiguous = True

    def __init__(
        self,
        *,
        num_pairs: Annotated[int, Range(ge=1)] = 8,
        num_queries: Annotated[int, Range(ge=1)] = 8,
        local_queries: Annotated[int, Range(ge=0)] = 8,
        num_keys: Annotated[int, Range(ge=1)] = 16,
        num_values: Annotated[int, Range(ge=1)] = 16,
        filler_symbols: Annotated[int, Range(ge=1)] = 32,
        filler_rule: bool = True,
        gap_rows: Annotated[int, Range(ge=0)] = 2,
        seq_len: Annotated[int, Range(ge=2)] = 32,
        doc_mask: bool = True,
        num_train: Annotated[int, Range(ge=1)] = 16384,
        num_val: Annotated[int, Range(ge=1)] = 1024,
        num_test: Annotated[int, Range(ge=1)] = 1024,
        batch_size: Annotated[int, Range(ge=1)] = 16,
        seed: int = 0,
    ):
        self.keep_params(locals(), exclude=("doc_mask",))
        self.vocab_size = 2 + filler_symbols + num_keys + num_values
        self.pad_id, self.eos_id, self.doc_mask = PAD, EOS, doc_mask

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        problems, p = [], params
        if p["num_keys"] < p["num_pairs"]:
            problems.append(
                f"num_keys={p['num_keys']} < num_pairs={p['num_pairs']}: the keys of an episode are distinct. "
                f"Fix: set data.num_keys >= {p['num_pairs']}."
            )
        if p["num_queries"] > p["num_pairs"]:
            problems.append(
                f"num_queries={p['num_queries']} > num_pairs={p['num_pairs']}: each query is a distinct stored "
                f"key. Fix: set data.num_queries <= {p['num_pairs']}."
            )
        if p["local_queries"] > p["num_pairs"]:
            problems.append(
                f"local_queries={p['local_queries']} > num_pairs={p['num_pairs']}: each query is a distinct "
                f"stored key. Fix: set data.local_queries <= {p['num_pairs']}."
            )
        need = 2 * (p["num_pairs"] + p["local_queries"])
        if need > p["seq_len"]:
            problems.append(
                f"num_pairs={p['num_pairs']} pairs and local_queries={p['local_queries']} queries take {need} "
                f"tokens, more than one row of seq_len={p['seq_len']}. Fix: set data.seq_len >= {need}."
            )
        if 2 * p["num_queries"] + 1 > p["seq_len"]:
            problems.append(
                f"num_queries={p['num_queries']} queries and the closing <eos> take {2 * p['num_queries'] + 1} "
                f"tokens, more than one row of seq_len={p['seq_len']}. Fix: set data.seq_len >= "
                f"{2 * p['num_queries'] + 1}."
            )
        problems += period_problems(p, p["gap_rows"] + 2, "episode")
        return problems

    def min_distance(self) -> int:
        """Fewest positions between a key and the query that asks for it: ``(G+1)*S - 2P + 1``."""
        p = self.params
        return (p["gap_rows"] + 1) * p["seq_len"] - 2 * p["num_pairs"] + 1

    def prepare(self) -> None:
        features = masked_lm_features(self.seq_len, token_dtype(self.vocab_size))
        self.generate(_rows, {"version": VERSION, **self.params}, features)
        counts = {name: len(ds) for name, ds in self._splits.items()}
        ranges = {k: [r.start, r.stop - 1] for k, r in vocab_ranges(self.params).items()}
        self.manifest = {"source": "far_recall", "generator": VERSION, **self.params, "rows": counts}
        self.manifest.update(vocab=ranges, min_distance=self.min_distance(), fingerprint=self.fingerprint)
