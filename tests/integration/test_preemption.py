"""Preemption on a cluster (``xfam.training.lit.preempt``), on CPU: a real signal sent to a real training process
in a fake one-task SLURM job (Lightning detects SLURM from its variables; ``scontrol`` is a script that
records its arguments). SIGUSR1 (``sbatch --signal=USR1@90``) must write an ordinary checkpoint at the
end of the current step, request ``scontrol requeue <job id>`` and exit with status 138; SIGTERM
(preemption, ``scancel``) the same without the requeue, status 143. Lightning's own SLURM handler
(``hpc_ckpt_N.ckpt`` in the run directory, a requeue of its own) must not act. The restarted command
(``ckpt_path=auto``, as the requeued job runs it) must continue so that the per-step losses of the two
parts equal an uninterrupted run's bit for bit, with no step missing. In-process: the stop is a
``SystemExit`` with that status and the process's signal handlers are put back."""

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
from tests.integration.test_train import step_losses
from xfam.core.errors import ConfigError
from xfam.training.lit.preempt import Preempted
from xfam.training.runner import train

STEPS = 40
RUN = ["model.dropout=0.1", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=5", "callbacks.every_n_steps=4"]
FIRST = "step-0000004.ckpt"  # the signal is sent as soon as this periodic checkpoint exists
JOB = "4242"


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Per-step losses of an uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("reference")
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    assert train(compose_cfg([*TINY, *RUN, *text_data(corpus)]), run_dir)["step"] == STEPS
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before  # handlers put back
    return step_losses(run_dir)


def slurm_job(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of a one-task SLURM job whose ``scontrol`` appends its arguments to the returned file."""
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol.txt"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "XFAM_RUNS": str(tmp_path / "runs"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": JOB,
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "xfam-test",  # not "bash"/"interactive": Lightning's SLURMEnvironment is used
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    env.pop("XFAM_DEBUG", None)
    return env, record


def signalled_run(args: list[str], env: dict[str, str], tmp_path: Path, sig: signal.Signals) -> tuple[int, str]:
    """Start training, send ``sig`` once the first periodic checkpoint exists; exit status and output."""
    out = tmp_path / "first.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while not list((tmp_path / "runs").glob(f"preempt/*/checkpoints/{FIRST}")):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"training ended or stalled before {FIRST}:\n{out.read_text()[-3000:]}")
            time.sleep(0.02)
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
    return code, out.read_text()


@pytest.mark.parametrize(("sig", "requeued"), [(signal.SIGUSR1, True), (signal.SIGTERM, False)], ids=["USR1", "TERM"])
def test_a_signal_checkpoints_and_stops_and_the_requeued_job_continues_exactly(
    reference: dict[int, float], corpus: Path, tmp_path: Path, sig: signal.Signals, requeued: bool
) -> None:
    env, record = slurm_job(tmp_path)
    args = [sys.executable, "train.py", "name=preempt", *TINY, *RUN, *text_data(corpus)]
    code, out = signalled_run(args, env, tmp_path, sig)
    assert code == 128 + sig, out[-3000:]  # stopped on purpose, reported as unfinished
    (run_dir,) = (tmp_path / "runs").glob("preempt/*")
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 4 < step < STEPS  # it stopped mid-run, after the signal
    assert torch.load(run_dir / "checkpoints" / f"step-{step:07d}.ckpt", weights_only=True)["global_step"] == step
    assert f"preemption: {sig.name} received; checkpoint of step {step} written" in out
    assert set(step_losses(run_dir)) == set(range(step))  # every trained step logged, none past the checkpoint
    assert not (run_dir / "metrics.json").exists()  # no evaluation, not reported as finished
    assert not list((tmp_path / "runs").rglob("hpc_ckpt*"))  # Lightning's SLURM handler did not act
    assert (record.read_text() if record.exists() else "") == (f"requeue {JOB}\n" if requeued else "")
    if not requeued:
        return  # the same kind of checkpoint as the requeue signal's, whose restart is tested

    env["SLURM_RESTART_COUNT"] = "1"  # what the requeued job runs: the same command, with ckpt_path=auto
    res = subprocess.run([*args, "ckpt_path=auto"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'} at step {step}" in res.stdout + res.stderr
    assert step_losses(run_dir) == reference  # bit-identical, every step once
    assert record.read_text() == f"requeue {JOB}\n"  # the restart requeued nothing


def test_the_same_signal_for_requeue_and_stop_is_refused(corpus: Path) -> None:
    cfg = compose_cfg([*TINY, *text_data(corpus), "callbacks.requeue_signal=TERM"])
    with pytest.raises(ConfigError, match="requeue_signal and callbacks.stop_signal are both TERM.*Fix:"):
        train(cfg, Path("/nonexistent"))


class SignalAt(L.Callback):
    """Sends ``sig`` to this process at the end of optimizer step ``step``."""

    def __init__(self, step: int, sig: signal.Signals):
        self.step, self.sig = step, sig

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            signal.raise_signal(self.sig)


def test_in_process_the_stop_is_an_exit_status_and_the_handlers_are_put_back(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as stop:  # a SystemExit: the process ends with its code
        train(compose_cfg([*TINY, *text_data(corpus)]), tmp_path, callbacks=[SignalAt(3, signal.SIGUSR1)])
    assert stop.value.code == 128 + signal.SIGUSR1
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4  # the next step
    assert (tmp_path / "checkpoints" / "step-0000004.ckpt").is_file()
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before
