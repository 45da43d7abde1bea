"""Preemption and time limits on clusters: on a signal, checkpoint at the end of the current training
step, requeue the SLURM job, and exit; the requeued job continues exactly with ``ckpt_path=auto``.

SLURM warns a job before it ends it: ``sbatch --signal=USR1@90`` sends SIGUSR1 90 s before the time
limit; preemption, ``scancel`` and the time limit itself send SIGTERM (then SIGKILL after the
cluster's KillWait, 30 s by default). ``Preemption``:

* while training (from ``on_train_start``: over Lightning's SIGTERM handler; Lightning puts the
  handlers of before the fit back on every exit) handles ``callbacks.requeue_signal`` (SIGUSR1) and
  ``callbacks.stop_signal`` (SIGTERM) with a handler that only records the signal: a handler runs
  between two bytecodes of whatever the process was doing (mid-step, mid-write, inside a collective),
  where nothing else is safe. Outside training (data preparation, the final test) a signal keeps
  its previous effect;
* at the end of the next optimizer step the ranks agree (one all-reduce of two flags per step under
  DDP, so every rank stops at the same step even if only one got the signal) and the run's ordinary
  checkpoints are written by its periodic ``StepCheckpoint``: ``checkpoints/step-N.ckpt`` and
  ``last.ckpt``, exact resume points like the periodic ones (batches consumed, RNG states), which
  ``ckpt_path=auto`` finds;
* once that step's metrics are logged and flushed, rank zero requeues the job for the requeue
  signal (``scontrol requeue $SLURM_JOB_ID``, an array job's ``<array id>_<task id>``), never for the
  stop signal: SIGTERM also comes from ``scancel``, and SLURM requeues a job preempted under
  ``PreemptMode=REQUEUE`` itself;
* the process exits with status 128 + the signal number (138 for SIGUSR1, 143 for SIGTERM), as if
  the signal had ended it: no validation, no test, no ``metrics.json``, so a script or a scheduler
  sees an unfinished run. The requeued job reruns the same command: launch it with ``ckpt_path=auto``.

Lightning's own SLURM handling is switched off (``cluster_plugins``): with
``SLURMEnvironment(auto_requeue=True)`` (its default under SLURM; lightning 2.6) SIGUSR1 makes it save
``hpc_ckpt_N.ckpt`` inside the signal handler, possibly mid-step (not an exact resume point), in the
run directory where ``ckpt_path=auto`` does not look, requeue, and train on until SLURM kills the
job; any later ``fit``/``test`` with no checkpoint path in that directory then loads that file. Its
SIGTERM handler (stop after the step with status 0, no checkpoint) is replaced while training.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from xfam.core.logs import log
from xfam.training.lit.step_checkpoint import StepCheckpoint


class Preempted(SystemExit):
    """Training stopped on a signal after writing its checkpoint; the process exits with ``code``."""


def signal_number(name: str | None) -> int | None:
    """``"USR1"`` -> ``signal.SIGUSR1`` (None stays None)."""
    return None if name is None else int(getattr(signal, "SIG" + name))


def slurm_job_id() -> str | None:
    """The id ``scontrol requeue`` takes for this job (an array task: ``<array job id>_<task id>``)."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def requeue(job_id: str) -> bool:
    """Run ``scontrol requeue <job_id>``; log the outcome (a failure with what to do) and return success."""
    cmd = ["scontrol", "requeue", job_id]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        why = f"{type(err).__name__}: {err}"
    else:
        if res.returncode == 0:
            log.info("preemption: requeued SLURM job %s (`%s`)", job_id, " ".join(cmd))
            return True
        why = f"exit status {res.returncode}: {(res.stderr or res.stdout).strip()}"
    log.error(
        "preemption: `%s` failed (%s). The checkpoint is written, but this job will not restart by itself. "
        "Fix: submit jobs that may be requeued (sbatch --requeue, or ask your admins), or resubmit the same "
        "command with ckpt_path=auto to continue.",
        " ".join(cmd),
        why,
    )
    return False


def cluster_plugins() -> list[Any]:
    """Trainer plugins that leave signals to ``Preemption``: under SLURM (as Lightning detects it),
    Lightning's SLURM environment without its auto-requeue (see the module docstring)."""
    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


class Preemption(L.Callback):
    """Checkpoint, requeue and exit on ``requeue_signal``; checkpoint and exit on ``stop_signal``.

    Args:
        checkpoint: the run's periodic ``StepCheckpoint`` (``step-N.ckpt`` and ``last.ckpt``).
        requeue_signal, stop_signal: signal names (``"USR1"``, ``"TERM"``, ...) or None (not handled).
        ckpt_path: the run's ``ckpt_path``; a requeued job reruns the command, which needs ``auto``.
    """

    def __init__(
        self,
        checkpoint: StepCheckpoint,
        requeue_signal: str | None = "USR1",
        stop_signal: str | None = "TERM",
        ckpt_path: str | None = "auto",
    ):
        self.checkpoint = checkpoint
        self.requeue_signal = signal_number(requeue_signal)
        self.stop_signal = signal_number(stop_signal)
        if self.requeue_signal is not None and self.requeue_signal == self.stop_signal:
            raise ValueError(f"requeue_signal and stop_signal are both {requeue_signal}")
        self.ckpt_path = ckpt_path
        self.received: list[int] = []  # signal numbers in order of arrival: the handler's only effect
        self._previous: dict[int, Any] = {}  # the handlers installed before ours
        self._step = -1  # global step at the last batch end (it changes when an optimizer step is done)
        self._stopping: tuple[int, bool, int] | None = None  # (signal, requeue, step) once checkpointed

    @property
    def signals(self) -> list[int]:
        return [s for s in (self.requeue_signal, self.stop_signal) if s is not None]

    # -- signals ------------------------------------------------------------------------------------
    def handle(self, signum: int, frame: Any = None) -> None:
        """The signal handler: records the signal; the checkpoint and the exit follow at the step's end."""
        self.received.append(signum)

    def install(self) -> None:
        """Handle ``signals`` with ``handle``, remembering the handlers found (unless ``setup`` did)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption: not in the main thread, where signals are handled: no checkpoint on a signal")
            return
        for signum in self.signals:
            self._previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, self.handle)

    def restore(self) -> None:
        """Put back the handlers found before training."""
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _agreed(self, trainer: L.Trainer, module: L.LightningModule) -> tuple[bool, bool]:
        """(requeue, stop): whether any rank received each signal; every rank gets the same answer."""
        mine = [self.requeue_signal in self.received, self.stop_signal in self.received]
        if trainer.world_size == 1:
            return mine[0], mine[1]
        flags = trainer.strategy.reduce(torch.tensor(mine, dtype=torch.int32, device=module.device), reduce_op="sum")
        return bool(flags[0]), bool(flags[1])

    # -- hooks ----------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not self.signals:
            return
        self.received.clear()
        self._stopping = None
        # The handlers of before the fit (Lightning's own, put in later, are not kept): put back at the
        # end, as Lightning puts back the same ones (from before it registered its own) on every path.
        self._previous = {s: signal.getsignal(s) for s in self.signals}
        job = slurm_job_id()
        if job is not None and self.requeue_signal is not None and self.ckpt_path != "auto" and trainer.is_global_zero:
            log.warning(
                "preemption: SLURM job %s is requeued on %s and a requeued job reruns this command, which "
                "without ckpt_path=auto %s. Fix: add ckpt_path=auto.",
                job,
                signal.Signals(self.requeue_signal).name,
                "will refuse to start (its run directory holds this run)"
                if self.ckpt_path is None
                else f"restarts from {self.ckpt_path} instead of the checkpoint written at the signal",
            )

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._step = trainer.global_step
        if self.signals:
            self.install()  # after Lightning registered its handlers (SIGTERM): ours win while training

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._step or self._stopping is not None:
            return  # inside a gradient accumulation, or already stopping
        self._step = trainer.global_step
        if not self.signals:
            return
        wants_requeue, wants_stop = self._agreed(trainer, module)
        if not (wants_requeue or wants_stop):
            return
        signum = self.requeue_signal if wants_requeue else self.stop_signal
        assert signum is not None  # (only a handled signal is wanted)
        ckpt = self.checkpoint
        ckpt.save_now(trainer)  # a periodic checkpoint's files, pruning and content (unless written at this step)
        if trainer.is_global_zero:
            log.warning(
                "preemption: %s received; checkpoint of step %d written to %s (and last.ckpt); stopping",
                signal.Signals(signum).name,
                trainer.global_step,
                ckpt.format_checkpoint_name(ckpt._monitor_candidates(trainer)),
            )
        self._stopping = (signum, wants_requeue, trainer.global_step)

    def _exit(self, trainer: L.Trainer) -> None:
        """At the first hook after the checkpointed step's metrics are logged: flush, requeue, exit."""
        if self._stopping is None:
            return
        signum, requeueing, step = self._stopping
        finish = getattr(getattr(trainer, "strategy", None), "finish_pending", None)
        if finish is not None:  # a sharded checkpoint written in the background is complete before the exit
            finish()
        for logger in trainer.loggers:  # before a requeue: SLURM then sends SIGTERM, SIGKILL follows
            logger.save()
        if trainer.is_global_zero:
            job = slurm_job_id()
            requeued = False
            if requeueing and job is None:
                log.warning("preemption: not a SLURM job (no SLURM_JOB_ID): nothing to requeue")
            elif requeueing and job is not None:
                requeued = requeue(job)
            log.warning(
                "preemption: stopped at step %d on %s; exiting with status %d. Continue with ckpt_path=auto%s.",
                step,
                signal.Signals(signum).name,
                128 + signum,
                " (the requeued job does)" if requeued else "",
            )
        raise Preempted(128 + signum)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self._exit(trainer)

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._exit(trainer)  # no validation after the signal: the time left is short

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._exit(trainer)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._exit(trainer)

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        self.restore()

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.restore()
        late = sorted({signal.Signals(s).name for s in self.received})
        if late and trainer.is_global_zero:
            log.warning("preemption: %s arrived after the last training step; the run finishes", "/".join(late))
