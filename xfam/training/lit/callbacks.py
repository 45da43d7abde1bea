"""Callbacks xfam adds to every run: progress, throughput, the loss-curve plot, the fp32 matmul precision."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities import rank_zero_only

from xfam.core.logs import log, log_once
from xfam.eval.forward import input_positions


class StepProgressBar(RichProgressBar):
    """Rich progress bar without Lightning's "Epoch 0/-2" (runs here are sized in steps; the bar
    counts them) and without the logger version."""

    def _get_train_description(self, current_epoch: int) -> str:
        return f"Epoch {current_epoch}".ljust(len(self.validation_description))

    def get_metrics(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, module)
        items.pop("v_num", None)
        return items


class LogProgress(L.Callback):
    """Progress for logs (stdout not a terminal, e.g. a SLURM job): one line every ``every_s``
    seconds with the step, the latest losses, throughput and the time left."""

    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s
        self._start = self._last = 0.0
        self._first_step = 0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._start = self._last = time.perf_counter()
        self._first_step = trainer.global_step

    @rank_zero_only
    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        done = trainer.global_step - self._first_step
        if now - self._last < self.every_s and trainer.global_step != trainer.max_steps:
            return
        self._last = now
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        eta = (now - self._start) / max(done, 1) * (total - trainer.global_step) if total else None
        m = trainer.callback_metrics
        parts = [f"step {trainer.global_step}" + (f"/{total}" if total else "")]
        parts += [f"{k} {float(m[k]):.4f}" for k in ("train/loss", "val/loss", "val/bpb") if k in m]
        if "train/tokens_per_s" in m:
            parts.append(f"{float(m['train/tokens_per_s']):,.0f} tokens/s")
        if eta is not None:
            parts.append(f"{eta / 60:.1f} min left")
        log.info("  ".join(parts))


class Throughput(L.Callback):
    """Logs training tokens per second (all ranks together) and keeps the run's median."""

    def __init__(self, warmup_steps: int = 3):
        self.warmup_steps = warmup_steps
        self.rates: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        dt = time.perf_counter() - self._t0
        tokens = input_positions(batch) + (  # (continuous inputs: their positions, xfam.eval.forward)
            batch["decoder_input_ids"].numel() if "decoder_input_ids" in batch else 0
        )
        rate = tokens * trainer.world_size / max(dt, 1e-9)  # (an encoder-decoder's: source + target tokens)
        module.log("train/tokens_per_s", rate, on_step=True, on_epoch=False)
        if batch_idx >= self.warmup_steps:
            self.rates.append(rate)
            # Kept as a callback metric (not logged) so it survives ddp_spawn's return to the parent.
            module.log("train/tokens_per_s_median", statistics.median(self.rates), logger=False)


class LossCurve(L.Callback):
    """Records train and validation loss by step (kept in checkpoints, so a resumed run's plot is
    whole) and writes ``loss_curve.png`` when training ends."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.written = False  # whether this run wrote the plot (the end-of-run summary names it only then)
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            self.train.append((trainer.global_step, float(loss)))

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None and not trainer.sanity_checking:
            self.val.append((trainer.global_step, float(loss)))

    def state_dict(self) -> dict[str, Any]:
        return {"train": self.train, "val": self.val}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train, self.val = list(state["train"]), list(state["val"])

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.train:
            plot_losses(self.train, self.val, self.path)
            self.written = True


def plot_losses(train: list[tuple[int, float]], val: list[tuple[int, float]], path: Path) -> None:
    """Train loss (raw and smoothed) and validation loss against optimizer steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*train)
    k = max(1, len(losses) // 50)
    smooth = [statistics.fmean(losses[max(0, i - k) : i + 1]) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
    ax.plot(steps, smooth, color="tab:blue", lw=1.5, label=f"train (mean of {k})")
    if val:
        vs, vl = zip(*val)
        ax.plot(vs, vl, "o-", color="tab:orange", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per target)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


class MatmulPrecision(L.Callback):
    """``trainer.matmul_precision``: ``torch.set_float32_matmul_precision`` for the run, in every process (spawned
    DDP workers too), restored at teardown. ``high`` lets fp32 matmuls use TF32 tensor cores on a GPU (Ampere
    and newer), and so do the Triton kernels' fp32 dots (kernels/flash_attention.py, linear_attention.py, which
    follow ``torch.backends.cuda.matmul.allow_tf32``); ``medium`` allows bf16 too. Under ``bf16-mixed``
    autocast most matmuls are bf16 anyway."""

    MEANING = {
        "highest": "fp32 matmuls in full fp32",
        "high": "fp32 matmuls may use TF32 on GPUs (the Triton kernels' fp32 dots too)",
        "medium": "fp32 matmuls may use TF32 or bf16 internally",
    }

    def __init__(self, precision: str) -> None:
        self.precision = precision
        self.before: str | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.before is None:  # each stage (fit, validate, test) sets it here and restores it at its teardown
            self.before = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(self.precision)
            log_once(f"trainer.matmul_precision={self.precision}: {self.MEANING[self.precision]}")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.before is not None:
            torch.set_float32_matmul_precision(self.before)
            self.before = None
