"""A Decision Transformer run end to end (``experiment=decision``, docs/rl.md): trained on generated CartPole
trajectories with rollouts in every validation, stopped and resumed with ``ckpt_path=auto`` it reproduces an
uninterrupted run's per-step losses and rollout returns exactly; the checkpoint loads alone and acts through
``xfam rollout`` and ``xfam eval``; bad configurations are refused before anything runs."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

import xfam
from tests.integration.helpers import compose_cfg
from tests.integration.test_train import step_losses, stop_at
from xfam.cli.commands import XFAM
from xfam.cli.grammar import parse
from xfam.core.errors import ConfigError
from xfam.training.runner import train

RUN = [
    "experiment=decision",
    "data.episodes=4",
    "data.context=5",
    "data.batch_size=8",
    "model.dim=32",
    "model.layers=2",
    "model.max_len=15",
    "trainer.max_steps=8",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.log_every_n_steps=1",
    "callbacks.every_n_steps=4",
    "callbacks.progress_bar=none",
    "optim.warmup_steps=2",
    "task.rollout_episodes=2",
    "task.rollout_max_steps=15",
    "task.target_returns=[500,100]",
]


def xfam_cli(argv: list[str]) -> Any:
    """``xfam <argv>`` in this process: what the command's function returns."""
    command, args = parse(XFAM, argv)
    module, fn = command.run.split(":")
    return getattr(importlib.import_module(module), fn)(args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict, dict]:
    root = tmp_path_factory.mktemp("decision")
    whole = train(compose_cfg(RUN), root / "whole")
    stop_at(5, compose_cfg(RUN), root / "split")  # last checkpoint: step 4
    resumed = train(compose_cfg([*RUN, "ckpt_path=auto"]), root / "split")
    return root / "whole", root / "split", whole, resumed


def test_a_decision_run_resumes_exactly_rollouts_included(runs) -> None:
    whole_dir, split_dir, whole, resumed = runs
    assert len(step_losses(whole_dir)) == 8 and step_losses(split_dir) == step_losses(whole_dir)
    for key in ("val/loss", "val/acc", "val/return@500", "val/return@100", "val/score", "test/return"):
        assert resumed[key] == whole[key], key


def test_a_decision_run_with_memory_resumes_exactly(tmp_path: Path) -> None:
    """memory=xl over contiguous chunks of the episodes (data.stream): carried across batches, saved with the
    checkpoint, and read segment by segment by the rollouts."""
    run = [*RUN, "memory=xl", "memory.mem_len=15", "data.stream=true", "data.batch_size=4", "model.max_len=30"]
    whole = train(compose_cfg(run), tmp_path / "whole")
    stop_at(5, compose_cfg(run), tmp_path / "split")
    resumed = train(compose_cfg([*run, "ckpt_path=auto"]), tmp_path / "split")
    assert step_losses(tmp_path / "split") == step_losses(tmp_path / "whole")
    assert resumed["val/return@500"] == whole["val/return@500"] and resumed["test/loss"] == whole["test/loss"]
    with pytest.raises(ConfigError, match="data.stream=true"):
        train(compose_cfg([*RUN, "memory=xl"]), tmp_path / "refused")


def test_the_checkpoint_loads_alone_and_acts(runs, capsys) -> None:
    whole_dir = runs[0]
    ckpt = whole_dir / "checkpoints" / "last.ckpt"
    model, meta = xfam.load_model(ckpt)
    assert meta["data_info"]["task"] == "decision" and meta["data_info"]["decision"]["env"] == "cartpole"
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert all(torch.equal(state[f"model.{k}"], v) for k, v in model.state_dict().items())
    rows = xfam_cli(["rollout", f"ckpt={ckpt}", "target_return=500,50", "episodes=2", "max_steps=10"])
    assert [r["target"] for r in rows] == [500.0, 50.0] and all(len(r["returns"]) == 2 for r in rows)
    assert "target       500" in capsys.readouterr().out
    metrics = xfam_cli(["eval", f"ckpt={ckpt}", "split=test", "limit=2"])
    assert {"test/loss", "test/acc", "test/return", "test/score"} <= set(metrics)
    assert metrics["test/return"] == runs[2]["test/return"]  # the run's own test rollouts, same seeds


def test_bad_decision_configurations_are_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        train(compose_cfg([*RUN, "data.env=lunarlander"]), tmp_path / "a")
    assert "cartpole" in str(err.value) and "pendulum" in str(err.value)
    with pytest.raises(ConfigError, match="Fix: exit=calm"):
        train(compose_cfg([*RUN, "exit=depth_adaptive"]), tmp_path / "b")
    with pytest.raises(ConfigError, match="continuous actions"):
        train(compose_cfg([*RUN, "data.env=pendulum", "exit=calm"]), tmp_path / "b")
    with pytest.raises(ConfigError, match="model.causal=false"):
        train(compose_cfg([*RUN, "model.causal=false"]), tmp_path / "c")
    with pytest.raises(ConfigError, match="model.max_len=15"):
        train(compose_cfg([*RUN, "pos=learned", "model.max_len=10"]), tmp_path / "d")
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists()


@pytest.mark.slow  # (8 runs of 20 steps, their rollouts and the report: ~1 min)
def test_the_decision_experiment_renders_its_report_in_quick_mode(tmp_path: Path) -> None:
    from tests.integration.helpers import run_cli

    run = run_cli(["scripts/exp_decision.py", "--quick", "--seeds", "0", "--out", str(tmp_path)], timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = (tmp_path / "results.md").read_text()
    assert "<!-- experiments:decision:start -->" in report and "| %BC |" in report and "Spearman" in report
    assert (tmp_path / "results_decision.png").stat().st_size > 1000
