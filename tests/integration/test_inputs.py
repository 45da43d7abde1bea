"""Inputs beyond tokens end to end: a ViT on the digits and a regress model on the time series train a few
steps, checkpoint, load without Lightning with the same outputs (the evaluation of the loaded checkpoint equals
the run's last validation), evaluate with ``xfam eval``'s loop, and generate vectors; text generation refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, run_cli
from xfam.core.errors import ConfigError
from xfam.eval.continuous import generate_continuous
from xfam.eval.generate import generate
from xfam.eval.loop import evaluate
from xfam.model.build import check_checkpoint_data
from xfam.model.checkpoint import load_model
from xfam.training.runner import train

RUNS = {
    "digits": ["data=digits", "data.batch_size=16", "model.patch_size=2", "model.pool=cls", "pos=learned"],
    "timeseries": ["data=timeseries", "data.seq_len=24", "data.batch_size=8", "data.num_train=64", "pos=rope"],
}
SMALL = ["data.num_val=32", "data.num_test=32"]


@pytest.mark.parametrize("name", list(RUNS))
def test_trains_checkpoints_and_loads_with_the_same_outputs(name: str, tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, *RUNS[name], *SMALL])
    metrics = train(cfg, tmp_path)
    assert metrics["step"] == 6
    keys = ("loss", "acc") if name == "digits" else ("loss", "mse", "rmse", "mae")
    for key in keys:
        assert math.isfinite(metrics[f"val/{key}"]) and math.isfinite(metrics[f"test/{key}"]), key
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    model, meta = load_model(ckpt)  # no Lightning, no Hydra
    kind = {"digits": "image", "timeseries": "vectors"}[name]
    assert meta["data_info"]["inputs"]["kind"] == model.inputs["kind"] == kind
    # The loaded model scores the validation batches exactly as the run did at its last step (step 6).
    again = evaluate(str(ckpt), "validation", limit=2)
    assert math.isclose(again["validation/loss"], metrics["val/loss"], rel_tol=1e-5)
    if name == "digits":  # resuming on images of another size is refused like another vocabulary
        bigger = {**meta["data_info"], "inputs": {**meta["data_info"]["inputs"], "height": 16, "width": 16}}
        with pytest.raises(ConfigError, match="inputs"):
            check_checkpoint_data(str(ckpt), meta["config"], bigger, meta)
    if name == "timeseries":
        prefix = torch.randn(2, 8, 2)
        new = generate_continuous(model, prefix, 4)
        assert new.shape == (2, 4, 2)
        assert torch.allclose(new, generate_continuous(model, prefix, 4, cache=False), atol=1e-5)
        with pytest.raises(ConfigError, match="task 'regress'"):
            generate(model, torch.zeros(1, 3, dtype=torch.long), 2)


@pytest.mark.slow  # (three subprocesses: ~40 s on the shared CPU)
def test_train_py_runs_the_time_series_and_the_cli_evaluates_and_refuses_text_generation(tmp_path: Path) -> None:
    env = {"XFAM_RUNS": str(tmp_path)}
    run = run_cli(["train.py", "name=ts", *TINY, *RUNS["timeseries"], *SMALL, "trainer.max_steps=3"], env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (ckpt,) = (tmp_path / "ts").glob("*/checkpoints/last.ckpt")
    res = run_cli(["-m", "xfam.cli", "eval", f"ckpt={ckpt}", "split=test", "limit=1"], env=env)
    assert res.returncode == 0 and "test/rmse" in res.stdout, res.stderr[-2000:]
    res = run_cli(["-m", "xfam.cli", "generate", f"ckpt={ckpt}", "prompt=a", "max_new_tokens=2"], env=env)
    assert res.returncode != 0 and "no text tokenizer" in res.stderr + res.stdout


@pytest.mark.slow  # (a 20-step ViT run and the baseline: ~16 s)
def test_the_vit_digits_experiment_renders_its_report_in_quick_mode(tmp_path: Path) -> None:
    run = run_cli(["scripts/exp_vit_digits.py", "--quick", "--out", str(tmp_path)])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = (tmp_path / "results.md").read_text()
    assert "<!-- experiments:vit_digits:start -->" in report and "| logistic regression | 650 |" in report
    assert (tmp_path / "results_vit_digits.png").stat().st_size > 1000
