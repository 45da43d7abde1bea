"""``data=text``: language modelling on local text files, by default the Python standard library.

The default corpus (``paths: null``) is the standard library's own sources, found through
``sysconfig.get_paths()["stdlib"]``: it exists wherever Python does, so a fresh machine trains on
real text without a download (~1,800 ``*.py`` files, ~31 MB for CPython 3.11).

Documents are whole files. Each goes to one split by a hash of its relative path (stable across
runs, machines and seeds, so validation numbers stay comparable); ``seed`` only orders the
documents inside a split before they are packed (see ``xfam.data.packing``). The manifest lists
every file with its size and sha256; the fingerprint is a hash of those, the split assignment, the
tokenizer and ``seq_len``, and it names the ``datasets`` cache files.

Files are read as bytes and stored as they are. Documents that are not UTF-8 text (a byte sequence
that does not decode, or a NUL byte: a binary file) are kept, and each ``prepare`` logs one warning
with their count, bytes and up to 3 paths, and how to leave them out (``data.extensions``,
``data.paths``): ``documents`` knows every file's hash for the manifest and whether it is text (read
once and remembered by size, modification time and inode: ``xfam.data.files.FileFacts``), so the warning is the same
whether the documents come from the cache or not. Under the byte tokenizer the model trains on their
raw bytes (a valid input for a byte model); ``tokenizer=bpe`` works on text (the ``tokenizers``
byte-level BPE takes ``str``), so each invalid sequence reaches it, in training and in encoding, as
U+FFFD (``xfam.data.tokenize``): the model then learns the replaced text, which the warning says.
The default corpus holds a few such files (the standard library's own encoding tests, ~13 KB of ~31
MB): a fixed, known part of it that a user cannot remove except by naming other paths, so it is
reported at INFO level, not as a warning.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import pyarrow as pa
import pyarrow.compute as pc

from xfam.core.errors import ConfigError
from xfam.core.logs import log
from xfam.core.registry import Range
from xfam.data.base import DATA
from xfam.data.cache import Check, cached_generate, rows_check
from xfam.data.files import FileFacts, discover, stdlib_root
from xfam.data.packing import SPLITS, PackedLM, unigram_entropy_bits
from xfam.data.tokenize import cache_root, short_hash, tokenizer_problems

__all__ = ["TextSource", "discover", "unigram_entropy_bits"]


def _unit(text: str) -> float:
    """A number in [0, 1) fixed by ``text`` (first 52 bits of its sha256)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:13], 16) / 16**13


def not_text_message(found: list[tuple[str, str, int]], total: int, tokenizer: str, default_corpus: bool) -> str:
    """The warning about documents that are not UTF-8 text: ``found`` holds ``(path, what, bytes)``."""
    binary = sum(what == "binary" for _, what, _ in found)
    counts = ((binary, "binary (NUL bytes)"), (len(found) - binary, "not valid UTF-8"))
    kinds = ", ".join(f"{n} {what}" for n, what in counts if n)
    examples = ", ".join(path for path, _, _ in found[:3]) + (", ..." if len(found) > 3 else "")
    how = (
        "the byte tokenizer trains on their bytes as they are"
        if tokenizer == "byte"
        else "tokenizer=bpe works on text, so each invalid UTF-8 sequence reaches it as U+FFFD (the model learns "
        "the replaced text, not the file's bytes)"
    )
    fix = (
        "they are the standard library's own encoding tests; to train on other files set data.paths"
        if default_corpus
        else "if they are not meant as training text, leave them out: set data.extensions to the suffixes of "
        "your text files, or name the files to read in data.paths"
    )
    return (
        f"data=text: {len(found)} of {total} documents ({sum(n for *_, n in found):,} bytes) are not UTF-8 "
        f"text ({kinds}), e.g. {examples}; {how}. They are kept; {fix}."
    )


def _documents_check(keys: tuple[str, ...], sizes: list[int]) -> Check:
    """The cached documents of a split: one row per file, in manifest order, each as long as its file."""
    count = rows_check(len(keys))

    def check(ds: Any) -> str | None:
        if (problem := count(ds)) is not None:
            return problem
        table = ds.with_format("arrow")[:]
        if not pc.all(pc.equal(table.column("path"), pa.array(keys))).as_py():
            return "documents of other files, or in another order, than the manifest's"
        if not pc.all(pc.equal(pc.binary_length(table.column("text")), pa.array(sizes))).as_py():
            return "documents of other lengths than their files"
        return None

    return check


def _read_documents(keys: tuple[str, ...], files: tuple[str, ...], sha256: tuple[str, ...]):
    """``Dataset.from_generator`` body: the bytes of each file, checked against the manifest's hash."""
    for key, file, digest in zip(keys, files, sha256):
        data = Path(file).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise ConfigError(f"{file} changed while it was being read. Fix: run again once it stops changing.")
        yield {"path": key, "text": data}


@DATA.register("text")
class TextSource(PackedLM):
    """Byte-level (or BPE) language modelling on local text files, packed into contiguous rows.

    Args:
        paths: files or folders (walked recursively for ``extensions``; hidden folders,
            ``__pycache__`` and ``site-packages`` skipped; empty files skipped). null: the Python
            standard library's ``*.py`` sources, which need no download.
        extensions: suffixes of the files taken from folders (files named in ``paths`` are taken
            whatever their suffix). The default matches the default corpus; for prose use e.g.
            ``[".txt", ".md"]``.
        tokenizer: ``byte`` (vocab 257: 256 bytes + eos), ``bpe`` (byte-level BPE trained on
            the train split, cached), or the path of a pretrained tokenizer: a ``tokenizer.json`` or a
            local Hugging Face tokenizer folder (GPT-2's, Llama's ...; its vocabulary and end-of-document
            token are the tokenizer's own; nothing is downloaded).
        bpe_vocab_size: vocabulary of the BPE, eos included.
        num_proc: processes that tokenise (null: every core this process may use); the shards
            are the same for any value (``xfam.data.shards``).
        val_fraction / test_fraction: expected share of documents in validation / test.
        doc_mask: true: attention stays inside each document of a packed row (the batch carries
            ``segments``); false: attention crosses document boundaries (the eos token is the only
            separator, as in GPT-2-style training).
        max_bytes: cap on the bytes read, for quick runs: each split takes, in seed order, every
            document that still fits in its share of the cap (at least its smallest document).
        seq_len: tokens per row (inputs; a row stores ``seq_len + 1``).
        batch_size: rows per batch.
        seed: data seed (document order inside each split).
    """

    def __init__(
        self,
        *,
        paths: list[str] | None = None,
        extensions: list[str] = [".py"],  # noqa: B006  (copied, never mutated; YAML mirrors it)
        tokenizer: str = "byte",
        bpe_vocab_size: Annotated[int, Range(ge=257)] = 4096,
        num_proc: Annotated[int, Range(ge=1)] | None = None,
        val_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.05,
        test_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.05,
        doc_mask: bool = False,
        max_bytes: Annotated[int, Range(ge=1)] | None = None,
        seq_len: Annotated[int, Range(ge=1)] = 256,
        batch_size: Annotated[int, Range(ge=1)] = 16,
        seed: int = 0,
    ):
        self.paths = None if paths is None else [str(p) for p in paths]
        self.extensions = list(extensions)
        self.tokenizer_kind, self.bpe_vocab_size, self.num_proc = tokenizer, bpe_vocab_size, num_proc
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.doc_mask, self.max_bytes = doc_mask, max_bytes
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        problems = [
            f"extensions: {e!r} must start with a dot. Fix: write '.{e}'." for e in params["extensions"] if e[:1] != "."
        ]
        if params["val_fraction"] + params["test_fraction"] >= 1:
            problems.append(
                f"val_fraction + test_fraction = {params['val_fraction'] + params['test_fraction']:g} leaves no "
                "document for training. Fix: make their sum < 1 (e.g. 0.05 each)."
            )
        problems += tokenizer_problems(params["tokenizer"])
        return problems + discover(params["paths"], params["extensions"])[1]

    def documents(self) -> tuple[dict[str, Any], str, str, dict[str, Any]]:
        from datasets import Features, Value

        found, problems = discover(self.paths, self.extensions)
        if problems:
            raise ConfigError(problems)
        chosen = self._assign(found)
        entries, docs, not_utf8 = [], {}, []
        facts = FileFacts(cache_root() / "text-files" / f"{short_hash(self.paths, self.extensions)}.json")
        for name in SPLITS:
            if not chosen[name]:
                raise ConfigError(
                    f"data=text: no document falls in the {name} split ({len(found)} documents, val_fraction="
                    f"{self.val_fraction}, test_fraction={self.test_fraction}). Fix: pass more files or raise "
                    "the fractions."
                )
            split_entries: list[dict[str, Any]] = []
            for key, path in chosen[name]:
                size, digest, what = facts.of(path)
                if what:
                    not_utf8.append((str(path), what, size))
                split_entries.append({"path": key, "bytes": size, "sha256": digest})
            kwargs = {
                "keys": tuple(e["path"] for e in split_entries),
                "files": tuple(str(p) for _, p in chosen[name]),
                "sha256": tuple(e["sha256"] for e in split_entries),
            }
            features = Features({"path": Value("string"), "text": Value("binary")})
            key = short_hash("text-documents", name, kwargs["keys"], kwargs["sha256"])
            check = _documents_check(kwargs["keys"], [e["bytes"] for e in split_entries])
            docs[name] = cached_generate(_read_documents, kwargs, features, name, key, check)
            entries += [{**e, "split": name} for e in split_entries]
        facts.save()
        if not_utf8:
            message = not_text_message(not_utf8, len(entries), self.tokenizer_kind, self.paths is None)
            log.log(logging.INFO if self.paths is None else logging.WARNING, message)
        corpus = {
            "source": "text",
            "roots": [str(stdlib_root())] if self.paths is None else [str(Path(p).expanduser()) for p in self.paths],
            "python": sys.version.split()[0],
            "extensions": self.extensions,
            "seed": self.seed,
            "max_bytes": self.max_bytes,
            "total_bytes": sum(e["bytes"] for e in entries),
            "files": entries,
        }
        corpus_fp = short_hash([(e["path"], e["sha256"], e["split"]) for e in entries])
        return docs, "text", corpus_fp, corpus

    def _assign(self, found: list[tuple[str, Path]]) -> dict[str, list[tuple[str, Path]]]:
        """Split by a hash of the key, order by a seeded hash, then apply ``max_bytes`` per split."""
        chosen: dict[str, list[tuple[str, Path]]] = {name: [] for name in SPLITS}
        for key, path in found:
            u = _unit(key)  # test takes [0, test), validation [test, test + val), train the rest
            name = "test" if u < self.test_fraction else "train"
            if name == "train" and u < self.test_fraction + self.val_fraction:
                name = "validation"
            chosen[name].append((key, path))
        for docs in chosen.values():
            docs.sort(key=lambda d: _unit(f"{self.seed}:{d[0]}"))
        if self.max_bytes is None:
            return chosen
        share = {"validation": self.val_fraction, "test": self.test_fraction}
        for name, docs in chosen.items():
            budget, kept, used = self.max_bytes * share.get(name, 1 - self.val_fraction - self.test_fraction), [], 0
            for key, path in docs:
                if used + (size := path.stat().st_size) <= budget:
                    kept.append((key, path))
                    used += size
            chosen[name] = kept or sorted(docs, key=lambda d: d[1].stat().st_size)[:1]
        return chosen
