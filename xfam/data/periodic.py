"""Generated contiguous streams made of fixed-length units of rows (the memory slot's tasks).

``data=repeat_segments`` and ``data=far_recall`` write one token stream per split, built from units
of ``period`` rows of ``seq_len`` tokens (a segment and its copy: 2 rows; an episode: E rows), and
cut it like every contiguous source (``xfam.data.packing.pack_rows``): row k is
``stream[k*S : k*S + S + 1]``, so row k+1 continues row k and every row's last token is the next
row's first.

The streams layout of the sampler (``xfam.data.sampler``) cuts a split of n rows into ``B * W``
streams of ``stream_len = n // (B * W)`` consecutive rows (B = ``batch_size``, W ranks). A unit is
whole inside one stream exactly when every stream starts at a unit boundary, i.e. when
``stream_len`` is a multiple of ``period``; otherwise the first unit of a stream would be cut from
its beginning, which sits at the end of the previous stream (a copy without its original, queries
without their pairs) and its targets could not be predicted by any memory. ``period_problems``
refuses such row counts for one rank (the data config knows ``batch_size``, not the world size:
with W ranks make ``num_*`` a multiple of ``period * B * W``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from xfam.data.packing import NUM_KEY, SPLITS, pack_rows


def period_problems(params: dict[str, Any], period: int, unit: str) -> list[str]:
    """One problem per split whose rows do not make streams of whole units at ``batch_size``."""
    problems, batch = [], params.get("batch_size")
    if not isinstance(batch, int) or batch < 1 or period < 1:
        return []  # reported by the generic checks
    for split, key in NUM_KEY.items():
        rows = params.get(key)
        if not isinstance(rows, int) or rows < 1:
            continue
        stream_len = rows // batch
        if stream_len % period or stream_len == 0:
            good = max(1, round(stream_len / period)) * period * batch
            problems.append(
                f"{key}={rows}: the {split} split is cut into {batch} streams (data.batch_size) of "
                f"{stream_len} rows, not a multiple of the {period} rows of a {unit}, so a {unit} would be split "
                f"between two streams and its targets could not be predicted. Fix: set data.{key}={good} "
                f"(a multiple of {period} x batch_size; with W ranks, of {period} x batch_size x W)."
            )
    return problems


def stream_rows(stream: np.ndarray, mask: np.ndarray, seq_len: int, rows: int) -> Iterator[dict[str, np.ndarray]]:
    """Rows ``{"tokens" [S + 1], "target_mask" [S]}`` of ``stream`` (length ``rows * S + 1``) cut with
    stride ``seq_len``; ``mask[p]`` says whether the target at stream position ``p`` counts (the
    target of row k's input t is stream position ``k*S + t + 1``)."""
    assert len(stream) == rows * seq_len + 1 and len(mask) == len(stream)
    tokens = pack_rows(stream, seq_len)  # [rows, S + 1]
    keep = mask[1:].reshape(rows, seq_len)  # [rows, S]: target t of row k is stream[k*S + t + 1]
    for row, k in zip(tokens, keep, strict=True):
        yield {"tokens": row, "target_mask": k}


def split_rng(params: dict[str, Any], split: str) -> np.random.Generator:
    """Each split from its own stream: reproducible, and different from the other splits."""
    return np.random.default_rng([params["seed"], SPLITS.index(split)])
