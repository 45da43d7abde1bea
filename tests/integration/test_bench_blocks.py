"""scripts/bench_blocks.py: for each option set both libraries build the same matrices (up to x-transformers' GLU
bias), with the same FFN width and FLOP count; every worker runs a tiny training step; xfam takes its explicit-score
path exactly where talking heads need it; the report is a marked section of docs/benchmarks.md that keeps the rest
of the file. No timings are asserted."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_blocks as bb  # noqa: E402
from benchlib.common import NOTES_MARKER  # noqa: E402

pytest.importorskip("x_transformers")
TINY, FULL = bb.TINY, bb.FULL


def _n(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_help_names_every_set_and_option(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        bb.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert all(name in text for name in bb.SETS) and "--quick" in text and "--from-json" in text


def test_systems_per_set_and_no_flash_with_talking_heads() -> None:
    """Three systems per set where x-transformers allows attn_flash, two for talking heads (its Attend refuses)."""
    assert bb.systems_of("geglu_rms_qknorm") == (
        "xfam_geglu_rms_qknorm",
        "xtransformers_geglu_rms_qknorm",
        "xtransformers_geglu_rms_qknorm_flash",
    )
    assert len(bb.SYSTEMS) == 8 and "xtransformers_macaron_talking_heads_flash" not in bb.SYSTEMS
    assert bb.parse_system("xtransformers_sandwich_layerscale_flash") == ("xtransformers", "sandwich_layerscale", True)
    with pytest.raises(AssertionError, match="talking heads"):
        bb.build_xtransformers("macaron_talking_heads", TINY, flash=True)


@pytest.mark.parametrize("name", list(bb.SETS))
def test_both_libraries_build_the_same_matrices(name: str) -> None:
    """At the benchmark's shape: equal parameter counts but for x-transformers' GLU bias (``param_gap``), and the
    FLOP count's matmul weights are exactly xfam's block and head Linear weights."""
    xfam, xt = bb.build_xfam(name, FULL), bb.build_xtransformers(name, FULL, flash=False)
    assert _n(xt) - _n(xfam) == bb.param_gap(name, FULL)[0]
    weights = sum(m.weight.numel() for m in xfam.modules() if isinstance(m, nn.Linear))
    assert bb.flops_per_step(name, FULL)["n_matmul"] == weights


def test_the_glu_sets_hidden_width_is_the_same_in_both() -> None:
    """xfam's 8 ceil(2/3 x 4D / 8) = 688 at D = 256; x-transformers' ff_mult gives the same inner width, and its
    extra parameters are exactly its GLU input bias (ff_no_bias does not reach it)."""
    assert FULL.glu_hidden == 688
    xfam, xt = bb.build_xfam("geglu_rms_qknorm", FULL), bb.build_xtransformers("geglu_rms_qknorm", FULL, False)
    assert xfam.blocks[0].ffn.up.weight.shape == (2 * 688, 256) and xfam.blocks[0].ffn.down.weight.shape == (256, 688)
    glu = [m for m in xt.modules() if type(m).__name__ == "GLU"]
    assert len(glu) == 4 and all(g.proj.weight.shape == (2 * 688, 256) for g in glu)
    biases = sum(p.numel() for n, p in xt.named_parameters() if n.endswith("bias"))
    assert biases == sum(g.proj.bias.numel() for g in glu) == bb.param_gap("geglu_rms_qknorm", FULL)[0] == 5504


@pytest.mark.parametrize("system", bb.SYSTEMS)
def test_each_system_runs_a_training_step(system: str) -> None:
    """One tiny step; tokens/s = batch x seq / step time; an untrained model's loss is near log V."""
    res = bb.run_train(system, TINY, warmup=0, steps=1)
    assert res["tokens_per_s"] == pytest.approx(TINY.tokens / res["step_s"])
    assert abs(res["loss_first"] - math.log(TINY.vocab)) < 1.0


@pytest.mark.parametrize("name", list(bb.SETS))
def test_xfam_forms_explicit_scores_only_for_talking_heads(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's claim: vanilla (backend=auto) runs SDPA for the first two sets, its einsum reference path (one
    call per layer) for talking heads, whose head mixing needs the score matrix."""
    import xfam.attention.vanilla as vanilla

    calls = []
    real = vanilla.reference_attention
    monkeypatch.setattr(vanilla, "reference_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = bb.build_xfam(name, TINY)
    model(torch.randint(0, TINY.vocab, (TINY.batch, TINY.seq)))
    assert len(calls) == (TINY.layers if name == "macaron_talking_heads" else 0)


def _fake_run(system: str, repeat: int, tps: float, params: int = 1000) -> dict:
    run = {"system": system, "repeat": repeat, "tokens_per_s": tps, "step_s": 0.3, "params": params}
    return run | {"peak_rss_mb": 700.0, "rss_before_mb": 300.0, "foreign_cores": 0.01}


def _fake_data(scale: float = 1.0) -> dict:
    runs = []
    gap = bb.param_gap("geglu_rms_qknorm", FULL)[0]
    for rep, (xfam, default, flash) in enumerate(((6600, 6000, 6600), (7800, 6000, 6000))):
        runs.append({"system": "matmul", "repeat": rep, "gflops": 180.0, "foreign_cores": 0.0})
        for name in bb.SETS:
            extra = gap if name == "geglu_rms_qknorm" else 0
            runs.append(_fake_run(f"xfam_{name}", rep, xfam * scale))
            runs.append(_fake_run(f"xtransformers_{name}", rep, default, 1000 + extra))
            if bb.SETS[name].flash:
                runs.append(_fake_run(f"xtransformers_{name}_flash", rep, flash, 1000 + extra))
    for r in runs:
        r |= {"loss_first": 5.6, "loss_last": 5.5} if r["system"] != "matmul" else {}
    meta = {"date": "today", "command": "bench_blocks.py", "cpu": "cpu", "cores": 2, "torch": "t"}
    meta |= {"x_transformers": "x", "xfam_commit": "c", "threads": 2, "shape": bb.dataclasses.asdict(FULL)}
    meta |= {"repeats": 2, "warmup": 5, "steps": 20, "max_wait": 600, "quiet": 0.25, "noisy": 0.3, "retries": 5}
    return {"meta": meta, "runs": runs, "rejected": []}


def test_the_report_is_a_section_after_the_training_reports_notes(tmp_path: Path) -> None:
    """Per set: ratios of the medians over rounds with the per-round range, a flash ratio only where x-transformers
    has one, the parameter difference explained; rewriting replaces only the section, which sits after
    bench_train.py's notes marker and any earlier section (so rewriting the training report keeps it)."""
    md, png = tmp_path / "benchmarks.md", tmp_path / "benchmarks_blocks.png"
    seq2seq = "<!-- bench_seq2seq:start -->\nseq2seq\n<!-- bench_seq2seq:end -->"
    md.write_text(f"# Training throughput\n\ntable\n\n{NOTES_MARKER}\n\nnotes\n\n{seq2seq}\n")
    bb.write_report(_fake_data(), md, png)
    text = md.read_text()
    for name in bb.SETS:
        assert (
            f"* {name}: xfam / x-transformers default = 1.200 (per round 1.100-1.300, median 1.200), target >= 1.10: "
            "**met**" in text
        )
    flash = "xfam / x-transformers attn_flash = 1.143 (per round 1.000-1.300, median 1.150), target >= 1.00: **met**"
    assert text.count(flash) == 2 and "* macaron_talking_heads: xfam / x-transformers attn_flash" not in text
    assert (
        "exactly the bias of its GLU input projection (4 blocks x 2 x 688)" in text and "not the expected" not in text
    )
    assert "`model.attn_qk_scale=10.0`" in text and "`ff_mult=2.6875`" in text
    assert text.index(NOTES_MARKER) < text.index("notes") < text.index("seq2seq") < text.index(bb.START)
    assert png.stat().st_size > 0
    bb.write_report(_fake_data(scale=0.5), md, png)
    again = md.read_text()
    assert again.count(bb.START) == again.count(bb.HEADING) == 1 and again.startswith(text[: text.index(bb.START)])
    assert "xfam / x-transformers default = 0.600" in again and "**not met**" in again


def test_a_report_without_the_notes_marker_gets_one_first(tmp_path: Path) -> None:
    md = tmp_path / "benchmarks.md"
    md.write_text("# Training throughput\n")
    bb.write_report(_fake_data(), md, tmp_path / "b.png")
    text = md.read_text()
    assert text.index(NOTES_MARKER) < text.index(bb.HEADING) < text.index(bb.START)


def test_rendering_from_json_keeps_the_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--from-json`` renders saved results without running a worker, and prints the verdicts."""
    import json

    raw, md = tmp_path / "raw.json", tmp_path / "b.md"
    raw.write_text(json.dumps(_fake_data()))
    bb.main(["--from-json", str(raw), "--md", str(md), "--png", str(tmp_path / "b.png")])
    assert "rendered by `bench_blocks.py --from-json" in md.read_text()
    assert "geglu_rms_qknorm: xfam / x-transformers default = 1.200" in capsys.readouterr().out


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    """``--quick`` at the tiny shape: every worker in its own process, the section and the chart written."""
    md, png, raw = tmp_path / "b.md", tmp_path / "b.png", tmp_path / "b.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench_blocks.py"), "--quick", "--tiny", "--threads", "1"]
    proc = subprocess.run(
        [*cmd, "--md", str(md), "--png", str(png), "--json", str(raw)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert bb.START in md.read_text() and png.exists()
    import json

    runs = json.loads(raw.read_text())["runs"]
    assert [r["system"] for r in runs] == ["matmul", *bb.SYSTEMS]
