"""``data=docstrings``: code summarisation on the Python standard library (function -> docstring summary).

A real sequence-to-sequence task that needs no download, in the spirit of CodeXGLUE's code-to-text
task (Lu et al., 2021, arXiv:2102.04664; its Python part is CodeSearchNet's, Husain et al., 2019,
arXiv:1909.09436): for every function and method (``def`` and ``async def``, nested ones and methods
included) of the standard library's ``*.py`` files that has a docstring,

* source = the function's source text without its docstring: from its first decorator (or ``def``)
  to the end of its body, as ``ast`` locates them (``lineno``/``col_offset`` in UTF-8 bytes, the
  positions ``ast.get_source_segment`` reads). The docstring statement is removed: its whole lines when
  nothing else stands on them (the usual layout), else exactly the statement. Every other byte is
  kept, then the text is dedented: each line loses the ``def``'s indentation where it starts with it.
  A function whose body is only its docstring keeps just its signature (and decorators).
* target = the first paragraph of the docstring: ``inspect.cleandoc`` (what ``ast.get_docstring``
  returns), up to the first blank line, whitespace runs collapsed to one space. Functions whose
  target is empty are skipped.

Files are split as ``data=text`` splits them (``xfam.data.text``: a hash of the path inside the
standard library, so a file, and all of its functions, falls in one split, the same one for every
seed and machine, and the same as under ``data=text`` with equal fractions: a model pretrained there
never saw the functions of these validation and test files). ``seed`` orders the files of a split;
``max_files`` and ``max_pairs`` cap each split to about its share (at least 1) of files and pairs,
taken in that order, for quick runs. Files that do not parse under this Python (a handful of Python 2
and deliberately broken test files) give no pair.

Ids: the UTF-8 bytes 0..255 of each text (the byte tokenizer, ``xfam.data.tokenize``); ``eos`` = 256
(the byte tokenizer's own, as ``data=hf`` pairs), ``bos`` = 257, ``pad`` = 258, vocabulary 259;
``token_bytes`` is 1 per byte and 0 per special id (bits per byte of the target). Pairs longer than
``source_len`` / ``target_len - 1`` are cut or refused by ``fit_pairs`` (``xfam.data.seq2seq``).
Rows also carry ``path``, ``function`` (the qualified name) and ``line``, for inspection (the torch-formatted
splits serve only ``source`` and ``target``).

The pairs of a split are a cached ``Dataset.from_generator`` keyed by the files (paths, sha256), the
Python version, the caps and the extraction version; the manifest lists every file (path, bytes, sha256,
split, pairs) and per split the pair counts, as ``data=text``'s lists its files.
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import sys
import tokenize
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from xfam.core.errors import ConfigError
from xfam.core.registry import Range
from xfam.data.base import DATA
from xfam.data.cache import cached_generate, ids_problem
from xfam.data.files import discover, stdlib_root
from xfam.data.packing import FORMAT, SPLITS
from xfam.data.seq2seq import COLUMNS, Seq2SeqSource, pair_lengths
from xfam.data.text import TextSource, _read_documents
from xfam.data.tokenize import ByteTokenizer, short_hash

VERSION = "docstrings-1"
EOS, BOS, PAD = 256, 257, 258
VOCAB = 259
_LINE_END = re.compile(rb"\r\n|\r|\n")  # the line ends the parser counts (``ast`` line numbers)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


# -- the files: data=text's discovery and split, a cap -------------------------------------------------------------


def split_share(cap: int | None, split: str, val_fraction: float, test_fraction: float) -> int | None:
    """About ``split``'s share of ``cap`` (at least 1): the fractions for validation/test, the rest for train."""
    if cap is None:
        return None
    share = {"validation": val_fraction, "test": test_fraction}.get(split, 1 - val_fraction - test_fraction)
    return max(1, round(cap * share))


def stdlib_files(
    val_fraction: float, test_fraction: float, seed: int, max_files: int | None, owner: str
) -> dict[str, list[tuple[str, Path]]]:
    """Per split the ``(key, path)`` of the standard library's ``*.py`` files, as ``data=text`` splits and
    orders them (``TextSource._assign``), each split cut to its share of ``max_files``."""
    found, problems = discover(None, [".py"])
    if problems:
        raise ConfigError(problems)
    chosen = TextSource(val_fraction=val_fraction, test_fraction=test_fraction, seed=seed)._assign(found)
    for name in SPLITS:
        if not chosen[name]:
            raise ConfigError(
                f"data={owner}: no file of the standard library ({len(found)} files) falls in the {name} split "
                f"(val_fraction={val_fraction}, test_fraction={test_fraction}). Fix: raise the fractions."
            )
        chosen[name] = chosen[name][: split_share(max_files, name, val_fraction, test_fraction)]
    return chosen


def file_entries(chosen: dict[str, list[tuple[str, Path]]]) -> list[dict[str, Any]]:
    """The manifest's files: ``path`` (the key), ``bytes``, ``sha256``, ``split``, in split then seed order."""
    entries = []
    for name in SPLITS:
        for key, path in chosen[name]:
            data = path.read_bytes()
            entries.append({"path": key, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "split": name})
    return entries


def fraction_problems(params: dict[str, Any]) -> list[str]:
    """``val_fraction + test_fraction`` of a source split by standard-library file must leave files to train on."""
    total = params["val_fraction"] + params["test_fraction"]
    if total >= 1:
        return [
            f"val_fraction + test_fraction = {total:g} leaves no file for training. Fix: make their sum < 1 "
            "(e.g. 0.05 each)."
        ]
    return []


def stdlib_corpus(
    val_fraction: float, test_fraction: float, seed: int, max_files: int | None, owner: str, version: str
) -> tuple[dict[str, list[tuple[str, Path]]], list[dict[str, Any]], str]:
    """The standard-library files of each split (``stdlib_files``), their manifest entries (``file_entries``) and
    a fingerprint of them, the Python version and the extraction ``version``."""
    chosen = stdlib_files(val_fraction, test_fraction, seed, max_files, owner)
    entries = file_entries(chosen)
    python = sys.version.split()[0]
    return chosen, entries, short_hash(FORMAT, version, python, [(e["path"], e["sha256"], e["split"]) for e in entries])


def decode_source(data: bytes) -> str | None:
    """A Python file's text under its declared encoding (PEP 263; a UTF-8 BOM dropped), None if it does not decode."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


# -- extraction ------------------------------------------------------------------------------------------------------


def first_paragraph(docstring: str) -> str:
    """The first paragraph of a docstring (``inspect.cleandoc`` applied already), whitespace collapsed."""
    lines: list[str] = []
    for line in docstring.splitlines():
        if not line.strip():
            if lines:
                break
            continue
        lines.append(line)
    return " ".join(" ".join(lines).split())


class _Lines:
    """``(lineno, col_offset)`` of ``ast`` to offsets in the UTF-8 bytes of a text."""

    def __init__(self, raw: bytes):
        self.raw = raw
        self.starts = [0] + [m.end() for m in _LINE_END.finditer(raw)]  # [lines] offset of each line

    def at(self, lineno: int, col: int) -> int:
        return self.starts[lineno - 1] + col

    def line_start(self, lineno: int) -> int:
        return self.starts[lineno - 1]

    def next_line(self, lineno: int) -> int:
        """Offset of the line after ``lineno`` (the end of the text after the last line)."""
        return self.starts[lineno] if lineno < len(self.starts) else len(self.raw)


def function_source(lines: _Lines, node: ast.FunctionDef | ast.AsyncFunctionDef) -> bytes:
    """The function's source bytes (decorators included) without its docstring statement, dedented."""
    raw, doc = lines.raw, node.body[0]
    assert node.end_lineno is not None and node.end_col_offset is not None  # (ast.parse sets every position)
    assert doc.end_lineno is not None and doc.end_col_offset is not None
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    start, end = lines.line_start(first), lines.at(node.end_lineno, node.end_col_offset)
    cut_a, cut_b = lines.at(doc.lineno, doc.col_offset), lines.at(doc.end_lineno, doc.end_col_offset)
    before = raw[lines.line_start(doc.lineno) : cut_a]
    after = raw[cut_b : lines.next_line(doc.end_lineno)]
    if not before.strip() and not after.strip():  # the docstring owns its lines: remove them whole
        cut_a, cut_b = lines.line_start(doc.lineno), lines.next_line(doc.end_lineno)
    text = raw[start:cut_a] + raw[cut_b:end] if cut_b < end else raw[start:cut_a]
    indent = raw[lines.line_start(node.lineno) : lines.at(node.lineno, node.col_offset)]
    if not indent:
        return text
    return b"".join(line[len(indent) :] if line.startswith(indent) else line for line in text.splitlines(True))


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of a module with its qualified name (``C.m``, ``f.<locals>.g``), in source order."""
    stack: list[tuple[str, ast.AST]] = [("", tree)]
    found = []
    while stack:
        prefix, parent = stack.pop()
        for child in ast.iter_child_nodes(parent):
            if isinstance(child, (*_FUNCTIONS, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if isinstance(child, _FUNCTIONS):
                    found.append((name, child))
                stack.append((f"{name}.<locals>." if isinstance(child, _FUNCTIONS) else f"{name}.", child))
            else:
                stack.append((prefix, child))
    yield from sorted(found, key=lambda f: (f[1].lineno, f[1].col_offset))


def extract_pairs(data: bytes) -> list[tuple[str, int, str, str]]:
    """``(qualified name, line, source, target)`` of every function of a file with a non-empty summary
    (see the module docstring); none when the file does not decode or parse."""
    text = decode_source(data)
    if text is None:
        return []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # ValueError: NUL bytes
        return []
    lines, pairs = _Lines(text.encode("utf-8")), []
    for name, node in _functions(tree):
        doc = ast.get_docstring(node, clean=True)
        target = first_paragraph(doc) if doc else ""
        if target:
            source = function_source(lines, node).decode("utf-8")
            pairs.append((name, node.lineno, source, target))
    return pairs


def _read_pairs(keys: tuple[str, ...], files: tuple[str, ...], sha256: tuple[str, ...], max_pairs: int | None):
    """``Dataset.from_generator`` body: the pairs of each file in order (hash-checked), up to ``max_pairs``."""
    made = 0
    for doc in _read_documents(keys, files, sha256):
        for name, line, source, target in extract_pairs(doc["text"]):
            if made == max_pairs:
                return
            made += 1
            src, tgt = source.encode("utf-8"), target.encode("utf-8")
            yield {"path": doc["path"], "function": name, "line": line, "source": list(src), "target": list(tgt)}


def _pairs_check(ds: Any) -> str | None:
    """A cached split: byte ids (below 256) in both columns."""
    return ids_problem(ds, "source", 256) or ids_problem(ds, "target", 256)


@DATA.register("docstrings")
class Docstrings(Seq2SeqSource):
    """Summarise standard-library functions: source code (bytes) -> the first paragraph of its docstring.

    Args:
        val_fraction / test_fraction: expected share of the files in validation / test (split by file,
            as ``data=text``).
        max_files: cap on the files read, for quick runs: each split takes about its share (at least 1),
            in seed order. null: every file.
        max_pairs: cap on the pairs, for quick runs: each split keeps about its share (at least 1), the
            first in file (seed) order and source order. null: every pair.
        source_len: the most source bytes the encoder reads.
        target_len: the most decoder positions, BOS plus target bytes.
        truncate: cut longer pairs to fit (counted in the log) instead of refusing them.
        batch_size: pairs per batch.
        seed: data seed (the order of the files inside each split, hence what the caps keep).
    """

    paper = "Lu et al., 2021 (CodeXGLUE code-to-text)"
    byte_text = True  # byte-level text: bits per byte of the targets

    def __init__(
        self,
        *,
        val_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.05,
        test_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.05,
        max_files: Annotated[int, Range(ge=1)] | None = None,
        max_pairs: Annotated[int, Range(ge=1)] | None = None,
        source_len: Annotated[int, Range(ge=1)] = 512,
        target_len: Annotated[int, Range(ge=2)] = 128,
        truncate: bool = True,
        batch_size: Annotated[int, Range(ge=1)] = 16,
        seed: int = 0,
    ):
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.max_files, self.max_pairs = max_files, max_pairs
        self.keep_lengths(
            source_len=source_len, target_len=target_len, truncate=truncate, batch_size=batch_size, seed=seed
        )
        self.vocab_size, self.eos_id, self.bos_id, self.pad_id = VOCAB, EOS, BOS, PAD
        self.token_bytes = [1] * 256 + [0, 0, 0]
        self.tokenizer = ByteTokenizer()

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        return fraction_problems(params)

    def prepare(self) -> None:
        if getattr(self, "_splits", None):
            return
        from datasets import Features, List, Value

        owner = self.registry_name or "docstrings"
        chosen, entries, corpus_fp = stdlib_corpus(
            self.val_fraction, self.test_fraction, self.seed, self.max_files, owner, VERSION
        )
        self.fingerprint = short_hash(corpus_fp, self.max_pairs, self.source_len, self.target_len, self.truncate)
        features = Features(
            {
                "path": Value("string"),
                "function": Value("string"),
                "line": Value("int32"),
                "source": List(Value("uint8")),
                "target": List(Value("uint8")),
            }
        )
        self._splits, stats = {}, {}
        per_file: Counter[str] = Counter()
        for name in SPLITS:
            mine = [e for e in entries if e["split"] == name]
            cap = split_share(self.max_pairs, name, self.val_fraction, self.test_fraction)
            kwargs = {
                "keys": tuple(e["path"] for e in mine),
                "files": tuple(str(p) for _, p in chosen[name]),
                "sha256": tuple(e["sha256"] for e in mine),
                "max_pairs": cap,
            }
            key = short_hash(corpus_fp, "docstrings-pairs", name, cap)
            try:  # (datasets refuses to write a split of no rows: "corresponds to no data")
                ds = cached_generate(_read_pairs, kwargs, features, name, key, _pairs_check) if mine else None
            except ValueError:
                ds = None
            if ds is None or len(ds) == 0:
                raise ConfigError(
                    f"data={owner}: the {name} split has no function with a docstring ({len(mine)} files). "
                    "Fix: a larger data.max_files (or null), or larger data.val_fraction / data.test_fraction."
                )
            per_file.update(ds.with_format("arrow")["path"].to_pylist())
            ds = self.fit(name, ds)
            self._splits[name] = ds.with_format("torch", columns=list(COLUMNS))
            src, tgt = pair_lengths(ds)
            stats[name] = {
                "files": len(mine),
                "pairs": len(ds),
                "source_bytes": int(src.sum()),
                "target_bytes": int(tgt.sum()),
                **self.truncated[name],
            }
        self.manifest = {
            "source": "docstrings",
            "extraction": VERSION,
            "root": str(stdlib_root()),
            "python": sys.version.split()[0],
            "seed": self.seed,
            "max_files": self.max_files,
            "max_pairs": self.max_pairs,
            "special_ids": {"eos": EOS, "bos": BOS, "pad": PAD},
            "source_len": self.source_len,
            "target_len": self.target_len,
            "total_bytes": sum(e["bytes"] for e in entries),
            "files": [{**e, "pairs": per_file[e["path"]]} for e in entries],
            "splits": stats,
            "fingerprint": self.fingerprint,
        }

    def tokenizer_state(self) -> dict[str, Any]:
        return self.tokenizer.state()

    def encode(self, text: str) -> list[int]:
        """Text to its UTF-8 bytes (no BOS/EOS)."""
        return self.tokenizer.encode(text)

    def decode(self, ids: Any) -> str:
        """Bytes to text (invalid UTF-8 replaced); eos, bos and pad are dropped."""
        return self.tokenizer.decode(int(i) for i in ids)
