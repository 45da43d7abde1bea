"""``data=assoc_recall``: multi-query associative recall.

Associative recall (Ba et al., NeurIPS 2016, "Using Fast Weights to Attend to the Recent Past"):
after a list of key-value pairs, a query key must be answered with its value. The multi-query
form (MQAR, Arora et al. 2023, "Zoology") asks several queries per sequence, which is what
separates attention from fixed-size recurrent state.

Rows (lm): ``tokens`` ``[S + 1]`` = ``k1 v1 ... kP vP  q1 a1 ... qQ aQ  <pad>...`` where the P keys
are distinct, values are drawn with replacement, the Q queries are distinct stored keys in random
order and each answer ``a_j`` is the value stored with ``q_j``. ``target_mask`` ``[S]`` is True
exactly on the targets that are answers (target t is ``tokens[t + 1]``). Vocabulary: ``<pad>`` 0,
keys ``1..num_keys``, values ``num_keys + 1 .. num_keys + num_values``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import numpy as np

from xfam.core.registry import Range
from xfam.data.base import DATA
from xfam.data.packing import NUM_KEY, SPLITS, GeneratedSource, masked_lm_features
from xfam.data.tokenize import token_dtype

VERSION = "mqar-1"
PAD = 0


def recall_rows(p: dict[str, Any], num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` ``[num, seq_len + 1]`` and ``target_mask`` ``[num, seq_len]`` of ``num`` examples."""
    pairs, queries, seq_len = p["num_pairs"], p["num_queries"], p["seq_len"]
    keys = rng.random((num, p["num_keys"])).argsort(axis=1)[:, :pairs] + 1  # [num, P], distinct per row
    values = rng.integers(0, p["num_values"], size=(num, pairs)) + p["num_keys"] + 1  # [num, P]
    which = rng.random((num, pairs)).argsort(axis=1)[:, :queries]  # [num, Q] distinct pair indices
    asked = np.take_along_axis(keys, which, axis=1)
    answers = np.take_along_axis(values, which, axis=1)
    tokens = np.full((num, seq_len + 1), PAD, dtype=np.int64)
    tokens[:, 0 : 2 * pairs : 2], tokens[:, 1 : 2 * pairs : 2] = keys, values
    start = 2 * pairs
    tokens[:, start : start + 2 * queries : 2], tokens[:, start + 1 : start + 2 * queries : 2] = asked, answers
    mask = np.zeros(seq_len, dtype=bool)
    mask[start : start + 2 * queries : 2] = True  # target t = tokens[t + 1], an answer
    return tokens, np.broadcast_to(mask, (num, seq_len))


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng([params["seed"], SPLITS.index(split)])
    tokens, mask = recall_rows(params, params[NUM_KEY[split]], rng)
    for row, keep in zip(tokens, mask):
        yield {"tokens": row, "target_mask": keep}


@DATA.register("assoc_recall")
class AssocRecall(GeneratedSource):
    """Multi-query associative recall (Ba et al. 2016; MQAR of Arora et al. 2023).

    Args:
        num_pairs: key-value pairs per sequence.
        num_queries: queries per sequence (distinct stored keys, ``<= num_pairs``).
        num_keys / num_values: sizes of the key and value vocabularies (``num_keys >= num_pairs``).
        seq_len: inputs per row; a sequence takes ``2 * (num_pairs + num_queries)`` tokens, padded.
        num_train / num_val / num_test: examples per split.
        batch_size: rows per batch.
        seed: data seed.
    """

    task = "lm"
    paper = "Ba et al., 2016; Arora et al., 2023 (MQAR)"
    contiguous = False

    def __init__(
        self,
        *,
        num_pairs: Annotated[int, Range(ge=1)] = 16,
        num_queries: Annotated[int, Range(ge=1)] = 16,
        num_keys: Annotated[int, Range(ge=1)] = 64,
        num_values: Annotated[int, Range(ge=1)] = 64,
        seq_len: Annotated[int, Range(ge=2)] = 64,
        num_train: Annotated[int, Range(ge=1)] = 5000,
        num_val: Annotated[int, Range(ge=1)] = 500,
        num_test: Annotated[int, Range(ge=1)] = 500,
        batch_size: Annotated[int, Range(ge=1)] = 32,
        seed: int = 0,
    ):
        self.keep_params(locals())
        self.vocab_size, self.pad_id = 1 + num_keys + num_values, PAD

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        problems, p = [], params
        if p["num_keys"] < p["num_pairs"]:
            problems.append(
                f"num_keys={p['num_keys']} < num_pairs={p['num_pairs']}: keys of a sequence are distinct. "
                f"Fix: set data.num_keys >= {p['num_pairs']}."
            )
        if p["num_queries"] > p["num_pairs"]:
            problems.append(
                f"num_queries={p['num_queries']} > num_pairs={p['num_pairs']}: each query is a distinct stored "
                f"key. Fix: set data.num_queries <= {p['num_pairs']}."
            )
        need = 2 * (p["num_pairs"] + p["num_queries"])
        if need > p["seq_len"] + 1:
            problems.append(
                f"a sequence of {p['num_pairs']} pairs and {p['num_queries']} queries takes {need} tokens, more "
                f"than a row of seq_len + 1 = {p['seq_len'] + 1}. Fix: set data.seq_len >= {need - 1}."
            )
        return problems

    def prepare(self) -> None:
        features = masked_lm_features(self.seq_len, token_dtype(self.vocab_size))
        self.generate(_rows, {"version": VERSION, **self.params}, features)
        counts = {name: len(ds) for name, ds in self._splits.items()}
        self.manifest = {"source": "assoc_recall", "generator": VERSION, **self.params, "examples": counts}
        self.manifest["fingerprint"] = self.fingerprint
