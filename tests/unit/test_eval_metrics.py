"""``batch_stats``' sums: evaluation adds per-token losses in float64, so the same tokens scored in another
grouping (kNN-LM's per-token sums, another batch size) give the same loss; the training objective keeps its
float32 sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xfam.eval.metrics import add_stats, batch_stats, summarize


def test_the_evaluation_sum_is_the_float64_sum_of_the_tokens_losses() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, 300, generator=g) * 4  # [B, S, V]
    labels = torch.randint(0, 300, (4, 50), generator=g)
    labels[1, 30:] = -100  # a padded row
    per_token = -F.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]  # [B, S]
    want = per_token[labels != -100].double().sum()
    got = batch_stats("lm", logits, {"labels": labels}, None)
    assert got["nll"].dtype == torch.float64 and torch.allclose(got["nll"], want, rtol=1e-13, atol=0)
    halves = {}  # the same tokens as two batches of two rows
    for rows in (slice(0, 2), slice(2, 4)):
        add_stats(halves, batch_stats("lm", logits[rows], {"labels": labels[rows]}, None))
    whole = summarize(add_stats({}, got), "lm", "test")["test/loss"]
    assert torch.allclose(summarize(halves, "lm", "test")["test/loss"], whole, rtol=1e-13, atol=0)


def test_the_training_objective_keeps_the_float32_sum() -> None:
    logits, labels = torch.randn(2, 8, 16), torch.randint(0, 16, (2, 8))
    got = batch_stats("lm", logits, {"labels": labels}, None, float64=False)["nll"]
    assert got.dtype == torch.float32
    assert torch.equal(got, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
