"""Early exit through the real command lines: training reports the full-depth comparison, and xfam
eval / generate / calibrate take the policy's inference options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.helpers import TINY, run_cli, text_data

CLEAN_EXIT = 2


@pytest.fixture(scope="module")
def calm_ckpt(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    runs = tmp_path_factory.mktemp("exit-runs")
    env = {"XFAM_RUNS": str(runs)}
    args = ["name=calm", *TINY, "model.layers=3", "exit=calm", "exit.threshold=0.2", *text_data(corpus)]
    res = run_cli(["train.py", *args], env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run_dir,) = [p.parent for p in (runs / "calm").glob("*/metrics.json")]
    return run_dir, env


def test_validation_reports_depth_and_the_full_model(calm_ckpt: tuple[Path, dict]) -> None:
    run_dir, _ = calm_ckpt
    metrics = json.loads((run_dir / "metrics.json").read_text())
    flat = json.dumps(metrics)
    for key in ("val/depth", "val/compute_saved", "val/full/bpb", "val/agreement", "test/agreement"):
        assert key in flat, key
    (csv,) = run_dir.glob("logs/*/metrics.csv")
    header = csv.read_text().splitlines()[0].split(",")
    assert "train/exit/layers" in header and "train/exit/classifier" in header


def test_eval_compares_with_full_depth_and_takes_inference_options(calm_ckpt: tuple[Path, dict]) -> None:
    run_dir, env = calm_ckpt
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    res = run_cli(["-m", "xfam.cli", "eval", f"ckpt={ckpt}", "exit.threshold=1.5"], env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    values = dict(line.split() for line in res.stdout.splitlines()[1:] if line.startswith("  "))
    assert float(values["test/agreement"]) == 1.0 and float(values["test/compute_saved"]) == 0.0
    assert values["test/bpb"] == values["test/full/bpb"]  # exits disabled: the full model
    res = run_cli(["-m", "xfam.cli", "eval", f"ckpt={ckpt}", "exit.exit_at=1", "exit.measure=saturation"], env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    values = dict(line.split() for line in res.stdout.splitlines()[1:] if line.startswith("  "))
    assert values["test/compute_saved"] == "0.6667" and float(values["test/depth"]) == 1.0


@pytest.mark.parametrize(
    ("word", "message"),
    [
        ("exit.classifier_weight=2", "not an inference option of exit=calm"),
        ("exit.measure=entropy", "exit.measure"),
        ("exit.exit_at=3", "exit.exit_at=2 or less"),
        ("threshold=0.5", "expected exit.KEY=VALUE"),
    ],
)
def test_bad_inference_options_are_one_clear_error(calm_ckpt: tuple[Path, dict], word: str, message: str) -> None:
    run_dir, env = calm_ckpt
    res = run_cli(["-m", "xfam.cli", "eval", f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}", word], env=env)
    assert res.returncode == CLEAN_EXIT and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_generate_reports_depth_and_agreement(calm_ckpt: tuple[Path, dict]) -> None:
    run_dir, env = calm_ckpt
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    args = ["-m", "xfam.cli", "generate", f"ckpt={ckpt}", "prompt=the quick", "max_new_tokens=12", "num_samples=3"]
    res = run_cli([*args, "exit.threshold=0.0"], env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "depth: 1.00 of 3 layers per generated token, compute saved 66.7%" in res.stdout
    assert "agreement with the full-depth model" in res.stdout and "of 36 tokens" in res.stdout


def test_calibrate_prints_the_table_and_a_choice(calm_ckpt: tuple[Path, dict]) -> None:
    run_dir, env = calm_ckpt
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    res = run_cli(["-m", "xfam.cli", "calibrate", f"ckpt={ckpt}", "delta=0.5", "thresholds=0.0,1.01,0.5"], env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split()[0] for line in res.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert rows == ["1.0100", "0.5000", "0.0000"] and "p-value" in res.stdout  # most conservative first
    assert "chosen: exit.threshold=" in res.stdout
    # a few dozen examples cannot show a disagreement <= 0.001 with 95% confidence, even with exits disabled
    res = run_cli(["-m", "xfam.cli", "calibrate", f"ckpt={ckpt}", "delta=0.001", "thresholds=1.01"], env=env)
    assert res.returncode == 0 and "no candidate passes" in res.stdout, res.stdout + res.stderr
    res = run_cli(["-m", "xfam.cli", "calibrate", f"ckpt={ckpt}", "method=grid", "thresholds=1.01,0.0"], env=env)
    assert res.returncode == 0 and "chosen: exit.threshold=1.01" in res.stdout, res.stdout + res.stderr


def test_calibrate_refuses_a_model_without_exits(corpus: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"x")
    res = run_cli(["-m", "xfam.cli", "calibrate", f"ckpt={bad}"])
    assert res.returncode == CLEAN_EXIT and "Traceback" not in res.stderr
