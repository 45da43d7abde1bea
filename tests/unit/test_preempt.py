"""xfam.training.lit.preempt without training: the signal handler only records, the stop happens at an optimizer
step boundary with a checkpoint first, only rank zero requeues and only for the requeue signal, and
``scontrol`` failures are reported. (The end-to-end path with real signals: tests/integration/test_preemption.py.)"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from xfam.training.lit import preempt
from xfam.training.lit.preempt import Preempted, Preemption, requeue, slurm_job_id
from xfam.training.lit.step_checkpoint import StepCheckpoint


@pytest.fixture
def callback():
    ckpt = mock.create_autospec(StepCheckpoint, instance=True)
    ckpt.save_now.return_value = True
    ckpt._monitor_candidates.return_value = {}
    ckpt.format_checkpoint_name.return_value = "checkpoints/step-0000004.ckpt"
    cb = Preemption(ckpt, "USR1", "TERM")
    yield cb, ckpt
    cb.restore()


def test_the_handler_only_records_the_signal(callback) -> None:
    cb, ckpt = callback
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    cb.install()
    signal.raise_signal(signal.SIGUSR1)  # real deliveries: the process must survive them
    signal.raise_signal(signal.SIGTERM)
    assert cb.received == [signal.SIGUSR1, signal.SIGTERM]
    assert ckpt.mock_calls == []  # nothing saved, nothing stopped: that waits for the step's end
    cb.restore()
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before


def fake_trainer(step: int, rank_zero: bool = True) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, world_size=1, is_global_zero=rank_zero, loggers=[mock.Mock()])


@pytest.mark.parametrize(
    ("sig", "rank_zero", "requeued"),
    [(signal.SIGUSR1, True, ["7"]), (signal.SIGUSR1, False, []), (signal.SIGTERM, True, [])],
    ids=["USR1-rank0", "USR1-rank1", "TERM"],
)
def test_checkpoint_at_the_step_end_then_requeue_and_exit(callback, monkeypatch, sig, rank_zero, requeued) -> None:
    cb, ckpt = callback
    calls: list[str] = []
    monkeypatch.setattr(preempt, "requeue", lambda job: calls.append(job) or True)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    trainer = fake_trainer(3, rank_zero)
    cb.on_train_start(trainer, None)
    cb.handle(sig)
    cb.on_train_batch_end(trainer, None, None, None, 0)  # no optimizer step since (gradient accumulation)
    cb.on_train_batch_start(trainer, None, None, 1)
    assert ckpt.mock_calls == []
    trainer.global_step = 4
    cb.on_train_batch_end(trainer, None, None, None, 1)
    ckpt.save_now.assert_called_once_with(trainer)
    assert calls == []  # not before the step's metrics are logged
    with pytest.raises(Preempted) as stop:
        cb.on_validation_start(trainer, None)
    assert stop.value.code == 128 + sig
    assert calls == requeued
    trainer.loggers[0].save.assert_called_once()


def test_requeue_runs_scontrol_and_reports_failures(tmp_path: Path, monkeypatch, caplog) -> None:
    record = tmp_path / "args.txt"
    scontrol = tmp_path / "scontrol"
    monkeypatch.setenv("PATH", str(tmp_path))
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {record}\n')
    scontrol.chmod(0o755)
    assert requeue("123_4") and record.read_text() == "requeue 123_4\n"
    scontrol.write_text('#!/bin/sh\necho "Requested operation is presently disabled" >&2\nexit 1\n')
    caplog.set_level(logging.ERROR, logger="xfam")
    assert not requeue("123")
    assert "exit status 1: Requested operation is presently disabled" in caplog.text and "Fix:" in caplog.text
    scontrol.unlink()
    assert not requeue("123")  # no scontrol at all
    assert "FileNotFoundError" in caplog.text


def test_job_id_of_an_array_task(monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert slurm_job_id() == "101"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "100")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    assert slurm_job_id() == "100_1"


def test_every_rank_stops_when_any_rank_got_the_signal(callback) -> None:
    cb, ckpt = callback
    other_rank = torch.tensor([1, 0], dtype=torch.int32)  # rank 1 received the requeue signal, this one nothing
    strategy = SimpleNamespace(reduce=lambda flags, reduce_op: flags + other_rank if reduce_op == "sum" else None)
    trainer = SimpleNamespace(**vars(fake_trainer(3, rank_zero=False)), strategy=strategy)
    trainer.world_size = 2
    cb._step = 3
    trainer.global_step = 4
    cb.on_train_batch_end(trainer, SimpleNamespace(device=torch.device("cpu")), None, None, 0)
    ckpt.save_now.assert_called_once_with(trainer)
    with pytest.raises(Preempted) as stop:
        cb.on_train_batch_start(trainer, None, None, 1)
    assert stop.value.code == 128 + signal.SIGUSR1
