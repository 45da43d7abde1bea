"""``data=pytokens``: per-byte tagging of Python source with the token types of the ``tokenize`` module.

A real token-classification task that needs no download: every byte of the standard library's
``*.py`` files is labelled with the type of the Python token it belongs to, as the standard
``tokenize`` module (the language's own lexer, in pure Python) finds it. A model that tags well has
learnt Python's lexical grammar: string and comment extents, numbers, keywords-as-names, operators,
and NEWLINE (a logical line ends) apart from NL (a line break inside brackets or a blank line),
which needs the bracket depth.

Classes (``CLASSES``, fixed across Python versions):

==  =========  ===========================================================================
 0  none       bytes in no token: spaces between tokens, the indentation of a line that
               opens no new block, a line continuation (backslash and its line break)
 1  name       NAME (identifiers and keywords)
 2  op         OP (operators and delimiters)
 3  number     NUMBER
 4  string     STRING (Python 3.12+: FSTRING_START, FSTRING_MIDDLE, FSTRING_END too)
 5  comment    COMMENT
 6  newline    NEWLINE (the end of a logical line)
 7  nl         NL (a line break that ends no logical line)
 8  indent     INDENT (the whitespace that opens an indented block)
 9  error      ERRORTOKEN (and any other token type), e.g. a stray ``$`` or an unterminated quote
==  =========  ===========================================================================

The zero-width tokens (ENCODING, DEDENT, ENDMARKER; NEWLINE at the end of a file without a final
line break) label no byte. A file is read under its declared encoding (PEP 263), tokenized as
text, and each character's label is given to each of its bytes; a UTF-8 byte-order mark is
class ``none``. Files that ``tokenize`` rejects (three deliberately malformed test files of CPython
3.11) or whose text does not encode back to their bytes are left out and listed in the manifest.

Rows (``task = "tag"``): each file is cut into chunks of ``seq_len`` bytes (the last one shorter), a
row per chunk: ``input_ids`` ``[n <= seq_len]`` the bytes, ``labels`` ``[n]`` their classes. Batches:
``input_ids`` ``[B, S]`` right-padded with ``pad_id`` = 256 (vocabulary 257), ``labels`` ``[B, S]``
with -100 on padding, ``key_padding`` ``[B, S]`` (True on real bytes) when some row is padded.

Files are split and capped as ``data=docstrings`` does (``data=text``'s split by file). The manifest
lists the files (path, bytes, sha256, split), the files left out, and per split the rows, bytes and
class frequencies with the majority-class rate: the accuracy of always answering the most frequent
class, the baseline a tagger must beat.
"""

from __future__ import annotations

import io
import sys
import tokenize
from typing import Annotated, Any

import numpy as np
import pyarrow.compute as pc
import torch
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.core.registry import Range
from xfam.data.base import DATA, DataSource
from xfam.data.cache import cached_generate, ids_problem
from xfam.data.docstrings import decode_source, fraction_problems, stdlib_corpus
from xfam.data.files import stdlib_root
from xfam.data.packing import SPLITS, get_split
from xfam.data.text import _read_documents
from xfam.data.tokenize import short_hash

VERSION = "pytokens-1"
CLASSES = ("none", "name", "op", "number", "string", "comment", "newline", "nl", "indent", "error")
NONE, ERROR = 0, CLASSES.index("error")
#: ``tokenize`` token names -> class; zero-width ones (ENCODING, DEDENT, ENDMARKER) never reach a byte.
TOKEN_CLASS = {
    "NAME": 1,
    "OP": 2,
    "NUMBER": 3,
    "STRING": 4,
    "FSTRING_START": 4,
    "FSTRING_MIDDLE": 4,
    "FSTRING_END": 4,
    "COMMENT": 5,
    "NEWLINE": 6,
    "NL": 7,
    "INDENT": 8,
}
PAD = 256
IGNORE = -100


def char_labels(text: str) -> np.ndarray:
    """``[len(text)]`` the class of each character (see the module docstring); raises what ``tokenize`` raises.

    A token covers ``len(token.string)`` characters from its start (row, column), so a NEWLINE that
    ``tokenize`` adds at the end of a file without a final line break (an empty string) covers none.
    """
    labels = np.zeros(len(text), dtype=np.uint8)
    lines = io.StringIO(text).readlines()  # the lines tokenize reads: split at "\n" only
    starts = np.cumsum([0] + [len(line) for line in lines]).tolist()  # [lines + 1] offset of each line
    feed = iter(lines)
    for tok in tokenize.generate_tokens(lambda: next(feed, "")):
        if tok.string:
            start = starts[tok.start[0] - 1] + tok.start[1]
            labels[start : start + len(tok.string)] = TOKEN_CLASS.get(tokenize.tok_name[tok.type], ERROR)
    return labels


def _utf8_lengths(text: str) -> np.ndarray:
    """``[len(text)]`` bytes of each character in UTF-8 (from the code points, without a Python loop)."""
    points = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    return 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)


def byte_labels(data: bytes) -> np.ndarray | None:
    """``[len(data)]`` the class of each byte of a Python file, or None when it cannot be tagged (it does not
    decode, ``tokenize`` rejects it, or its text does not encode back to its bytes)."""
    text = decode_source(data)
    if text is None:
        return None
    try:
        chars = char_labels(text)
    except (SyntaxError, tokenize.TokenError):  # IndentationError is a SyntaxError
        return None
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    bom = b"\xef\xbb\xbf" if encoding == "utf-8-sig" else b""
    if encoding in ("utf-8", "utf-8-sig"):
        widths, body = _utf8_lengths(text), text.encode("utf-8")
    else:
        widths, body = np.array([len(c.encode(encoding)) for c in text], dtype=np.int64), text.encode(encoding)
    if bom + body != data:
        return None
    return np.concatenate([np.zeros(len(bom), dtype=np.uint8), np.repeat(chars, widths)])


def _read_rows(keys: tuple[str, ...], files: tuple[str, ...], sha256: tuple[str, ...], seq_len: int):
    """``Dataset.from_generator`` body: the chunks of every taggable file, in order (hash-checked)."""
    for doc in _read_documents(keys, files, sha256):
        data = doc["text"]
        labels = byte_labels(data)
        if labels is None:
            continue
        ids = np.frombuffer(data, dtype=np.uint8)
        for i in range(0, len(data), seq_len):
            yield {"path": doc["path"], "input_ids": ids[i : i + seq_len], "labels": labels[i : i + seq_len]}


def _rows_check(ds: Any) -> str | None:
    """A cached split: bytes below 256, classes below ``len(CLASSES)``, a label per byte."""
    if problem := ids_problem(ds, "input_ids", 256) or ids_problem(ds, "labels", len(CLASSES)):
        return problem
    table = ds.with_format("arrow")[:]
    same = pc.equal(pc.list_value_length(table["input_ids"]), pc.list_value_length(table["labels"]))
    return None if pc.all(same).as_py() is not False else "rows whose labels are not as long as their bytes"


def collate_tag(rows: list[dict[str, Tensor]], pad_id: int) -> dict[str, Tensor]:
    """Tagged rows to a batch: ``input_ids`` / ``labels`` ``[B, S]`` right-padded (pad_id / -100), ``key_padding``."""
    lengths = [len(r["input_ids"]) for r in rows]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, S]
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)  # [B, S]
    for i, r in enumerate(rows):
        ids[i, : lengths[i]] = torch.as_tensor(r["input_ids"]).long()
        labels[i, : lengths[i]] = torch.as_tensor(r["labels"]).long()
    batch = {"input_ids": ids, "labels": labels}
    if min(lengths) < width:
        batch["key_padding"] = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # [B, S]
    return batch


def class_stats(ds: Any) -> dict[str, Any]:
    """Per-class byte counts of a split and the majority-class rate (the always-the-same-class accuracy)."""
    labels = pc.list_flatten(ds.with_format("arrow")["labels"]).to_numpy(zero_copy_only=False)
    counts = np.bincount(labels, minlength=len(CLASSES))
    top = int(counts.argmax())
    return {
        "class_bytes": dict(zip(CLASSES, counts.tolist())),
        "majority_class": CLASSES[top],
        "majority_rate": float(counts[top] / max(1, counts.sum())),
    }


@DATA.register("pytokens")
class PyTokens(DataSource):
    """Tag each byte of standard-library Python source with its ``tokenize`` token type (10 classes).

    Args:
        val_fraction / test_fraction: expected share of the files in validation / test (split by file,
            as ``data=text``).
        max_files: cap on the files read, for quick runs: each split takes about its share (at least 1),
            in seed order. null: every file.
        seq_len: bytes per row (each file is cut into chunks of this length; its last one is shorter).
        batch_size: rows per batch.
        seed: data seed (the order of the files inside each split, hence what ``max_files`` keeps).
    """

    task = "tag"

    def __init__(
        self,
        *,
        val_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.05,
        test_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.05,
        max_files: Annotated[int, Range(ge=1)] | None = None,
        seq_len: Annotated[int, Range(ge=1)] = 256,
        batch_size: Annotated[int, Range(ge=1)] = 16,
        seed: int = 0,
    ):
        self.val_fraction, self.test_fraction, self.max_files = val_fraction, test_fraction, max_files
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.vocab_size, self.pad_id, self.num_classes = PAD + 1, PAD, len(CLASSES)
        self.token_bytes = [1] * 256 + [0]

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        return fraction_problems(params)

    def prepare(self) -> None:
        if getattr(self, "_splits", None):
            return
        from datasets import Features, List, Value

        owner = self.registry_name or "pytokens"
        chosen, entries, corpus_fp = stdlib_corpus(
            self.val_fraction, self.test_fraction, self.seed, self.max_files, owner, VERSION
        )
        self.fingerprint = short_hash(corpus_fp, self.seq_len)
        features = Features(
            {"path": Value("string"), "input_ids": List(Value("uint8")), "labels": List(Value("uint8"))}
        )
        self._splits, stats, tagged = {}, {}, set()
        for name in SPLITS:
            mine = [e for e in entries if e["split"] == name]
            kwargs = {
                "keys": tuple(e["path"] for e in mine),
                "files": tuple(str(p) for _, p in chosen[name]),
                "sha256": tuple(e["sha256"] for e in mine),
                "seq_len": self.seq_len,
            }
            ds = cached_generate(_read_rows, kwargs, features, name, short_hash(self.fingerprint, name), _rows_check)
            if len(ds) == 0:
                raise ConfigError(
                    f"data={owner}: no file of the {name} split could be tagged ({len(mine)} files). Fix: a larger "
                    "data.max_files (or null), or larger data.val_fraction / data.test_fraction."
                )
            tagged.update(pc.unique(ds.with_format("arrow")["path"]).to_pylist())
            self._splits[name] = ds.with_format("torch", columns=["input_ids", "labels"])
            nbytes = int(pc.sum(pc.list_value_length(ds.with_format("arrow")["input_ids"])).as_py())
            stats[name] = {"files": len(mine), "rows": len(ds), "bytes": nbytes, **class_stats(ds)}
        self.manifest = {
            "source": "pytokens",
            "labeller": VERSION,
            "root": str(stdlib_root()),
            "python": sys.version.split()[0],
            "classes": list(CLASSES),
            "seed": self.seed,
            "max_files": self.max_files,
            "seq_len": self.seq_len,
            "total_bytes": sum(e["bytes"] for e in entries),
            "files": entries,
            "left_out": [e["path"] for e in entries if e["path"] not in tagged],
            "splits": stats,
            "fingerprint": self.fingerprint,
        }

    def split(self, name: str) -> Any:
        return get_split(getattr(self, "_splits", {}), name, self.registry_name)

    def collate(self, rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        return collate_tag(rows, PAD)
