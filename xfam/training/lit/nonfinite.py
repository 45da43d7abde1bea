"""``trainer.nonfinite``: what a training step with a NaN or Inf loss or gradient does.

The check runs on the gradients just before the optimizer step (after any NaN in the loss has
reached them, and after DDP's all-reduce, so every rank takes the same decision):

* ``stop`` (default): save a debug checkpoint ``checkpoints/nonfinite-step-<N>.ckpt`` (the state
  before the step; ``ckpt_path=auto`` never picks it), find the first module whose forward output
  on the batch is not finite (or, when the forward is finite, the first parameter whose gradient is
  not), and stop with a ``NonFiniteError`` naming the step, the module and the fixes.
* ``skip``: drop every gradient of the step (the optimizer then leaves the parameters and its
  moments untouched), count it (``train/nonfinite_skipped``, saved in checkpoints) and log it. A run
  that keeps failing is not training: after ``trainer.max_nonfinite_skips`` consecutive skipped steps
  it stops with a ``NonFiniteError`` (non-zero exit; a sweep records the job as failed). The count is
  reported when training ends.

Under fp16 mixed precision the gradient scaler already skips steps whose gradients overflow (and
lowers its scale), so there the guard leaves gradients to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor, nn

from xfam.core.logs import log

Policy = Literal["stop", "skip"]  # xfam.config.XFAM_TRAINER["nonfinite"]


class NonFiniteError(RuntimeError):
    """Training met a NaN/Inf under ``trainer.nonfinite=stop``; the message says where and what to do."""


def _finite(x: Any) -> bool:
    if isinstance(x, Tensor):
        return not x.is_floating_point() or bool(torch.isfinite(x).all())
    if isinstance(x, (tuple, list)):
        return all(_finite(v) for v in x)
    if hasattr(x, "__dataclass_fields__"):
        return all(_finite(getattr(x, f)) for f in x.__dataclass_fields__)
    return True


def all_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every gradient is finite, on every rank. Under FSDP (``DTensor`` gradients) each rank holds a shard,
    some of them empty, so each checks its own and the ranks agree by an all-reduce: they must all skip or all
    step. (Under DDP every rank holds the same reduced gradients.)"""
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(g, DTensor) for g in grads)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    local = [g for g in local if g.numel()]
    finite = torch.ones((), device=grads[0].device)
    if local:  # (the max |g| of each tensor: NaN stays NaN)
        finite = torch.isfinite(torch.stack(torch._foreach_norm(local, float("inf")))).all().float()
    if sharded:
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    return bool(finite)


def first_nonfinite_module(model: nn.Module, run: Any) -> str | None:
    """The qualified name of the first module (in execution order) whose output is not finite when
    ``run()`` executes ``model``'s forward pass; None if every output is finite."""
    found: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not found and not _finite(output):
            found.append(names[module] or type(module).__name__)

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


class NonFiniteGuard(L.Callback):
    """Applies ``trainer.nonfinite`` (see the module docstring)."""

    def __init__(self, policy: Policy, run_dir: Path, max_skips: int = 10):
        self.policy, self.run_dir, self.max_skips = policy, Path(run_dir), max_skips
        self.skipped, self.consecutive, self.active = 0, 0, True
        self._batch: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
        self.consecutive = int(state_dict.get("consecutive", 0))

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.active = not str(trainer.precision).startswith("16")
        if not self.active:
            log.info("trainer.nonfinite: fp16 mixed precision, so the gradient scaler skips overflowing steps itself")

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = batch

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not self.active or not grads:
            return
        if all_finite(grads):  # one synchronisation per step, not one per parameter
            self.consecutive = 0
            return
        step = trainer.global_step
        if self.policy == "skip":
            for p in module.parameters():
                p.grad = None  # AdamW skips parameters without a gradient: no update, no moment change
            self.skipped += 1
            self.consecutive += 1
            log.warning("step %d: NaN/Inf in the gradients; step skipped (%d so far)", step, self.skipped)
            module.log("train/nonfinite_skipped", float(self.skipped))
            if self.consecutive >= self.max_skips:
                raise NonFiniteError(
                    f"training stopped at step {step}: {self.consecutive} consecutive steps had NaN/Inf gradients "
                    f"and were skipped (trainer.max_nonfinite_skips={self.max_skips}; {self.skipped} skipped in "
                    f"all), so the run is not training. Fix: a lower optim.lr or longer optim.warmup_steps, "
                    f"trainer.gradient_clip_val, trainer.precision=32-true, or trainer.nonfinite=stop to find the "
                    f"first module that produces the NaN/Inf."
                )
            return
        path = self.run_dir / "checkpoints" / f"nonfinite-step-{step:07d}.ckpt"
        trainer.save_checkpoint(path)
        raise NonFiniteError(self._message(module, step, path))

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.skipped:
            log.warning("trainer.nonfinite=skip: %d step(s) with NaN/Inf gradients were skipped", self.skipped)

    def _message(self, module: L.LightningModule, step: int, path: Path) -> str:
        where = None
        if self._batch is not None:
            model = module.model
            assert isinstance(model, nn.Module)  # (an XfamLitModule's)
            where = first_nonfinite_module(model, lambda: module(self._batch))
        if where is not None:
            culprit = f"the first module with a NaN/Inf output on this batch is model.{where}"
        else:
            bad = [n for n, p in module.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
            culprit = f"the forward pass is finite; the first parameter with a NaN/Inf gradient is {bad[0]}"
        return (
            f"training stopped at step {step}: NaN/Inf in the loss or gradients ({culprit}). "
            f"Debug checkpoint (the state before this step): {path}. Fix: a lower optim.lr or longer "
            f"optim.warmup_steps, trainer.gradient_clip_val, trainer.precision=32-true, or trainer.nonfinite=skip "
            f"to skip such steps (counted in train/nonfinite_skipped)."
        )
