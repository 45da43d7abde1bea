"""Exact resume of stateful components (reliability): a memory run carries per-layer states across
batches and checkpoints, a Performer run redraws its random features on a step schedule; stopped
and resumed with ``ckpt_path=auto``, both reproduce an uninterrupted run's per-step losses bit for
bit (CPU, fp32). The 2-process DDP counterparts are in test_distributed.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, text_data
from tests.integration.test_train import step_losses, stop_at
from xfam.training.runner import train

RUN = ["trainer.max_steps=16", "callbacks.every_n_steps=4", "trainer.val_check_interval=4", "model.dropout=0.1"]
MEMORY = ["memory=xl", "memory.mem_len=24", "pos=xl", "loader.streams=true"]
COMPRESSIVE = [  # both queues, groups left waiting (rate 3 does not divide the segment length), the loss
    "memory=compressive",
    "memory.mem_len=16",
    "memory.compressed_len=8",
    "memory.rate=3",
    "pos=rope",
    "data.doc_mask=true",
]
PERFORMER = ["attention=performer", "attention.num_features=16", "attention.redraw_every=3", "pos=rope"]


@pytest.mark.parametrize("stateful", [MEMORY, COMPRESSIVE, PERFORMER], ids=["memory", "compressive", "performer"])
def test_stopped_and_resumed_run_equals_the_uninterrupted_one(stateful, corpus: Path, tmp_path: Path) -> None:
    overrides = [*TINY, *text_data(corpus), *RUN, *stateful]
    whole = train(compose_cfg(overrides), tmp_path / "whole")
    stop_at(10, compose_cfg(overrides), tmp_path / "split")  # last checkpoint: step 8
    assert max(step_losses(tmp_path / "split")) == 9
    resumed = train(compose_cfg([*overrides, "ckpt_path=auto"]), tmp_path / "split")
    assert len(step_losses(tmp_path / "whole")) == 16
    assert step_losses(tmp_path / "split") == step_losses(tmp_path / "whole")
    assert resumed["val/loss"] == whole["val/loss"]


def test_the_checkpoint_holds_the_memory_and_resume_uses_it(corpus: Path, tmp_path: Path) -> None:
    """The saved memory is the per-layer state at the checkpoint; a resume that dropped it (a fresh
    memory) would give different losses, so the equality above is a test of restoring it."""
    overrides = [*TINY, *text_data(corpus), *RUN, *MEMORY]
    stop_at(5, compose_cfg(overrides), tmp_path)
    ckpt = torch.load(tmp_path / "checkpoints" / "step-0000004.ckpt", weights_only=False)
    (rank,) = ckpt["xfam_resume"]["ranks"]
    memory = [layer["h"] for layer in rank["memory"]["layers"]]
    assert len(memory) == 2 and all(m.shape == (4, 24, 32) and not m.requires_grad for m in memory)
    assert not torch.equal(memory[0], memory[1])  # one state per layer
    assert ckpt["xfam_resume"]["batches_in_epoch"] == 4
