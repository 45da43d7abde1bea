"""``data=parity``: the parity task of Adaptive Computation Time (Graves, 2016, arXiv:1603.08983, sec. 3.1).

The paper: an input vector of 64 entries, of which a random number k (uniform in 1..64) are
random +-1 and the rest 0; the target is the parity of the number of +1 entries (1 odd, 0 even).
The difficulty of an example is k. The paper's wording ("a random number ... were randomly set")
leaves the positions open; like the usual reimplementations (e.g. PonderNet's, Banino et al. 2021)
the nonzero entries are the first k, so ``difficulty`` is recoverable from the tokens alone.

Rows (classify): ``input_ids`` ``[S]`` with ``S = seq_len`` (the vector size; every row has it, so
difficulty is the number of nonzero entries, never the length) and one token per entry: ``ZERO``
1, ``PLUS`` 2 (+1), ``MINUS`` 3 (-1); ``<pad>`` 0 never occurs (fixed length) but is the pad id.
No ``<cls>``: in a bidirectional encoder any position can be read out (``pool=cls`` reads entry 0,
always nonzero since k >= 1), and ``pool=mean`` needs none. ``label`` the parity (2 classes),
``difficulty`` k; ``collate`` carries ``difficulty`` long ``[B]`` into the batch next to ``label`` so
an evaluation can group its metrics by k (``difficulty(input_ids)`` recovers it from tokens too).

Each split is drawn from its own stream (``[seed, split index]``): the splits are reproducible and
different, but not disjoint at small k, where there are only 2**k inputs (two at k = 1). The
training and validation sets take k in ``[min_k, max_k]``, the test set in ``[test_min_k,
test_max_k]`` (the training range by default; set it apart to test generalisation to other k).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import numpy as np
import torch
from torch import Tensor

from xfam.core.registry import Range
from xfam.data.base import DATA, collate_classify
from xfam.data.packing import NUM_KEY, SPLITS, GeneratedSource

VERSION = "act-parity-1"
PAD, ZERO, PLUS, MINUS = 0, 1, 2, 3
TOKENS = ("<pad>", "0", "+1", "-1")


def k_range(params: dict[str, Any], split: str) -> tuple[int, int]:
    """The inclusive range of k of one split (None bounds resolved: ``max_k`` = ``seq_len``, test = training)."""
    lo, hi = params["min_k"], params["max_k"] if params["max_k"] is not None else params["seq_len"]
    if split == "test":
        lo = params["test_min_k"] if params["test_min_k"] is not None else lo
        hi = params["test_max_k"] if params["test_max_k"] is not None else hi
    return lo, hi


def parity_rows(
    size: int, min_k: int, max_k: int, num: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``input_ids`` ``[num, size]``, ``label`` ``[num]`` and ``difficulty`` ``[num]`` of ``num`` examples."""
    k = rng.integers(min_k, max_k + 1, size=num)  # [num], uniform in min_k..max_k
    plus = rng.integers(0, 2, size=(num, size)).astype(bool)  # [num, size], each sign with probability 1/2
    active = np.arange(size)[None, :] < k[:, None]  # [num, size], the first k entries
    ids = np.where(active, np.where(plus, PLUS, MINUS), ZERO).astype(np.uint8)
    label = (plus & active).sum(axis=1) % 2  # parity of the number of +1 entries
    return ids, label, k


def difficulty(input_ids: Tensor) -> Tensor:
    """k of each row, the number of nonzero entries: ``[B, S]`` ids -> ``[B]`` long."""
    return ((input_ids == PLUS) | (input_ids == MINUS)).sum(dim=-1)


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng([params["seed"], SPLITS.index(split)])
    lo, hi = k_range(params, split)
    ids, labels, ks = parity_rows(params["seq_len"], lo, hi, params[NUM_KEY[split]], rng)
    for row, label, k in zip(ids, labels.tolist(), ks.tolist()):
        yield {"input_ids": row, "label": label, "difficulty": k}


@DATA.register("parity")
class Parity(GeneratedSource):
    """Parity of +-1 vectors whose first k entries are nonzero, a classification whose difficulty is k.

    Args:
        seq_len: the vector size, the length of every row (paper: 64).
        min_k / max_k: range of k (inclusive, uniform) of the training and validation examples;
            ``max_k: null`` means ``seq_len`` (paper: 1..64).
        test_min_k / test_max_k: range of k of the test examples; null means the training bound
            (e.g. train on 1..32 and test on 33..64 for generalisation to harder examples).
        num_train / num_val / num_test: examples per split (each split its own random stream).
        batch_size: rows per batch.
        seed: data seed; the same seed gives the same data.
    """

    task = "classify"
    paper = "Graves, 2016 (ACT, sec. 3.1)"
    id_column = "input_ids"

    def __init__(
        self,
        *,
        seq_len: Annotated[int, Range(ge=1)] = 64,
        min_k: Annotated[int, Range(ge=1)] = 1,
        max_k: Annotated[int | None, Range(ge=1)] = None,
        test_min_k: Annotated[int | None, Range(ge=1)] = None,
        test_max_k: Annotated[int | None, Range(ge=1)] = None,
        num_train: Annotated[int, Range(ge=1)] = 10000,
        num_val: Annotated[int, Range(ge=1)] = 1000,
        num_test: Annotated[int, Range(ge=1)] = 1000,
        batch_size: Annotated[int, Range(ge=1)] = 32,
        seed: int = 0,
    ):
        self.keep_params(locals())
        self.vocab_size, self.num_classes, self.pad_id = len(TOKENS), 2, PAD

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        problems, n = [], params["seq_len"]
        for split, lo_key, hi_key in (("train", "min_k", "max_k"), ("test", "test_min_k", "test_max_k")):
            if split == "test" and params[lo_key] is None and params[hi_key] is None:
                continue  # the training range, checked already
            lo, hi = k_range(params, split)
            if params[hi_key] is not None and hi > n:
                problems.append(
                    f"{hi_key}={hi} > seq_len={n}: a vector of {n} entries has at most {n} nonzero ones. "
                    f"Fix: set data.{hi_key} <= {n} (or null), or data.seq_len >= {hi}."
                )
            if lo > hi:
                where = "training and validation" if split == "train" else "test"
                problems.append(
                    f"{lo_key}..{hi_key} is {lo}..{hi}: the {where} range of k is empty (a null bound is "
                    f"{'seq_len' if split == 'train' else 'the training one'}). Fix: set data.{lo_key} <= {hi}"
                    + (f" or data.{hi_key} >= {lo}." if lo <= n else ".")
                )
        return problems

    def prepare(self) -> None:
        from datasets import Features, List, Value

        features = Features(
            {
                "input_ids": List(Value("uint8"), length=self.seq_len),
                "label": Value("int64"),
                "difficulty": Value("int64"),
            }
        )
        self.generate(_rows, {"version": VERSION, **self.params}, features)
        self.manifest = {"source": "parity", "generator": VERSION, **self.params, "splits": {}}
        for name, ds in self._splits.items():
            table = ds.with_format("arrow")[:]
            labels, ks = table.column("label").to_numpy(), table.column("difficulty").to_numpy()
            self.manifest["splits"][name] = {
                "examples": len(ds),
                "k_range": list(k_range(self.params, name)),
                "majority_class_rate": float(max(labels.mean(), 1 - labels.mean())),
                "difficulty": {"min": int(ks.min()), "mean": float(ks.mean()), "max": int(ks.max())},
            }
        self.manifest["fingerprint"] = self.fingerprint

    def collate(self, rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """``collate_classify`` plus ``difficulty`` long ``[B]``, k of each row."""
        batch = collate_classify(rows, PAD)
        batch["difficulty"] = torch.stack([torch.as_tensor(r["difficulty"]) for r in rows]).long()  # [B]
        return batch

    def encode(self, text: str) -> list[int]:
        """Entries as text (``"+1 -1 0 0"``, also ``1``/``-1``/``0``) to ids."""
        names = {"0": ZERO, "+1": PLUS, "1": PLUS, "-1": MINUS}
        return [names[t] for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(TOKENS[int(i)] for i in ids if int(i) != PAD)
