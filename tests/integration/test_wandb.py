"""Weights & Biases without a network: offline chosen automatically, the run id kept for resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.helpers import TINY, compose_cfg, text_data
from xfam.config.specs import LoggerSpec
from xfam.training.lit.trainer import wandb_mode
from xfam.training.runner import train


def test_auto_mode_is_offline_without_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert wandb_mode(LoggerSpec(name="wandb"))[0] == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(LoggerSpec(name="wandb"))[0] == "online"
    assert wandb_mode(LoggerSpec(name="wandb", mode="disabled"))[0] == "disabled"


def test_wandb_run_is_offline_and_resumes_the_same_id(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    overrides = ["logger=wandb", *TINY, *text_data(corpus)]
    train(compose_cfg(overrides), tmp_path / "run")
    run_id = (tmp_path / "run" / "wandb_id.txt").read_text()
    offline = list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline, "an offline wandb run with the stored id"
    train(compose_cfg([*overrides, "ckpt_path=auto", "trainer.max_steps=8"]), tmp_path / "run")
    assert (tmp_path / "run" / "wandb_id.txt").read_text() == run_id
    assert len(list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
