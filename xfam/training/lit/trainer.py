"""Assembles the Lightning Trainer of a run: loggers, checkpoints, progress bar, plugins."""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch import callbacks as cb
from lightning.pytorch import loggers

from xfam.config.specs import CallbacksSpec, LoggerSpec, wandb_credentials, wandb_online_problem
from xfam.config.trainer_args import SHARDED_STRATEGIES
from xfam.core.errors import ConfigError
from xfam.core.logs import log, quiet_lightning
from xfam.training.lit.callbacks import LogProgress, LossCurve, MatmulPrecision, StepProgressBar, Throughput
from xfam.training.lit.checkpoint import AtomicCheckpointIO
from xfam.training.lit.fsdp import ShardedStrategy
from xfam.training.lit.nonfinite import NonFiniteGuard
from xfam.training.lit.preempt import Preemption, cluster_plugins
from xfam.training.lit.resume_logs import ContinuedCSVLogger, ContinuedTensorBoardLogger
from xfam.training.lit.step_checkpoint import StepCheckpoint


def wandb_mode(spec: LoggerSpec) -> tuple[str, str]:
    """The wandb mode to use and why (``auto``: online only with credentials); online without credentials is
    refused (``ConfigError``), as before launch (``xfam.config.check_machine``)."""
    if (why := wandb_online_problem(dataclasses.asdict(spec))) is not None:
        raise ConfigError(why)
    if spec.mode != "auto":
        return spec.mode, "set by logger.mode"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], "set by WANDB_MODE"
    if (found := wandb_credentials()) is not None:
        return "online", found
    return "offline", "no wandb credentials (WANDB_API_KEY or ~/.netrc); sync later with `wandb sync`"


def make_loggers(spec: LoggerSpec, run_dir: Path, name: str, resume_step: int = 0) -> list[Any]:
    """CSV (always) and the chosen logger. ``resume_step``: the step training continues from (0 when it
    starts from scratch); the CSV and TensorBoard records are continued from there, each step once."""
    mode, why = wandb_mode(spec) if spec.name == "wandb" else (None, "")  # (a refusal before any logger exists)
    out: list[Any] = [ContinuedCSVLogger(run_dir, resume_step)]
    if spec.name == "tensorboard":
        out.append(ContinuedTensorBoardLogger(run_dir, resume_step))
    elif spec.name == "wandb":
        log.info("wandb: mode %s (%s)", mode, why)
        id_file = run_dir / "wandb_id.txt"  # a resumed run continues the same wandb run
        if not id_file.exists():
            run_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(secrets.token_hex(4))
        out.append(
            loggers.WandbLogger(
                project=spec.project,
                entity=spec.entity,
                tags=list(spec.tags),
                name=name,
                save_dir=str(run_dir),
                id=id_file.read_text().strip(),
                resume="allow",
                mode=mode,
            )
        )
    return out


def make_callbacks(
    spec: CallbacksSpec, run_dir: Path, ckpt_path: str | None = None, sharded: bool = False
) -> list[L.Callback]:
    """Checkpoints (periodic, best, and on a preemption signal), progress, learning rate, loss curve.
    ``sharded``: checkpoints are folders (``trainer=fsdp``), and ``last.ckpt`` links to the newest one."""
    ckpt_dir = run_dir / "checkpoints"
    periodic = StepCheckpoint(
        dirpath=ckpt_dir,
        filename="step-{step:07d}",
        auto_insert_metric_name=False,
        every_n_train_steps=spec.every_n_steps,
        save_top_k=spec.keep_last,
        monitor=None if spec.keep_last == -1 else "global_step",
        mode="max",
        save_last="link" if sharded else True,
        enable_version_counter=False,
    )
    out: list[L.Callback] = [periodic, Throughput()]
    if spec.requeue_signal or spec.stop_signal:
        out.append(Preemption(periodic, spec.requeue_signal, spec.stop_signal, ckpt_path))
    if spec.save_best:
        out.append(
            cb.ModelCheckpoint(
                dirpath=ckpt_dir,
                filename="best",
                monitor=spec.monitor,
                mode="min",
                save_top_k=1,
                enable_version_counter=False,
            )
        )
    if spec.lr_monitor:
        out.append(cb.LearningRateMonitor(logging_interval="step"))
    if spec.progress_bar != "none" and not sys.stdout.isatty():
        log.info("progress: stdout is not a terminal, so a line every 30 s instead of a live bar")
        out.append(LogProgress())
    elif spec.progress_bar == "rich":
        out.append(StepProgressBar(leave=True))
    elif spec.progress_bar == "tqdm":
        out.append(cb.TQDMProgressBar())
    if spec.loss_curve:
        out.append(LossCurve(run_dir / "loss_curve.png"))
    return out


def sharded_strategy(trainer_kw: dict[str, Any], async_save: bool = False) -> ShardedStrategy:
    """``trainer.strategy=fsdp`` / ``fsdp_spawn``: FSDP2 (``xfam.training.lit.fsdp``); a bf16-mixed run computes in
    bf16 with fp32 parameters and gradient reduction (fp16 is refused by ``check_trainer``). ``async_save``:
    ``callbacks.async_save``."""
    precision = str(trainer_kw.get("precision", "32-true"))
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    return ShardedStrategy(spawn=trainer_kw["strategy"] == "fsdp_spawn", param_dtype=dtype, async_save=async_save)


def make_trainer(
    cfg: dict[str, Any], run_dir: Path, extra: Sequence[L.Callback] = (), resume_step: int = 0
) -> L.Trainer:
    """The Trainer of a validated config writing into ``run_dir`` (plus ``extra`` callbacks), resuming at
    ``resume_step`` (0: from scratch)."""
    quiet_lightning()
    cbs = CallbacksSpec(**cfg["callbacks"])
    trainer_kw = dict(cfg["trainer"])
    guard = NonFiniteGuard(trainer_kw.pop("nonfinite", "stop"), run_dir, trainer_kw.pop("max_nonfinite_skips", 10))
    precision = MatmulPrecision(trainer_kw.pop("matmul_precision", "highest"))
    trainer_kw.pop("compile", None), trainer_kw.pop("compile_mode", None)  # read by XfamLitModule (lit/compile.py)
    if cbs.progress_bar == "none" or not sys.stdout.isatty():
        trainer_kw["enable_progress_bar"] = False
    sharded = str(trainer_kw.get("strategy")) in SHARDED_STRATEGIES
    if sharded:
        trainer_kw["strategy"] = sharded_strategy(trainer_kw, cbs.async_save)
    return L.Trainer(
        **trainer_kw,
        default_root_dir=str(run_dir),
        logger=make_loggers(LoggerSpec(**cfg["logger"]), run_dir, cfg["name"], resume_step),
        callbacks=[*make_callbacks(cbs, run_dir, cfg.get("ckpt_path"), sharded), guard, precision, *extra],
        plugins=[AtomicCheckpointIO(), *cluster_plugins()],  # signals: xfam.training.lit.preempt
        use_distributed_sampler=False,
    )
