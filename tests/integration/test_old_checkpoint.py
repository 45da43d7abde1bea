"""A checkpoint written by an earlier version of xfam still loads and resumes bit for bit.

``tests/fixtures/old_checkpoint/`` was written by the code before the core was reorganised
(``tests/fixtures/make_old_checkpoint.py`` says how): a run with dropout and Transformer-XL memory,
checkpointed at step 3 of 6, the losses of all six steps, and the loaded model's logits on a fixed input.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.fixtures.old_checkpoint_run import FIXTURE, OVERRIDES, PROBE, write_corpus
from tests.integration.helpers import compose_cfg
from tests.integration.test_train import step_losses
from xfam import load_model
from xfam.training.runner import train

EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def test_old_checkpoint_loads_to_the_same_model() -> None:
    model, meta = load_model(FIXTURE / "step-0000003.ckpt")
    with torch.no_grad():
        logits = model.eval()(PROBE).logits
    assert torch.equal(logits, torch.load(FIXTURE / "probe_logits.pt"))
    assert meta["config"]["memory"]["name"] == "xl"


def test_old_checkpoint_resumes_bit_for_bit(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    train(compose_cfg([*OVERRIDES(corpus), f"ckpt_path={FIXTURE / 'step-0000003.ckpt'}"]), run_dir)
    losses = step_losses(run_dir)
    assert sorted(losses) == [3, 4, 5]
    assert losses == {s: EXPECTED["losses"][str(s)] for s in (3, 4, 5)}
