"""``data=listops``: ListOps as generated for the Long Range Arena (Tay et al., ICLR 2021).

The generator follows LRA's released ``listops.py`` (google-research/long-range-arena):
operators MIN, MAX, MED, SM (sum mod 10); the root is at depth 1; below ``max_depth`` a node is a
leaf (a uniform digit) when ``r > 0.25`` for ``r ~ U[0, 1)``, at ``max_depth`` always; an operator
node has a uniform number of children in ``[2, max_args]``, each sampled one level deeper; a tree
of token length ``L`` is kept only if ``min_length < L < max_length`` and it has not been drawn
before. MED is ``int(numpy.median(args))`` (for an even count the mean of the middle two,
truncated toward zero).

Rows (classify): ``input_ids`` = ``[<cls>] + tree tokens`` (so ``pool=cls`` reads the first
position), at most ``max_length`` ids; ``label`` the value 0..9. Vocabulary (17): ``<pad>`` 0,
``<cls>`` 1, ``[MIN [MAX [MED [SM`` 2-5, ``]`` 6, digits 7-16. One seeded draw yields every split
(test first, then validation, then train: the evaluation sets do not change with ``num_train``),
so the splits are disjoint. Report accuracy against the majority-class rate in the manifest, not
10%: MIN and MAX skew labels toward 0 and 9.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

import numpy as np
import pyarrow.compute as pc

from xfam.core.errors import ConfigError
from xfam.core.registry import Range
from xfam.data.base import DATA
from xfam.data.packing import GeneratedSource

OPS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
TOKENS = ("<pad>", "<cls>", *OPS, CLOSE, *"0123456789")
TOKEN_ID = {t: i for i, t in enumerate(TOKENS)}
PAD, CLS = 0, 1
VERSION = "lra-listops-1"


def _apply(op: str, args: list[int]) -> int:
    """The generator's operator semantics (MED for non-negative ints: floor of the middle mean)."""
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[SM":
        return sum(args) % 10
    s, m = sorted(args), len(args) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2


def sample_tree(rng: random.Random, depth: int, max_depth: int, max_args: int, out: list[str]) -> int:
    """Append one random tree's tokens to ``out`` and return its value (LRA's ``generate_tree``)."""
    r = rng.random() if depth < max_depth else 1.0
    if r > 0.25:
        digit = rng.randint(0, 9)
        out.append(str(digit))
        return digit
    slot = len(out)
    out.append("")  # the operator token, drawn after the children as in the LRA generator
    args = [sample_tree(rng, depth + 1, max_depth, max_args, out) for _ in range(rng.randint(2, max_args))]
    out[slot] = rng.choice(OPS)
    out.append(CLOSE)
    return _apply(out[slot], args)


def evaluate(tokens: Sequence[str | int]) -> int:
    """Parse and evaluate one ListOps sequence (token strings or ids; ``<pad>``/``<cls>`` ignored).

    Independent of the generator: a stack parser, with MED computed by ``numpy.median``.
    """
    stack: list[list[Any]] = [[]]
    for tok in tokens:
        tok = TOKENS[tok] if isinstance(tok, (int, np.integer)) else tok
        if tok in ("<pad>", "<cls>"):
            continue
        if tok in OPS:
            stack.append([tok])
        elif tok == CLOSE:
            if len(stack) < 2 or len(stack[-1]) < 2:
                raise ValueError(f"unbalanced or empty operator at {tok!r}")
            op, *args = stack.pop()
            value = {
                "[MIN": min(args),
                "[MAX": max(args),
                "[MED": int(np.median(args)),
                "[SM": sum(args) % 10,
            }[op]
            stack[-1].append(value)
        else:
            stack[-1].append(int(tok))
    if len(stack) != 1 or len(stack[0]) != 1:
        raise ValueError("not a single well-formed expression")
    return stack[0][0]


def max_tree_length(max_depth: int, max_args: int) -> int:
    """Longest tree the depth cap allows (every node below the cap an operator with ``max_args`` children)."""
    length = 1
    for _ in range(max_depth - 1):
        length = 2 + max_args * length
    return length


@functools.lru_cache(maxsize=4)
def sample_dataset(params: tuple[tuple[str, Any], ...]) -> dict[str, list[tuple[tuple[str, ...], int]]]:
    """Every split's ``(tokens, value)`` from one seeded draw of distinct trees (cached per process)."""
    p = dict(params)
    rng, seen = random.Random(p["seed"]), set()
    wanted = {"test": p["num_test"], "validation": p["num_val"], "train": p["num_train"]}
    total, draws, limit = sum(wanted.values()), 0, 1000 * sum(wanted.values()) + 100_000
    found: list[tuple[tuple[str, ...], int]] = []
    while len(found) < total:
        if draws == limit:
            raise ConfigError(
                f"data=listops: only {len(found)} of {total} distinct trees with {p['min_length']} < length < "
                f"{p['max_length']} in {draws} draws. Fix: widen the length bounds, raise max_depth/max_args, "
                "or ask for fewer examples."
            )
        draws += 1
        out: list[str] = []
        value = sample_tree(rng, 1, p["max_depth"], p["max_args"], out)
        key = tuple(out)
        if p["min_length"] < len(key) < p["max_length"] and key not in seen:
            seen.add(key)
            found.append((key, value))
    splits, start = {}, 0
    for name, n in wanted.items():
        splits[name], start = found[start : start + n], start + n
    return splits


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    for tokens, value in sample_dataset(tuple(sorted(params.items())))[split]:
        yield {"input_ids": [CLS] + [TOKEN_ID[t] for t in tokens], "label": value}


@DATA.register("listops")
class ListOps(GeneratedSource):
    """LRA ListOps at CPU scale (10-way classification of nested MIN/MAX/MED/SM expressions).

    Args:
        max_depth / max_args: depth cap (root at depth 1) and most children of an operator
            (LRA: 10 / 10).
        min_length / max_length: strict bounds on a tree's token length (LRA: 500 / 2000).
        num_train / num_val / num_test: distinct trees per split (LRA: 96k / 2k / 2k).
        seq_len: longest row the model sees; rows hold at most ``max_length`` ids (``max_length - 1``
            tree tokens + ``<cls>``), so it must be ``>= max_length``.
        batch_size: rows per batch (padded with ``<pad>`` to the longest row).
        seed: data seed; the same seed gives the same data.
    """

    task = "classify"
    paper = "Nangia & Bowman, 2018; LRA generator, Tay et al., 2021"
    id_column = "input_ids"

    def __init__(
        self,
        *,
        max_depth: Annotated[int, Range(ge=1)] = 6,
        max_args: Annotated[int, Range(ge=2)] = 10,
        min_length: Annotated[int, Range(ge=0)] = 20,
        max_length: Annotated[int, Range(ge=2)] = 200,
        num_train: Annotated[int, Range(ge=1)] = 5000,
        num_val: Annotated[int, Range(ge=1)] = 500,
        num_test: Annotated[int, Range(ge=1)] = 500,
        seq_len: Annotated[int, Range(ge=2)] = 200,
        batch_size: Annotated[int, Range(ge=1)] = 32,
        seed: int = 0,
    ):
        self.keep_params(locals(), exclude=("seq_len",))
        self.vocab_size, self.num_classes, self.pad_id = len(TOKENS), 10, PAD

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        problems, lo, hi = [], params["min_length"], params["max_length"]
        if hi - lo < 2:
            problems.append(
                f"min_length={lo}, max_length={hi}: no length lies strictly between them. "
                f"Fix: set data.max_length >= {lo + 2}."
            )
        longest = max_tree_length(params["max_depth"], params["max_args"])
        if longest <= lo:
            problems.append(
                f"max_depth={params['max_depth']}, max_args={params['max_args']} allow trees of at most {longest} "
                f"tokens, not more than min_length={lo}. Fix: raise max_depth or max_args, or lower min_length."
            )
        if params["seq_len"] < hi:
            problems.append(
                f"seq_len={params['seq_len']} < max_length={hi}: a row holds up to {hi} ids (<cls> + {hi - 1} "
                f"tree tokens). Fix: set data.seq_len >= {hi}."
            )
        return problems

    def prepare(self) -> None:
        from datasets import Features, List, Value

        features = Features({"input_ids": List(Value("uint8")), "label": Value("int64")})
        self.generate(_rows, {"version": VERSION, **self.params}, features)
        self.manifest = {"source": "listops", "generator": VERSION, **self.params, "splits": {}}
        for name, ds in self._splits.items():
            table = ds.with_format("arrow")[:]
            labels = table.column("label").to_numpy()
            lengths = pc.list_value_length(table.column("input_ids")).to_numpy() - 1  # without <cls>
            counts = Counter(labels.tolist())
            self.manifest["splits"][name] = {
                "examples": len(ds),
                "majority_class_rate": max(counts.values()) / len(ds),
                "label_counts": [counts.get(c, 0) for c in range(10)],
                "tree_length": {"min": int(lengths.min()), "mean": float(lengths.mean()), "max": int(lengths.max())},
            }
        self.manifest["fingerprint"] = self.fingerprint

    def encode(self, text: str) -> list[int]:
        return [TOKEN_ID[t] for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(TOKENS[int(i)] for i in ids if int(i) != PAD)
