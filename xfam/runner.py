"""One training run from a plain config: validate, resolve the checkpoint, prepare data, build,
train, evaluate, and write the run's record (config, manifest, metrics) into its directory.

Nothing is written before every check has passed, and an existing run is never overwritten: a
fresh start in a directory that already holds a run is refused (``ckpt_path=auto`` continues it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from lightning.pytorch.utilities import rank_zero_only

from xfam.allocator import keep_freed_memory
from xfam.build import build_data, check_checkpoint_data, data_info
from xfam.config import resolve_streams, validate
from xfam.errors import ConfigError
from xfam.lit import checkpoint
from xfam.logs import log
from xfam.specs import LoaderSpec


def resolve_checkpoint(ckpt_path: str | None, run_dir: Path) -> str | None:
    """The checkpoint to resume from, or None for a fresh run (refused if ``run_dir`` has a run)."""
    last = run_dir / "checkpoints" / "last.ckpt"
    started = (run_dir / "config.yaml").exists()
    if ckpt_path is None:
        if started:
            raise ConfigError(
                f"run directory {run_dir} already holds a run"
                + (f" (last checkpoint: {last})" if last.exists() else "")
                + ". Nothing was changed. Fix: add ckpt_path=auto to continue it, or start a separate run "
                "with name=<new name> (or any other override, which gives another directory)."
            )
        return None
    if ckpt_path == "auto":
        return newest_readable(run_dir)
    return ckpt_path


def newest_readable(run_dir: Path) -> str | None:
    """``ckpt_path=auto``: ``last.ckpt``, or when it cannot be read (a crash, a truncated copy) the newest
    readable ``step-N.ckpt``, with a warning for each file passed over; None (a fresh start) when the run
    has no checkpoint yet. Debug checkpoints (``nonfinite-*``) and unfinished ``*.tmp`` writes are never used."""
    ckpts = run_dir / "checkpoints"
    steps = sorted(ckpts.glob("step-*.ckpt"), key=lambda p: p.name, reverse=True)  # zero-padded: newest first
    candidates = [p for p in [ckpts / "last.ckpt", *steps] if p.is_file()]
    if not candidates:
        log.info("ckpt_path=auto: no checkpoint in %s yet, starting a fresh run", run_dir)
        return None
    for path in candidates:
        try:
            checkpoint.read(path)
        except ConfigError as err:
            log.warning("ckpt_path=auto: skipping %s: %s", path.name, err)
            continue
        if path != candidates[0]:
            log.warning("ckpt_path=auto: resuming from %s, the newest readable checkpoint", path)
        return str(path)
    raise ConfigError(
        f"ckpt_path=auto: no checkpoint of {ckpts} can be read ({', '.join(p.name for p in candidates)}). "
        f"Nothing was changed. Fix: ckpt_path=<a good .ckpt file>, or start a separate run with name=<new name>."
    )


def check_resume(ckpt: str, cfg: dict[str, Any]) -> int:
    """Refuse a checkpoint whose architecture differs from the config's; returns its step."""
    saved = checkpoint.read(ckpt)
    meta = saved["xfam"]
    diff = checkpoint.architecture_diff(meta["config"], cfg)
    if diff:
        raise ConfigError(
            f"checkpoint {ckpt} has a different architecture than this config:\n  "
            + "\n  ".join(diff)
            + "\nFix: resume with the checkpoint's settings, or start a fresh run (ckpt_path=null, another name)."
        )
    return int(saved.get("global_step", 0))


def describe(cfg: dict[str, Any], module: L.LightningModule, source: Any) -> str:
    spec = cfg["model"]
    n = sum(p.numel() for p in module.model.parameters())
    slots = "  ".join(f"{s}={cfg[s]['name']}" for s in ("attention", "pos", "memory", "exit"))
    return (
        f"model {spec['name']}: {spec['layers']} layers x {spec['dim']} wide, {spec['heads']} heads, "
        f"{n / 1e6:.2f}M parameters, {'causal LM' if module.task == 'lm' else 'bidirectional classifier'}\n"
        f"  slots: {slots}\n"
        f"  data {cfg['data']['name']}: vocab {source.vocab_size}, seq_len {source.seq_len}, "
        f"batch {source.batch_size}, fingerprint {source.fingerprint}"
    )


def train(cfg: dict[str, Any], run_dir: Path, callbacks: list[L.Callback] | None = None) -> dict[str, Any]:
    """Run the job described by ``cfg`` in ``run_dir``; returns the final metrics.

    ``callbacks`` are added to the Trainer's (for programmatic use and tests)."""
    from xfam.data.module import XfamDataModule
    from xfam.lit.module import XfamLitModule
    from xfam.lit.trainer import make_trainer

    validate(cfg)
    log.info(keep_freed_memory())
    run_dir = Path(run_dir)
    ckpt = resolve_checkpoint(cfg.get("ckpt_path"), run_dir)
    resumed_at = check_resume(ckpt, cfg) if ckpt is not None else 0
    L.seed_everything(cfg["seed"], workers=True, verbose=False)
    source = build_data(cfg)
    source.prepare()
    info = data_info(source)
    if ckpt is not None:
        check_checkpoint_data(ckpt, cfg, info)  # the checkpoint's model must fit this data
    module = XfamLitModule(cfg, info)  # builds the model: vocabulary and size errors surface here
    loader = LoaderSpec(**cfg["loader"])
    streams, why = resolve_streams(cfg)
    log.info(why)
    datamodule = XfamDataModule(source, seed=cfg["seed"], streams=streams, num_workers=loader.num_workers)
    trainer = make_trainer(cfg, run_dir, callbacks or [], resume_step=resumed_at)
    handler = write_record(run_dir, cfg, source)
    try:
        log.info("run directory: %s", run_dir)
        if ckpt is not None:
            max_steps = cfg["trainer"].get("max_steps", -1)
            done = " (max_steps reached: nothing left to train, evaluating)" if 0 < max_steps <= resumed_at else ""
            log.info("resuming from %s at step %d%s", ckpt, resumed_at, done)
        log.info(describe(cfg, module, source))
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
        done = trainer.callback_metrics  # after ddp_spawn only these come back to this process
        result: dict[str, Any] = {
            "step": int(done["steps_done"]) if "steps_done" in done else trainer.global_step,
            **{k: float(v) for k, v in done.items() if k.startswith("val/")},
            "train/tokens_per_s": float(done["train/tokens_per_s_median"])
            if "train/tokens_per_s_median" in done
            else None,
        }
        # ddp_spawn trains in other processes: this Trainer's loop never counted the steps, and the
        # evaluation below would log its rows at step 0 (spawned ranks get a copy of this Trainer).
        trainer.fit_loop.epoch_loop._batches_that_stepped = result["step"]
        if "val/loss" not in result:  # e.g. resumed at max_steps: nothing trained, still report
            trainer.validate(module, datamodule=datamodule, verbose=False)
            result.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")})
        if cfg.get("test", True):
            trainer.test(module, datamodule=datamodule, verbose=False)
            result.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")})
        finish(trainer, run_dir, result)
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
    return result


@rank_zero_only
def write_record(run_dir: Path, cfg: dict[str, Any], source: Any) -> logging.Handler:
    """Config, data manifest and a log file in the run directory (rank zero; after all checks)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (run_dir / "data_manifest.json").write_text(json.dumps(source.manifest, indent=1, default=str))
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


@rank_zero_only
def finish(trainer: L.Trainer, run_dir: Path, result: dict[str, Any]) -> None:
    (run_dir / "metrics.json").write_text(json.dumps(result, indent=1))
    for lg in trainer.loggers:
        if type(lg).__name__ == "WandbLogger":
            import wandb

            wandb.finish()  # a multirun's next job must not reuse this run
    lines = [f"  {k} = {v:.4f}" for k, v in result.items() if isinstance(v, float)]
    log.info("finished at step %d:\n%s", result["step"], "\n".join(lines))
    ckpts = run_dir / "checkpoints"
    log.info(
        "outputs in %s:\n  checkpoints: %s (last.ckpt, best.ckpt, step-*.ckpt)\n  metrics: %s, logs/\n  loss curve: %s",
        run_dir,
        ckpts,
        run_dir / "metrics.json",
        run_dir / "loss_curve.png",
    )
