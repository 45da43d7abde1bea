"""2-process DDP on CPU (gloo, ``trainer=ddp_cpu``), as real command lines (Lightning's DDP and pytest do
not mix in one process, docs/architecture.md): the same loss curve as one process with the same global batch,
only rank 0 writing, and an exact resume of a stateful run (XL memory per rank + Performer features)
after the process tree is killed."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import ROOT, TINY, run_cli, text_data
from tests.integration.test_crash_safety import same_losses
from tests.integration.test_train import step_losses

# Memory (one stream per batch row and rank) and randomised features redrawn every 3 steps: the
# stateful components whose state must be saved per rank and restored.
STATEFUL = [
    *TINY,
    "trainer.max_steps=9",
    "trainer.val_check_interval=3",
    "memory=xl",
    "memory.mem_len=24",
    "loader.streams=true",
    "attention=performer",
    "attention.num_features=16",
    "attention.redraw_every=3",
]
#: Relative tolerance of DDP vs one process: the same rows and gradients, summed in another order.
RTOL = 1e-4


def data(corpus: Path, batch: int) -> list[str]:
    return [*text_data(corpus)[:-3], f"data.batch_size={batch}", "data.val_fraction=0.2", "data.test_fraction=0.2"]


def val_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for f in run_dir.glob("logs/version_*/metrics.csv"):
        with open(f) as fh:
            out.update({int(r["step"]): float(r["val/loss"]) for r in csv.DictReader(fh) if r.get("val/loss")})
    return out


def trains_as_one_process(run_dir: Path, one: Path, ranks: int = 2) -> dict:
    """The checks of a data-parallel run (DDP, FSDP, several nodes) against one process reading the same rows per
    step: the validation losses (``RTOL``), the weights after 9 steps (1e-3), and every rank's own memory streams,
    which differ and together are the one-process streams. Returns the run's last checkpoint (``read``)."""
    from xfam.model.checkpoint import read, weights

    two, single = val_losses(run_dir), val_losses(one)
    assert sorted(two) == sorted(single) == [2, 5, 8]
    for step in two:
        assert two[step] == pytest.approx(single[step], rel=RTOL), step
    last = run_dir / "checkpoints" / "last.ckpt"
    a, b = read(last), read(one / "checkpoints" / "last.ckpt")  # (a file, or a sharded run's folder)
    a_weights = weights(last, a)
    assert a_weights.keys() == b["state_dict"].keys()
    for name, p in b["state_dict"].items():
        assert torch.allclose(a_weights[name], p, rtol=1e-3, atol=1e-5), name
    first_layer = lambda r: r["memory"]["layers"][0]["h"]  # noqa: E731
    streams = a["xfam_resume"]["ranks"]
    assert len(streams) == ranks and not torch.equal(first_layer(streams[0]), first_layer(streams[1]))
    together = torch.cat([first_layer(r) for r in streams])  # [B x ranks, mem_len, dim]
    assert torch.allclose(together, first_layer(b["xfam_resume"]["ranks"][0]), atol=1e-4)
    return a


def run(args: list[str], runs: Path) -> Path:
    res = run_cli(["train.py", "name=d", *args], env={"XFAM_RUNS": str(runs)}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = runs.glob("d/*")
    return run_dir


@pytest.fixture(scope="module")
def ddp_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-process run, 4 rows per rank."""
    return run([*STATEFUL, *data(corpus, 4), "trainer=ddp_cpu"], tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow  # two DDP runs and one single-process run: ~35 s
def test_ddp_matches_one_process_with_the_same_global_batch(ddp_run: Path, corpus: Path, tmp_path: Path) -> None:
    one = run([*STATEFUL, *data(corpus, 8)], tmp_path)  # one process, 8 rows: the same rows per step
    a = trains_as_one_process(ddp_run, one)
    # the test split is evaluated in fresh spawned processes: its row still carries the trained step
    for run_dir in (ddp_run, one):
        with open(run_dir / "logs" / "version_0" / "metrics.csv") as fh:
            assert [r["step"] for r in csv.DictReader(fh) if r.get("test/loss")] == ["9"], run_dir
    # only rank 0 writes: the run directory holds what a one-process run's holds, nothing per rank
    assert sorted(p.relative_to(ddp_run) for p in ddp_run.rglob("*")) == sorted(
        p.relative_to(one) for p in one.rglob("*")
    )
    # each rank's state is saved (its own streams: trains_as_one_process), and the position in the epoch
    ranks = a["xfam_resume"]["ranks"]
    assert len(ranks) == 2 and a["xfam_resume"]["batches_in_epoch"] == 9
    assert all(m["h"].shape == (4, 24, 32) for r in ranks for m in r["memory"]["layers"])


def killed_then_resumed(args: list[str], runs: Path, step: int) -> tuple[Path, int]:
    """Run ``train.py <args>`` (a multi-process run) in ``runs``, kill its whole process tree once the checkpoint of
    ``step`` exists (a preempted node), resume it with ``ckpt_path=auto`` to the end; returns the run folder and
    the last step logged before the kill."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XFAM_RUNS": str(runs), "PYTHONUNBUFFERED": "1"}
    env.pop("XFAM_DEBUG", None)
    command = [sys.executable, "train.py", "name=d", *args]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while not list(runs.glob(f"d/*/checkpoints/step-{step:07d}.ckpt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank
    assert proc.wait() == -signal.SIGKILL
    (run_dir,) = runs.glob("d/*")
    killed_at = max(step_losses(run_dir))
    res = subprocess.run([*command, "ckpt_path=auto"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir, killed_at


@pytest.mark.slow
def test_ddp_killed_then_resumed_continues_exactly(ddp_run: Path, corpus: Path, tmp_path: Path) -> None:
    run_dir, killed_at = killed_then_resumed([*STATEFUL, *data(corpus, 4), "trainer=ddp_cpu"], tmp_path, 3)
    assert killed_at < 8, "killed mid-run"
    same_losses(step_losses(run_dir), step_losses(ddp_run))
    same_losses(val_losses(run_dir), val_losses(ddp_run))  # a kill after a checkpoint loses its validation row
