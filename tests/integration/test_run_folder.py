"""The run folder across failures: different command lines get different folders, a launch that fails
or is refused leaves no folder behind (so the corrected command runs), a resume on other data is
refused unless asked for, and a full disk is one line, with a retry on a still-full disk refused
before it trains."""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from tests.integration.helpers import TINY, compose_cfg, run_cli, text_data
from xfam.core.errors import ConfigError
from xfam.model.checkpoint import DiskFullError
from xfam.training.run_names import CONFIG_DIR, register_resolvers
from xfam.training.runner import train

SHORT = ["trainer.max_steps=3", "trainer.val_check_interval=3"]


def run_dir_of(overrides: list[str]) -> str:
    """The run directory Hydra would give ``python train.py <overrides>``."""
    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            return cfg.hydra.run.dir
    finally:
        GlobalHydra.instance().clear()


def test_command_lines_that_differ_get_different_run_directories() -> None:
    assert run_dir_of(["data.paths=[x/ab]"]) != run_dir_of(["data.paths=[x_ab]"])
    assert run_dir_of(["data.name='a:b'"]) != run_dir_of(["data.name='a=b'"])
    assert run_dir_of(["pos=alibi", "model=small"]).endswith("/default/model:small+pos:alibi")  # as always
    assert run_dir_of(["allow_data_change=true"]).endswith("/default/default")  # not a setting of the run


class Boom(Exception):
    """A failure late in a launch: after the record and the loggers, before the first checkpoint."""


class FailAtStart(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        raise Boom("failed at the start of training")


def test_a_late_failure_leaves_no_folder_and_the_corrected_command_runs(corpus: Path, tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, *SHORT, *text_data(corpus)])
    run_dir = tmp_path / "runs" / "exp" / "default"
    with pytest.raises(Boom):
        train(cfg, run_dir, callbacks=[FailAtStart()])
    assert not (tmp_path / "runs" / "exp").exists()  # nothing left: not its config, logs, nor runs/exp/
    assert train(cfg, run_dir)["step"] == 3  # the same command again: a fresh run, not "already holds a run"


def test_a_refused_launch_leaves_no_folder(corpus: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    runs = tmp_path / "runs"
    args = ["train.py", "name=refused", f"ckpt_path={bad}", *TINY, *text_data(corpus)]
    res = run_cli(args, env={"XFAM_RUNS": str(runs)})
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "not a checkpoint xfam can read safely" in res.stderr and "weights_only" not in res.stderr
    assert not (runs / "refused").exists()


def mtimes(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*")}


def test_resuming_on_other_data_is_refused_unless_asked_for(corpus: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"  # the same kind of data (bytes: the same vocabulary), other text
    other.mkdir()
    for doc in sorted(corpus.glob("*.txt")):
        (other / doc.name).write_text(doc.read_text().upper())
    run_dir = tmp_path / "run"
    train(compose_cfg([*TINY, *SHORT, *text_data(corpus)]), run_dir)
    moved = compose_cfg([*TINY, *text_data(other), "ckpt_path=auto"])  # max_steps=6: three more steps
    before = mtimes(run_dir)
    with pytest.raises(ConfigError) as err:
        train(moved, run_dir)
    msg = str(err.value)
    was, now = re.search(r"data fingerprint (\w+) -> (\w+)", msg).groups()
    assert was == torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["xfam"]["data_fingerprint"]
    assert was != now and "allow_data_change=true" in msg and "Nothing was changed. Fix:" in msg
    assert mtimes(run_dir) == before
    assert train({**moved, "allow_data_change": True}, run_dir)["step"] == 6


class CountBatches(L.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, *args: object) -> None:
        self.batches += 1


def test_a_full_disk_is_one_line_and_a_retry_on_a_still_full_disk_fails_before_training(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = compose_cfg([*TINY, *SHORT, *text_data(corpus)])
    run_dir = tmp_path / "runs" / "exp" / "default"

    def no_space(obj, f, *args, **kwargs):
        f.write(b"the first bytes of a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)  # the disk fills up at the first checkpoint
    with pytest.raises(DiskFullError) as err:
        train(cfg, run_dir)
    msg = str(err.value)
    assert "\n" not in msg and "step-0000003.ckpt" in msg and "MB free" in msg and "XFAM_RUNS=" in msg
    assert not (tmp_path / "runs" / "exp").exists()  # no checkpoint was written: nothing is left
    monkeypatch.undo()

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=2**20))  # still full
    counter = CountBatches()
    with pytest.raises(DiskFullError, match=r"1\.0 MB free, this run needs about \d+ MB"):
        train(cfg, run_dir, callbacks=[counter])
    assert counter.batches == 0 and not (tmp_path / "runs" / "exp").exists()
