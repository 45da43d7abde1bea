"""``data=duplication``: the Reformer's duplication task (Kitaev, Kaiser & Levskaya, ICLR 2020, sec. 5).

Each example is ``0 w 0 w`` with ``w`` a uniform random string over the symbols ``1..N``
(``N = symbols``; the paper: N = 127, length 1024, so ``|w| = 511``). A model that attends back
over ``seq_len / 2`` positions can copy the second ``w`` exactly; one that cannot sees noise.

Rows (lm): ``tokens`` ``[S + 1]`` = ``0 w 0 w 0`` (the input is exactly ``0 w 0 w``, ``S =
seq_len``; the closing 0 is a target that never counts) and ``target_mask`` ``[S]``, True exactly
where the target is a symbol of the second copy of ``w`` (targets ``S/2 .. S-2``): loss and
accuracy are measured on the copy only. Vocabulary ``symbols + 1``; no padding, no eos, no bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import numpy as np

from xfam.core.registry import Range
from xfam.data.base import DATA
from xfam.data.packing import NUM_KEY, SPLITS, GeneratedSource, masked_lm_features
from xfam.data.tokenize import token_dtype

VERSION = "reformer-duplication-1"


def duplication_rows(symbols: int, seq_len: int, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` ``[num, seq_len + 1]`` and ``target_mask`` ``[num, seq_len]`` of ``num`` examples."""
    half = seq_len // 2
    w = rng.integers(1, symbols + 1, size=(num, half - 1))
    zero = np.zeros((num, 1), dtype=w.dtype)
    tokens = np.concatenate([zero, w, zero, w, zero], axis=1)  # [num, S + 1]
    mask = np.zeros(seq_len, dtype=bool)
    mask[half : seq_len - 1] = True  # target t = tokens[t + 1] is in the second copy
    return tokens, np.broadcast_to(mask, (num, seq_len))


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng([params["seed"], SPLITS.index(split)])
    tokens, mask = duplication_rows(params["symbols"], params["seq_len"], params[NUM_KEY[split]], rng)
    for row, keep in zip(tokens, mask):
        yield {"tokens": row, "target_mask": keep}


@DATA.register("duplication")
class Duplication(GeneratedSource):
    """Copy a random string seen ``seq_len / 2`` positions earlier (Reformer, Kitaev et al. 2020).

    Args:
        symbols: alphabet size N of ``w`` (ids 1..N; 0 is the delimiter). Paper: 127.
        seq_len: length of ``0 w 0 w`` (even). Paper: 1024.
        num_train / num_val / num_test: examples per split (each drawn from its own stream).
        batch_size: rows per batch.
        seed: data seed.
    """

    task = "lm"
    paper = "Kitaev et al., 2020 (Reformer, sec. 5)"
    contiguous = False

    def __init__(
        self,
        *,
        symbols: Annotated[int, Range(ge=1)] = 127,
        seq_len: Annotated[int, Range(ge=4)] = 256,
        num_train: Annotated[int, Range(ge=1)] = 5000,
        num_val: Annotated[int, Range(ge=1)] = 500,
        num_test: Annotated[int, Range(ge=1)] = 500,
        batch_size: Annotated[int, Range(ge=1)] = 16,
        seed: int = 0,
    ):
        self.keep_params(locals())
        self.vocab_size = symbols + 1

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        if params["seq_len"] % 2:
            n = params["seq_len"]
            return [f"seq_len={n} is odd; an example 0w0w has even length. Fix: set data.seq_len={n + 1}."]
        return []

    def prepare(self) -> None:
        features = masked_lm_features(self.seq_len, token_dtype(self.vocab_size))
        self.generate(_rows, {"version": VERSION, **self.params}, features)
        counts = {name: len(ds) for name, ds in self._splits.items()}
        self.manifest = {"source": "duplication", "generator": VERSION, **self.params, "examples": counts}
        self.manifest["fingerprint"] = self.fingerprint
