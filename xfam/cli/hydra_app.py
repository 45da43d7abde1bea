"""Glue between Hydra and xfam: resolvers, the pre-launch check, and the task function.

``precheck(argv)`` runs before Hydra: it composes every job a command line would launch (each
combination of a sweep, up to a limit) and validates each with xfam, so an unknown option, an
unknown key or an incompatible combination is reported in one clear message before any job
starts or any directory is created; so is a trainer this machine cannot run (``trainer=fsdp``
without a GPU), unless the jobs go to a cluster (``hydra/launcher=...``). In a sweep, jobs that
are individually invalid (e.g. one attention x pos pair that cannot combine) do not stop the
others: they are announced, then recorded as skipped with their reason, and a job that fails
while training is recorded as failed; the sweep summary lists both (``xfam.hydra_callbacks``) and
the command exits 1 if any job failed.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from xfam.errors import ConfigError, close_matches, unknown_choice

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
MAX_PRECHECK_JOBS = 256
log = logging.getLogger("xfam")


def dirname(overrides: str) -> str:
    """A run directory name from Hydra's override_dirname (``pos=alibi+model=small``, the overrides as
    typed, sorted): ``pos:alibi+model:small``, only characters that a path can carry unquoted in a Hydra
    override; long values (paths) become a short hash, so every key stays readable; a bounded length.

    Two different command lines must never share a directory (``ckpt_path=auto`` would continue one's
    checkpoint with the other's config), so an item that had to be changed (characters replaced, e.g.
    ``data.paths=[x/ab]`` and ``data.paths=[x_ab]``) or that is not a plain ``key=value`` (a piece of a
    value holding ``+``) carries a hash of itself; names needing none of this are as they always were."""

    def _hash(text: str) -> str:
        return hashlib.sha1(text.encode()).hexdigest()[:8]

    items: list[str] = []
    for piece in overrides.split("+") if overrides else []:
        if items and not items[-1].strip("+"):  # "+key=value" (add a key): the "+" is part of the item
            piece = items.pop() + "+" + piece
        items.append(piece)
    names = []
    for item in items:
        rest = item.lstrip("+")
        key, sep, value = rest.partition("=")
        if len(value) > 24:
            value = "h" + _hash(value)
        plain = key + (":" if sep else "") + value
        name = re.sub(r"[^A-Za-z0-9_.\-:@%]", "_", plain)
        if name != plain or not sep or ":" in key:
            name += "-" + _hash(item)
        names.append(item[: len(item) - len(rest)] + name)
    name = "+".join(names) or "default"
    if len(name) > 160:
        name = name[:140] + "-" + hashlib.sha1(name.encode()).hexdigest()[:10]
    return name


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("xfam_dirname"):
        OmegaConf.register_new_resolver("xfam_dirname", dirname)


def config_groups() -> dict[str, list[str]]:
    """xfam's config groups and their options (from configs/)."""
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(CONFIG_DIR.iterdir())
        if d.is_dir() and d.name != "hydra"
    }


def _job_overrides(args: list[str]) -> list[list[str]] | None:
    """Every job's override list (sweeps expanded); None when a sweep cannot be enumerated."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=args)
    choices = []
    for ov in parsed:
        if ov.key_or_group.startswith("hydra"):
            continue
        if ov.is_sweep_override():
            if ov.is_interval_sweep():
                return None
            values = list(ov.sweep_string_iterator())
            choices.append([f"{ov.get_key_element()}={v}" for v in values])
        else:
            choices.append([ov.input_line])
    jobs = [list(c) for c in itertools.islice(itertools.product(*choices), MAX_PRECHECK_JOBS + 1)]
    return jobs[:MAX_PRECHECK_JOBS]


def _group_problems(args: list[str]) -> tuple[list[str], list[str]]:
    """Unknown config-group options, and the overrides that remain once those are dropped."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = config_groups()
    problems, kept = [], []
    for ov in OverridesParser.create().parse_overrides(overrides=args):
        group = ov.key_or_group.lstrip("+~")
        values = []
        if group in groups and not ov.is_interval_sweep():
            values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.value()]
        bad = [v for v in values if isinstance(v, str) and v not in groups[group] and v != "null"]
        for v in bad:
            problems.append(unknown_choice(group, v, groups[group], f"pass {group}=<one of the valid choices>."))
        if not bad:
            kept.append(ov.input_line)
    return problems, kept


def _unknown_key(err: Exception) -> str | None:
    """The dotted key of Hydra's "Could not override 'a.b'" error, if that is what ``err`` is."""
    msg = str(err)
    if msg.startswith("Could not override '"):
        return msg.split("'")[1]
    return None


def _key_problem(key: str, base: dict[str, Any]) -> str:
    section, _, leaf = key.rpartition(".")
    node: Any = base
    for part in section.split(".") if section else []:
        node = node.get(part, {}) if isinstance(node, dict) else {}
    valid = sorted(node) if isinstance(node, dict) else []
    near = close_matches(leaf, valid)
    hint = f" Did you mean {' or '.join(map(repr, near))}?" if near else ""
    where = section or "config"
    return (
        f"{where}: unknown key {leaf!r}.{hint} Valid keys: {', '.join(valid)}. "
        f"Fix: use a valid key (or +{key}=... to add one on purpose)."
    )


def _compose(compose: Any, job: list[str]) -> tuple[Any, list[str]]:
    """Compose ``job``, dropping (and reporting) overrides of keys that do not exist; the valid keys
    named are those of the config the rest of the job selects (e.g. ``attention=local``'s)."""
    unknown = []
    for _ in range(len(job) + 1):
        try:
            cfg = compose("train", overrides=job)
        except Exception as err:  # Hydra's composition errors
            key = _unknown_key(err)
            if key is None:
                return None, [f"{err}. Fix: check the override against `python train.py --help`."]
            unknown.append(key)
            job = [o for o in job if o.lstrip("+~").split("=")[0] != key]
            continue
        plain = OmegaConf.to_container(cfg, resolve=False)
        return cfg, [_key_problem(key, plain) for key in unknown]
    return None, []


def precheck(args: list[str]) -> None:
    """Validate every job of a command line (overrides in ``args``); raises ConfigError. In a sweep of
    several jobs, jobs invalid on their own are only announced (they will be skipped) unless all are."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from xfam.config import check_machine, validate

    problems, overrides = _group_problems([a for a in args if not a.startswith("-")])
    launcher = [a.split("=", 1)[1] for a in args if a.lstrip("+").startswith("hydra/launcher=")]
    here = launcher in ([], ["basic"])  # jobs run on this machine (not on a cluster's nodes)
    job_problems: list[str] = []  # problems of single jobs of a sweep
    jobs = _job_overrides(overrides)
    if jobs is None:  # a sweeper's search space (intervals): check the base config only
        jobs = [[o for o in overrides if "(" not in o]]
    bad_jobs: set[tuple[str, ...]] = set()
    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            for job in jobs:
                cfg, compose_problems = _compose(compose, job)
                problems += compose_problems
                if cfg is None:
                    continue
                try:
                    plain = OmegaConf.to_container(cfg, resolve=True)
                    validate(plain)
                    if here:
                        check_machine(plain)
                except ConfigError as err:
                    label = f"[{' '.join(job)}] " if len(jobs) > 1 else ""
                    (job_problems if len(jobs) > 1 else problems).extend(label + p for p in err.problems)
                    bad_jobs.add(tuple(job))
    finally:
        GlobalHydra.instance().clear()
    if problems or (job_problems and len(bad_jobs) == len(jobs)):
        raise ConfigError(list(dict.fromkeys(problems + job_problems)))
    if job_problems:  # (before Hydra configures logging: printed)
        listed = "\n  ".join(dict.fromkeys(job_problems))
        print(
            f"xfam: {len(bad_jobs)} of {len(jobs)} jobs of this sweep cannot run and will be recorded as skipped:"
            f"\n  {listed}",
            file=sys.stderr,
        )


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

    from xfam.lit.nonfinite import NonFiniteError
    from xfam.runner import train

    plain = OmegaConf.to_container(cfg, resolve=True)
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
    reason, the job's overrides) is read by the sweep summary; a job that does not finish never stops
    the others."""
    import json
    import traceback

    from xfam.runner import train

    status: dict[str, Any] = {"status": "ok"}
    try:
        metrics = train(plain, run_dir)
    except ConfigError as err:
        status = {"status": "skipped", "reason": str(err)}
    except Exception as err:  # a job failing in training: the others still run
        status = {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
        log.error("job %s failed:\n%s", run_dir.name, traceback.format_exc())
        FAILED_JOBS.append(run_dir.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps({**status, "overrides": " ".join(overrides)}, indent=1))
    metric = plain.get("optimized_metric")
    if status["status"] != "ok":
        log.warning("job %s %s: %s", run_dir.name, status["status"], status["reason"])
        return float("nan") if metric else None  # Optuna records a NaN trial as failed
    return metrics.get(metric) if metric else None


def main(task: Any) -> None:
    """Entry point of train.py: pre-launch check, then Hydra."""
    args = sys.argv[1:]
    register_resolvers()
    if not any(
        a in ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion")
        or a.startswith(("--cfg", "--info"))
        for a in args
    ):
        try:
            precheck(args)
        except ConfigError as err:
            report(err, debug_requested(args))
    task()
    if FAILED_JOBS:
        print(f"xfam: {len(FAILED_JOBS)} job(s) of the sweep failed: {', '.join(FAILED_JOBS)}", file=sys.stderr)
        sys.exit(1)
