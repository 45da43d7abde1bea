"""Image generation end to end: ``python train.py data=pixels attention=local2d`` trains, tests and checkpoints a
model whose layers run 2D local attention; the experiment (scripts/exp_image_gen.py) compares two runs that differ
in their attention only, and its ``--quick`` run renders the report and the samples."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import xfam
from tests.integration.helpers import ROOT, TINY, compose_cfg
from xfam.config import validate
from xfam.training.runner import train

sys.path.insert(0, str(ROOT / "scripts"))
import exp_image_gen as eig  # noqa: E402

PIXELS = ["data=pixels", "data.seq_len=64", "data.width=8", "data.block=[4,4]", "data.max_images=24"]
PIXELS += ["data.batch_size=4", "attention=local2d", "attention.shape=[8,8]", "attention.query_block=[4,4]"]
PIXELS += ["attention.memory=[2,2]", "trainer.max_steps=2", "trainer.val_check_interval=2"]


def test_a_tiny_image_model_trains_and_its_checkpoint_decodes_an_image(tmp_path: Path) -> None:
    metrics = train(compose_cfg([*TINY, *PIXELS]), tmp_path)
    assert math.isfinite(metrics["test/loss"]) and metrics["test/loss"] < math.log(257) + 1
    model, meta = xfam.load_model(tmp_path / "checkpoints" / "last.ckpt")
    assert type(model.blocks[0].attn.mechanism).__name__ == "Local2D" and meta["data_info"]["vocab_size"] == 257
    x = torch.randint(0, 256, (1, 64))
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :1], cache=model.empty_cache())
        steps = [out.logits]
        for t in range(1, 64):
            out = model(x[:, t : t + 1], cache=out.cache)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_the_experiment_runs_differ_only_in_their_attention() -> None:
    local, vanilla = (compose_cfg(r.overrides) for r in eig.make_runs(eig.REAL, ROOT / "runs" / "exp_image_gen"))
    for cfg in (local, vanilla):
        validate(cfg)
    assert local["attention"]["name"] == "local2d" and vanilla["attention"]["name"] == "vanilla"
    rest = lambda cfg: {k: v for k, v in cfg.items() if k != "attention"}  # noqa: E731
    assert rest(local) == rest(vanilla)
    assert local["data"]["seq_len"] >= 32 * 32 and local["attention"]["shape"] == [32, 32]
    assert local["attention"]["query_block"] == local["data"]["block"] == [8, 8]


@pytest.mark.slow
def test_the_quick_run_renders_the_report(tmp_path: Path) -> None:
    results = eig.main(["--quick", "--out", str(tmp_path)])
    body = (tmp_path / "results.md").read_text()
    assert "<!-- experiments:image_gen:start -->" in body and "| local2d |" in body and "| vanilla |" in body
    assert (tmp_path / "results_image_gen.png").stat().st_size > 0
    assert all(r["status"] == "ok" and len(r["samples"]) == 2 for r in results["runs"])
