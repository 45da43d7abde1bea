"""``data=seq2seq_toy``: synthetic sequence-to-sequence tasks for quick checks of an encoder-decoder.

The copy, reverse and sort tasks are the algorithmic transductions of the early sequence-to-sequence
work (reversal: Sutskever et al., 2014, arXiv:1409.3215; copy and sort: Graves et al., 2014, Neural
Turing Machines, arXiv:1410.5401; Vinyals et al., 2015, Pointer Networks, arXiv:1506.03134), and
addition that of Zaremba & Sutskever, 2014 (Learning to Execute, arXiv:1410.4615):

* ``copy``: source a random digit string (length uniform in ``[min_digits, max_digits]``, digits uniform),
  target the same string; ``reverse``: the string reversed; ``sort``: its digits in ascending order.
* ``addition``: source ``a+b``, each operand with a digit count uniform in ``[min_digits, max_digits]``
  (no leading zero unless the operand is the single digit 0), target the decimal sum ``a + b``.

Rows (seq2seq, ``xfam.data.seq2seq``): ``source`` and ``target`` ids without BOS/EOS. Vocabulary:
``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, the digits ``0``..``9`` as 3..12, ``+`` 13 (``token_bytes``
None: the tokens stand for no text bytes). Each split is generated from its own stream
``[seed, split index]`` and cached (``GeneratedSource``): reproducible, different, but not disjoint
when there are few possible strings (short ``max_digits``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

import numpy as np

from xfam.core.errors import ConfigError
from xfam.core.registry import Range
from xfam.data.base import DATA
from xfam.data.cache import ids_problem
from xfam.data.packing import NUM_KEY, SPLITS, GeneratedSource
from xfam.data.seq2seq import Seq2SeqSource, pair_lengths

VERSION = "seq2seq-toy-1"
PAD, BOS, EOS, DIGIT0, PLUS = 0, 1, 2, 3, 13
TOKENS = ("<pad>", "<bos>", "<eos>", *"0123456789", "+")
KINDS = ("copy", "reverse", "sort", "addition")


def longest(kind: str, max_digits: int) -> tuple[int, int]:
    """The longest source and target (ids, no BOS/EOS) a kind can make: addition's sum may carry one digit."""
    return (2 * max_digits + 1, max_digits + 1) if kind == "addition" else (max_digits, max_digits)


def _number(rng: np.random.Generator, digits: int) -> list[int]:
    """The digits of a uniform random number with ``digits`` digits (no leading zero unless it is one digit)."""
    first = int(rng.integers(1 if digits > 1 else 0, 10))
    return [first, *rng.integers(0, 10, size=digits - 1).tolist()]


def toy_pair(kind: str, min_digits: int, max_digits: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """One (source, target) pair of digits (0..9; ``addition``'s ``+`` is -1), before the id offset."""
    if kind == "addition":
        a, b = (_number(rng, int(rng.integers(min_digits, max_digits + 1))) for _ in range(2))
        total = int("".join(map(str, a))) + int("".join(map(str, b)))
        return [*a, -1, *b], [int(c) for c in str(total)]
    digits = rng.integers(0, 10, size=int(rng.integers(min_digits, max_digits + 1))).tolist()
    target = {"copy": digits, "reverse": digits[::-1], "sort": sorted(digits)}[kind]
    return digits, target


def _to_ids(digits: list[int]) -> list[int]:
    return [PLUS if d < 0 else DIGIT0 + d for d in digits]


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng([params["seed"], SPLITS.index(split)])
    for _ in range(params[NUM_KEY[split]]):
        source, target = toy_pair(params["kind"], params["min_digits"], params["max_digits"], rng)
        yield {"source": _to_ids(source), "target": _to_ids(target)}


@DATA.register("seq2seq_toy")
class Seq2SeqToy(Seq2SeqSource, GeneratedSource):
    """Copy, reverse, sort or add digit strings: a sequence-to-sequence task with known answers.

    Args:
        kind: ``copy`` | ``reverse`` | ``sort`` | ``addition`` (see the module docstring).
        min_digits / max_digits: digit string length, or (addition) digits of each operand, uniform in
            this inclusive range.
        num_train / num_val / num_test: pairs per split (each split its own random stream).
        source_len: the most source ids the encoder reads (addition: ``2 * max_digits + 1`` fit all).
        target_len: the most decoder positions, BOS plus target ids (``max_digits + 1`` fit all; addition
            ``max_digits + 2``).
        truncate: cut longer pairs to fit (counted in the log) instead of refusing them.
        batch_size: pairs per batch.
        seed: data seed; the same seed gives the same data.
    """

    id_column = "source"

    def __init__(
        self,
        *,
        kind: Literal["copy", "reverse", "sort", "addition"] = "copy",
        min_digits: Annotated[int, Range(ge=1)] = 1,
        max_digits: Annotated[int, Range(ge=1)] = 8,
        num_train: Annotated[int, Range(ge=1)] = 10000,
        num_val: Annotated[int, Range(ge=1)] = 500,
        num_test: Annotated[int, Range(ge=1)] = 500,
        source_len: Annotated[int, Range(ge=1)] = 32,
        target_len: Annotated[int, Range(ge=2)] = 32,
        truncate: bool = False,
        batch_size: Annotated[int, Range(ge=1)] = 32,
        seed: int = 0,
    ):
        args = dict(locals())
        self.params = {k: v for k, v in args.items() if k not in ("self", "__class__", "batch_size")}
        self.kind, self.min_digits, self.max_digits = kind, min_digits, max_digits
        self.keep_lengths(
            source_len=source_len, target_len=target_len, truncate=truncate, batch_size=batch_size, seed=seed
        )
        self.vocab_size, self.pad_id, self.bos_id, self.eos_id = len(TOKENS), PAD, BOS, EOS
        self.token_bytes = None

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        lo, hi, kind = params["min_digits"], params["max_digits"], params["kind"]
        if lo > hi:
            return [
                f"min_digits={lo} > max_digits={hi}: the range of digit counts is empty. "
                "Fix: set data.min_digits <= data.max_digits."
            ]
        if params["truncate"]:
            return []
        problems = []
        src, tgt = longest(kind, hi)
        if src > params["source_len"]:
            problems.append(
                f"kind={kind} with max_digits={hi} makes sources of up to {src} ids, more than source_len="
                f"{params['source_len']}, and truncate=false refuses them. Fix: data.source_len >= {src}, "
                f"a smaller data.max_digits, or data.truncate=true."
            )
        if tgt + 1 > params["target_len"]:
            problems.append(
                f"kind={kind} with max_digits={hi} makes targets of up to {tgt} ids, and the decoder reads BOS too: "
                f"{tgt + 1} positions, more than target_len={params['target_len']}, and truncate=false refuses them. "
                f"Fix: data.target_len >= {tgt + 1}, a smaller data.max_digits, or data.truncate=true."
            )
        return problems

    def prepare(self) -> None:
        if getattr(self, "_splits", None):
            return
        from datasets import Features, List, Value

        features = Features({"source": List(Value("uint8")), "target": List(Value("uint8"))})
        self.generate(_rows, {"version": VERSION, **self.params}, features)
        self.manifest = {"source": "seq2seq_toy", "generator": VERSION, **self.params, "splits": {}}
        for name in SPLITS:
            if problem := ids_problem(self._splits[name], "target", self.vocab_size):
                raise RuntimeError(f"xfam bug: data=seq2seq_toy generated a bad {name} split: {problem}")
            self._splits[name] = ds = self.fit(name, self._splits[name])
            src, tgt = pair_lengths(ds)
            self.manifest["splits"][name] = {
                "pairs": len(ds),
                "source_len": {"min": int(src.min()), "mean": float(src.mean()), "max": int(src.max())},
                "target_len": {"min": int(tgt.min()), "mean": float(tgt.mean()), "max": int(tgt.max())},
                **self.truncated[name],
            }
        self.manifest["fingerprint"] = self.fingerprint

    def encode(self, text: str) -> list[int]:
        """Digits and ``+`` (``"123+45"``) to ids; spaces are ignored."""
        bad = sorted({c for c in text if c not in "0123456789+ "})
        if bad:
            raise ConfigError(
                f"data=seq2seq_toy: cannot encode {text!r}: characters {bad} are not in the vocabulary "
                f"(the digits 0-9 and '+'). Fix: pass only digits and '+'."
            )
        return [PLUS if c == "+" else DIGIT0 + int(c) for c in text if c != " "]

    def decode(self, ids: Any) -> str:
        return "".join(TOKENS[int(i)] for i in ids if int(i) not in (PAD, BOS, EOS))
