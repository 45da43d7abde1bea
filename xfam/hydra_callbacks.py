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
    """One row per job directory of ``sweep_dir`` that holds a ``metrics.json``."""
    rows = []
    for metrics in sorted(sweep_dir.glob("*/metrics.json")):
        row = {"run": metrics.parent.name, **json.loads(metrics.read_text())}
        rows.append(row)
    return rows


def write_tables(rows: list[dict[str, Any]], sweep_dir: Path) -> tuple[Path, Path]:
    keys = ["run"] + sorted({k for r in rows for k in r} - {"run"})
    csv_path, md_path = sweep_dir / "summary.csv", sweep_dir / "summary.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


class MultirunSummary(Callback):
    """At the end of a multirun, writes ``summary.csv`` and ``summary.md`` in the sweep directory:
    one row per job with its final metrics (jobs that failed have no row)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = summarize(sweep_dir)
        if not rows:
            log.warning("multirun summary: no job in %s wrote metrics.json", sweep_dir)
            return
        csv_path, md_path = write_tables(rows, sweep_dir)
        log.info("multirun summary (%d jobs): %s\n%s", len(rows), csv_path, md_path.read_text())
