"""A resumed run's logs are one continuous record: a single CSV file and a single TensorBoard directory
in which every step an uninterrupted run logs appears exactly once, with the same values, however
often the run was stopped and resumed; an earlier run's rows survive a resume refused by validation."""

from __future__ import annotations

import copy
import csv
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.helpers import TINY, compose_cfg, text_data
from tests.integration.test_train import stop_at
from xfam.core.errors import ConfigError
from xfam.training.lit.resume_logs import ContinuedCSVLogger, ContinuedTensorBoardLogger
from xfam.training.runner import train

# Checkpoints and validation every 4 steps; the first part runs without the learning-rate monitor,
# so the resumed run's CSV gains columns.
RUN = ["trainer.max_steps=12", "callbacks.every_n_steps=4", "trainer.val_check_interval=4", "logger=tensorboard"]


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    assert [p.name for p in (run_dir / "logs").iterdir()] == ["version_0"]
    with open(run_dir / "logs" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def per_step(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    """``key`` by step; a step logged twice fails."""
    steps = [int(r["step"]) for r in rows if r.get(key)]
    assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {sorted(steps)}"
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def tb_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows them (it applies the purge markers)."""
    assert [p.name for p in (run_dir / "tensorboard").iterdir()] == ["version_0"]
    acc = EventAccumulator(str(run_dir / "tensorboard" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An uninterrupted run, and the same run killed twice (after steps 6 and 10: checkpoints at 4 and
    8, steps logged after each, which the resumed run trains and logs again) and resumed twice with
    ``ckpt_path=auto``."""
    whole, split = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("split")
    cfg = compose_cfg([*TINY, *text_data(corpus), *RUN])
    train(cfg, whole)
    stop_at(6, {**cfg, "callbacks": {**cfg["callbacks"], "lr_monitor": False}}, split)
    assert max(per_step(csv_rows(split), "train/loss")) == 5
    stop_at(10, {**cfg, "ckpt_path": "auto"}, split)
    assert max(per_step(csv_rows(split), "train/loss")) == 9
    train({**cfg, "ckpt_path": "auto"}, split)
    return whole, split


def test_csv_log_of_a_resumed_run_has_every_step_once(runs: tuple[Path, Path]) -> None:
    whole, split = (csv_rows(d) for d in runs)
    assert sorted(per_step(whole, "train/loss")) == list(range(12))
    assert per_step(split, "train/loss") == per_step(whole, "train/loss")
    assert sorted(per_step(whole, "val/loss")) == [3, 7, 11]
    assert per_step(split, "val/loss") == per_step(whole, "val/loss")
    assert list(per_step(split, "test/loss")) == [12]  # only the finished run's test
    # the learning rate, logged only after the first resume: a column added to the file, old rows kept
    assert sorted(per_step(split, "lr/pg1")) == list(range(4, 12))
    assert per_step(split, "lr/pg1") == {k: v for k, v in per_step(whole, "lr/pg1").items() if k >= 4}


@pytest.mark.parametrize("tag", ["train/loss", "val/loss"])
def test_tensorboard_log_of_a_resumed_run_has_every_step_once(runs: tuple[Path, Path], tag: str) -> None:
    whole, split = (tb_scalars(d, tag) for d in runs)
    assert [s for s, _ in whole] == (list(range(12)) if tag == "train/loss" else [3, 7, 11])
    assert split == whole


def test_a_resume_refused_by_validation_changes_no_log(runs: tuple[Path, Path], corpus: Path) -> None:
    _, split = runs
    files = [*(split / "logs").rglob("*"), *(split / "tensorboard").rglob("*")]
    before = {p: p.read_bytes() for p in files if p.is_file()}
    with pytest.raises(ConfigError):
        train(compose_cfg([*TINY, *text_data(corpus), *RUN, "model.heads=3", "ckpt_path=auto"]), split)
    after = [*(split / "logs").rglob("*"), *(split / "tensorboard").rglob("*")]
    assert {p: p.read_bytes() for p in after if p.is_file()} == before


def write_csv(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(text)


def test_csv_cut_keeps_earlier_rows_drops_a_torn_line_and_happens_once(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "version_0" / "metrics.csv"
    write_csv(path, "epoch,step,train/loss\n0,0,5.0\n0,1,4.0\n0,2,3.0\n0,3,2.0\n0,1")  # killed mid-line
    logger = ContinuedCSVLogger(tmp_path, resume_step=2)
    spawned = copy.deepcopy(logger)  # as ddp_spawn hands the logger to the fit's process
    spawned.log_metrics({"train/loss": 3.5, "val/loss": 3.4}, step=2)
    spawned.save()
    assert path.read_text().splitlines() == [
        "epoch,step,train/loss,val/loss",
        "0,0,5.0,",
        "0,1,4.0,",
        ",2,3.5,3.4",
    ]
    logger.log_metrics({"test/loss": 3.3}, step=3)  # the test stage's process: continues, no second cut
    logger.save()
    rows = list(csv.DictReader(path.read_text().splitlines()))
    assert per_step(rows, "train/loss") == {0: 5.0, 1: 4.0, 2: 3.5} and per_step(rows, "test/loss") == {3: 3.3}


def next_second() -> None:
    """TensorBoard reads a directory's event files in name order, which is creation order only across
    seconds (the name is the time in seconds, then host, process and an unpadded counter)."""
    time.sleep(1.01 - time.time() % 1)


def test_tensorboard_purge_marker_is_written_once(tmp_path: Path) -> None:
    first = ContinuedTensorBoardLogger(tmp_path)
    for step in range(5):
        first.log_metrics({"loss": float(step)}, step=step)
    first.finalize("success")
    resumed = ContinuedTensorBoardLogger(tmp_path, resume_step=3)
    spawned = copy.deepcopy(resumed)  # the fit's process under ddp_spawn
    next_second()
    spawned.log_metrics({"loss": 30.0}, step=3)
    spawned.finalize("success")
    next_second()
    resumed.log_metrics({"loss": 40.0}, step=4)  # the test stage's process: no second purge
    resumed.finalize("success")
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "version_0"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
