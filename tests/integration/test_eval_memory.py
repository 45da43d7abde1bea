"""``xfam eval`` and kNN-LM on a model trained with memory carry the memory through the split's
contiguous streams, exactly as the run's own test pass does (cached evaluation)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, text_data
from xfam.eval.knnlm import build_datastore, score
from xfam.eval.loop import evaluate, split_loader
from xfam.eval.metrics import add_stats, batch_stats, summarize
from xfam.model.checkpoint import load_model
from xfam.training.runner import train

MEMORY = ["memory=xl", "pos=xl", "memory.mem_len=32", "data.doc_mask=true"]


@pytest.fixture(scope="module")
def run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny model trained with XL memory on documents marked in packed rows; its final metrics."""
    run_dir = tmp_path_factory.mktemp("xl-run")
    metrics = train(compose_cfg([*TINY, *text_data(corpus), *MEMORY]), run_dir)
    return run_dir / "checkpoints" / "last.ckpt", metrics


def test_xfam_eval_reports_the_runs_own_test_metrics(run: tuple[Path, dict]) -> None:
    ckpt, trained = run
    got = evaluate(str(ckpt), "test", None, 2, "cpu")  # the run tested on 2 batches (TINY)
    for m in ("loss", "bpb", "acc"):
        assert got[f"test/{m}"] == pytest.approx(float(trained[f"test/{m}"]), rel=1e-5), m


def test_without_the_carried_memory_the_metrics_differ(run: tuple[Path, dict]) -> None:
    """The mutation the test above guards against: every batch starting from empty memory."""
    ckpt, _ = run
    model, meta = load_model(ckpt)
    loader, _ = split_loader(meta["config"], meta["data_info"], "test", None)
    sums: dict = {}
    with torch.no_grad():
        for batch in list(loader)[:2]:
            out = model(batch["input_ids"], segments=batch["segments"], memory=model.init_memory(4, "cpu"))
            add_stats(sums, batch_stats("lm", out.logits, batch, None, None, model.num_layers))
    fresh = float(summarize(sums, "lm", "test")["test/loss"])
    assert fresh != pytest.approx(evaluate(str(ckpt), "test", None, 2, "cpu")["test/loss"], rel=1e-5)


def test_knnlm_over_a_memory_model_at_lambda_zero_is_the_base_model(run: tuple[Path, dict], tmp_path: Path) -> None:
    ckpt, _ = run
    store = build_datastore(ckpt, "train", tmp_path / "store", limit=6)
    base = evaluate(str(ckpt), "test", None, 2, "cpu")
    scorer, _ = score(ckpt, store, "test", ks=(8,), lambdas=(0.0,), limit=2)
    metrics = scorer.metrics("test")
    assert metrics["base"]["test/loss"] == pytest.approx(base["test/loss"], rel=1e-6)
    assert metrics[(8, 0.0)]["test/loss"] == metrics["base"]["test/loss"]
    # On the store's own split each token's own entry is excluded: the rows line up with the streams
    # (a misaligned order is refused), as long as the batches are the datastore's.
    _, about = score(ckpt, store, "train", ks=(8,), lambdas=(0.5,), limit=3)
    assert about["exclude_self"]
