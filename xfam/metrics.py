"""Evaluation statistics shared by training, ``xfam eval`` and reports.

Batches contribute sums (NLL, target count, bytes, correct predictions), so a metric over many
batches or ranks is exact: bits per byte = summed NLL / (ln 2 * summed bytes of the targets).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def batch_stats(task: str, logits: Tensor, batch: dict[str, Tensor], token_bytes: Tensor | None) -> dict[str, Tensor]:
    """Sums over one batch: ``nll``, ``count``, ``correct`` and, for byte-backed lm data, ``bytes``."""
    logits = logits.float()
    if task == "classify":
        y = batch["label"]
        nll = F.cross_entropy(logits, y, reduction="sum")
        return {
            "nll": nll,
            "count": torch.tensor(float(len(y)), device=y.device),
            "correct": (logits.argmax(-1) == y).sum(),
        }
    labels = batch["labels"]  # [B, S], -100 = no target
    nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    keep = labels != -100
    stats = {"nll": nll, "count": keep.sum().float(), "correct": ((logits.argmax(-1) == labels) & keep).sum()}
    if token_bytes is not None and token_bytes.numel():
        stats["bytes"] = (token_bytes[labels.clamp_min(0)] * keep).sum()
    return stats


def summarize(sums: dict[str, Tensor], task: str, prefix: str) -> dict[str, Tensor]:
    """Epoch metrics from summed statistics (see ``batch_stats``); aux losses are batch means."""
    count = sums["count"].clamp_min(1)
    loss = sums["nll"] / count
    out = {f"{prefix}/loss": loss, f"{prefix}/acc": sums["correct"] / count}
    if task == "lm":
        out[f"{prefix}/ppl"] = torch.exp(loss.clamp(max=50))
        if "bytes" in sums and sums["bytes"] > 0:
            out[f"{prefix}/bpb"] = sums["nll"] / (math.log(2) * sums["bytes"])
    for k, v in sums.items():
        if k.startswith("aux/"):
            out[f"{prefix}/{k[4:]}"] = v / sums["batches"].clamp_min(1)
    return out
