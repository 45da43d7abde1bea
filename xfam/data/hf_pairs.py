"""``data=hf`` with ``source_column`` and ``target_column``: (source, target) text pairs of a Hugging Face dataset.

The split loading and carving are ``data=hf``'s (``xfam.data.hf``, which builds ``HFPairs``, this mixin
on its ``HFSource``, when both columns are set); the rows are ``xfam.data.seq2seq``'s pairs for an
encoder-decoder (Vaswani et al., 2017, arXiv:1706.03762). Both texts of a pair are tokenized with
the configured tokenizer (``byte``, a ``bpe`` trained on the train split's sources and targets
together, or a pretrained one), and the pair gets the special ids the decoder needs: the tokenizer's
own where it has them (``eos`` always for byte/bpe; a pretrained tokenizer's ``eos``/``bos``/``pad``),
else new ids after its vocabulary (``special_ids``): for byte/bpe ``bos`` = ``tokenizer.vocab_size``
and ``pad`` = ``tokenizer.vocab_size + 1``, so ``vocab_size`` = ``tokenizer.vocab_size + 2``, and
``token_bytes`` gives the new ids 0 bytes. A null text counts as empty: a pair with an empty target is
refused and long pairs are truncated or refused (``fit_pairs``).

The ids of each split are a cached ``datasets.map`` (``xfam.data.cache``) keyed by the corpus (the
``datasets`` fingerprints of the loaded splits, the carving, the columns) and the tokenizer; the
data fingerprint adds ``source_len`` and ``target_len``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from xfam.data.cache import cached_map, ids_problem, rows_check
from xfam.data.packing import FORMAT
from xfam.data.seq2seq import COLUMNS, Seq2SeqSource, pair_lengths
from xfam.data.tokenize import build_tokenizer, short_hash, token_dtype

PAIR_KEYS = ("source_column", "target_column")


def is_pairs(params: dict[str, Any]) -> bool:
    """Whether ``data=hf`` parameters ask for pairs (both columns set; one alone is refused by ``pair_problems``)."""
    return all(params.get(k) is not None for k in PAIR_KEYS)


def pair_problems(params: dict[str, Any]) -> list[str]:
    """Problems of the pair settings of ``data=hf`` that need no data: a column without the other, doc_mask."""
    given = [k for k in PAIR_KEYS if params.get(k) is not None]
    if len(given) == 1:
        (key,) = given
        (other,) = (k for k in PAIR_KEYS if k != key)
        return [
            f"{key}={params[key]!r} is set but {other} is null: pairs need both columns (both null: language "
            f"modelling on text_column). Fix: set data.{other} to the other text column, or data.{key}=null."
        ]
    if given and params.get("doc_mask"):
        return [
            "doc_mask=true masks attention at the documents of packed language-modelling rows; pairs "
            f"({', '.join(PAIR_KEYS)} set) are not packed. Fix: set data.doc_mask=false."
        ]
    return []


class _PairEncoder:
    """``datasets.map`` function: a table of text pairs -> a table of ``source`` and ``target`` id lists."""

    def __init__(self, tokenizer: Any, columns: tuple[str, str], dtype: str):
        self.tokenizer, self.columns, self.dtype = tokenizer, columns, dtype

    def __call__(self, table: pa.Table) -> pa.Table:
        out = {}
        for name, column in zip(COLUMNS, self.columns):
            texts = [t or "" for t in table.column(column).to_pylist()]
            arrays = [a.astype(self.dtype, copy=False) for a in self.tokenizer.encode_docs(texts)]
            offsets = np.cumsum([0] + [len(a) for a in arrays], dtype=np.int64)
            values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=self.dtype)
            out[name] = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
        return pa.table(out)


def special_ids(tok: Any) -> tuple[int, int, int, int]:
    """``(eos, bos, pad, vocab_size)`` of pairs: the tokenizer's own where it has them (a pretrained one's
    ``eos_id``/``bos_id``/``pad_id``), else new ids after its vocabulary; a pad that is also eos or bos gets its
    own id, so padding is never a real token."""
    size = tok.vocab_size

    def own_or_new(i: int | None, taken: tuple[int | None, ...] = ()) -> int:
        nonlocal size
        if i is not None and i not in taken:
            return i
        size += 1
        return size - 1

    eos = own_or_new(tok.eos_id)
    bos = own_or_new(getattr(tok, "bos_id", None), (eos,))
    pad = own_or_new(getattr(tok, "pad_id", None), (eos, bos))
    return eos, bos, pad, size


def _ids_check(rows: int, vocab_size: int) -> Any:
    """A cache check of encoded pairs: ``rows`` rows, both columns lists of ids below ``vocab_size``."""
    first = rows_check(rows, "source", vocab_size)
    return lambda ds: first(ds) or ids_problem(ds, "target", vocab_size)


class PairsMixin(Seq2SeqSource):
    """The pairs behaviour of ``data=hf`` (``HFPairs`` = this mixin + ``HFSource``): prepare, encode, decode.

    Needs from the class it is mixed into: ``load_splits(columns)`` (per split a ``datasets.Dataset``,
    the corpus fingerprint and manifest part), ``source_column``, ``target_column``, ``tokenizer_kind``,
    ``bpe_vocab_size`` and the lengths of ``keep_lengths``.
    """

    contiguous: ClassVar[bool] = False
    # (what the class it is mixed into provides; see above)
    load_splits: Callable[[dict[str, str]], tuple[dict[str, Any], str, dict[str, Any]]]
    source_column: str | None  # (both set: a pairs source)
    target_column: str | None
    tokenizer_kind: str
    bpe_vocab_size: int

    def prepare(self) -> None:
        if getattr(self, "_splits", None):
            return
        assert self.source_column is not None and self.target_column is not None  # (a pairs source)
        columns = (self.source_column, self.target_column)
        docs, corpus_fp, corpus = self.load_splits(dict(zip(PAIR_KEYS, columns)))
        train = docs["train"].with_format("arrow")
        texts = (t for batch in train.iter(256) for c in columns for t in batch[c].to_pylist() if t)
        self.tokenizer = tok = build_tokenizer(self.tokenizer_kind, self.bpe_vocab_size, corpus_fp, texts)
        self.eos_id, self.bos_id, self.pad_id, self.vocab_size = special_ids(tok)
        self.token_bytes = [*tok.token_bytes, *[0] * (self.vocab_size - tok.vocab_size)]
        dtype = token_dtype(self.vocab_size)
        ids_key = short_hash(FORMAT, "pairs", corpus_fp, tok.config, dtype)
        self.fingerprint = short_hash(ids_key, self.source_len, self.target_len)
        self._splits, stats = {}, {}
        for name, ds in docs.items():
            key, desc = f"pairs-{short_hash(ids_key, name)}", f"xfam {self.registry_name}: pairs"
            ids = cached_map(ds, _PairEncoder(tok, columns, dtype), key, 256, _ids_check(len(ds), tok.vocab_size), desc)
            fitted = self.fit(name, ids)
            self._splits[name] = fitted.with_format("torch")
            src, tgt = pair_lengths(fitted)
            stats[name] = {"pairs": len(fitted), "source_tokens": int(src.sum()), "target_tokens": int(tgt.sum())}
            stats[name] |= self.truncated[name]
        self.manifest = {
            **corpus,
            "tokenizer": tok.config,
            "special_ids": {"eos": self.eos_id, "bos": self.bos_id, "pad": self.pad_id},
            "source_len": self.source_len,
            "target_len": self.target_len,
            "splits": stats,
            "fingerprint": self.fingerprint,
        }

    def encode(self, text: str) -> list[int]:
        """Text to the tokenizer's ids (no BOS/EOS)."""
        self.split("train")  # raises unless prepared: the tokenizer may need training first
        return self.tokenizer.encode(text)

    def decode(self, ids: Any) -> str:
        """Ids to text; eos, bos and pad are dropped."""
        self.split("train")
        return self.tokenizer.decode([int(i) for i in ids if int(i) < self.tokenizer.vocab_size])
