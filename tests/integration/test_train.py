"""End-to-end training in-process: every slot option trains, checkpoints carry their provenance,
same seed gives identical losses, and resume is exact."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, text_data
from xfam.core.errors import ConfigError
from xfam.model.checkpoint import load_model
from xfam.training.runner import train


def log_rows(run_dir: Path) -> list[dict[str, str]]:
    """The rows of a run's CSV log: one file, which a resumed run continues (xfam.training.lit.resume_logs)."""
    with open(run_dir / "logs" / "version_0" / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


def step_losses(run_dir: Path) -> dict[int, float]:
    """Per-step training loss of a run (resumed or not); a step logged twice fails."""
    out: dict[int, float] = {}
    for row in log_rows(run_dir):
        if row.get("train/loss"):
            assert int(row["step"]) not in out, f"step {row['step']} logged twice"
            out[int(row["step"])] = float(row["train/loss"])
    return out


def epochs(run_dir: Path) -> set[int]:
    return {int(float(row["epoch"])) for row in log_rows(run_dir) if row.get("epoch")}


@pytest.mark.parametrize("pos", ["none", "sinusoidal", "learned", "rope", "alibi"])
def test_every_pos_trains_and_checkpoints(pos: str, corpus: Path, tmp_path: Path) -> None:
    cfg = compose_cfg([f"pos={pos}", *TINY, *text_data(corpus)])
    metrics = train(cfg, tmp_path)
    assert metrics["step"] == 6
    for key in ("val/loss", "val/bpb", "test/loss", "test/bpb"):
        assert math.isfinite(metrics[key]), key
    assert metrics["val/bpb"] < 8.0  # a byte model starts near log2(257) and must have moved
    for name in ("last.ckpt", "best.ckpt", "step-0000006.ckpt"):
        assert (tmp_path / "checkpoints" / name).is_file(), name
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert json.loads((tmp_path / "metrics.json").read_text())["step"] == 6
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    meta = ckpt["xfam"]
    for key in ("xfam_version", "config_version", "git_commit", "packages", "data_fingerprint", "config"):
        assert key in meta, key
    assert meta["config"]["pos"]["name"] == pos
    assert meta["packages"]["torch"] == torch.__version__
    model, _ = load_model(tmp_path / "checkpoints" / "last.ckpt")  # no Lightning, no Hydra
    assert model.pos.registry_name == pos


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "data=listops",
            "data.num_train=64",
            "data.num_val=16",
            "data.num_test=16",
            "data.min_length=5",
            "data.max_length=40",
            "data.seq_len=41",
            "data.batch_size=8",
            "model.pool=cls",
        ],
        [
            "data=duplication",
            "data.seq_len=32",
            "data.num_train=64",
            "data.num_val=16",
            "data.num_test=16",
            "data.symbols=15",
            "data.batch_size=8",
        ],
        [
            "data=assoc_recall",
            "data.seq_len=32",
            "data.num_pairs=4",
            "data.num_queries=4",
            "data.num_train=64",
            "data.num_val=16",
            "data.num_test=16",
            "data.batch_size=8",
        ],
        [
            "model.norm=rmsnorm",
            "model.ffn=swiglu",
            "model.norm_position=post",
            "model.kv_heads=1",
            "model.tie_embeddings=true",
            "model.dropout=0.1",
            "attention.backend=torch",
            "optim.schedule=linear",
        ],
        ["loader.streams=true", "data.doc_mask=true", "pos=alibi", "trainer.accumulate_grad_batches=2"],
    ],
    ids=["listops", "duplication", "assoc_recall", "options", "streams-docmask-accumulate"],
)
def test_tasks_and_model_options_train(overrides: list[str], corpus: Path, tmp_path: Path) -> None:
    data = [] if overrides[0].startswith("data=") else text_data(corpus)
    cfg = compose_cfg([*TINY, *data, *overrides])
    metrics = train(cfg, tmp_path)
    assert math.isfinite(metrics["val/loss"]) and 0.0 <= metrics["val/acc"] <= 1.0


def test_same_seed_same_losses_and_fresh_start_refused(corpus: Path, tmp_path: Path) -> None:
    overrides = [*TINY, *text_data(corpus), "model.dropout=0.1"]
    train(compose_cfg(overrides), tmp_path / "a")
    train(compose_cfg(overrides), tmp_path / "b")
    assert step_losses(tmp_path / "a") == step_losses(tmp_path / "b")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")}
    with pytest.raises(ConfigError, match="already holds a run.*ckpt_path=auto"):
        train(compose_cfg(overrides), tmp_path / "a")
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")} == before  # nothing changed


class Killed(Exception):
    """Stands for the process being killed."""


class StopAt(L.Callback):
    """Kills training after ``step`` optimizer steps, as a SIGKILL would: the steps up to ``step`` are logged,
    the last checkpoint is the last periodic one, and a resume trains the steps after it again. (A stop that
    Lightning carries out, ``trainer.should_stop``, ends training and writes the final step's checkpoint.)"""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step >= self.step:
            raise Killed(f"killed after step {self.step}")


def stop_at(step: int, cfg: dict, run_dir: Path) -> None:
    """Train ``cfg`` in ``run_dir`` until it is killed after ``step`` steps (``StopAt``)."""
    with pytest.raises(Killed):
        train(cfg, run_dir, callbacks=[StopAt(step)])


def test_resume_is_exact(corpus: Path, tmp_path: Path) -> None:
    # Dropout draws from the RNG, validation runs between checkpoints, and the run crosses an
    # epoch boundary: a resumed run must still reproduce every loss of an uninterrupted one.
    overrides = [
        *TINY,
        *text_data(corpus),
        "model.dropout=0.1",
        "trainer.max_steps=40",
        "callbacks.every_n_steps=4",
        "trainer.val_check_interval=4",
        "data.batch_size=8",
    ]
    train(compose_cfg(overrides), tmp_path / "whole")
    stop_at(22, compose_cfg(overrides), tmp_path / "split")  # last checkpoint: step 20
    assert max(step_losses(tmp_path / "split")) == 21
    train(compose_cfg([*overrides, "ckpt_path=auto"]), tmp_path / "split")
    whole, split = step_losses(tmp_path / "whole"), step_losses(tmp_path / "split")
    assert len(whole) == 40
    assert split == whole
    assert max(epochs(tmp_path / "split")) >= 1  # the resumed part crossed an epoch boundary


def test_resume_into_another_architecture_is_refused(corpus: Path, tmp_path: Path) -> None:
    train(compose_cfg([*TINY, *text_data(corpus)]), tmp_path)
    cfg = compose_cfg([*TINY, *text_data(corpus), "model.dim=64", "ckpt_path=auto"])
    with pytest.raises(ConfigError, match="(?s)different architecture.*model.dim: 32 -> 64"):
        train(cfg, tmp_path)


def test_auto_without_checkpoint_starts_fresh(corpus: Path, tmp_path: Path) -> None:
    metrics = train(compose_cfg([*TINY, *text_data(corpus), "ckpt_path=auto"]), tmp_path / "new")
    assert metrics["step"] == 6


def test_tensorboard_logger_writes_event_files_besides_csv(corpus: Path, tmp_path: Path) -> None:
    train(compose_cfg([*TINY, *text_data(corpus), "logger=tensorboard"]), tmp_path)
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert step_losses(tmp_path)  # CSV metrics are written whatever the logger
