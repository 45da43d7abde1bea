"""xfam.eval.inference: inference options on a trained policy, and the threshold sweep of calibration."""

from __future__ import annotations

import pytest
import torch
from doubles import build_model

from xfam.core.errors import ConfigError
from xfam.eval.inference import agreement, set_exit_options, threshold_sweep

CONFIG = {"exit": {"name": "calm", "threshold": 0.9}}


def batches(n: int = 2, b: int = 3, s: int = 10, v: int = 11) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, v, (b, s + 1), generator=gen)
        labels = ids[:, 1:].clone()
        labels[0, :3] = -100  # a row with some targets ignored
        out.append({"input_ids": ids[:, :-1], "labels": labels})
    return out


def test_set_exit_options_changes_only_inference_options() -> None:
    model = build_model(exit={"name": "calm"}, layers=4, vocab_size=11)
    config = set_exit_options(model, CONFIG, ["exit.threshold=0.5", "exit.measure=saturation"])
    assert model.exit.threshold == 0.5 and model.exit.measure == "saturation"
    assert config["exit"] == {"name": "calm", "threshold": 0.5, "measure": "saturation"}
    with pytest.raises(ConfigError, match="not an inference option.*Valid: exit.measure"):
        set_exit_options(model, CONFIG, ["exit.weighting=uniform"])
    with pytest.raises(ConfigError, match="exit.min_layer"):
        set_exit_options(model, CONFIG, ["exit.min_layer=4"])  # validated like a training config
    assert model.exit.min_layer == 1  # nothing changed by a refused override
    plain = build_model(layers=2)
    with pytest.raises(ConfigError, match="none \\(this policy has no inference options\\)"):
        set_exit_options(plain, {"exit": {"name": "none"}}, ["exit.threshold=0.5"])


def test_threshold_sweep_against_direct_runs() -> None:
    model = build_model(exit={"name": "calm", "measure": "softmax"}, layers=4, vocab_size=11, init_std=0.3)
    data = batches()
    sweep = threshold_sweep(model, data, "lm", [1.01, 0.3, 0.0])
    assert model.exit.threshold == 0.9  # restored
    assert sweep["depth"][0] == 4 and sweep["depth"][2] == 1 and sweep["loss"][0] == sweep["full_loss"]
    assert sweep["risk"].shape == (6, 3) and float(sweep["risk"][:, 0].abs().sum()) == 0.0
    model.exit.threshold = 0.3
    with torch.no_grad():
        rows = []
        for b in data:
            early = model(b["input_ids"]).logits
            with model.exit.full_depth():
                full = model(b["input_ids"]).logits
            keep = b["labels"] != -100
            differ = (early.argmax(-1) != full.argmax(-1)) & keep
            rows.append(differ.sum(-1) / keep.sum(-1))
            same, count = agreement(early, full, keep)
            assert count == keep.sum() and same == (~differ & keep).sum()
    assert torch.allclose(sweep["risk"][:, 1], torch.cat(rows).float())
