"""Fine-tuning end to end: a plain decoder trained for 3 steps starts a ``memory=memorizing`` run (``init_from``),
which logs the table of what it loaded, trains its loaded and new parameters at their own learning rates with
the embeddings frozen, and continues after a stop (``ckpt_path=auto``) with the same optimiser groups."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, text_data
from xfam.training.runner import train

SHORT = ["trainer.max_steps=3", "trainer.val_check_interval=3", "test=false", "callbacks.loss_curve=false"]


def lr_columns(run_dir: Path) -> dict[str, dict[int, float]]:
    with open(run_dir / "logs" / "version_0" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    return {k: {int(r["step"]): float(r[k]) for r in rows if r.get(k)} for k in rows[0] if k.startswith("lr")}


def test_init_from_a_plain_decoder_into_memorizing(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="xfam")  # (as the train.py app logs; train.log gets it too)
    base = [*TINY, *text_data(corpus), *SHORT]
    train(compose_cfg(base), tmp_path / "base")
    ckpt = tmp_path / "base" / "checkpoints" / "last.ckpt"
    finetune = [
        *base,
        "memory=memorizing",
        "memory.store_size=64",
        f"init_from={ckpt}",
        "finetune.freeze=[embed.*]",
        "finetune.lr_loaded=0.0001",
        "finetune.lr_new=0.01",
        "optim.schedule=constant",
    ]
    run = tmp_path / "finetune"
    assert train(compose_cfg([*finetune, "ckpt_path=auto"]), run)["step"] == 3
    log = (run / "train.log").read_text()
    assert f"init_from {ckpt} (step 3): 15 loaded, 4 new, 0 mismatched, 0 dropped" in log
    assert (
        "memories.{0-1}.gate" in log and "finetune.freeze: 1 tensors frozen (8224 of 41192 values): embed.weight" in log
    )
    lrs = lr_columns(run)
    assert set(lrs) == {"lr/loaded", "lr/loaded_no_decay", "lr/new", "lr/new_no_decay"}
    assert lrs["lr/new"][2] == 0.01 and lrs["lr/loaded"][2] == 0.0001  # after the 2 warmup steps
    before = torch.load(ckpt, weights_only=True)["state_dict"]
    after = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert torch.equal(after["model.embed.weight"], before["model.embed.weight"])  # frozen
    assert not torch.equal(after["model.blocks.0.attn.qkv.weight"], before["model.blocks.0.attn.qkv.weight"])
    # A stop and a restart: the run's own checkpoint, with the groups it recorded (AdamW's state maps onto them).
    assert train(compose_cfg([*finetune, "ckpt_path=auto", "trainer.max_steps=5"]), run)["step"] == 5
    assert "not loaded, resuming" in (run / "train.log").read_text()
    assert set(lr_columns(run)["lr/new"]) == {0, 1, 2, 3, 4}
