"""Glue between Hydra and xfam: resolvers, run directory names, and the task function.

``main`` (train.py's entry point) runs the pre-launch check (``xfam.training.precheck``: every job of
the command line composed and validated before any job starts or any directory is created), then
Hydra. A job that fails while training is recorded as failed; the sweep summary lists it with the
skipped ones (``xfam.training.hydra_callbacks``) and the command exits 1 if any job failed.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from xfam.core.errors import ConfigError
from xfam.training.plugin_options import prepare as prepare_plugins
from xfam.training.precheck import hydra_args, precheck
from xfam.training.run_names import register_resolvers

log = logging.getLogger("xfam")


def report(err: ConfigError, debug: bool) -> None:
    """Print a configuration error the way the command line shows it, then exit 2."""
    if debug:
        raise err
    print(f"xfam: error: {err}", file=sys.stderr)
    print("(run with debug=true or XFAM_DEBUG=1 for a traceback)", file=sys.stderr)
    sys.exit(2)


def debug_requested(args: list[str]) -> bool:
    return os.environ.get("XFAM_DEBUG") == "1" or any(a in ("debug=true", "debug=True") for a in args)


#: Jobs of this process's sweep that failed (the basic launcher runs them here); main() exits 1 then.
FAILED_JOBS: list[str] = []


def run_job(cfg: DictConfig) -> Any:
    """Hydra's task function body: one job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from xfam.training.lit.nonfinite import NonFiniteError
    from xfam.training.runner import train

    plain = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    debug = plain.get("debug", False) or os.environ.get("XFAM_DEBUG") == "1"
    if HydraConfig.get().mode == RunMode.MULTIRUN and not debug:
        return _sweep_job(plain, run_dir, list(HydraConfig.get().overrides.task))
    try:
        metrics = train(plain, run_dir)
    except ConfigError as err:
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # Hydra created it for this job; a refused job leaves nothing behind
        report(err, debug)
    except NonFiniteError as err:  # trainer.nonfinite=stop: the message says where and what to do
        if debug:
            raise
        print(f"xfam: error: {err}", file=sys.stderr)
        sys.exit(1)
    metric = plain.get("optimized_metric")
    if metric:
        if metric not in metrics:
            report(
                ConfigError(
                    f"optimized_metric={metric!r} is not among the final metrics {sorted(metrics)}."
                    f" Fix: choose one of them."
                ),
                False,
            )
        return metrics[metric]
    return None


def _sweep_job(plain: dict[str, Any], run_dir: Path, overrides: list[str]) -> Any:
    """One job of a sweep: its ``status.json`` (ok, skipped by validation or failed in training, the
    reason, the job's overrides as a list) is read by the sweep summary; a job that does not finish
    never stops the others."""
    import json
    import traceback

    from lightning.pytorch.utilities import rank_zero_only

    from xfam.model.checkpoint import DiskFullError
    from xfam.training.runner import train

    status: dict[str, Any] = {"status": "ok"}
    try:
        metrics = train(plain, run_dir)
    except DiskFullError as err:  # one line like a config problem, but the job did not run: failed, not skipped
        status = {"status": "failed", "reason": str(err)}
        FAILED_JOBS.append(run_dir.name)
    except ConfigError as err:
        status = {"status": "skipped", "reason": str(err)}
    except Exception as err:  # a job failing in training: the others still run
        status = {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
        log.error("job %s failed:\n%s", run_dir.name, traceback.format_exc())
        FAILED_JOBS.append(run_dir.name)
    # (set by Lightning at import; under srun every task of the job runs this: the rank from the environment)
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "status.json").write_text(json.dumps({**status, "overrides": overrides}, indent=1))
    metric = plain.get("optimized_metric")
    if status["status"] != "ok":
        log.warning("job %s %s: %s", run_dir.name, status["status"], status["reason"])
        return float("nan") if metric else None  # Optuna records a NaN trial as failed
    return metrics.get(metric) if metric else None


def main(task: Any) -> None:
    """Entry point of train.py: pre-launch check, then Hydra."""

    args = sys.argv[1:]
    register_resolvers()
    try:
        prepare_plugins(args)  # third-party components: their Hydra options on the config search path
        flags = hydra_args(args) if "--version" not in args else None
        shows = flags is None or any(  # commands that only show something: Hydra's own checks
            getattr(flags, f) for f in ("help", "hydra_help", "cfg", "info", "shell_completion", "experimental_rerun")
        )
        if not shows:
            precheck(args)
    except ConfigError as err:
        report(err, debug_requested(args))
    task()
    if FAILED_JOBS:
        print(f"xfam: {len(FAILED_JOBS)} job(s) of the sweep failed: {', '.join(FAILED_JOBS)}", file=sys.stderr)
        sys.exit(1)
