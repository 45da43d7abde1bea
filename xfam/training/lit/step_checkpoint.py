"""The run's periodic checkpoints: ``step-N.ckpt`` and ``last.ckpt`` at exactly the steps they name, and at
the step that ends training, so ``last.ckpt`` is always the final model.

Lightning's ``ModelCheckpoint`` (2.6) with ``every_n_train_steps`` and a monitor defers a save that falls
on an epoch's last batch to the next validation, which may come many steps later (a 64-step run with
32-step epochs ended with its only ``step-N.ckpt`` and ``last.ckpt`` at step 40), and it writes nothing
at the final step when ``trainer.max_steps`` is not a multiple of the period (a run ending at 100 kept
``last.ckpt`` at 90). ``StepCheckpoint`` keeps Lightning's files, naming and pruning (the newest
``keep_last`` by step) and decides *when* itself:

* at the end of every optimizer step that is a multiple of ``every_n_train_steps``, never deferred;
* at the end of the step that ends training (``trainer.max_steps`` reached, the last batch of the last
  epoch under ``trainer.max_epochs``, or a stop requested by a callback);
* at the end of training if neither wrote the final step (e.g. ``trainer.max_time``), as a fallback;
* on request (``save_now``), for a preemption signal.

Every file is written at a training batch's end, where the loop state and xfam's resume state (batches
consumed in the epoch, RNG states) make it an exact resume point.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from xfam.core.logs import log


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that saves at the steps it names and at the final step (module docstring)."""

    def save_now(self, trainer: L.Trainer) -> bool:
        """Write ``step-N.ckpt`` and ``last.ckpt`` for the current step unless written already; True if written."""
        if self._should_skip_saving_checkpoint(trainer):
            return False
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        return True

    @staticmethod
    def ends_training(trainer: L.Trainer) -> bool:
        """Whether the step that just finished is the last one the fit loop will run."""
        if trainer.should_stop or (0 < trainer.max_steps <= trainer.global_step):
            return True
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs > 0
        return last_epoch and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        # Inside a gradient accumulation the step is the one already saved (``_should_skip_saving_checkpoint``
        # compares steps), so a save only happens at the batch that ended an optimizer step.
        periodic = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        if periodic or self.ends_training(trainer):
            self.save_now(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Nothing: saves are per step (at a batch's end, an exact resume point)."""

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Nothing: a step's checkpoint was written at its batch's end, before validation."""

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_step > 0 and self.save_now(trainer):
            log.info("final checkpoint of step %d written (training ended off the step schedule)", trainer.global_step)
