"""Hydra callbacks: the summary table of a multirun, and its jobs' composition."""

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
    why it did not finish (``status.json``: skipped by validation, or failed in training), and its
    overrides (a list)."""
    rows = []
    for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        row: dict[str, Any] = {"run": job.name}
        for name in ("status.json", "metrics.json"):  # status.json: jobs of a sweep (see run_job)
            if (job / name).is_file():
                row.update(json.loads((job / name).read_text()))
        if isinstance(row.get("overrides"), str):  # (written as one string before)
            row["overrides"] = row["overrides"].split()
        if len(row) > 1:
            rows.append({"status": "ok", **row})
    return rows


def differing(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Each row's overrides that not every row has: what tells the sweep's jobs apart (in full)."""
    known = [set(r["overrides"]) for r in rows if r.get("overrides")]
    everywhere = set.intersection(*known) if known else set()
    return [[o for o in r.get("overrides") or [] if o not in everywhere] for r in rows]


def write_tables(rows: list[dict[str, Any]], sweep_dir: Path) -> tuple[Path, Path]:
    """``summary.csv``: every job's directory, status, metrics, reason and overrides; ``summary.md``: the
    same table naming each job by the overrides that tell it apart (a run directory's name is cut)."""
    last = ["reason", "overrides"]
    keys = ["run", "status"] + sorted({k for r in rows for k in r} - {"run", "status", *last}) + last
    keys = [k for k in keys if any(k in r for r in rows)]
    csv_path, md_path = sweep_dir / "summary.csv", sweep_dir / "summary.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "overrides": " ".join(r["overrides"])} if "overrides" in r else r)

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v).replace("\n", " ").replace("|", "/")

    shown = [k for k in keys if k != "overrides"]  # in summary.csv
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for r, own in zip(rows, differing(rows)):
        named = {**r, "run": " ".join(own) or r["run"]}
        lines.append("| " + " | ".join(fmt(named.get(k)) for k in shown) + " |")
    if any(r.get("overrides") for r in rows):
        lines += ["", "run: the overrides that tell jobs apart; summary.csv has each job's directory and overrides."]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def _compose_unknown_keys(load: Any) -> Any:
    """Hydra's ``load_sweep_config`` (which composes each job of a sweep, for the sweeper's check and for
    the launch) for sweeps where an override names a key that only some jobs' components have
    (``-m pos=rope,alibi pos.rotary_dim=8``): Hydra cannot compose the other jobs, and one such job would
    stop the whole sweep before any job starts. Such a job is composed with ``++key=value`` instead
    (``force_keys``): its run refuses the key (validation names it and the valid keys) and it is recorded
    as skipped with that reason, like every invalid job; its overrides and run directory stay as typed."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    from xfam.training.precheck import _override_key, _unknown_key, force_keys

    def load_sweep_config(master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        typed = list(sweep_overrides)
        forced: set[str] = set()
        while True:
            try:
                cfg = load(master_config, force_keys(typed, forced))
                break
            except Exception as err:
                key = _unknown_key(err)
                if key is None or key in forced or not any(_override_key(o) == key for o in typed):
                    raise
                forced.add(key)
        if forced:  # the job as typed: its overrides, its run directory
            task = [o for o in OverridesParser.create().parse_overrides(typed) if not o.is_hydra_override()]
            names = cfg.hydra.job.config.override_dirname
            with open_dict(cfg.hydra):
                cfg.hydra.overrides.task = [o.input_line for o in task]
                cfg.hydra.job.override_dirname = get_overrides_dirname(
                    overrides=task, kv_sep=names.kv_sep, item_sep=names.item_sep, exclude_keys=names.exclude_keys
                )
        return cfg

    load_sweep_config.xfam_wrapped = load  # type: ignore[attr-defined]
    return load_sweep_config


class MultirunSummary(Callback):
    """At the end of a multirun, writes ``summary.csv`` and ``summary.md`` in the sweep directory:
    one row per job with its final metrics, or with its status (skipped, failed) and the reason. At its
    start, lets a job with a key its components lack be recorded as skipped (``_compose_unknown_keys``)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        loader = GlobalHydra.instance().config_loader()  # the sweeper's and the launcher's
        if not hasattr(loader.load_sweep_config, "xfam_wrapped"):
            loader.load_sweep_config = _compose_unknown_keys(loader.load_sweep_config)  # type: ignore[method-assign]

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = summarize(sweep_dir)
        if not rows:
            log.warning("multirun summary: no job in %s wrote metrics.json", sweep_dir)
            return
        csv_path, md_path = write_tables(rows, sweep_dir)
        bad = sum(r["status"] != "ok" for r in rows)
        log.info("multirun summary (%d jobs, %d did not finish): %s\n%s", len(rows), bad, csv_path, md_path.read_text())
