"""One training run from a plain config: validate, resolve the checkpoint, prepare data, build,
train, evaluate, and write the run's record (config, manifest, metrics) into its directory.

Nothing is written before every check has passed, and an existing run is never overwritten: a
fresh start in a directory that already holds a run is refused (``ckpt_path=auto`` continues it).
A launch that fails before its first checkpoint removes what it wrote, so the corrected command
runs in a clean directory.

Fine-tuning (``init_from``, ``xfam.model.init_from``): a fresh start loads the checkpoint's matching weights
into the model once it is built, before anything is written, and logs the table of what was loaded; a resumed
run (``ckpt_path=auto`` after a stop) takes its own checkpoint's weights instead, and the list of loaded
parameters that the first start recorded in its checkpoints (``FinetuneRecord``), so the optimiser's groups
are the same again. ``finetune.freeze`` applies to both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import yaml
from filelock import FileLock
from lightning.pytorch.utilities import rank_zero_only

from xfam.config import RunConfig, validate
from xfam.core.logs import LOG_FORMAT, log
from xfam.data.tokenize import cache_root
from xfam.model import checkpoint
from xfam.model.build import build_data, check_checkpoint_data, data_info
from xfam.model.init_from import ParamSplit, freeze, grouped_names, init_from, mark_split
from xfam.training.allocator import keep_freed_memory
from xfam.training.resume import FinetuneRecord, check_resume, holds_run, processes, resolve_checkpoint

if TYPE_CHECKING:
    from xfam.training.lit.module import XfamLitModule


def prepared_once() -> FileLock:
    """A lock around data preparation: processes that torchrun or srun started all run this function at once, on
    a cache that may be cold; the first builds the cache, the others then find it built."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return FileLock(str(root / "prepare.lock"))


def check_room(run_dir: Path, module: L.LightningModule) -> None:
    """Refuse to start when the disk of ``run_dir`` cannot hold two checkpoints of this model (fp32
    weights and buffers, plus AdamW's two moments per parameter) and a margin: a retry on a still-full
    disk then fails at once instead of after training again."""
    values = sum(t.numel() for t in module.state_dict().values()) + 2 * sum(p.numel() for p in module.parameters())
    need = 2 * 4 * values + checkpoint.DISK_MARGIN
    if checkpoint.free_bytes(run_dir) < need:
        raise checkpoint.disk_full(run_dir, need)


@contextlib.contextmanager
def undo_on_failure(run_dir: Path) -> Iterator[None]:
    """A launch that fails before any checkpoint was written takes back what it wrote: the entries of
    ``run_dir`` it created (config, manifest, train.log, logs/, ...), then ``run_dir`` and its parent
    (``runs/<name>/``) if that leaves them empty. So a refusal or a failed launch leaves no empty folder,
    and the corrected command is not refused. A directory that held a run before is never touched, nor
    is anything that was there before this launch."""
    before = set(run_dir.iterdir()) if run_dir.is_dir() else set()
    had_run = holds_run(run_dir)
    try:
        yield
    except BaseException:
        if not had_run and not any((run_dir / "checkpoints").glob("*.ckpt")):  # nonfinite-*: kept for debugging
            remove_new(run_dir, before)
        raise


@rank_zero_only
def remove_new(run_dir: Path, before: set[Path]) -> None:
    """Remove the entries of ``run_dir`` not in ``before``, then ``run_dir`` and its parent if empty."""
    for path in set(run_dir.iterdir()) - before if run_dir.is_dir() else ():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    for folder in (run_dir, run_dir.parent):
        with contextlib.suppress(OSError):  # not empty (or not there): kept
            folder.rmdir()


def prepare_finetune(
    rc: RunConfig, model: Any, info: dict[str, Any], ckpt: str | None, record: dict[str, Any] | None
) -> tuple[list[str], list[L.Callback]]:
    """Load ``init_from``'s weights into ``model`` on a fresh start (``ckpt`` None), freeze ``finetune.freeze``,
    and mark the optimiser's split of a fine-tuning run (``record``: the one a resumed checkpoint holds). Returns
    the messages to log (the table of what was loaded) and the callback that records the split."""
    spec, path, messages = rc.finetune, rc.run.init_from, []
    if ckpt is None and path is not None:
        report = init_from(model, path, spec, info)
        messages.append(report.table())
        record = {"init_from": str(path), "loaded": sorted(report.loaded_params)}
    elif path is not None:
        started = "it began from it" if record is not None else "a run that did not begin from it"
        messages.append(f"init_from={path}: not loaded, resuming {ckpt} ({started}), which holds the run's weights")
    if spec.freeze:
        frozen = set(freeze(model, spec.freeze))
        values = sum(p.numel() for n, p in model.named_parameters() if n in frozen)
        total = sum(p.numel() for p in model.parameters())
        messages.append(
            f"finetune.freeze: {len(frozen)} tensors frozen ({values} of {total} values): "
            + ", ".join(grouped_names(sorted(frozen)))
        )
    if record is None:
        return messages, []
    mark_split(model, ParamSplit(loaded=frozenset(record["loaded"]), lr_loaded=spec.lr_loaded, lr_new=spec.lr_new))
    return messages, [FinetuneRecord(record)]


#: How ``describe`` names a model shape and its task.
SHAPES = {
    ("decoder", "lm"): "causal LM",
    ("encoder", "classify"): "bidirectional classifier",
    ("decoder", "classify"): "causal classifier",
    ("encoder", "mlm"): "bidirectional masked LM",
    ("encoder", "tag"): "bidirectional tagger",
    ("decoder", "tag"): "causal tagger",
    ("encoder_decoder", "seq2seq"): "encoder-decoder",
    ("decoder", "seq2seq"): "decoder-only seq2seq (source as a prefix)",
}


def describe(rc: RunConfig, module: XfamLitModule, source: Any) -> str:
    spec, cfg = rc.spec, rc.raw
    n = sum(p.numel() for p in module.model.parameters())
    slots = "  ".join(f"{s}={cfg[s]['name']}" for s in ("attention", "pos", "memory", "exit"))  # (as configured)
    return (
        f"model {spec.name}: {spec.layers} layers x {spec.dim} wide, {spec.heads} heads, "
        f"{n / 1e6:.2f}M parameters, {SHAPES.get((rc.arch, rc.task), rc.arch + ' ' + rc.task)}\n"
        f"  slots: {slots}\n"
        f"{_encoder_line(rc)}"
        f"  data {cfg['data']['name']}: vocab {source.vocab_size}, seq_len {source.seq_len}, "
        f"batch {source.batch_size}, fingerprint {source.fingerprint}"
    )


def _encoder_line(rc: RunConfig) -> str:
    """The encoder stack and cross-attention of an encoder-decoder, for ``describe``."""
    if rc.encoder is None:
        return ""
    enc = rc.encoder
    return (
        f"  encoder: {enc.spec.layers} layers, attention={enc.attention[0]['name']} pos={enc.pos['name']}; "
        f"decoder cross_attention={rc.cross[0]['name']}\n"
    )


def train(cfg: dict[str, Any], run_dir: Path, callbacks: list[L.Callback] | None = None) -> dict[str, Any]:
    """Run the job described by ``cfg`` in ``run_dir``; returns the final metrics.

    ``callbacks`` are added to the Trainer's (for programmatic use and tests)."""
    rc = validate(cfg)
    run_dir = Path(run_dir)
    with undo_on_failure(run_dir):
        return _train(rc, run_dir, callbacks)


def _train(rc: RunConfig, run_dir: Path, callbacks: list[L.Callback] | None) -> dict[str, Any]:
    """The run of a validated config: ``rc``'s typed fields drive it; its plain dict (``rc.raw``) is what the
    checkpoints, the run record and the trainer's loggers get, and what the data section is read from."""
    from xfam.data.module import XfamDataModule
    from xfam.data.tasks import task_collate
    from xfam.training.lit.fsdp import ShardedStrategy, sharding_plan
    from xfam.training.lit.module import XfamLitModule
    from xfam.training.lit.trainer import make_trainer

    cfg = rc.raw
    log.info(keep_freed_memory())
    ckpt = resolve_checkpoint(rc.run.ckpt_path, run_dir, cfg)
    resumed_at, meta, record = check_resume(ckpt, cfg, rc.streams) if ckpt is not None else (0, None, None)
    L.seed_everything(rc.run.seed, workers=True, verbose=False)
    source = build_data(cfg)
    with prepared_once():
        source.prepare()
    info = data_info(source, rc.task)
    if ckpt is not None:
        check_checkpoint_data(ckpt, cfg, info, meta)  # the checkpoint's model must fit this data
    module = XfamLitModule(rc, info)  # builds the model: vocabulary and size errors surface here
    finetuning, finetune_callbacks = prepare_finetune(rc, module.model, info, ckpt, record)
    check_room(run_dir, module)
    log.info(rc.streams_why)
    masking = dataclasses.asdict(rc.task_spec)
    collate = task_collate(source, info, arch=rc.arch, masking=masking, seed=rc.run.seed)
    datamodule = XfamDataModule(
        source, seed=rc.run.seed, streams=rc.streams, num_workers=rc.loader.num_workers, collate=collate
    )
    trainer = make_trainer(cfg, run_dir, [*(callbacks or []), *finetune_callbacks], resume_step=resumed_at)
    handler = write_record(run_dir, cfg, source)
    try:
        log.info("run directory: %s", run_dir)
        if ckpt is not None:
            max_steps = cfg["trainer"].get("max_steps", -1)
            note = " (max_steps reached: nothing left to train, evaluating)" if 0 < max_steps <= resumed_at else ""
            log.info("resuming from %s at step %d%s", ckpt, resumed_at, note)
        log.info(describe(rc, module, source))
        if isinstance(trainer.strategy, ShardedStrategy):  # (said before launch, once, by this process)
            log.info(sharding_plan(module.model, processes(cfg["trainer"])))
        for message in finetuning:
            log.info(message)
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
        done = trainer.callback_metrics  # after ddp_spawn only these come back to this process
        result: dict[str, Any] = {
            "step": int(done["steps_done"]) if "steps_done" in done else trainer.global_step,
            **{k: float(v) for k, v in done.items() if k.startswith("val/")},
            "train/tokens_per_s": float(done["train/tokens_per_s_median"])
            if "train/tokens_per_s_median" in done
            else None,
        }
        if "train/nonfinite_skipped" in done:  # trainer.nonfinite=skip: how many steps were skipped
            result["train/nonfinite_skipped"] = int(done["train/nonfinite_skipped"])
        # ddp_spawn trains in other processes: this Trainer's loop never counted the steps, and the
        # evaluation below would log its rows at step 0 (spawned ranks get a copy of this Trainer).
        trainer.fit_loop.epoch_loop._batches_that_stepped = result["step"]
        if "val/loss" not in result:  # e.g. resumed at max_steps: nothing trained, still report
            trainer.validate(module, datamodule=datamodule, verbose=False)
            result.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")})
        if rc.run.test:
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
    with checkpoint.disk_errors(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        write_whole(run_dir / "config.yaml", yaml.safe_dump(cfg, sort_keys=False))
        write_whole(run_dir / "data_manifest.json", json.dumps(source.manifest, indent=1, default=str))
        handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    return handler


def write_whole(path: Path, text: str) -> None:
    """Replace ``path`` only once ``text`` is written in full: a full disk while a resumed run rewrites its
    config.yaml must not leave the run with half a config."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


@rank_zero_only
def finish(trainer: L.Trainer, run_dir: Path, result: dict[str, Any]) -> None:
    (run_dir / "metrics.json").write_text(json.dumps(result, indent=1))
    for lg in trainer.loggers:
        if type(lg).__name__ == "WandbLogger":
            import wandb

            wandb.finish()  # a multirun's next job must not reuse this run
    lines = [f"  {k} = {v:.4f}" for k, v in result.items() if isinstance(v, float)]
    log.info("finished at step %d:\n%s", result["step"], "\n".join(lines))
    from xfam.training.lit.callbacks import LossCurve

    ckpts = run_dir / "checkpoints"
    # (``callbacks`` is set on the Trainer by Lightning's callback connector, and not declared)
    curves = [cb.path for cb in trainer.callbacks if isinstance(cb, LossCurve) and cb.written]  # type: ignore[attr-defined]
    log.info(
        "outputs in %s:\n  checkpoints: %s (last.ckpt, best.ckpt, step-*.ckpt)\n  metrics: %s, logs/%s",
        run_dir,
        ckpts,
        run_dir / "metrics.json",
        "".join(f"\n  loss curve: {path}" for path in curves),
    )
