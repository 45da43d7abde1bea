"""Exact resume and a checkpoint round trip for one model that combines many block options (docs/blocks.md):
stopped and resumed with ``ckpt_path=auto``, the run reproduces an uninterrupted run's per-step losses bit
for bit (stochastic depth and the forgetful mask draw from the restored RNG), and ``xfam.load_model`` rebuilds
the same model from the file alone."""

from __future__ import annotations

from pathlib import Path

import torch

import xfam
from tests.integration.helpers import TINY, compose_cfg, text_data
from tests.integration.test_train import step_losses, stop_at
from xfam.training.runner import train

RUN = ["trainer.max_steps=12", "callbacks.every_n_steps=4", "trainer.val_check_interval=4", "model.dropout=0.1"]
OPTIONS = [
    "model.norm=rmsnorm",
    "model.norm_position=sandwich",
    "model.residual=layerscale",
    "model.ffn=geglu",
    "model.ffn_post_act_norm=true",
    "model.attn_qk_norm=l2",
    "model.attn_talking_heads=true",
    "model.residual_attn=true",
    "model.value_residual=true",
    "model.attn_gate=true",
    "model.attn_head_scale=true",
    "model.macaron=true",
    "model.shift_tokens=1",
    "model.layer_drop=0.3",
    "model.forgetful_mask=0.2",
    "model.post_emb_norm=true",
    "pos=rope",
    "pos.rotary_heads=1",
]


def test_many_options_resume_bit_for_bit_and_load_from_the_file(corpus: Path, tmp_path: Path) -> None:
    overrides = [*TINY, *text_data(corpus), *RUN, *OPTIONS]
    whole = train(compose_cfg(overrides), tmp_path / "whole")
    stop_at(6, compose_cfg(overrides), tmp_path / "split")  # last checkpoint: step 4
    resumed = train(compose_cfg([*overrides, "ckpt_path=auto"]), tmp_path / "split")
    assert len(step_losses(tmp_path / "whole")) == 12
    assert step_losses(tmp_path / "split") == step_losses(tmp_path / "whole")
    assert resumed["val/loss"] == whole["val/loss"]

    ckpt = sorted((tmp_path / "whole" / "checkpoints").glob("step-*.ckpt"))[-1]
    model, meta = xfam.load_model(ckpt)
    assert meta["config"]["model"]["macaron"] is True and len(model.blocks[0].before) == 1
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    mine = model.state_dict()
    assert {k.removeprefix("model.") for k in state} == set(mine)
    assert all(torch.equal(state[f"model.{k}"], v) for k, v in mine.items())
