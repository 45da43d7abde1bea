"""Which checkpoint a run continues from, and whether it can: a run directory's checkpoints (``ckpt_path=auto``
passes over unreadable ones and ones of another architecture), the architecture check, and the check of the
processes that resume it (a sharded checkpoint under FSDP, a single file otherwise; another number of processes
maps the data position by rows). Everything here runs before anything is launched or written
(``xfam.training.runner``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import lightning as L

from xfam.config.trainer_args import SHARDED_STRATEGIES
from xfam.core.errors import ConfigError
from xfam.core.logs import log
from xfam.model import checkpoint


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run that a fresh start must not overwrite: a checkpoint (debug
    ``nonfinite-*`` files and unfinished ``*.tmp`` writes aside) or a trained step (a logged row of
    ``logs/*/metrics.csv``, or the final ``metrics.json``). A config, manifest or log alone is what a
    launch that failed before training left behind: it does not block the corrected command."""
    if (run_dir / "metrics.json").exists():
        return True
    if any(not p.name.startswith("nonfinite-") for p in (run_dir / "checkpoints").glob("*.ckpt")):
        return True
    for csv in run_dir.glob("logs/*/metrics.csv"):
        with contextlib.suppress(OSError), open(csv) as f:
            if f.readline() and f.readline().strip():  # a row below the header
                return True
    return False


def resolve_checkpoint(ckpt_path: str | None, run_dir: Path, cfg: dict[str, Any] | None = None) -> str | None:
    """The checkpoint to resume from, or None for a fresh run (refused if ``run_dir`` has a run).
    ``cfg``: with ``ckpt_path=auto``, checkpoints of another architecture are passed over."""
    last = run_dir / "checkpoints" / "last.ckpt"
    if ckpt_path is None:
        if holds_run(run_dir):
            raise ConfigError(
                f"run directory {run_dir} already holds a run"
                + (f" (last checkpoint: {last})" if last.exists() else "")
                + ". Nothing was changed. Fix: add ckpt_path=auto to continue it, or start a separate run "
                "with name=<new name> (or any other override, which gives another directory)."
            )
        return None
    if ckpt_path == "auto":
        return newest_readable(run_dir, cfg)
    return ckpt_path


def newest_readable(run_dir: Path, cfg: dict[str, Any] | None = None) -> str | None:
    """``ckpt_path=auto``: ``last.ckpt``, or when it cannot be used the newest usable ``step-N.ckpt``, with a
    warning for each file passed over: one that cannot be read (a crash, a truncated or corrupted copy, a
    folder or a dangling link in its place) or, given ``cfg``, one of another architecture (e.g. a
    ``last.ckpt`` copied from another run). None (a fresh start) when the run has no checkpoint yet. Debug
    checkpoints (``nonfinite-*``) and unfinished ``*.tmp`` writes are never used."""
    ckpts = run_dir / "checkpoints"
    steps = sorted(ckpts.glob("step-*.ckpt"), key=lambda p: p.name, reverse=True)  # zero-padded: newest first
    candidates = [p for p in [ckpts / "last.ckpt", *steps] if p.exists() or p.is_symlink()]
    if not candidates:
        log.info("ckpt_path=auto: no checkpoint in %s yet, starting a fresh run", run_dir)
        return None
    passed, other_architecture = [], None
    for path in candidates:
        try:
            saved = checkpoint.read(path)
        except ConfigError as err:
            log.warning("ckpt_path=auto: skipping %s: %s", path.name, err)
            passed.append(path.name)
            continue
        diff = checkpoint.architecture_diff(saved["xfam"]["config"], cfg) if cfg is not None else []
        if diff:
            log.warning("ckpt_path=auto: skipping %s: another architecture (%s)", path.name, "; ".join(diff))
            passed.append(path.name)
            other_architecture = other_architecture or (path, diff)
            continue
        if passed:
            log.warning("ckpt_path=auto: resuming from %s, the newest usable checkpoint", path)
        return str(path)
    if other_architecture:  # none of this architecture: the config, not the files, is what to fix
        raise architecture_error(*other_architecture)
    raise ConfigError(
        f"ckpt_path=auto: no checkpoint of {ckpts} can be read ({', '.join(passed)}). "
        f"Nothing was changed. Fix: ckpt_path=<a good .ckpt file>, or start a separate run with name=<new name>."
    )


def check_resume(
    ckpt: str, cfg: dict[str, Any], streams: bool = False
) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
    """Refuse a checkpoint whose architecture differs from the config's, or that this run cannot resume on its
    processes (``check_processes``); returns its step, its ``xfam`` metadata and the ``FinetuneRecord`` of a
    fine-tuning run (None otherwise) (read once: a checkpoint is loaded and its digest checked here, then by
    Lightning only)."""
    saved = checkpoint.read(ckpt)
    diff = checkpoint.architecture_diff(saved["xfam"]["config"], cfg)
    if diff:
        raise architecture_error(ckpt, diff)
    check_processes(ckpt, saved, cfg, streams)
    record = saved.get("callbacks", {}).get(FinetuneRecord.__qualname__)
    return int(saved.get("global_step", 0)), saved["xfam"], record


def processes(trainer: dict[str, Any]) -> int | None:
    """The number of training processes a trainer section starts (None: known only at launch, ``devices=auto``)."""
    devices, nodes = trainer.get("devices", 1), int(trainer.get("num_nodes", 1))
    if isinstance(devices, (list, tuple)):
        return len(devices) * nodes
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()]) * nodes
    if isinstance(devices, str) and not devices.isdigit():
        return None
    return int(devices) * nodes if int(devices) > 0 else None


def check_processes(ckpt: str, saved: dict[str, Any], cfg: dict[str, Any], streams: bool) -> None:
    """Before launch: a sharded checkpoint (a folder) resumes under ``trainer=fsdp`` / ``fsdp_cpu`` and a single
    file under the other strategies (``xfam convert`` turns one into the other); on another number of processes
    than wrote it, the position in the data maps by rows (``ResumableBatchSampler.skip``), except the memory
    slot's streams, which need the same rows per step over all ranks (``data.batch_size`` x processes)."""
    folder, fsdp = Path(ckpt).is_dir(), str(cfg["trainer"].get("strategy")) in SHARDED_STRATEGIES
    if folder != fsdp:
        what, other = ("a sharded checkpoint (a folder)", "trainer=fsdp_cpu / fsdp") if folder else ("one file", "")
        raise ConfigError(
            f"ckpt_path={ckpt} is {what}, and trainer.strategy={cfg['trainer'].get('strategy')!r} "
            + ("resumes single-file checkpoints. " if folder else "(FSDP) resumes sharded ones. ")
            + f"Fix: xfam convert ckpt={ckpt} out=<new path> to convert it, then ckpt_path=<new path>"
            + (f"; or resume it with {other}." if folder else ".")
        )
    resume = saved.get("xfam_resume") or {}
    before, now = len(resume.get("ranks", [])) or 1, processes(cfg["trainer"])
    stream = (resume.get("ranks") or [{}])[0].get("stream")
    if stream is not None:
        check_stream_units(ckpt, stream["units"], before, now, cfg)
    if now is None or now == before:
        return
    old_batch = resume.get("global_batch") or saved["xfam"]["config"]["data"]["batch_size"] * before
    new_batch = cfg["data"]["batch_size"] * now
    if streams and old_batch != new_batch:
        raise ConfigError(
            f"ckpt_path={ckpt} was written by {before} processes reading {old_batch} memory streams "
            f"(data.batch_size x processes); {now} processes with data.batch_size={cfg['data']['batch_size']} read "
            f"{new_batch}, so the streams and the memory the checkpoint carries for them cannot continue. Fix: "
            f"data.batch_size={old_batch // now if old_batch % now == 0 else '<a divisor>'} (the same {old_batch} "
            f"streams over {now} processes), or resume on {before} processes."
        )
    log.info(
        "resuming a checkpoint of %d processes on %d: %d rows per step before, %d now; the position in the epoch is "
        "mapped by rows%s",
        before,
        now,
        old_batch,
        new_batch,
        ", the memory streams regrouped" if streams else "",
    )


def check_stream_units(ckpt: str, units: int, before: int, now: int | None, cfg: dict[str, Any]) -> None:
    """A streamed train split resumes exactly on the same units (processes x loader workers) only
    (``xfam.data.streaming``): each unit's position is in its own documents."""
    workers = max(1, cfg["loader"]["num_workers"])
    if now is not None and now * workers != units:
        per = units // before
        raise ConfigError(
            f"ckpt_path={ckpt} streamed its training data in {units} unit(s) (processes x loader workers: {before} x "
            f"{per}); this run would read {now * workers} ({now} x {workers}), and a position in one unit's "
            f"documents means nothing in another's. Fix: resume with {before} process(es) and "
            f"loader.num_workers={per if per > 1 else 0}."
        )
    if cfg["data"].get("shuffle_buffer"):
        log.warning(
            "resuming a stream with data.shuffle_buffer=%d: approximate, the documents that were in the shuffle "
            "buffer at the checkpoint are skipped",
            cfg["data"]["shuffle_buffer"],
        )


def architecture_error(ckpt: str | Path, diff: list[str]) -> ConfigError:
    return ConfigError(
        f"checkpoint {ckpt} has a different architecture than this config:\n  "
        + "\n  ".join(diff)
        + "\nFix: resume with the checkpoint's settings, or start a fresh run (ckpt_path=null, another name)."
    )


class FinetuneRecord(L.Callback):
    """Keeps in every checkpoint of a fine-tuning run (as Lightning's state of this callback) the checkpoint it
    started from and the parameters loaded from it, so a resumed run splits its optimiser's groups the same way
    without reading that file again."""

    def __init__(self, record: dict[str, Any]):
        self.record = record

    def state_dict(self) -> dict[str, Any]:
        return dict(self.record)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.record = dict(state_dict)
