"""Hydra callbacks: the summary table of a multirun."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("xfam")


def summarize(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory of ``sweep_dir``: its final metrics (``metrics.json``, status ok), or
    why it did not finish (``status.json``: skipped by validation, or failed in training)."""
    rows = []
    for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        row: dict[str, Any] = {"run": job.name}
        for name in ("status.json", "metrics.json"):  # status.json: jobs of a sweep (see run_job)
            if (job / name).is_file():
                row.update(json.loads((job / name).read_text()))
        if len(row) > 1:
            rows.append({"status": "ok", **row})
    return rows


def write_tables(rows: list[dict[str, Any]], sweep_dir: Path) -> tuple[Path, Path]:
    last = ["reason", "overrides"]
    keys = ["run", "status"] + sorted({k for r in rows for k in r} - {"run", "status", *last}) + last
    keys = [k for k in keys if any(k in r for r in rows)]
    csv_path, md_path = sweep_dir / "summary.csv", sweep_dir / "summary.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v).replace("\n", " ").replace("|", "/")

    shown = [k for k in keys if k != "overrides"]  # in summary.csv; too long for the table
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in shown) + " |" for r in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


class MultirunSummary(Callback):
    """At the end of a multirun, writes ``summary.csv`` and ``summary.md`` in the sweep directory:
    one row per job with its final metrics, or with its status (skipped, failed) and the reason."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = summarize(sweep_dir)
        if not rows:
            log.warning("multirun summary: no job in %s wrote metrics.json", sweep_dir)
            return
        csv_path, md_path = write_tables(rows, sweep_dir)
        bad = sum(r["status"] != "ok" for r in rows)
        log.info("multirun summary (%d jobs, %d did not finish): %s\n%s", len(rows), bad, csv_path, md_path.read_text())
