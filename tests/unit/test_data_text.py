"""data=text: document split, packing, eos, doc_mask segments, manifest/fingerprint, caching, BPE."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import numpy as np
import pytest

from xfam.core.errors import ConfigError
from xfam.data import DATA
from xfam.data.packing import pack_rows, unigram_entropy_bits
from xfam.data.text import TextSource, _unit, discover
from xfam.data.tokenize import ByteTokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


@pytest.fixture(scope="module", autouse=True)
def hf_cache(tmp_path_factory):
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("hf_cache")
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", path)
        yield path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """30 small text files (some nested), plus files that must be skipped."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(30):
        path = root / ("sub" if i % 3 == 0 else ".") / f"doc{i:02d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"# doc {i}\n" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400))) + "\n")
    (root / "empty.txt").write_text("")
    (root / "blob.bin").write_bytes(bytes(range(256)))
    (root / ".git").mkdir()
    (root / ".git" / "hidden.txt").write_text("never read")
    return root


def make(corpus: Path, **kw) -> TextSource:
    params = {"paths": [str(corpus)], "extensions": [".txt"], "val_fraction": 0.2, "test_fraction": 0.2, "seq_len": 32}
    return TextSource(**{**params, **kw})


def split_stream(src: TextSource, split: str) -> list[int]:
    """The token stream of a split rebuilt from the files, in manifest order: doc bytes + eos each."""
    root = Path(src.manifest["roots"][0])
    stream: list[int] = []
    for entry in src.manifest["files"]:
        if entry["split"] == split:
            stream += list((root.parent / entry["path"]).read_bytes()) + [src.eos_id]
    return stream


def row_stream(src: TextSource, split: str) -> list[int]:
    """The stream as the rows hold it: the first row whole, then each row without its first token."""
    rows = src.split(split)[:]["tokens"].numpy()  # [n, S + 1]
    return np.concatenate([rows[0]] + [r[1:] for r in rows[1:]]).tolist()


def test_discover_skips_hidden_empty_and_other_suffixes(corpus):
    files, problems = discover([str(corpus)], [".txt"])
    keys = [k for k, _ in files]
    assert problems == [] and len(keys) == 30
    assert all(k.startswith(f"{corpus.name}/doc") or k.startswith(f"{corpus.name}/sub/doc") for k in keys)


def test_overlapping_paths_are_one_error(corpus):
    """A folder and a folder inside it reach the same files under two keys; the split hash, taken on the key,
    put 14 of 20 such files in two splits (train/test leakage)."""
    sub = sorted(p for p in corpus.iterdir() if p.is_dir() and not p.name.startswith("."))[0]
    for paths in ([str(corpus), str(sub)], [str(corpus), str(corpus)]):
        _, problems = discover(paths, [".txt"])
        (msg,) = problems
        assert "reach the same file twice" in msg and "Fix: name each file once" in msg
    assert discover([str(sub)], [".txt"])[1] == []


def test_default_corpus_is_the_stdlib_without_site_packages():
    files, problems = discover(None, [".py"])
    keys = [k for k, _ in files]
    assert problems == [] and len(keys) > 500
    assert "os.py" in keys and "json/decoder.py" in keys
    assert not any("site-packages" in k or k.startswith("/") for k in keys)
    assert DATA.check({"name": "text"}, {}) == []


def test_split_by_document_is_deterministic_and_seed_independent(corpus):
    a, b = make(corpus, seed=0), make(corpus, seed=1)
    a.prepare()
    b.prepare()
    split_a = {e["path"]: e["split"] for e in a.manifest["files"]}
    split_b = {e["path"]: e["split"] for e in b.manifest["files"]}
    assert len(split_a) == len(a.manifest["files"]) == 30  # every document in exactly one split
    assert split_a == split_b  # the split depends on the path only
    for key, name in split_a.items():
        u = _unit(key)
        assert name == ("test" if u < 0.2 else "validation" if u < 0.4 else "train")
    assert set(split_a.values()) == {"train", "validation", "test"}
    order_a = [e["path"] for e in a.manifest["files"] if e["split"] == "train"]
    order_b = [e["path"] for e in b.manifest["files"] if e["split"] == "train"]
    assert sorted(order_a) == sorted(order_b) and order_a != order_b  # the seed orders documents
    assert a.fingerprint != b.fingerprint


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_rows_pack_the_stream_with_eos_between_documents(corpus, split):
    src = make(corpus)
    src.prepare()
    rows = src.split(split)[:]["tokens"].numpy()  # [n, S + 1]
    s = src.seq_len
    assert rows.shape[1] == s + 1 and src.contiguous
    assert (rows[1:, 0] == rows[:-1, -1]).all()  # row k+1 starts where row k ended
    stream = split_stream(src, split)
    covered = row_stream(src, split)  # every target exactly once
    assert covered == stream[: len(covered)]
    assert len(stream) - len(covered) < s  # only a partial row is dropped
    assert src.manifest["splits"][split]["tokens"] == len(stream)
    assert stream.count(256) == sum(e["split"] == split for e in src.manifest["files"])


def test_pack_rows_overlap_by_one():
    rows = pack_rows(np.arange(11), 4)
    assert rows.tolist() == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]
    assert pack_rows(np.arange(4), 4).shape == (0, 5)


def test_doc_mask_segments_change_exactly_at_document_boundaries(corpus):
    src = make(corpus, doc_mask=True)
    src.prepare()
    rows = src.split("train")
    batch = src.collate([rows[i] for i in range(len(rows))])
    stream = np.array(split_stream(src, "train"))
    doc_of = np.concatenate([[0], np.cumsum(stream == src.eos_id)[:-1]])  # eos belongs to the doc it closes
    s = src.seq_len
    for k, seg in enumerate(batch["segments"].numpy()):
        expected = doc_of[k * s : k * s + s]
        assert (seg - seg[0] == expected - expected[0]).all()
    assert "segments" not in make(corpus).collate([rows[0]])


def test_manifest_hashes_files_and_fingerprint_follows_contents(corpus, tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    for p in sorted(corpus.glob("*.txt"))[:12]:
        (folder / p.name).write_bytes(p.read_bytes())
    src = make(folder)
    src.prepare()
    for e in src.manifest["files"]:
        data = (tmp_path / e["path"]).read_bytes()
        assert e["bytes"] == len(data) and e["sha256"] == hashlib.sha256(data).hexdigest()
    assert src.manifest["total_bytes"] == sum(e["bytes"] for e in src.manifest["files"])
    again = make(folder)
    again.prepare()
    assert again.fingerprint == src.fingerprint
    name = src.manifest["files"][0]["split"]
    before = row_stream(src, name)
    target = folder / src.manifest["files"][0]["path"].split("/", 1)[1]
    target.write_text(target.read_text() + "changed zzz\n")
    changed = make(folder)
    changed.prepare()
    assert changed.fingerprint != src.fingerprint
    assert [e["sha256"] for e in changed.manifest["files"]] != [e["sha256"] for e in src.manifest["files"]]
    assert row_stream(changed, name) != before
    assert b"changed zzz" in bytes(t for t in row_stream(changed, name) if t < 256)


def test_second_prepare_is_served_from_cache(corpus, hf_cache):
    first = make(corpus, seq_len=24)
    first.prepare()
    files = {p: p.stat().st_mtime_ns for p in Path(hf_cache).rglob("*") if p.is_file()}
    second = make(corpus, seq_len=24)
    second.prepare()
    after = {p: p.stat().st_mtime_ns for p in Path(hf_cache).rglob("*") if p.is_file()}
    assert second.fingerprint == first.fingerprint and after == files  # nothing written or rewritten
    assert second.split("train").stream.files == first.split("train").stream.files


def test_a_corrupt_token_shard_is_rebuilt_with_a_warning(corpus, hf_cache, caplog):
    first = make(corpus, seq_len=20)
    first.prepare()
    rows = {name: [r["tokens"].tolist() for r in first.split(name)] for name in ("train", "validation", "test")}
    files = [first.split(name).stream.folder / f for name in rows for f in first.split(name).stream.files]
    assert files
    for path in files:  # a crash mid-copy, a bad copy
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    second = make(corpus, seq_len=20)
    with caplog.at_level("WARNING", logger="xfam"):
        second.prepare()
    assert sum("cannot be read" in r.message and "writing them again" in r.message for r in caplog.records) == 3
    assert {name: [r["tokens"].tolist() for r in second.split(name)] for name in rows} == rows


def test_byte_tokenizer():
    tok = ByteTokenizer()
    text = "héllo ✓"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text) + [256]) == text
    assert tok.token_bytes == [1] * 256 + [0] and tok.vocab_size == 257


def test_bpe_is_trained_locally_and_round_trips(corpus, hf_cache):
    src = make(corpus, tokenizer="bpe", bpe_vocab_size=300)
    src.prepare()
    assert src.vocab_size == 300 and src.token_bytes[src.eos_id] == 0
    for text in ["alpha beta gamma\n", "héllo wörld ✓ <eos> tab\tend"]:
        ids = src.encode(text)
        assert src.decode(ids) == text
        assert src.eos_id not in ids  # a literal "<eos>" is text
        assert sum(src.token_bytes[i] for i in ids) == len(text.encode("utf-8"))
    assert len(src.encode("alpha beta gamma delta")) < len("alpha beta gamma delta")  # merges learned
    rows = src.split("validation")[:]["tokens"].numpy()
    assert rows.max() < src.vocab_size
    (tok_file,) = Path(hf_cache).rglob("bpe-*-300.json")
    mtime = tok_file.stat().st_mtime_ns
    again = make(corpus, tokenizer="bpe", bpe_vocab_size=300)
    again.prepare()
    assert tok_file.stat().st_mtime_ns == mtime and again.fingerprint == src.fingerprint


def test_unigram_entropy_bits():
    # targets b a b eos: eos excluded, p = (1/3, 2/3)
    expected = -(1 / 3 * np.log2(1 / 3) + 2 / 3 * np.log2(2 / 3))
    assert unigram_entropy_bits([np.array([98, 97]), np.array([98, 256], dtype=np.uint16)]) == pytest.approx(expected)
    # token 0 = b"ab" stands for one a and one b: 1 bit per byte
    assert unigram_entropy_bits([np.array([0, 0])], [b"ab", b""]) == pytest.approx(1.0)


def test_max_bytes_caps_each_split(corpus):
    src = make(corpus, max_bytes=3000)
    src.prepare()
    by_split = {n: sum(e["bytes"] for e in src.manifest["files"] if e["split"] == n) for n in ("validation", "test")}
    full = make(corpus)
    full.prepare()
    assert len(src.manifest["files"]) < len(full.manifest["files"])
    assert sum(e["bytes"] for e in src.manifest["files"] if e["split"] == "train") <= 3000 * 0.6
    assert all(v > 0 for v in by_split.values())


def test_split_too_short_for_a_row_is_a_config_error(corpus):
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        make(corpus, seq_len=100_000).prepare()


def test_bad_inputs_are_reported_by_check(tmp_path, corpus):
    empty = tmp_path / "empty"
    empty.mkdir()
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "a.bin").write_bytes(b"\x00\x01")
    (tmp_path / "zero.txt").write_text("")
    cfg = {
        "name": "text",
        "paths": [str(tmp_path / "missing"), str(empty), str(binary), str(tmp_path / "zero.txt")],
        "extensions": ["txt"],
        "val_fraction": 0.6,
        "test_fraction": 0.5,
    }
    problems = DATA.check(cfg, {})
    assert len(problems) == 6 and all("Fix:" in p for p in problems)
    text = "\n".join(problems)
    assert "'missing'" not in text and str(tmp_path / "missing") in text and "does not exist" in text
    assert "empty folder" in text and "empty file" in text
    assert ".bin (1)" in text and "extensions=['.bin']" in text
    assert "'.txt'" in text and "leaves no document" in text
    with pytest.raises(ConfigError):
        DATA.build(cfg)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_documents_that_are_not_utf8_text_are_kept_with_one_warning(tokenizer, tmp_path, caplog):
    """Binary and non-UTF-8 files reached training with no word. They are kept (bytes are a byte model's input,
    and the rows hold them unchanged), and every prepare, from the cache too, warns once with the counts,
    up to 3 paths and how to leave them out."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    rng = random.Random(1)
    for i in range(16):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 200))))
    bad = {
        "blob.txt": bytes(range(256)) * 4,  # NUL bytes: binary
        "latin1.txt": "café naïve façade\n".encode("latin-1") * 20,
        "cut.txt": b"\xc3 cut in the middle of a character\n" * 20,
        "koi8.txt": "привет мир\n".encode("koi8-r") * 20,
    }
    for name, data in bad.items():
        (folder / name).write_bytes(data)
    kw = {"tokenizer": tokenizer, "bpe_vocab_size": 300}
    for attempt in ("built", "from the cache"):
        src = make(folder, **kw)
        caplog.clear()
        with caplog.at_level("WARNING", logger="xfam"):
            src.prepare()
        found = [r.getMessage() for r in caplog.records if "not UTF-8 text" in r.getMessage()]
        assert len(found) == 1, f"{attempt}: {found}"
        msg = found[0]
        assert f"4 of 20 documents ({sum(map(len, bad.values())):,} bytes)" in msg
        assert "1 binary (NUL bytes), 3 not valid UTF-8" in msg
        assert sum(str(folder / name) in msg for name in bad) == 3 and ", ..." in msg  # 3 examples of 4
        assert "data.extensions" in msg and "data.paths" in msg
        assert ("U+FFFD" in msg) == (tokenizer == "bpe")
    if tokenizer == "byte":  # the rows hold the files' bytes as they are
        for split in ("train", "validation", "test"):
            covered = row_stream(src, split)
            assert covered == split_stream(src, split)[: len(covered)]
        assert {e["path"].split("/")[-1] for e in src.manifest["files"]} >= set(bad)


def test_a_text_corpus_gives_no_utf8_warning(corpus, caplog):
    with caplog.at_level("WARNING", logger="xfam"):
        make(corpus).prepare()
    assert not [r for r in caplog.records if "UTF-8" in r.getMessage()]


def test_file_facts_are_remembered_until_the_file_changes(tmp_path, monkeypatch):
    """Start-up does not hash a large corpus again: a file whose size, mtime and inode are unchanged is not
    read; a rewrite of the same size (another mtime) is; a file written just now is never remembered."""
    import os

    from xfam.data.files import FileFacts

    memo, doc = tmp_path / "memo.json", tmp_path / "doc.txt"
    doc.write_bytes(b"hello")
    os.utime(doc, ns=(10**18, 10**18))
    first = FileFacts(memo)
    assert first.of(doc) == (5, hashlib.sha256(b"hello").hexdigest(), None)
    first.save()
    reads = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or real(self))
    assert FileFacts(memo).of(doc)[1] == hashlib.sha256(b"hello").hexdigest() and not reads
    doc.write_bytes(b"j\x00llo")  # the same size, another mtime
    os.utime(doc, ns=(10**18 + 1, 10**18 + 1))
    assert FileFacts(memo).of(doc) == (5, hashlib.sha256(b"j\x00llo").hexdigest(), "binary") and reads == [doc]
    fresh = tmp_path / "fresh.txt"
    fresh.write_bytes(b"now")
    racy = FileFacts(memo)
    racy.of(fresh)
    assert str(fresh) not in racy.known


def test_a_second_discover_sees_files_added_or_removed(tmp_path):
    """The walk is kept for the same process (validation, then the documents), never past a change."""
    folder = tmp_path / "c" / "sub"
    folder.mkdir(parents=True)
    (folder / "a.txt").write_text("a")
    assert [k for k, _ in discover([str(tmp_path / "c")], [".txt"])[0]] == ["c/sub/a.txt"]
    (folder / "b.txt").write_text("b")
    assert [k for k, _ in discover([str(tmp_path / "c")], [".txt"])[0]] == ["c/sub/a.txt", "c/sub/b.txt"]
    (folder / "a.txt").unlink()
    assert [k for k, _ in discover([str(tmp_path / "c")], [".txt"])[0]] == ["c/sub/b.txt"]
