"""Run directory names and the multirun summary table."""

from __future__ import annotations

import json
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

from xfam.cli.hydra_app import dirname
from xfam.hydra_callbacks import summarize, write_tables


def test_dirname_is_deterministic_readable_and_usable_unquoted_in_an_override() -> None:
    assert dirname("") == "default"
    name = dirname("data.paths:[/some/long/path/to/a/corpus/folder]+model:small+pos:alibi")
    assert name == dirname("data.paths:[/some/long/path/to/a/corpus/folder]+model:small+pos:alibi")
    assert name.startswith("data.paths:h") and name.endswith("+model:small+pos:alibi")
    assert dirname("data.paths:[/x]") != dirname("data.paths:[/y]")
    (ov,) = OverridesParser.create().parse_overrides([f"ckpt_path=runs/default/{name}/checkpoints/last.ckpt"])
    assert ov.value() == f"runs/default/{name}/checkpoints/last.ckpt"
    assert len(dirname("+".join(f"k{i}:{i}" for i in range(100)))) <= 160


def test_summary_has_one_row_per_job_with_its_status(tmp_path: Path) -> None:
    for name, loss in (("pos:rope", 1.5), ("pos:alibi", 1.25)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"step": 10, "val/loss": loss}))
    (tmp_path / "pos:killed").mkdir()  # a job killed from outside wrote nothing: no row
    (tmp_path / "pos:xl").mkdir()  # a job that failed in training records why
    (tmp_path / "pos:xl" / "status.json").write_text(json.dumps({"status": "failed", "reason": "Boom: a|b\nc"}))
    rows = summarize(tmp_path)
    assert [(r["run"], r["status"]) for r in rows] == [("pos:alibi", "ok"), ("pos:rope", "ok"), ("pos:xl", "failed")]
    csv_path, md_path = write_tables(rows, tmp_path)
    assert csv_path.read_text().splitlines()[0] == "run,status,step,val/loss,reason"
    table = md_path.read_text()
    assert "| pos:alibi | ok | 10 | 1.25 |  |" in table and "| pos:xl | failed |  |  | Boom: a/b c |" in table
