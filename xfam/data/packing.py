"""How rows are made and cached: LM packing of documents, and generated rows of synthetic tasks.

LM packing (``PackedLM``, the base of the ``text`` and ``hf`` sources). Every document is
tokenized and followed by the ``eos`` token (``join_eos``; a source whose rows are pieces of one
text concatenates them instead), the documents of a split form one token stream
``d0 eos d1 eos ...``, and the stream is cut into rows of ``seq_len + 1`` tokens with stride
``seq_len``: row k is ``stream[k*S : k*S + S + 1]``, so consecutive rows overlap by one token,
every stream token after the first is a target exactly once, and row k+1 continues row k
(``contiguous = True``). The last ``< S`` targets of a split that do not fill a row are dropped.

The documents -> ids stage writes each split's stream once, in parallel (``data.num_proc``
processes, default every available core), as token shards in the smallest unsigned dtype that holds
the vocabulary (uint16 for the byte tokenizer and GPT-2's, uint32 past 65,536 ids), in a folder named
by a hash of everything that changes the ids (document contents, tokenizer, eos joining): see
``xfam.data.shards`` (resumable, checked in constant time on load, rebuilt with a warning when
damaged). The ids -> rows stage is not stored: ``PackedRows`` reads each row from the memory-mapped
shards when the loader asks for it, so ``seq_len`` can change without tokenising again and start-up
does not grow with the corpus. The fingerprint (which checkpoints record) depends on the rows' contents
only, not on how they are stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import numpy as np
import pyarrow.compute as pc

from xfam.core.errors import ConfigError
from xfam.data.base import DataSource, Task
from xfam.data.cache import cached_generate, rows_check
from xfam.data.shards import (  # noqa: F401  (pack_rows: the packing rule, defined beside the shards it reads)
    SHARD_FORMAT,
    Encoder,
    PackedRows,
    TokenStream,
    available_cores,
    pack_rows,
    prepare_split,
)
from xfam.data.tokenize import build_tokenizer, cache_root, short_hash, token_dtype

SPLITS = ("train", "validation", "test")
#: Enters every cache key: bump it when the stored form of ids or rows changes.
FORMAT = 1
#: The parameter that sets the size of each split in the synthetic tasks.
NUM_KEY = {"train": "num_train", "validation": "num_val", "test": "num_test"}


def doc_bytes(ds: Any, column: str) -> np.ndarray:
    """Bytes of text in each document of ``ds`` (str as UTF-8, or bytes; null counts 0), from Arrow's offsets."""
    col = ds.with_format("arrow")[column]
    return pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False)


def no_eos_message(owner: str, kind: str, tokenizer: Any) -> str:
    """The refusal of a tokenizer without an end-of-document token where documents are joined with one."""
    special = ", ".join(getattr(tokenizer, "special_tokens", [])) or "none"
    return (
        f"data={owner}: tokenizer {kind} has no end-of-document token (its special tokens: {special}), and documents "
        f"are joined with one. Fix: a tokenizer folder whose tokenizer_config.json names eos_token"
        + (", or data.join=concat." if owner == "hf" else ".")
    )


def get_split(splits: dict[str, Any], name: str, owner: str) -> Any:
    if not splits:
        raise RuntimeError(f"data={owner}: call prepare() before split()")
    if name not in splits:
        raise KeyError(f"data={owner}: unknown split {name!r}; splits are {', '.join(splits)}")
    return splits[name]


def unigram_entropy_bits(targets: Iterable[np.ndarray], id_bytes: list[bytes] | None = None) -> float:
    """Entropy in bits per byte of the byte-unigram distribution of a packed LM split.

    ``targets``: every target token of the split once (``PackedRows.targets()``: ``stream[1 : 1 + rows * S]``,
    in pieces); tokens that stand for no byte (``eos``) are left out. ``id_bytes[i]`` is the byte string of
    token i (``tokenizer.id_bytes()``); None means ids 0..255 are bytes (the byte tokenizer).
    This is the loss of the best model that ignores context: a floor that any LM must beat.
    """
    counts = np.zeros(256 if id_bytes is None else len(id_bytes), dtype=np.float64)
    for piece in targets:
        found = np.bincount(np.asarray(piece, dtype=np.int64), minlength=len(counts)).astype(np.float64)
        if len(found) > len(counts):
            counts = np.pad(counts, (0, len(found) - len(counts)))
        counts[: len(found)] += found
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
    """Base of language modelling on documents: tokenizer, token shards, packing, manifest.

    A subclass sets ``seq_len, batch_size, seed, doc_mask, tokenizer_kind, bpe_vocab_size, num_proc,
    join_eos`` in ``__init__`` and implements ``documents()``.
    """

    num_proc: int | None = None
    tokenizer_kind: str  # (set by the subclass, as below)
    bpe_vocab_size: int
    _splits: dict[str, Any]  # per split its rows (``PackedRows``; a streamed train split: ``StreamedSplit``)

    task: ClassVar[Task] = "lm"
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
        sizes = {name: doc_bytes(ds, column) for name, ds in docs.items()}
        for name, n in sizes.items():  # before any work: an empty split would be tokenised for nothing
            if not (n > 0).any():
                raise ConfigError(
                    f"data={self.registry_name}: the {name} split has no text ({len(n)} documents, all empty). "
                    f"Fix: give it documents with text (data.paths, data.path, data.{name}_split or the fractions)."
                )
        train_texts = (t for batch in docs["train"].with_format("arrow").iter(256) for t in batch[column].to_pylist())
        self.tokenizer = tok = build_tokenizer(self.tokenizer_kind, self.bpe_vocab_size, corpus_fp, train_texts)
        self.vocab_size, self.token_bytes = tok.vocab_size, list(tok.token_bytes)
        self.eos_id = tok.eos_id if self.join_eos else None
        if self.join_eos and tok.eos_id is None:
            raise ConfigError(no_eos_message(self.registry_name, self.tokenizer_kind, tok))
        dtype = token_dtype(tok.vocab_size)
        ids_key = short_hash(FORMAT, corpus_fp, tok.config, self.join_eos, dtype)
        self.fingerprint = short_hash(ids_key, self.seq_len)
        root = cache_root() / "shards" / short_hash(SHARD_FORMAT, ids_key)
        encoder, procs = Encoder(docs, column, tok, self.eos_id, dtype), self.num_proc or available_cores()
        self._splits, stats = {}, {}
        for name in docs:
            desc = f"xfam {self.registry_name}: tokenize {name}"
            index = prepare_split(encoder, name, root / name, sizes[name], procs, desc, tok.vocab_size)
            rows = PackedRows(TokenStream(root / name, index), self.seq_len)
            num_tokens, shards = len(rows.stream), index["shards"]
            if len(rows) == 0:
                raise ConfigError(
                    f"data={self.registry_name}: the {name} split has {num_tokens} tokens, fewer than "
                    f"seq_len + 1 = {self.seq_len + 1}, so it makes no row. Fix: lower data.seq_len or give "
                    f"that split more text (a larger fraction, more files, a larger max_bytes)."
                )
            self._splits[name] = rows
            stats[name] = {
                "documents": sum(r["non_empty"] for r in shards),
                "text_bytes": int(sizes[name].sum()),
                "tokens": num_tokens,
                "rows": len(rows),
                "shards": [
                    {"file": f"{name}/{r['file']}", "tokens": r["tokens"], "bytes": r["size"]} for r in index["shards"]
                ],
            }
        self.manifest = {
            **corpus,
            "tokenizer": tok.config,
            "join": "eos" if self.join_eos else "concat",
            "seq_len": self.seq_len,
            "token_dtype": dtype,
            "shard_folder": str(root),
            "splits": stats,
            "fingerprint": self.fingerprint,
        }

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
        return unigram_entropy_bits(self.split(name).targets(), id_bytes)


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
