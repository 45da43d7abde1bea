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
once and remembered by size, modification time and inode: ``FileFacts``), so the warning is the same
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
import json
import logging
import os
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import pyarrow as pa
import pyarrow.compute as pc

from xfam.core.errors import ConfigError
from xfam.core.logs import log
from xfam.core.registry import Range
from xfam.data.base import DATA
from xfam.data.cache import Check, cached_generate, rows_check
from xfam.data.packing import SPLITS, PackedLM, unigram_entropy_bits
from xfam.data.tokenize import cache_root, short_hash, tokenizer_problems

__all__ = ["TextSource", "discover", "unigram_entropy_bits"]

#: Folders never walked: caches, installed third-party code and hidden folders (.git ...).
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


#: A file or folder modified less than this long ago is not remembered (its mtime may not move on a rewrite).
RACY_NS = 2_000_000_000
#: Walks of this process: (root, extensions) -> (the walk, {folder: mtime_ns}); see ``_walk``.
_WALKS: dict[tuple[str, tuple[str, ...]], tuple[Any, dict[str, int]]] = {}


def _walk(root: Path, extensions: list[str]) -> tuple[list[tuple[str, Path, tuple[int, int]]], Counter]:
    """Non-empty files under ``root`` ending in one of ``extensions`` as ``(path relative to root, path,
    (device, inode))`` in path order, and a count of all suffixes seen.

    Strings and ``os.scandir`` entries (which carry their type and stat), not a ``Path`` and a ``stat`` per
    file: a folder of ~56,000 files is walked in ~0.5 s instead of ~3.5 s. A run validates its config and
    then reads the documents, so the same folder is walked again in one process: the walk is kept while no
    folder's modification time changed (adding, removing or renaming a file changes its folder's), unless a
    folder changed in the last ``RACY_NS``."""
    key = (str(root), tuple(extensions))
    if key in _WALKS:
        walk, stamps = _WALKS[key]
        try:
            if all(os.stat(folder).st_mtime_ns == mtime for folder, mtime in stamps.items()):
                return walk
        except OSError:
            pass
    found, seen, exts = [], Counter(), tuple(e.lower() for e in extensions)
    top = str(root)
    folders, stamps = [top], {}
    while folders:
        folder = folders.pop()
        stamps[folder] = os.stat(folder).st_mtime_ns
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir():
                    if entry.name not in SKIP_DIRS and not entry.name.startswith("."):
                        folders.append(entry.path)
                    continue
                name = entry.name.lower()
                seen[os.path.splitext(name)[1] or "(none)"] += 1
                if name.endswith(exts) and entry.is_file() and (stat := entry.stat()).st_size > 0:
                    relative = entry.path[len(top) :].lstrip(os.sep).replace(os.sep, "/")
                    found.append((relative, entry.path, (stat.st_dev, stat.st_ino)))
    found.sort(key=lambda f: f[0].split("/"))  # (the order of Path: folder by folder)
    walk = ([(relative, Path(full), file_id) for relative, full, file_id in found], seen)
    if time.time_ns() - max(stamps.values()) > RACY_NS:  # (a folder changed just now may change again in its tick)
        _WALKS[key] = (walk, stamps)
    return walk


def discover(paths: list[str] | None, extensions: list[str]) -> tuple[list[tuple[str, Path]], list[str]]:
    """``(key, path)`` of every document, and the problems found (each ends with its fix).

    Keys are relative paths: inside the standard library as they are, inside a folder prefixed by
    the folder's name, a file by its name. Files named directly are taken whatever their suffix.
    """
    if paths is None:
        root = stdlib_root()
        files, _ = _walk(root, extensions)
        problem = f"the standard library at {root} has no file ending in {extensions}. Fix: set data.paths."
        return [(relative, path) for relative, path, _ in files], [] if files else [problem]
    docs, problems = [], [] if paths else ["paths is an empty list. Fix: name files or folders, or paths=null."]
    ids = []  # (device, inode) of each document: a file reached twice is one file
    for i, raw in enumerate(paths):
        path = Path(raw).expanduser()
        where = f"paths[{i}]={raw!r}"
        if not path.exists():
            problems.append(
                f"{where} does not exist. Fix: pass an existing file or folder, or paths=null for the "
                "built-in standard library corpus."
            )
        elif path.is_file():
            if (stat := path.stat()).st_size == 0:
                problems.append(f"{where} is an empty file. Fix: remove it from data.paths.")
            docs.append((path.name, path))
            ids.append((stat.st_dev, stat.st_ino))
        else:
            files, seen = _walk(path, extensions)
            if not files and not seen:
                problems.append(f"{where} is an empty folder. Fix: put text files in it or pass another folder.")
            elif not files:
                common = ", ".join(f"{ext} ({n})" for ext, n in seen.most_common(8))
                top = seen.most_common(1)[0][0]
                problems.append(
                    f"{where} has no non-empty file ending in {extensions} (found: {common}). Fix: set "
                    f"data.extensions to the suffixes of your text files, e.g. extensions=['{top}']."
                )
            docs += [(f"{path.name}/{relative}", file) for relative, file, _ in files]
            ids += [file_id for *_, file_id in files]
    first: dict[tuple[int, int], str] = {}  # (device, inode) of a file -> its first key (a link is the same file)
    twice = []
    for (key, _), real in zip(docs, ids):
        if real in first:
            twice.append((first[real], key))
        else:
            first[real] = key
    if twice:  # one file under two keys: read twice, and the split hash could put it in two splits
        (a, b), more = twice[0], f" and {len(twice) - 1} more" if len(twice) > 1 else ""
        problems.append(
            f"data.paths reach the same file twice: {a} is also {b}{more} (a folder and a folder or file inside "
            "it?). It would be read twice and could land in two splits. Fix: name each file once in data.paths."
        )
    return docs, problems


def _unit(text: str) -> float:
    """A number in [0, 1) fixed by ``text`` (first 52 bits of its sha256)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:13], 16) / 16**13


def not_text(data: bytes) -> str | None:
    """``"binary"`` when ``data`` holds a NUL byte, ``"not UTF-8"`` when it does not decode, else None."""
    if b"\0" in data:
        return "binary"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    return None


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


class FileFacts:
    """Size, SHA-256 and ``not_text`` of files, remembered by ``(size, mtime_ns, inode)`` in a JSON file.

    Hashing every file on every start made start-up grow with the corpus (~3 s per GB); a file whose size,
    modification time and inode are unchanged is taken as unchanged (as ``make`` and ``git`` do), and its facts
    are not read again. A change that keeps all three is not seen; the documents are still checked against
    the hashes whenever they are read (``_read_documents``).
    """

    def __init__(self, path: Path):
        self.path, self.changed = path, False  # (files modified in the last RACY_NS are never remembered)
        self.known: dict[str, list] = {}
        if path.exists():
            try:
                self.known = dict(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as err:
                log.warning("data cache %s cannot be read (%s); hashing the files again", path, err)

    def of(self, file: Path) -> tuple[int, str, str | None]:
        """``(bytes, sha256, not_text(data))`` of ``file``."""
        stat = file.stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        entry = self.known.get(str(file))
        if entry is not None and entry[:3] == stamp:
            return stat.st_size, entry[3], entry[4]
        data = file.read_bytes()
        facts = (len(data), hashlib.sha256(data).hexdigest(), not_text(data))
        if time.time_ns() - stat.st_mtime_ns > RACY_NS:  # (a file written just now may change again in its tick)
            self.known[str(file)], self.changed = [*stamp, facts[1], facts[2]], True
        return facts

    def save(self) -> None:
        if self.changed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.known))
            os.replace(tmp, self.path)


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
            split_entries = []
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
