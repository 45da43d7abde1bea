"""data=docstrings and data=pytokens: extraction and labels against brute-force references, split by file,
caps, manifest, caching, batches."""

from __future__ import annotations

import ast
import hashlib
import io
import re
import tokenize

import numpy as np
import pytest
import torch

from xfam.data import DATA
from xfam.data.docstrings import BOS, EOS, PAD, Docstrings, extract_pairs
from xfam.data.files import stdlib_root
from xfam.data.pytokens import CLASSES, PyTokens, byte_labels, char_labels, collate_tag

SNIPPET = b'''import os
@deco(1)
@other
def f(a, b):
    """Add two
    numbers.

    More text.
    """
    return a + b  # done

class C:
    async def m(self):
        \'\'\'Only doc.\'\'\'

    def n(self): "short"; return 1

    def g(self):
        def inner():
            """Inner doc."""
            s = """
not indented
"""
            return s
        return inner

    def undocumented(self):
        return 2

    def blank(self):
        """   """
'''


@pytest.fixture(scope="module", autouse=True)
def hf_cache(tmp_path_factory):
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_cache"))
        yield


# -- docstrings ------------------------------------------------------------------------------------------------------


def test_extract_pairs_of_a_snippet():
    """Decorators kept, the docstring's lines removed, dedented, first paragraph collapsed; functions without a
    docstring or with a blank one skipped; a docstring sharing its line is removed exactly."""
    pairs = {name: (line, source, target) for name, line, source, target in extract_pairs(SNIPPET)}
    assert list(pairs) == ["f", "C.m", "C.n", "C.g.<locals>.inner"]
    assert pairs["f"] == (4, "@deco(1)\n@other\ndef f(a, b):\n    return a + b", "Add two numbers.")
    assert pairs["C.m"] == (13, "async def m(self):\n", "Only doc.")
    assert pairs["C.n"] == (16, "def n(self): ; return 1", "short")
    line, source, target = pairs["C.g.<locals>.inner"]
    assert source == 'def inner():\n    s = """\nnot indented\n"""\n    return s' and target == "Inner doc."


def brute_force_pairs(data: bytes) -> tuple[list[tuple[str, str]], int]:
    """Independent reference: for each function with a docstring and another statement, the AST of the function
    without its docstring (dumped) and the summary by a regular expression split of ``inspect.cleandoc``; and the
    number of functions with a summary whose body is only the docstring."""
    tree = ast.parse(data)
    out, only_doc = [], 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            summary = " ".join(re.split(r"\n\s*\n", doc.strip())[0].split()) if doc else ""
            only_doc += bool(summary) and len(node.body) == 1
            if summary and len(node.body) > 1:
                node.body = node.body[1:]
                out.append((ast.dump(node), summary))
    return sorted(out), only_doc


@pytest.mark.parametrize("path", ["textwrap.py", "json/decoder.py", "asyncio/locks.py", "abc.py"])
def test_real_files_match_the_ast_without_the_docstring(path):
    """Each extracted source parses to exactly the function's AST minus its docstring statement; a function
    whose body was only its docstring keeps its signature alone (which does not parse)."""
    data = (stdlib_root() / path).read_bytes()
    found, signatures = [], 0
    for _, _, source, target in extract_pairs(data):
        try:
            module = ast.parse(source)
        except SyntaxError:
            assert source.rstrip().endswith(":")
            signatures += 1
            continue
        assert len(module.body) == 1 and isinstance(module.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
        found.append((ast.dump(module.body[0]), target))
    reference, only_doc = brute_force_pairs(data)
    assert sorted(found) == reference and len(found) >= 3 and signatures == only_doc


def test_signature_only_functions_keep_their_signature():
    data = b"class P:\n    def m(self) -> int:\n        '''Return it.'''\n"
    ((name, _, source, target),) = extract_pairs(data)
    assert (name, source, target) == ("P.m", "def m(self) -> int:\n", "Return it.")


def test_files_that_do_not_parse_give_no_pair():
    assert extract_pairs(b"def f(:\n    '''x'''\n") == []
    assert extract_pairs(b"# -*- coding: latin-1 -*-\ndef f():\n    '''Caf\xe9.'''\n    return 1\n")[0][3] == "Café."


SMALL_DOCS = {"val_fraction": 0.2, "test_fraction": 0.2, "max_files": 30, "max_pairs": 80, "seed": 3}


@pytest.fixture(scope="module")
def docs() -> Docstrings:
    src = Docstrings(**SMALL_DOCS, source_len=4096, target_len=1024)
    src.prepare()
    return src


def test_docstrings_rows_split_and_manifest(docs):
    """Rows equal the extraction of their file; a file's pairs all lie in its split; caps; manifest hashes."""
    files = {e["path"]: e for e in docs.manifest["files"]}
    assert {e["split"] for e in files.values()} == {"train", "validation", "test"}
    counts = {"train": 0, "validation": 0, "test": 0}
    for e in files.values():
        counts[e["split"]] += 1
        assert hashlib.sha256((stdlib_root() / e["path"]).read_bytes()).hexdigest() == e["sha256"]
    assert counts == {"train": 18, "validation": 6, "test": 6}
    expected_cap = {"train": 48, "validation": 16, "test": 16}
    for name in ("train", "validation", "test"):
        ds = docs.split(name)
        assert 0 < len(ds) <= expected_cap[name] and docs.manifest["splits"][name]["pairs"] == len(ds)
        rows = ds.with_format(None)[:]
        by_file: dict[str, list] = {}
        for path, fn, line, source, target in zip(*(rows[k] for k in ("path", "function", "line", "source", "target"))):
            assert files[path]["split"] == name
            by_file.setdefault(path, []).append((fn, line, bytes(source).decode(), bytes(target).decode()))
        for path, got in by_file.items():
            want = [(n, ln, s, t) for n, ln, s, t in extract_pairs((stdlib_root() / path).read_bytes())]
            assert got == want[: len(got)]
            assert files[path]["pairs"] == len(got)
        order = [e["path"] for e in docs.manifest["files"] if e["split"] == name and e["pairs"]]
        assert list(dict.fromkeys(rows["path"])) == order  # files in seed order, each whole except the last


def test_docstrings_batches(docs):
    rows = [docs.split("train")[i] for i in range(4)]
    batch = docs.collate(rows)
    assert (batch["decoder_input_ids"][:, 0] == BOS).all()
    for i, r in enumerate(rows):
        n = len(r["target"])
        assert torch.equal(batch["labels"][i, : n + 1], torch.cat([r["target"].long(), torch.tensor([EOS])]))
        assert (batch["decoder_input_ids"][i, n + 1 :] == PAD).all()
    assert docs.decode(rows[0]["target"].tolist() + [EOS, PAD]) == bytes(rows[0]["target"].tolist()).decode()
    assert docs.encode("é") == [0xC3, 0xA9] and docs.vocab_size == 259 and len(docs.token_bytes) == 259


def test_docstrings_truncation_cache_and_fingerprint(docs, monkeypatch):
    """A second source with the same settings reads the cache (nothing extracted again, same fingerprint);
    shorter lengths truncate exactly the long pairs; another cap is another fingerprint."""
    with monkeypatch.context() as mp:
        mp.setattr("xfam.data.docstrings.extract_pairs", lambda data: pytest.fail("extracted again"))
        again = Docstrings(**SMALL_DOCS, source_len=4096, target_len=1024)
        again.prepare()
    assert again.fingerprint == docs.fingerprint and again.manifest == docs.manifest
    short = Docstrings(**SMALL_DOCS, source_len=64, target_len=16)
    short.prepare()
    full = docs.split("train").with_format(None)[:]
    long_src = sum(len(s) > 64 for s in full["source"])
    long_tgt = sum(len(t) > 15 for t in full["target"])
    assert short.manifest["splits"]["train"]["source_truncated"] == long_src > 0
    assert short.manifest["splits"]["train"]["target_truncated"] == long_tgt > 0
    cut = short.split("train").with_format(None)[:]
    assert cut["source"] == [s[:64] for s in full["source"]] and cut["target"] == [t[:15] for t in full["target"]]
    assert short.fingerprint != docs.fingerprint
    fewer = Docstrings(**{**SMALL_DOCS, "max_pairs": 40}, source_len=4096, target_len=1024)
    fewer.prepare()
    assert fewer.fingerprint != docs.fingerprint and len(fewer.split("train")) == 24
    assert fewer.split("train").with_format(None)[:]["source"] == full["source"][:24]


def test_docstrings_refuses_long_pairs_without_truncate():
    from xfam.core.errors import ConfigError

    src = Docstrings(**SMALL_DOCS, source_len=32, target_len=8, truncate=False)
    with pytest.raises(ConfigError, match="data.truncate=true"):
        src.prepare()


# -- pytokens --------------------------------------------------------------------------------------------------------

TAG_SNIPPET = (
    "# -*- coding: utf-8 -*-\n"
    "import os  # comment\n"
    "x = [1, 2.5e3,\n"
    "     0x1F]  # caf\u00e9\n"
    "\n"
    "def f(\u00e9t\u00e9, b='\u4e2d\u6587'):\n"
    "    if b:\n"
    '        return f"{\u00e9t\u00e9!r}" + """multi\n'
    'line"""\n'
    "    y = 1 + \\\n"
    "        2\n"
    "    return y\n"
)


def brute_force_labels(text: str) -> list[int]:
    """Reference labels of each byte: token extents from tokenize's (row, col) start AND end positions over
    ``str.splitlines``, each character's bytes taking its label."""
    lines = text.splitlines(keepends=True)
    offset = [sum(len(x) for x in lines[:i]) for i in range(len(lines) + 2)]
    names = {"NAME": 1, "OP": 2, "NUMBER": 3, "STRING": 4, "COMMENT": 5, "NEWLINE": 6, "NL": 7, "INDENT": 8}
    char = [0] * len(text)
    for tok in tokenize.tokenize(io.BytesIO(text.encode()).readline):
        name = tokenize.tok_name[tok.type]
        if name in ("ENCODING", "DEDENT", "ENDMARKER"):
            continue
        start, end = offset[tok.start[0] - 1] + tok.start[1], offset[tok.end[0] - 1] + tok.end[1]
        for i in range(start, end):
            char[i] = names.get(name, 9)
    return [label for c, label in zip(text, char) for _ in c.encode()]


def test_labels_of_a_snippet_match_tokenize_exactly():
    data = TAG_SNIPPET.encode()
    labels = byte_labels(data)
    assert labels.tolist() == brute_force_labels(TAG_SNIPPET) and len(labels) == len(data)
    named = dict(zip(CLASSES, range(len(CLASSES))))
    at = data.index(b"# comment")
    assert labels[at : at + 9].tolist() == [named["comment"]] * 9
    at = data.index("'\u4e2d\u6587'".encode())
    assert labels[at : at + 8].tolist() == [named["string"]] * 8  # 2 quotes + 2 CJK characters of 3 bytes
    at = data.index(b"\\\n")
    assert labels[at : at + 2].tolist() == [named["none"]] * 2  # a line continuation is in no token
    assert labels[data.index(b"0x1F") : data.index(b"0x1F") + 4].tolist() == [named["number"]] * 4
    assert labels[data.index(b",\n") + 1] == named["nl"] and labels[data.index(b"]  #") + 1] == named["none"]


def test_other_encodings_bom_and_no_final_newline():
    latin = b"# -*- coding: latin-1 -*-\ns = 'caf\xe9'\n"
    labels = byte_labels(latin)
    assert len(labels) == len(latin)
    at = latin.index(b"'caf")
    assert labels[at : at + 6].tolist() == [4] * 6  # one byte per character in latin-1
    bom = b"\xef\xbb\xbfx = 1"
    assert byte_labels(bom).tolist() == [0, 0, 0, 1, 0, 2, 0, 3]  # no final newline: NEWLINE is zero-width
    assert byte_labels(b"def f(:\n  '''\n") is None  # tokenize rejects it (EOF in a triple-quoted string)
    assert char_labels("a\n").tolist() == [1, 6]


SMALL_TAGS = {"val_fraction": 0.2, "test_fraction": 0.2, "max_files": 10, "seq_len": 128, "seed": 1}


@pytest.fixture(scope="module")
def tags() -> PyTokens:
    src = PyTokens(**SMALL_TAGS)
    src.prepare()
    return src


def test_pytokens_rows_are_the_files_chunked_with_their_labels(tags):
    """The rows of each file, joined, are its bytes and byte_labels; every row but a file's last is seq_len long;
    class frequencies and the majority-class rate agree with the rows."""
    assert tags.num_classes == len(CLASSES) and tags.vocab_size == 257 and tags.task == "tag"
    files = {e["path"]: e for e in tags.manifest["files"]}
    for name in ("train", "validation", "test"):
        raw = tags.split(name).with_format(None)[:]
        ds = tags._splits[name]
        paths = ds.with_format("arrow")["path"].to_pylist()
        joined: dict[str, tuple[list, list, list]] = {}
        for path, ids, labels in zip(paths, raw["input_ids"], raw["labels"]):
            assert files[path]["split"] == name and len(ids) == len(labels)
            got = joined.setdefault(path, ([], [], []))
            got[0].extend(ids)
            got[1].extend(labels)
            got[2].append(len(ids))
        for path, (ids, labels, lengths) in joined.items():
            data = (stdlib_root() / path).read_bytes()
            assert bytes(ids) == data and labels == byte_labels(data).tolist()
            assert set(lengths[:-1]) <= {128} and 0 < lengths[-1] <= 128  # only a file's last chunk is short
        stats = tags.manifest["splits"][name]
        counts = np.bincount(np.concatenate([np.asarray(x) for x in raw["labels"]]), minlength=len(CLASSES))
        assert list(stats["class_bytes"].values()) == counts.tolist()
        assert stats["majority_rate"] == pytest.approx(counts.max() / counts.sum())
    assert set(tags.manifest["left_out"]) == {
        p for p, e in files.items() if byte_labels((stdlib_root() / p).read_bytes()) is None
    }


def test_pytokens_batches_pad_and_mask():
    rows = [
        {"input_ids": torch.tensor([10, 11, 12], dtype=torch.uint8), "labels": torch.tensor([1, 0, 2])},
        {"input_ids": torch.tensor([13], dtype=torch.uint8), "labels": torch.tensor([5])},
    ]
    batch = collate_tag(rows, 256)
    assert batch["input_ids"].tolist() == [[10, 11, 12], [13, 256, 256]]
    assert batch["labels"].tolist() == [[1, 0, 2], [5, -100, -100]]
    assert batch["key_padding"].tolist() == [[True, True, True], [True, False, False]]
    assert "key_padding" not in collate_tag(rows[:1], 256)


def test_pytokens_cache_and_registry(tags, monkeypatch):
    monkeypatch.setattr("xfam.data.pytokens.byte_labels", lambda data: pytest.fail("labelled again"))
    again = DATA.build({"name": "pytokens", **SMALL_TAGS})
    again.prepare()
    assert again.fingerprint == tags.fingerprint and again.manifest == tags.manifest
    assert PyTokens(**{**SMALL_TAGS, "seq_len": 64}).seq_len == 64
