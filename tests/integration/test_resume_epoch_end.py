"""Checkpoints at an epoch's last batch resume exactly, and ``last.ckpt`` is always the final step.

The data below makes short epochs of E batches (about a dozen), so step E closes epoch 0 and step 2E
epoch 1. A checkpoint written there has consumed its whole epoch; a resume that skipped that many batches of the
*next* epoch saw one epoch less (before the fix: 0 of the later steps matched). An epoch's last batch is
reached by a periodic checkpoint, by validation at the epoch's end (``best.ckpt``) and by a preemption
signal during that step; each resumes bit for bit (CPU, fp32, with dropout). Lightning deferred a
periodic save that fell on an epoch's last batch to the next validation and wrote nothing at a final
step off the period: every ``step-N.ckpt`` now holds step N, and ``last.ckpt`` the final step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.integration.helpers import ROOT, TINY, compose_cfg, text_data
from tests.integration.test_preemption import SignalAt
from tests.integration.test_train import log_rows, step_losses
from xfam.model.build import build_data
from xfam.training.lit.preempt import Preempted
from xfam.training.runner import train


def data(corpus: Path) -> list[str]:
    return [*text_data(corpus), "data.val_fraction=0.4", "data.test_fraction=0.4", "data.batch_size=8"]


@pytest.fixture(scope="module")
def epoch(corpus: Path) -> int:
    """Batches per epoch of ``data(corpus)``."""
    cfg = compose_cfg([*TINY, *data(corpus)])
    source = build_data(cfg)
    source.prepare()
    n = len(source.split("train")) // cfg["data"]["batch_size"]
    assert 5 <= n <= 30, n  # short epochs, the premise of this file
    return n


def run(corpus: Path, epoch: int, *extra: str) -> list[str]:
    """2E + 2 steps (off the E-step period), validation every E + 3 steps (never at an epoch's end), dropout."""
    return [
        *TINY,
        *data(corpus),
        "model.dropout=0.1",
        f"trainer.max_steps={2 * epoch + 2}",
        f"trainer.val_check_interval={epoch + 3}",
        f"callbacks.every_n_steps={epoch}",
        "callbacks.keep_last=-1",
        *extra,
    ]


def ckpt_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def resumed_losses(overrides: list[str], ckpt: Path, run_dir: Path) -> dict[int, float]:
    train(compose_cfg([*overrides, f"ckpt_path={ckpt}"]), run_dir)
    return step_losses(run_dir)


@pytest.fixture(scope="module")
def whole(corpus: Path, epoch: int, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float], dict]:
    run_dir = tmp_path_factory.mktemp("whole")
    metrics = train(compose_cfg(run(corpus, epoch)), run_dir)
    return run_dir, step_losses(run_dir), metrics


def name(step: int) -> str:
    return f"step-{step:07d}.ckpt"


def test_checkpoints_hold_the_steps_they_name_and_last_is_the_final_step(whole, epoch: int) -> None:
    run_dir, losses, metrics = whole
    epoch_of = {int(r["step"]): int(float(r["epoch"])) for r in log_rows(run_dir) if r.get("train/loss")}
    assert (epoch_of[epoch - 1], epoch_of[epoch]) == (0, 1)  # step E closes epoch 0 (logged steps count from 0)
    ckpts, final = run_dir / "checkpoints", 2 * epoch + 2
    names = sorted(p.name for p in ckpts.glob("step-*.ckpt"))
    assert names == [name(epoch), name(2 * epoch), name(final)]  # the final step too, off the period
    assert all(ckpt_step(ckpts / n) == int(n[5:12]) for n in names)  # none deferred to a later validation
    assert metrics["step"] == final and ckpt_step(ckpts / "last.ckpt") == final


def test_an_epoch_end_checkpoint_resumes_exactly(whole, epoch: int, corpus: Path, tmp_path: Path) -> None:
    run_dir, losses, metrics = whole
    resumed = resumed_losses(run(corpus, epoch), run_dir / "checkpoints" / name(epoch), tmp_path)
    assert min(resumed) == epoch and resumed == {s: v for s, v in losses.items() if s >= epoch}


@pytest.mark.slow
def test_a_best_checkpoint_written_by_validation_at_an_epoch_end_resumes_exactly(
    corpus: Path, epoch: int, tmp_path: Path
) -> None:
    overrides = run(corpus, epoch, f"trainer.val_check_interval={epoch}", "callbacks.every_n_steps=100")
    train(compose_cfg(overrides), tmp_path / "whole")
    best = tmp_path / "whole" / "checkpoints" / "best.ckpt"
    step = ckpt_step(best)
    assert step in (epoch, 2 * epoch)  # validation ran at the epoch ends only
    resumed = resumed_losses(overrides, best, tmp_path / "resumed")
    assert resumed == {s: v for s, v in step_losses(tmp_path / "whole").items() if s >= step}


@pytest.mark.slow
def test_a_preemption_signal_in_an_epochs_last_step_resumes_exactly(
    whole, epoch: int, corpus: Path, tmp_path: Path
) -> None:
    _, losses, _ = whole
    overrides = run(corpus, epoch, "callbacks.every_n_steps=100")
    with pytest.raises(Preempted):  # the signal arrives after step E - 1; its checkpoint is step E's, an epoch end
        train(compose_cfg(overrides), tmp_path, callbacks=[SignalAt(epoch - 1, signal.SIGTERM)])
    assert sorted(p.name for p in tmp_path.glob("checkpoints/step-*")) == [name(epoch)]
    train(compose_cfg([*overrides, "ckpt_path=auto"]), tmp_path)
    assert step_losses(tmp_path) == losses


@pytest.mark.slow
def test_a_run_ended_off_the_period_continues_exactly_from_its_last_ckpt(
    epoch: int, corpus: Path, tmp_path: Path
) -> None:
    overrides = run(corpus, epoch, "optim.schedule=constant")  # the schedule must not depend on max_steps
    stop = epoch + 4
    train(compose_cfg([*overrides, f"trainer.max_steps={stop}"]), tmp_path / "split")  # checkpoints at E, E + 4
    assert ckpt_step(tmp_path / "split" / "checkpoints" / "last.ckpt") == stop
    train(compose_cfg([*overrides, "ckpt_path=auto"]), tmp_path / "split")  # extended to 2E + 2 steps
    train(compose_cfg(overrides), tmp_path / "whole")
    assert step_losses(tmp_path / "split") == step_losses(tmp_path / "whole")


@pytest.mark.slow
def test_a_sigkill_during_a_checkpoint_write_then_auto_continues_exactly(
    whole, epoch: int, corpus: Path, tmp_path: Path
) -> None:
    """A real SIGKILL while step 2E's checkpoint (an epoch end) is half written: the writer is slowed so the
    kill lands inside it, with the temporary file on disk."""
    _, losses, _ = whole
    writing = tmp_path / "writing"
    slow_writer = (
        "import sys, time, pathlib, runpy\n"
        "from xfam.training.lit.checkpoint import AtomicCheckpointIO\n"
        "save = AtomicCheckpointIO.save_checkpoint\n"
        "def slow(self, checkpoint, path, storage_options=None):\n"
        f"    if checkpoint['global_step'] == {2 * epoch}:\n"
        "        tmp = pathlib.Path(str(path) + '.tmp'); tmp.write_bytes(b'half a checkpoint')\n"
        f"        pathlib.Path({str(writing)!r}).touch(); time.sleep(600)\n"
        "    return save(self, checkpoint, path, storage_options)\n"
        "AtomicCheckpointIO.save_checkpoint = slow\n"
        "sys.argv = ['train.py', *sys.argv[1:]]\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XFAM_RUNS": str(tmp_path / "runs"), "PYTHONUNBUFFERED": "1"}
    env.pop("XFAM_DEBUG", None)
    args = ["name=kill", *run(corpus, epoch)]
    proc = subprocess.Popen([sys.executable, "-c", slow_writer, *args], cwd=ROOT, env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not writing.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writing.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no write in 240 s"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    (run_dir,) = (tmp_path / "runs" / "kill").iterdir()
    assert list(run_dir.glob("checkpoints/*.tmp"))  # it died mid-write
    res = subprocess.run(
        [sys.executable, "train.py", *args, "ckpt_path=auto"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    resumed = step_losses(run_dir)
    assert resumed == {s: v for s, v in losses.items() if s in resumed}
    assert set(losses) - set(resumed) <= {
        2 * epoch - 1
    }  # at most the row the lost write's step closed (test_crash_safety)


@pytest.mark.slow
def test_a_memory_run_resumed_at_an_epoch_end_starts_the_next_epochs_streams_afresh(
    epoch: int, corpus: Path, tmp_path: Path
) -> None:
    """The checkpoint holds the memory of the epoch's last batch; the next epoch restarts its streams, as the
    uninterrupted run does, so that memory must not be carried into it."""
    overrides = run(corpus, epoch, "memory=xl", "memory.mem_len=24", "pos=xl", "loader.streams=true")
    train(compose_cfg(overrides), tmp_path / "whole")
    resumed = resumed_losses(overrides, tmp_path / "whole" / "checkpoints" / name(epoch), tmp_path / "resumed")
    assert resumed == {s: v for s, v in step_losses(tmp_path / "whole").items() if s >= epoch}


class RequestStop(L.Callback):
    """Asks Lightning to stop after ``step`` optimizer steps (as early stopping does)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_a_stop_requested_off_the_period_still_leaves_last_at_the_final_step(corpus: Path, tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, *text_data(corpus), "trainer.max_steps=20", "callbacks.every_n_steps=4"])
    assert train(cfg, tmp_path, callbacks=[RequestStop(6)])["step"] == 6
    assert ckpt_step(tmp_path / "checkpoints" / "last.ckpt") == 6
    assert sorted(p.name for p in tmp_path.glob("checkpoints/step-*")) == [name(4), name(6)]


@pytest.mark.slow
def test_a_run_sized_in_epochs_ends_with_last_at_its_final_step(epoch: int, corpus: Path, tmp_path: Path) -> None:
    cfg = compose_cfg([*run(corpus, epoch), "trainer.max_steps=-1", "trainer.max_epochs=2"])
    assert train(cfg, tmp_path)["step"] == 2 * epoch
    assert ckpt_step(tmp_path / "checkpoints" / "last.ckpt") == 2 * epoch
    assert ckpt_step(tmp_path / "checkpoints" / name(2 * epoch)) == 2 * epoch
