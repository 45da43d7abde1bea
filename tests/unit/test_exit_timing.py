"""``xfam eval``'s wall-clock report of an early-exit model: both passes timed, the saving beside the layer saving."""

from __future__ import annotations

import pytest
import torch
from doubles import build_model

from xfam.cli.evaluate import wall_clock
from xfam.eval.inference import full_depth_stats, summarize_full_depth
from xfam.eval.metrics import add_stats, batch_stats, summarize


def test_the_timed_passes_give_the_wall_clock_saving_and_its_ratio_to_the_layer_saving():
    model = build_model(exit={"name": "calm", "exit_at": 1}, layers=4, vocab_size=11, pos="rope")
    x = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x}
    sums: dict = {}
    with torch.no_grad():
        out = model(x)
        add_stats(sums, batch_stats("lm", out.logits, batch, None, out.depth, model.num_layers))
        stats = full_depth_stats(model, batch, "lm", None, out.logits, early_seconds=0.5)
        assert "seconds" not in full_depth_stats(model, batch, "lm", None, out.logits)  # (untimed: no keys)
    assert float(stats["seconds"]) == 0.5 and float(stats["full/seconds"]) > 0
    stats["full/seconds"] = torch.tensor(2.0)  # (a known full-depth time)
    add_stats(sums, stats)
    metrics = {
        k: float(v) for k, v in (summarize(sums, "lm", "test") | summarize_full_depth(sums, "lm", "test")).items()
    }
    assert metrics["test/compute_saved"] == pytest.approx(0.75)  # exit_at=1 of 4 layers
    assert metrics["test/wall_saved"] == pytest.approx(0.75)  # 1 - 0.5 / 2
    assert metrics["test/wall_per_layer_saved"] == pytest.approx(1.0)
    line = wall_clock(metrics, "test")
    assert line is not None and "75.0% of the layer applications" in line and "1.00 of the layer saving" in line
    assert wall_clock({"test/loss": 1.0}, "test") is None
