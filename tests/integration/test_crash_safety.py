"""Crash safety: a process dying before, during or after a checkpoint write (seeded fault injection),
a truncated checkpoint and a real SIGKILL all leave a run that ``ckpt_path=auto`` continues, and the
continued run's per-step losses equal an uninterrupted run's.

One row may be missing: Lightning logs a step's metrics after the callbacks of its batch end, where
the periodic checkpoint is written, so a death right after that write loses the logged loss of the
step the checkpoint closes (the resumed run starts after it). ``same_losses`` allows exactly that."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.helpers import ROOT, TINY, compose_cfg, flip_a_tensor_bit, text_data
from tests.integration.test_train import step_losses
from xfam.core.errors import ConfigError
from xfam.training.lit.checkpoint import AtomicCheckpointIO
from xfam.training.runner import train

RUN = ["trainer.max_steps=9", "trainer.val_check_interval=9"]  # checkpoints at steps 3, 6 and 9
CLOSING = {2, 5, 8}  # the logged step of the batch at whose end each checkpoint is written


def same_losses(run: dict[int, float], reference: dict[int, float]) -> None:
    """Equal per-step losses; at most one step missing, and only one a checkpoint closes (see above)."""
    missing = set(reference) - set(run)
    assert len(missing) <= 1 and missing <= CLOSING, missing
    assert {k: v for k, v in reference.items() if k in run} == run


class Died(Exception):
    """Stands for the process being killed inside the checkpoint writer."""


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, dict[int, float]]:
    """An uninterrupted run: its config, directory and per-step losses."""
    cfg = compose_cfg([*TINY, *RUN, *text_data(corpus)])
    run_dir = tmp_path_factory.mktemp("reference")
    assert train(cfg, run_dir)["step"] == 9
    return cfg, run_dir, step_losses(run_dir)


def dying_writer(monkeypatch: pytest.MonkeyPatch, when: str, call: int) -> None:
    """Make the ``call``-th checkpoint write die ``when`` = before / during / after writing the file."""
    original = AtomicCheckpointIO.save_checkpoint
    calls = {"n": 0}

    def save(self, checkpoint, path, storage_options=None):  # noqa: ANN001
        calls["n"] += 1
        if calls["n"] != call:
            return original(self, checkpoint, path, storage_options)
        if when == "before":
            raise Died(f"before writing {path}")
        if when == "during":  # half a file under the temporary name: a real death leaves it there
            tmp = Path(str(path) + ".tmp")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            original(self, checkpoint, tmp, storage_options)
            tmp.write_bytes(tmp.read_bytes()[: tmp.stat().st_size // 2])
            raise Died(f"while writing {path}")
        original(self, checkpoint, path, storage_options)
        raise Died(f"after writing {path}")

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", save)


@pytest.mark.parametrize("when", ["before", "during", "after"])
@pytest.mark.parametrize("seed", [0, 1])
def test_dying_in_the_checkpoint_writer_leaves_a_run_that_continues_exactly(
    reference, when: str, seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, _, losses = reference
    call = random.Random(seed).randint(1, 4)  # which write dies (each checkpoint step writes step-N and last)
    dying_writer(monkeypatch, when, call)
    with pytest.raises(Died):
        train(cfg, tmp_path)
    monkeypatch.undo()
    resumed = train({**cfg, "ckpt_path": "auto"}, tmp_path)
    assert resumed["step"] == 9
    same_losses(step_losses(tmp_path), losses)  # every step, before and after the crash, as without it


def test_auto_falls_back_past_truncated_checkpoints(reference, tmp_path: Path) -> None:
    cfg, ref_dir, losses = reference
    run_dir = tmp_path / "run"
    os.system(f"cp -r {ref_dir} {run_dir}")
    for name in ("last.ckpt", "step-0000009.ckpt"):  # both newest files cut in half (a disk full, a bad copy)
        path = run_dir / "checkpoints" / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    resumed = train({**cfg, "ckpt_path": "auto"}, run_dir)  # continues from step 6
    assert resumed["step"] == 9 and step_losses(run_dir) == losses  # nothing crashed: every row is there
    for name in ("last.ckpt", "step-0000003.ckpt", "step-0000006.ckpt", "step-0000009.ckpt"):
        path = run_dir / "checkpoints" / name
        path.write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="no checkpoint of .* can be read .*Nothing was changed. Fix:"):
        train({**cfg, "ckpt_path": "auto"}, run_dir)


def test_auto_passes_over_a_checkpoint_changed_after_writing(reference, tmp_path: Path, caplog) -> None:
    cfg, ref_dir, losses = reference
    run_dir = tmp_path / "run"
    os.system(f"cp -r {ref_dir} {run_dir}")
    for name in ("last.ckpt", "step-0000009.ckpt"):  # a flipped bit in the weights of the two newest files
        flip_a_tensor_bit(run_dir / "checkpoints" / name)
    with caplog.at_level(logging.WARNING, logger="xfam"):
        resumed = train({**cfg, "ckpt_path": "auto"}, run_dir)  # continues from step 6
    assert resumed["step"] == 9 and step_losses(run_dir) == losses
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "skipping last.ckpt" in warned and "do not match the digest written with it" in warned


def test_a_real_sigkill_then_auto_continues_exactly(reference, corpus: Path, tmp_path: Path) -> None:
    _, _, losses = reference
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XFAM_RUNS": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    env.pop("XFAM_DEBUG", None)
    args = [sys.executable, "train.py", "name=kill", *TINY, *RUN, *text_data(corpus)]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("kill/*/checkpoints/step-0000003.ckpt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # as soon as the first checkpoint exists (or at the deadline)
    assert proc.wait() == -signal.SIGKILL  # it was killed mid-run, not finished
    (run_dir,) = tmp_path.glob("kill/*")
    res = subprocess.run([*args, "ckpt_path=auto"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    same_losses(step_losses(run_dir), losses)
