"""How rows are made and cached: LM packing of documents, and generated rows of synthetic tasks.

LM packing (``PackedLM``, the base of the ``text`` and ``hf`` sources). Every document is
tokenized and followed by the ``eos`` token (``join_eos``; a source whose rows are pieces of one
text concatenates them instead), the documents of a split form one token stream
``d0 eos d1 eos ...``, and the stream is cut into rows of ``seq_len + 1`` tokens with stride
``seq_len``: row k is ``stream[k*S : k*S + S + 1]``, so consecutive rows overlap by one token,
every stream token after the first is a target exactly once, and row k+1 continues row k
(``contiguous = True``). The last ``< S`` targets of a split that do not fill a row are dropped.

Both stages, documents -> ids and ids -> rows, are ``datasets.map`` calls whose cache files are
named by fingerprints of everything that changes their output (document contents, tokenizer,
``seq_len``), so a second ``prepare`` only memory-maps them; a cache file that cannot be used is
rebuilt with a warning (``xfam.data.cache``). Tokens are stored in the smallest
unsigned dtype (uint16 for the byte tokenizer); torch formatting widens them to int64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from xfam.core.errors import ConfigError
from xfam.data.base import DataSource
from xfam.data.cache import Check, cached_generate, cached_map, rows_check
from xfam.data.tokenize import build_tokenizer, short_hash, token_dtype

SPLITS = ("train", "validation", "test")
#: Enters every cache key: bump it when the stored form of ids or rows changes.
FORMAT = 1
#: The parameter that sets the size of each split in the synthetic tasks.
NUM_KEY = {"train": "num_train", "validation": "num_val", "test": "num_test"}


def pack_rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """``[n, seq_len + 1]`` rows of a token stream, stride ``seq_len``; ``n = (len - 1) // seq_len``."""
    n = max(0, (len(stream) - 1) // seq_len)
    if n == 0:
        return np.zeros((0, seq_len + 1), dtype=stream.dtype)
    windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)  # [len - S, S + 1], a view
    return np.ascontiguousarray(windows[::seq_len][:n])


class _Encoder:
    """``datasets.map`` function: a table of documents -> a table with one ``ids`` list per non-empty one."""

    def __init__(self, tokenizer: Any, column: str, eos_id: int | None, dtype: str):
        self.tokenizer, self.column, self.eos_id, self.dtype = tokenizer, column, eos_id, dtype

    def __call__(self, table: pa.Table) -> pa.Table:
        docs = [d for d in table.column(self.column).to_pylist() if d]
        arrays = [a.astype(self.dtype, copy=False) for a in self.tokenizer.encode_docs(docs)]
        if self.eos_id is not None:
            arrays = [np.append(a, np.array(self.eos_id, dtype=self.dtype)) for a in arrays]
        offsets = np.cumsum([0] + [len(a) for a in arrays], dtype=np.int64)
        values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=self.dtype)
        return pa.table({"ids": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))})


class _Packer:
    """``datasets.map`` function over batches of ``ids``, in order, carrying the unfinished row.

    Stateful on purpose: ``map`` runs batches in order in one process (no ``num_proc``), and the
    carry makes the output identical to ``pack_rows`` of the whole stream with bounded memory.
    """

    def __init__(self, seq_len: int, dtype: str):
        self.seq_len, self.carry = seq_len, np.zeros(0, dtype=dtype)

    def __call__(self, table: pa.Table) -> pa.Table:
        flat = table.column("ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        stream = np.concatenate([self.carry, flat.astype(self.carry.dtype, copy=False)])
        rows = pack_rows(stream, self.seq_len)
        self.carry = stream[len(rows) * self.seq_len :]  # the last row's final token opens the next row
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), self.seq_len + 1)
        return pa.table({"tokens": tokens})


def non_empty(ds: Any, column: str) -> int:
    """Rows of ``ds`` whose ``column`` (text or bytes) is neither null nor empty: the documents ``_Encoder`` keeps."""
    lengths = pc.binary_length(ds.with_format("arrow")[column].combine_chunks())
    return int(pc.sum(pc.greater(lengths, 0)).as_py() or 0)


def get_split(splits: dict[str, Any], name: str, owner: str) -> Any:
    if not splits:
        raise RuntimeError(f"data={owner}: call prepare() before split()")
    if name not in splits:
        raise KeyError(f"data={owner}: unknown split {name!r}; splits are {', '.join(splits)}")
    return splits[name]


def unigram_entropy_bits(split: Any, id_bytes: list[bytes] | None = None) -> float:
    """Entropy in bits per byte of the byte-unigram distribution of a packed LM split.

    Counts the bytes of every target token (``tokens[:, 1:]`` of each row: each stream token once)
    and leaves out tokens that stand for no byte (``eos``). ``id_bytes[i]`` is the byte string of
    token i (``tokenizer.id_bytes()``); None means ids 0..255 are bytes (the byte tokenizer).
    This is the loss of the best model that ignores context: a floor that any LM must beat.
    """
    tokens = split.with_format("arrow")["tokens"].combine_chunks()
    width = tokens.type.list_size
    targets = tokens.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)[:, 1:].ravel()
    counts = np.bincount(targets, minlength=256).astype(np.float64)
    if id_bytes is None:
        byte_counts = counts[:256]
    else:
        table = np.zeros((max(len(id_bytes), len(counts)), 256))
        for i, b in enumerate(id_bytes):
            table[i] = np.bincount(np.frombuffer(b, dtype=np.uint8), minlength=256)
        byte_counts = counts @ table[: len(counts)]
    p = byte_counts[byte_counts > 0] / byte_counts.sum()
    return float(-(p * np.log2(p)).sum())


class PackedLM(DataSource):
    """Base of language modelling on documents: tokenizer, packing, caching, manifest.

    A subclass sets ``seq_len, batch_size, seed, doc_mask, tokenizer_kind, bpe_vocab_size,
    join_eos`` in ``__init__`` and implements ``documents()``.
    """

    task = "lm"
    contiguous = True
    byte_text = True
    join_eos: bool = True

    def documents(self) -> tuple[dict[str, Any], str, str, dict[str, Any]]:
        """Per split a ``datasets.Dataset`` of documents, the name of its text column (str or
        bytes), a fingerprint of the documents, and the corpus part of the manifest."""
        raise NotImplementedError  # abstract

    def prepare(self) -> None:
        if getattr(self, "_splits", None):
            return  # prepared already (the data module calls prepare in prepare_data and in setup)
        docs, column, corpus_fp, corpus = self.documents()
        train_texts = (t for batch in docs["train"].with_format("arrow").iter(256) for t in batch[column].to_pylist())
        self.tokenizer = tok = build_tokenizer(self.tokenizer_kind, self.bpe_vocab_size, corpus_fp, train_texts)
        self.vocab_size, self.token_bytes = tok.vocab_size, list(tok.token_bytes)
        self.eos_id = tok.eos_id if self.join_eos else None
        dtype = token_dtype(tok.vocab_size)
        ids_key = short_hash(FORMAT, corpus_fp, tok.config, self.join_eos, dtype)
        self.fingerprint = short_hash(ids_key, self.seq_len)
        self._splits, stats = {}, {}
        for name, ds in docs.items():
            encoder, key = _Encoder(tok, column, self.eos_id, dtype), f"ids-{short_hash(ids_key, name)}"
            ids = self._map(ds, encoder, key, 256, rows_check(non_empty(ds, column), "ids", tok.vocab_size))
            num_tokens = int(pc.sum(pc.list_value_length(ids.with_format("arrow")["ids"])).as_py() or 0)
            packer, key = _Packer(self.seq_len, dtype), f"rows-{short_hash(self.fingerprint, name)}"
            n_rows = max(0, (num_tokens - 1) // self.seq_len)
            check = rows_check(n_rows, "tokens", tok.vocab_size, self.seq_len + 1)
            rows = self._map(ids, packer, key, 4096, check)
            if len(rows) == 0:
                raise ConfigError(
                    f"data={self.registry_name}: the {name} split has {num_tokens} tokens, fewer than "
                    f"seq_len + 1 = {self.seq_len + 1}, so it makes no row. Fix: lower data.seq_len or give "
                    f"that split more text (a larger fraction, more files, a larger max_bytes)."
                )
            self._splits[name] = rows.with_format("torch")
            stats[name] = {"documents": len(ids), "tokens": num_tokens, "rows": len(rows)}
        self.manifest = {
            **corpus,
            "tokenizer": tok.config,
            "join": "eos" if self.join_eos else "concat",
            "seq_len": self.seq_len,
            "splits": stats,
            "fingerprint": self.fingerprint,
        }

    def _map(self, ds: Any, fn: Callable[[pa.Table], pa.Table], key: str, batch_size: int, check: Check) -> Any:
        """``fn`` over ``ds`` in batches, cached in ``<cache_root>/lm/<key>.arrow`` (``xfam.data.cache``)."""
        return cached_map(ds, fn, key, batch_size, check, f"xfam {self.registry_name}: {key.split('-')[0]}")

    def split(self, name: str) -> Any:
        return get_split(getattr(self, "_splits", {}), name, self.registry_name)

    def encode(self, text: str) -> list[int]:
        self.split("train")  # raises unless prepared: the tokenizer may need training first
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        self.split("train")
        return self.tokenizer.decode(ids)

    def tokenizer_state(self) -> dict[str, Any]:
        self.split("train")
        return self.tokenizer.state()

    def unigram_entropy_bits(self, name: str) -> float:
        """Byte-unigram entropy (bits per byte) of one prepared split; see ``unigram_entropy_bits``."""
        id_bytes = None if self.tokenizer.config["kind"] == "byte" else self.tokenizer.id_bytes()
        return unigram_entropy_bits(self.split(name), id_bytes)


def masked_lm_features(seq_len: int, dtype: str) -> Any:
    """Features of fixed-length lm rows with a target mask: ``tokens`` ``[S + 1]``, ``target_mask`` ``[S]``."""
    from datasets import Features, List, Value

    tokens, mask = List(Value(dtype), length=seq_len + 1), List(Value("bool"), length=seq_len)
    return Features({"tokens": tokens, "target_mask": mask})


class GeneratedSource(DataSource):
    """Base of synthetic tasks: each split generated from the seed by ``Dataset.from_generator``,
    cached under a fingerprint of the generator version, its parameters, the seed and the split.

    A subclass takes ``num_train / num_val / num_test`` (rows per split: a cached split with another
    count is damaged and is generated again) and calls ``keep_params(locals())`` in ``__init__``."""

    id_column = "tokens"

    def keep_params(self, args: dict[str, Any], exclude: tuple[str, ...] = ()) -> None:
        """Store the constructor's ``locals()``: every argument but ``batch_size`` (and ``exclude``)
        determines the generated data and enters ``self.params``, hence the fingerprint."""
        args = {k: v for k, v in args.items() if k not in ("self", "__class__")}
        self.seq_len, self.batch_size, self.seed = args["seq_len"], args.pop("batch_size"), args["seed"]
        self.params = {k: v for k, v in args.items() if k not in exclude}

    def generate(self, generator: Callable[..., Iterator[dict]], params: dict[str, Any], features: Any) -> None:
        if getattr(self, "_splits", None):
            return
        self.fingerprint = short_hash(FORMAT, self.registry_name, params)
        self._splits = {}
        width = getattr(features[self.id_column], "length", -1)  # List(..., length=n): every row holds n ids
        width, labels = width if width > 0 else None, None if self.num_classes is None else ("label", self.num_classes)
        for name in SPLITS:
            check = rows_check(params[NUM_KEY[name]], self.id_column, self.vocab_size, width, labels)
            kwargs, key = {"params": params, "split": name}, short_hash(self.fingerprint, name)
            self._splits[name] = cached_generate(generator, kwargs, features, name, key, check).with_format("torch")

    def split(self, name: str) -> Any:
        return get_split(getattr(self, "_splits", {}), name, self.registry_name)
