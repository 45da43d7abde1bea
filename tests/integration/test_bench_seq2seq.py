"""scripts/bench_seq2seq.py: both systems are built at the same shape (they differ by x-transformers' FFN biases
only), every worker runs a tiny training step or decoding call, decoding is forced to its full length, and the
report is a marked section of docs/benchmarks.md that keeps the rest of the file."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_seq2seq as bs  # noqa: E402
from benchlib.common import NOTES_MARKER  # noqa: E402

pytest.importorskip("x_transformers")
TINY = bs.TINY


def _n(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_help_names_every_system(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        bs.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert all(s in text for s in bs.TRAIN_SYSTEMS + bs.DECODE_SYSTEMS) and "--quick" in text


def test_the_two_systems_differ_only_by_x_transformers_ffn_biases() -> None:
    """At the benchmark's shape: same matrices, tables and norms; x-transformers adds 2 x 4 x (4D + D) FFN biases."""
    xfam, xt = bs.build_xfam(bs.FULL), bs.build_xtransformers(bs.FULL, flash=False)
    assert _n(xt) - _n(xfam) == bs.ff_biases(bs.FULL) == 10_240
    ff_bias = sum(p.numel() for name, p in xt.named_parameters() if ".ff." in name and name.endswith("bias"))
    assert ff_bias == bs.ff_biases(bs.FULL)
    assert xfam.encoder.blocks[0].attn.qkv.weight.shape == (3 * 256, 256)  # head dim 64: 4 heads x 64
    assert len(xfam.encoder.blocks) == len(xfam.decoder.blocks) == 4


@pytest.mark.parametrize("system", bs.TRAIN_SYSTEMS)
def test_each_training_system_runs_a_step(system: str) -> None:
    """One tiny step; tokens/s counts source + target tokens; an untrained model's loss is near log V."""
    res = bs.run_train(system, TINY, warmup=0, steps=1)
    assert res["tokens_per_s"] == pytest.approx(TINY.batch * (TINY.src + TINY.tgt) / res["step_s"])
    assert abs(res["loss_first"] - math.log(TINY.vocab)) < 1.0


@pytest.mark.parametrize("system", bs.DECODE_SYSTEMS)
@pytest.mark.parametrize("batch", [1, 3])
def test_each_decoding_system_decodes_the_forced_length(system: str, batch: int) -> None:
    """run_decode refuses an output shorter than new_tokens; new tokens/s = batch x new_tokens / call time."""
    res = bs.run_decode(system, TINY, batch, warmup=0, reps=1)
    assert res["tokens_per_s"] == pytest.approx(batch * TINY.new_tokens / res["step_s"])


@pytest.mark.parametrize("system", ["xfam_greedy", "xfam_beam"])
@torch.no_grad()
def test_masking_eos_forces_the_full_length(system: str) -> None:
    """A model that prefers EOS stops at once; with the benchmark's EOS mask it decodes every token, none EOS."""
    model = bs.build_xfam(TINY)
    favour = torch.zeros(TINY.vocab)
    favour[TINY.eos] = 100.0
    model.decoder.head.register_forward_hook(lambda module, inputs, logits: logits + favour)  # [N, 1, V]
    src = torch.randint(0, TINY.vocab, (2, TINY.src))
    from xfam.eval.translate import translate

    beam = TINY.beam if system == "xfam_beam" else 1
    early = translate(model, src, bos_id=0, eos_id=TINY.eos, max_new_tokens=TINY.new_tokens, beam_size=beam)
    assert early.tokens.shape == (2, 1)
    out = bs.decode_call(system, model, TINY, 2)(src, torch.ones(2, TINY.src, dtype=torch.bool))
    assert out.shape == (2, TINY.new_tokens) and (out != TINY.eos).all()


def _fake_run(system: str, batch: int, repeat: int, tps: float) -> dict:
    run = {"system": system, "batch": batch, "repeat": repeat, "tokens_per_s": tps, "step_s": 1.0, "params": 10}
    return run | {
        "peak_rss_mb": 500.0,
        "rss_before_mb": 400.0,
        "foreign_cores": 0.01,
        "loss_first": 5.6,
        "loss_last": 5.5,
    }


def _fake_data(scale: float = 1.0) -> dict:
    runs = []
    for rep, (xfam, default, flash) in enumerate(((1100, 1000, 1100), (1300, 1000, 1000))):
        runs.append({"system": "matmul", "batch": 0, "repeat": rep, "gflops": 180.0, "foreign_cores": 0.0})
        runs += [_fake_run("xfam_encdec", 8, rep, xfam * scale), _fake_run("xtransformers_encdec", 8, rep, default)]
        runs.append(_fake_run("xtransformers_encdec_flash", 8, rep, flash))
        runs += [_fake_run(s, b, rep, 100.0 * b) for b in (1, 8) for s in bs.DECODE_SYSTEMS]
    meta = {"date": "today", "command": "bench_seq2seq.py", "cpu": "cpu", "cores": 2, "torch": "t"}
    meta |= {"x_transformers": "x", "xfam_commit": "c", "threads": 2, "shape": bs.dataclasses.asdict(bs.FULL)}
    meta |= {"batches": [1, 8], "repeats": 2, "warmup": 5, "steps": 20, "decode_warmup": 1, "decode_reps": 5}
    meta |= {"max_wait": 600, "quiet": 0.25, "noisy": 0.3, "retries": 5}
    return {"meta": meta, "runs": runs, "rejected": []}


def test_the_report_is_a_section_after_the_training_reports_notes(tmp_path: Path) -> None:
    """Ratios are of the medians over rounds with the per-round range; rewriting replaces only the section, which
    sits after bench_train.py's notes marker (so rewriting the training report keeps it)."""
    md, png = tmp_path / "benchmarks.md", tmp_path / "benchmarks_seq2seq.png"
    md.write_text(f"# Training throughput\n\ntable\n\n{NOTES_MARKER}\n\nnotes\n\n## Triton kernels\n\nkept\n")
    bs.write_report(_fake_data(), md, png)
    text = md.read_text()
    assert (
        "xfam / x-transformers default = 1.200 (per round 1.100-1.300, median 1.200), target >= 1.10: **met**" in text
    )
    assert (
        "xfam / x-transformers attn_flash = 1.143 (per round 1.000-1.300, median 1.150), target >= 1.00: **met**"
        in text
    )
    assert text.index(NOTES_MARKER) < text.index("notes") < text.index("kept") < text.index(bs.START)
    assert png.stat().st_size > 0
    bs.write_report(_fake_data(scale=0.5), md, png)
    again = md.read_text()
    assert again.count(bs.START) == again.count(bs.HEADING) == 1 and again.startswith(text[: text.index(bs.START)])
    assert "xfam / x-transformers default = 0.600" in again and "**not met**" in again


def test_a_report_without_the_notes_marker_gets_one_first(tmp_path: Path) -> None:
    md = tmp_path / "benchmarks.md"
    md.write_text("# Training throughput\n")
    bs.write_report(_fake_data(), md, tmp_path / "s.png")
    text = md.read_text()
    assert text.index(NOTES_MARKER) < text.index(bs.HEADING) < text.index(bs.START)


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    """``--quick`` at the tiny shape: every worker in its own process, the section and the chart written."""
    md, png, raw = tmp_path / "b.md", tmp_path / "b.png", tmp_path / "b.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench_seq2seq.py"), "--quick", "--tiny", "--threads", "1"]
    proc = subprocess.run(
        [*cmd, "--md", str(md), "--png", str(png), "--json", str(raw)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert bs.START in md.read_text() and png.exists()
    import json

    runs = json.loads(raw.read_text())["runs"]
    assert {(r["system"], r["batch"]) for r in runs} == {("matmul", 0)} | {
        (s, TINY.batch) for s in bs.TRAIN_SYSTEMS
    } | {(s, b) for s in bs.DECODE_SYSTEMS for b in bs.DECODE_BATCHES}
