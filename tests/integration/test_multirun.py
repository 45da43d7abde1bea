"""A Hydra sweep through train.py, each job 2-process DDP on CPU: one run directory per job and one
summary table of every job's final metrics."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import yaml

from tests.integration.helpers import TINY, run_cli, text_data


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
