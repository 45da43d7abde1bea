"""The main job's promise, on the embedded corpus: a short run already predicts bytes far better
than the byte-unigram entropy of the same split (a model that ignores context)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.helpers import compose_cfg
from xfam.model.build import build_data
from xfam.training.runner import train


@pytest.mark.slow
def test_main_job_beats_the_unigram_entropy_by_a_wide_margin(tmp_path: Path) -> None:
    overrides = [
        "trainer.max_steps=300",
        "trainer.val_check_interval=300",
        "trainer.limit_val_batches=40",
        "test=false",
        "callbacks.progress_bar=none",
    ]
    cfg = compose_cfg(overrides)
    metrics = train(cfg, tmp_path)
    source = build_data(cfg)
    source.prepare()
    entropy = source.unigram_entropy_bits("validation")
    assert 4.0 < entropy < 5.5  # Python source: about 4.7 bits per byte
    assert metrics["val/bpb"] < entropy - 1.0, (metrics["val/bpb"], entropy)
