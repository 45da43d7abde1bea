"""``data=repeat_segments``: every random segment followed by itself, one segment per row.

The memory probe of Transformer-XL (Dai et al., ACL 2019, sec. 3.2 and the "relative effective
context length" of sec. 4.3) in its simplest form: a token is predictable only from exactly one
segment earlier. The split is one token stream ``w1 w1 w2 w2 w3 w3 ...`` where every ``w_k`` is a
uniform random string of ``seq_len`` symbols over ``0 .. symbols-1``, drawn independently. Rows are
consecutive chunks of the stream (``contiguous = True``; see ``xfam.data.periodic``): row ``2k`` is
``w_k`` and row ``2k+1`` its copy, each followed by the next row's first token.

A model that keeps the previous segment's states (``memory=xl`` with ``mem_len >= seq_len - 1``,
a relative ``pos``) copies: target t of a copy row is the symbol ``seq_len - 1`` positions back,
and the copy loss can fall to 0. Without memory the original is out of reach, every target is a
fresh uniform symbol and the loss stays at ``ln(symbols)`` (4.16 nats for 64 symbols).

Rows (lm): ``tokens`` ``[S + 1]`` and ``target_mask`` ``[S]``, True exactly on the targets that lie
inside a copy and are predictable from the previous segment: targets ``0 .. S-2`` of the odd rows
(``w_k[1:]``). The last target of a copy row is the next, random segment's first symbol, and no
target of an original row is predictable: they never count. Vocabulary ``symbols``; no padding, no
eos, no bytes (loss in nats). Row counts per split must make streams of whole (segment, copy) pairs
at ``batch_size`` (``xfam.data.periodic.period_problems``).
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

VERSION = "repeat-segments-1"
PERIOD = 2  # rows per unit: a segment and its copy


def repeat_stream(symbols: int, seq_len: int, rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The stream ``w1 w1 w2 w2 ...`` of ``rows`` rows plus one token, and its target mask (per position)."""
    pairs = -(-rows // PERIOD) + 1  # one more segment: the token after the last row is its first symbol
    w = rng.integers(0, symbols, size=(pairs, 1, seq_len))  # [pairs, 1, S]
    stream = np.repeat(w, PERIOD, axis=1).reshape(-1)[: rows * seq_len + 1]  # [rows * S + 1]
    pos = np.arange(len(stream))
    # Position p is in row p // S, at offset p % S; a copy row is odd; its offset 0 is the row's input,
    # never a target of that row (stream position k*S is the target of row k-1's last input).
    mask = ((pos // seq_len) % PERIOD == 1) & (pos % seq_len != 0)
    return stream, mask


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    rows = params[NUM_KEY[split]]
    stream, mask = repeat_stream(params["symbols"], params["seq_len"], rows, split_rng(params, split))
    yield from stream_rows(stream, mask, params["seq_len"], rows)


@DATA.register("repeat_segments")
class RepeatSegments(GeneratedSource):
    """A random segment followed by itself, a row each: copying needs one segment of memory.

    Args:
        symbols: alphabet size (ids ``0 .. symbols-1``); the loss without memory is ``ln(symbols)``.
        seq_len: symbols per segment = tokens per row (the copy length).
        num_train / num_val / num_test: rows per split (a segment and its copy are 2 rows); with
            streams each split makes ``batch_size`` streams whose length must be even.
        batch_size: rows per batch.
        seed: data seed.
    """

    task = "lm"
    paper = "Dai et al., ACL 2019 (Transformer-XL, sec. 3.2): a segment recurrence probe"
    contiguous = True

    def __init__(
        self,
        *,
        symbols: Annotated[int, Range(ge=2)] = 64,
        seq_len: Annotated[int, Range(ge=2)] = 64,
        num_train: Annotated[int, Range(ge=2)] = 8192,
        num_val: Annotated[int, Range(ge=2)] = 1024,
        num_test: Annotated[int, Range(ge=2)] = 1024,
        batch_size: Annotated[int, Range(ge=1)] = 16,
        seed: int = 0,
    ):
        self.keep_params(locals())
        self.vocab_size = symbols

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        return period_problems(params, PERIOD, "segment and its copy")

    def prepare(self) -> None:
        features = masked_lm_features(self.seq_len, token_dtype(self.vocab_size))
        self.generate(_rows, {"version": VERSION, **self.params}, features)
        counts = {name: len(ds) for name, ds in self._splits.items()}
        self.manifest = {"source": "repeat_segments", "generator": VERSION, **self.params, "rows": counts}
        self.manifest["fingerprint"] = self.fingerprint
