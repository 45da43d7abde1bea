"""A Hydra sweep through train.py, each job 2-process DDP on CPU: one run directory per job and one
summary table of every job's final metrics."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from tests.integration.helpers import TINY, run_cli, text_data


@pytest.mark.slow  # two 2-process jobs: ~50 s
def test_sweep_of_ddp_jobs_writes_runs_and_summary(corpus: Path, tmp_path: Path) -> None:
    args = ["-m", "pos=none,alibi", "trainer=ddp_cpu", "name=sweep", *TINY, *text_data(corpus)]
    res = run_cli(["train.py", *args], env={"XFAM_RUNS": str(tmp_path)}, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sweep = tmp_path / "sweep" / "multirun"
    runs = sorted(p.parent for p in sweep.glob("*/metrics.json"))
    assert len(runs) == 2, res.stdout[-3000:]
    assert sorted(yaml.safe_load((r / "config.yaml").read_text())["pos"]["name"] for r in runs) == ["alibi", "none"]
    for run in runs:
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["step"] == 6 and metrics["val/loss"] > 0
        assert (run / "checkpoints" / "last.ckpt").is_file()
        ckpt_rows = (run / "config.yaml").read_text()
        assert "strategy: ddp_spawn" in ckpt_rows and "devices: 2" in ckpt_rows
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["run"] for r in rows) == [r.name for r in runs]
    assert all(float(r["test/loss"]) > 0 for r in rows)
    assert (sweep / "summary.md").read_text().startswith("| run |")


def test_a_sweep_records_skipped_and_failed_jobs_and_finishes_the_others(corpus: Path, tmp_path: Path) -> None:
    # heads=3 does not divide width 32 (refused: skipped); lr=1e30 diverges at the first step (failed)
    args = ["-m", "name=mixed", *TINY, *text_data(corpus), "model.heads=2,3", "optim.lr=0.001,1e30"]
    res = run_cli(["train.py", *args], env={"XFAM_RUNS": str(tmp_path)}, timeout=600)
    assert res.returncode == 1 and "1 job(s) of the sweep failed" in res.stderr, res.stderr[-3000:]
    assert "2 of 4 jobs of this sweep cannot run and will be recorded as skipped" in res.stderr
    sweep = tmp_path / "mixed" / "multirun"
    with open(sweep / "summary.csv") as f:
        rows = {(r["run"]): r for r in csv.DictReader(f)}
    assert sorted(r["status"] for r in rows.values()) == ["failed", "ok", "skipped", "skipped"]
    (ok,) = [r for r in rows.values() if r["status"] == "ok"]
    assert "optim.lr=0.001" in ok["overrides"] and "model.heads=3" not in ok["overrides"]
    assert float(ok["test/loss"]) > 0
    (failed,) = [r for r in rows.values() if r["status"] == "failed"]
    assert "optim.lr=1e+30" in failed["overrides"] and "model.heads=3" not in failed["overrides"]
    assert "NonFiniteError: training stopped at step" in failed["reason"]
    for r in rows.values():
        if r["status"] == "skipped":
            assert "model.heads=3" in r["overrides"] and "heads" in r["reason"] and "Fix:" in r["reason"]
    assert "| status |" in (sweep / "summary.md").read_text().splitlines()[0]
