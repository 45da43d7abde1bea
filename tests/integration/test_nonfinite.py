"""trainer.nonfinite: a NaN/Inf step is skipped (counted, parameters untouched) or stops the run with a
debug checkpoint and the first module that produced it."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, run_cli, text_data
from xfam.config import validate
from xfam.core.errors import ConfigError
from xfam.training.lit.nonfinite import NonFiniteError
from xfam.training.runner import train

STEPS = ["trainer.max_steps=8", "trainer.val_check_interval=8"]


class NaNGradient(L.Callback):
    """Puts a NaN into one gradient after the backward pass of the given steps, and records the
    parameters before and after each of those steps."""

    def __init__(self, steps: set[int]):
        self.steps, self.before, self.after = steps, {}, {}

    def on_after_backward(self, trainer, module) -> None:
        if trainer.global_step in self.steps:
            next(p for p in module.parameters() if p.grad is not None).grad.view(-1)[0] = math.nan
            self.before[trainer.global_step] = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1  # the step just taken (or skipped)
        if step in self.steps:
            self.after[step] = [p.detach().clone() for p in module.parameters()]


class NaNWeight(L.Callback):
    """At the start of step ``step``, a NaN in the second block's FFN input layer."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                module.model.blocks[1].ffn.up.weight[0, 0] = math.nan


def test_skip_drops_the_step_counts_it_and_trains_on(corpus: Path, tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, *STEPS, "trainer.nonfinite=skip", *text_data(corpus)])
    nan = NaNGradient({2, 5})
    metrics = train(cfg, tmp_path, callbacks=[nan])
    assert metrics["step"] == 8 and math.isfinite(metrics["val/loss"])
    assert metrics["train/nonfinite_skipped"] == 2  # reported at the end (metrics.json)
    for step in (2, 5):  # the skipped steps left every parameter exactly as it was
        assert all(torch.equal(a, b) for a, b in zip(nan.before[step], nan.after[step], strict=True)), step
    rows = [r for f in tmp_path.glob("logs/*/metrics.csv") for r in csv.DictReader(f.read_text().splitlines())]
    counts = [float(r["train/nonfinite_skipped"]) for r in rows if r.get("train/nonfinite_skipped")]
    assert counts and max(counts) == 2.0
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert any(v.get("skipped") == 2 for v in saved["callbacks"].values())  # the count survives a resume


def test_stop_saves_a_debug_checkpoint_and_names_the_module(corpus: Path, tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, *STEPS, *text_data(corpus)])  # nonfinite=stop is the default
    assert cfg["trainer"]["nonfinite"] == "stop"
    with pytest.raises(NonFiniteError) as err:
        train(cfg, tmp_path, callbacks=[NaNWeight(3)])
    message = str(err.value)
    assert "stopped at step 3" in message and "model.blocks.1.ffn.up" in message and "Fix:" in message
    debug = tmp_path / "checkpoints" / "nonfinite-step-0000003.ckpt"
    assert debug.is_file() and str(debug) in message
    state = torch.load(debug, weights_only=False)["state_dict"]
    assert math.isnan(float(state["model.blocks.1.ffn.up.weight"][0, 0]))  # the state that produced the NaN


def test_a_nan_only_in_the_backward_pass_names_the_parameter(corpus: Path, tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, *STEPS, *text_data(corpus)])
    with pytest.raises(NonFiniteError, match="forward pass is finite; the first parameter with a NaN/Inf gradient"):
        train(cfg, tmp_path, callbacks=[NaNGradient({1})])


def test_an_unknown_policy_is_a_config_error(corpus: Path) -> None:
    cfg = compose_cfg([*TINY, "trainer.nonfinite=ignore", *text_data(corpus)])
    with pytest.raises(ConfigError, match=r"trainer.nonfinite: unknown value 'ignore'.*Valid choices: skip, stop"):
        validate(cfg)


def test_the_command_line_stops_with_one_clear_message(corpus: Path, tmp_path: Path) -> None:
    res = run_cli(["train.py", "name=nf", *TINY, *text_data(corpus), "optim.lr=1e30"], env={"XFAM_RUNS": str(tmp_path)})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "xfam: error: training stopped at step 1: NaN/Inf" in res.stderr
    assert "nonfinite-step-0000001.ckpt" in res.stderr


def test_skip_gives_up_after_max_consecutive_skips(corpus: Path, tmp_path: Path) -> None:
    """Skipping is for rare bad batches: a run whose steps keep failing stops (a sweep then records it as failed)."""
    cfg = compose_cfg([*TINY, *STEPS, "trainer.nonfinite=skip", "trainer.max_nonfinite_skips=3", *text_data(corpus)])
    nan = NaNGradient({1, 2, 4, 5, 6, 7})  # two in a row, a good step, then four in a row
    with pytest.raises(NonFiniteError, match=r"at step 6: 3 consecutive steps .*max_nonfinite_skips=3; 5 skipped"):
        train(cfg, tmp_path, callbacks=[nan])


def test_max_nonfinite_skips_is_validated(corpus: Path) -> None:
    cfg = compose_cfg([*TINY, "trainer.max_nonfinite_skips=0", *text_data(corpus)])
    with pytest.raises(ConfigError, match=r"trainer.max_nonfinite_skips=0: must be an integer >= 1"):
        validate(cfg)


@pytest.mark.slow  # a real process; the in-process give-up is tested above, the exit code for stop below
def test_a_run_that_never_trains_under_skip_exits_non_zero(corpus: Path, tmp_path: Path) -> None:
    args = ["train.py", "name=nf", *TINY, *text_data(corpus), "optim.lr=1e30", "trainer.nonfinite=skip"]
    res = run_cli([*args, "trainer.max_nonfinite_skips=2"], env={"XFAM_RUNS": str(tmp_path)})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "2 consecutive steps had NaN/Inf gradients and were skipped" in res.stderr
