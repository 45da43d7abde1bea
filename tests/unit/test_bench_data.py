"""scripts/bench_data.py and its ``benchlib.data_workers`` / ``benchlib.data_report``: the command line, the corpus
builders (files, and their ``data=hf`` twin that xfam reads), the benchmark's BPE tokenizer.json (accepted by xfam as
``tokenizer=<path>``), the peak-memory sampler and the plain-loop worker in this process, the start-up plan, the
merging of parts from an earlier run and what the report says of them (fast); the ``--quick`` preparation part --
every system in its own subprocess on a fresh cache, the report -- (slow: six subprocesses that import torch and
datasets, ~25 s on 2 shared cores). Nothing here times anything for pass/fail."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_data as bd  # noqa: E402
from benchlib import data_report as report  # noqa: E402
from benchlib import data_workers as workers  # noqa: E402

from tests.integration.helpers import run_cli  # noqa: E402

SCRIPT = Path(bd.__file__)


def _sources(root: Path) -> list[Path]:
    """Three small source files (one in a subfolder) under ``root``."""
    files = {"a.py": "x = 1\n" * 50, "b.py": "def f():\n    return 2\n" * 30, "pkg/c.py": "import os\n" * 40}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return sorted(root / rel for rel in files)


def test_help_describes_the_protocol() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for words in ("Preparation throughput", "Start-up after preparation", "Loader vs training", "--quick", "--json"):
        assert words in out.stdout


def test_unknown_part_is_refused_with_the_choices() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--parts", "prepare,bogus", "--no-docs"], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "bogus" in out.stderr and "prepare, startup, loader" in out.stderr


def test_corpus_has_distinct_documents_of_about_the_requested_size(tmp_path: Path) -> None:
    base = tmp_path / "src"
    files = _sources(base)
    largest = max(len(p.read_bytes()) for p in files)
    info = bd.build_corpus(tmp_path / "corpus", 5_000, base, files)
    built = sorted(p for p in (tmp_path / "corpus").rglob("*.py"))
    texts = [p.read_bytes() for p in built]
    assert info["files"] == len(built) and info["bytes"] == sum(len(t) for t in texts)
    assert 5_000 <= info["bytes"] < 5_000 + largest + 16  # stops at the first file past the size
    assert len(set(texts)) == len(texts)  # copy k of a file differs from its other copies
    assert info["copies"] >= 2 and (tmp_path / "corpus/copy-001/pkg/c.py").exists()
    for p, text in zip(built, texts):
        copy = int(p.relative_to(tmp_path / "corpus").parts[0].split("-")[1])
        assert text.startswith(f"# copy {copy}\n".encode())
        assert text.endswith((base / p.relative_to(tmp_path / "corpus" / f"copy-{copy:03d}")).read_bytes())


def test_corpus_is_reused_and_rebuilt_for_another_size(tmp_path: Path) -> None:
    base = tmp_path / "src"
    files = _sources(base)
    first = bd.build_corpus(tmp_path / "corpus", 3_000, base, files)
    stamp = (tmp_path / "corpus/copy-000/a.py").stat().st_mtime_ns
    assert bd.build_corpus(tmp_path / "corpus", 3_000, base, files) == first
    assert (tmp_path / "corpus/copy-000/a.py").stat().st_mtime_ns == stamp  # not rewritten
    bigger = bd.build_corpus(tmp_path / "corpus", 9_000, base, files)
    assert bigger["bytes"] >= 9_000 > first["bytes"]
    assert not (tmp_path / "corpus.tmp").exists()


def test_bpe_tokenizer_json_is_accepted_by_xfam(tmp_path: Path) -> None:
    from xfam.data.tokenize import load_pretrained, tokenizer_problems

    texts = ["def f(x):\n    return x + 1\n" * 20, "import os\nprint(os.getcwd())\n" * 20]
    info = workers.train_gpt2_bpe(texts, 300, tmp_path / "bpe" / "tokenizer.json")
    assert info["vocab"] <= 300
    assert tokenizer_problems(info["path"]) == []
    tok = load_pretrained(info["path"])
    assert tok.special["eos"] == workers.EOT and tok.eos_id is not None
    text = "def g(y):\n    return y\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert sum(tok.token_bytes[i] for i in ids) == len(text.encode())  # byte-level: bytes per token exact


PEAK_PROBE = """
import sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from benchlib.data_workers import PeakMemory
with PeakMemory(every_s=0.01) as mem:
    block = np.ones(80 * 2**20, dtype=np.uint8)  # 80 MiB, touched
    deadline = time.monotonic() + 10  # until the sampling thread has seen it (slow on a loaded machine)
    while mem.peak_anon < mem.baseline_anon + 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    del block
res = mem.result()
print(res["peak_anon_pss_mb"] - mem.baseline_anon, res["peak_rss_mb"] >= res["baseline_rss_mb"])
"""


def test_peak_memory_sees_an_allocation() -> None:
    """In a fresh process: in this one, a heap that keeps freed memory (xfam's allocator settings, other tests'
    arrays) can serve the block from pages the baseline already counted."""
    scripts = str(Path(bd.__file__).parent)
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE, scripts], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    grew, rss_ok = out.stdout.split()
    assert float(grew) >= 60 and rss_ok == "True"


def test_plain_loop_counts_every_byte_and_an_eos_per_document(tmp_path: Path) -> None:
    base = tmp_path / "src"
    _sources(base)
    info = bd.build_corpus(tmp_path / "corpus", 4_000, base, sorted(base.rglob("*.py")))
    res = workers.work_prepare_plain({"paths": [info["root"]], "tokenizer": "byte"})
    assert res["text_bytes"] == info["bytes"]
    assert res["tokens"] == info["bytes"] + info["files"]  # byte tokenizer: one id per byte, plus eos


def test_first_step_line_is_recognised() -> None:
    assert report.FIRST_STEP.search("[2026-12-04 04:34:37,496][xfam][INFO] step 1/1  train/loss 5.5715  4,609 tokens/s")
    assert report.FIRST_STEP.search("step 1/25  train/loss 5.5")
    assert not report.FIRST_STEP.search("step 11/25  train/loss 5.5")
    assert not report.FIRST_STEP.search("step 10/25")


def test_hf_twin_holds_the_corpus_text_and_is_reused(tmp_path: Path) -> None:
    import datasets

    from xfam.data.hf import _local_layout

    base = tmp_path / "src"
    _sources(base)
    corpus = bd.build_corpus(tmp_path / "corpus", 3_000, base, sorted(base.rglob("*.py")))
    info = bd.build_hf_corpus(tmp_path / "hf", corpus)
    assert info["bytes"] == corpus["bytes"] and info["files"] == 1  # all UTF-8: the same bytes, one Arrow file
    assert _local_layout(tmp_path / "hf") == {"train": {"text": {"dtype": "string", "_type": "Value"}}}
    rows = datasets.load_from_disk(str(tmp_path / "hf"))["text"]
    files = sorted((tmp_path / "corpus").rglob("*.py"))
    assert rows == [p.read_text() for p in files]  # a row per file, in path order
    stamp = (tmp_path / "hf/xfam_bench.json").stat().st_mtime_ns
    assert bd.build_hf_corpus(tmp_path / "hf", corpus) == info
    assert (tmp_path / "hf/xfam_bench.json").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_startup_plan_runs_text_then_hf_with_their_overrides() -> None:
    corpora = {name: {"root": f"/c/{name}"} for name in ("full", "half", "big", "hf full", "hf big")}
    full = bd.startup_corpora(argparse.Namespace(quick=False), corpora)
    assert [c["label"] for c in full] == ["default (stdlib)", "full", "big", "full, data=hf", "big, data=hf"]
    assert full[0]["spec"] == {"paths": None} and full[0]["overrides"] == []
    assert full[2]["overrides"] == ["data.paths=[/c/big]"]
    assert full[4]["spec"] == {"hf": "/c/hf big"}
    assert full[4]["overrides"][0] == "data=hf" and full[4]["overrides"][-1] == "data.path=/c/hf big"
    assert "data.validation_split=null" in full[4]["overrides"] and "data.join=eos" in full[4]["overrides"]
    no_hf = {k: v for k, v in corpora.items() if not k.startswith("hf")}  # (only the loader part runs)
    assert [c["data"] for c in bd.startup_corpora(argparse.Namespace(quick=True), no_hf)] == ["text", "text"]


def test_kept_parts_keep_the_run_that_measured_them() -> None:
    old_meta = {"date": "d1", "xfam_commit": "c1", "command": "old", "wall_s": 60.0, "loadavg": [0.1, 0.2]}
    new_meta = {"date": "d2", "xfam_commit": "c2", "command": "new", "wall_s": 120.0, "loadavg": [0.3, 0.4]}
    old = {"meta": old_meta, "prepare": {"old": 1}, "startup": {"old": 2}}
    data = {"meta": new_meta, "startup": {"new": 2}, "measured": {"startup": bd.measured(new_meta)}}
    merged = bd.keep_parts(data, old)
    assert merged["prepare"] == {"old": 1} and merged["startup"] == {"new": 2}  # a part measured now is not replaced
    assert merged["measured"]["prepare"]["date"] == "d1" and merged["measured"]["startup"]["xfam_commit"] == "c2"
    assert report.runs_of(merged) == [(["prepare"], bd.measured(old_meta)), (["startup"], bd.measured(new_meta))]
    again = bd.keep_parts({"meta": new_meta, "measured": {}}, merged)  # a third run keeps the first one's record
    assert again["measured"]["prepare"]["date"] == "d1" and again["measured"]["startup"]["date"] == "d2"


def _corpus(label: str, data: str, gb: float, files: int, steps: list[float], discover: float = 0.0) -> dict:
    """A part-2 result of one corpus, as ``bench_startup`` records it (the rest of ``documents()``: 0.25 s)."""
    stages = dict.fromkeys(report.STAGE_LABELS, 0.01) | {"discover": discover, "read_hash": 0.25}
    return {
        "label": label,
        "data": data,
        "prepare": {"text_bytes": gb * 1e9, "files": files, "tokens": gb * 1e9, "shards": 4, "total_s": 1.0},
        "runs": [{"milestones_s": {"config": 5.0, "data": s - 0.5, "step": s}, "total_s": s + 2} for s in steps],
        "warm": {"total_s": sum(stages.values()), "stages": stages, "discover_again_s": discover / 4},
    }


def test_startup_prose_says_files_not_bytes_only_when_the_numbers_do() -> None:
    text = [
        _corpus("default (stdlib)", "text", 0.03, 1_762, [6.6, 6.7, 6.8], 0.05),
        _corpus("big", "text", 1.0, 55_967, [8.5, 8.6, 8.7], 1.1),
    ]
    flat = [_corpus("full, data=hf", "hf", 0.1, 1, [6.5, 6.6, 6.9]), _corpus("big, data=hf", "hf", 1.0, 3, [6.7])]
    section = {"overrides": ["trainer.max_steps=1"], "hf_overrides": bd.HF_OVERRIDES}
    said = "\n".join(report.render_startup({"startup": section | {"corpora": text + flat}}))
    assert "| big, data=hf | 1,000.0 | 3 |" in said and "data=hf data.config_name=null" in said
    assert "| big, data=hf | - | 0.25 | - |" in said  # no discover or documents cache for data=hf
    assert "| big | 1.10 (0.28) |" in said  # discover: the first call (a later one)
    assert "+1.90 s (+1.96 s per GB" in said  # data=text: 8.6 - 6.7 over 0.97 GB
    assert "within the spread" in said and "Files, not bytes: the same 1.00 GB" in said
    grows = flat[:1] + [_corpus("big, data=hf", "hf", 1.0, 3, [9.0])]
    said = "\n".join(report.render_startup({"startup": section | {"corpora": text + grows}}))
    assert "beyond the spread" in said and "Files and bytes:" in said and "not bytes" not in said


@pytest.mark.slow
def test_quick_preparation_part_writes_its_section(tmp_path: Path) -> None:
    md, png, raw = tmp_path / "benchmarks.md", tmp_path / "data.png", tmp_path / "run.json"
    kept = "# Training throughput\n\nhand-written text\n"
    md.write_text(kept)
    args = [str(SCRIPT), "--quick", "--parts", "prepare", "--work", str(tmp_path / "work")]
    args += ["--md", str(md), "--png", str(png), "--json", str(raw)]
    out = run_cli(args, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(raw.read_text())
    runs = data["prepare"]["runs"]
    byte = [r for r in runs if r["tokenizer"] == "byte"]
    assert {(r["system"], r["num_proc"]) for r in byte} == {
        ("xfam", 1),
        ("xfam", 2),
        ("datasets.map", 1),
        ("datasets.map", 2),
        ("plain loop", 1),
    }
    corpus = data["corpora"]["full"]
    for r in byte:  # every system reads the same documents and writes the same number of ids
        assert r["text_bytes"] == corpus["bytes"], r["system"]
        assert r["tokens"] == corpus["bytes"] + corpus["files"], r["system"]
        assert 0 < r["tokenising_s"] <= r["total_s"] and r["reading_s"] >= 0
    assert any(r["tokenizer"].startswith("bpe") and r["system"] == "xfam" for r in runs)
    assert not list((tmp_path / "work").glob("cache-*"))  # the fresh caches are removed
    text = md.read_text()
    assert text.startswith(kept) and report.START in text and report.END in text and report.HEADING in text
    assert "| byte | plain loop" in text and "### Preparation throughput" in text
    assert "### Start-up" not in text  # parts not run leave no table
    assert png.stat().st_size > 0
