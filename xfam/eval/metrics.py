"""Evaluation statistics shared by training, ``xfam eval`` and reports.

Batches contribute sums (NLL, target count, bytes, correct predictions), so a metric over many
batches or ranks is exact: bits per byte = summed NLL / (ln 2 * summed bytes of the targets).
With an exit policy that reports per-token depth, the layers used are summed too: ``depth`` is
the mean number of layers (or recurrent steps) per scored token, ``compute_saved`` the share of
the model's layer applications not run, 1 - depth / layers (the exit slot's inference report).
A regression (``regress``) sums squared and absolute errors over every target value: its ``nll`` is
the summed squared error (the training loss is then the mean squared error), ``count`` the values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def batch_stats(
    task: str,
    logits: Tensor,
    batch: dict[str, Tensor],
    token_bytes: Tensor | None,
    depth: Tensor | None = None,
    layers: int | None = None,
    *,
    float64: bool = True,
) -> dict[str, Tensor]:
    """Sums over one batch: ``nll``, ``count``, ``correct``, for byte-backed text ``bytes`` (lm, seq2seq: the bytes
    the target tokens stand for), and with a per-token ``depth [B, S]`` of a ``layers``-deep model, ``depth`` and
    ``layers`` summed over the scored tokens (per-token tasks: tokens with a target; classify: real input
    tokens), with their count ``depth_tokens``. Per-token tasks (lm, seq2seq, mlm, tag) read ``labels [B, S]``
    (-100 = no target), classify ``label [B]``; regress reads ``targets [B, S, F]`` and sums the squared errors of
    the predictions ``logits [B, S, F]`` as ``nll`` and their absolute errors as ``abs_err`` over ``count`` values.
    Decision (``xfam.model.inputs``): discrete actions are ``labels [B, K]`` (as tag), continuous ones ``targets
    [B, K, A]`` (as regress) over the real steps of ``step_mask [B, K]``. Per-token tasks sum the tokens' ``nll``
    in float64 (a metric equal however the tokens are split, e.g. ``xfam knnlm``'s per-token sums); ``float64=False``
    keeps the float32 sum of the training objective (``reduction="sum"``: the losses of earlier runs, bit for bit)."""
    logits = logits.float()
    if "targets" in batch:  # regress; decision with continuous actions (its padded steps out: step_mask)
        err = logits - batch["targets"].float()  # [B, S, F]
        steps = batch.get("step_mask")
        if steps is not None:
            err = err * steps[..., None]
        real = err.numel() if steps is None else steps.sum() * err.shape[-1]
        count = torch.as_tensor(real, dtype=torch.float32, device=err.device)
        stats = {"nll": err.square().sum(), "abs_err": err.abs().sum(), "count": count}
        keep = None
    elif task == "classify":
        y = batch["label"]
        nll = F.cross_entropy(logits, y, reduction="sum")
        stats = {
            "nll": nll,
            "count": torch.tensor(float(len(y)), device=y.device),
            "correct": (logits.argmax(-1) == y).sum(),
        }
        keep = batch.get("key_padding")
    else:
        labels = batch["labels"]  # [B, S], -100 = no target
        flat = (logits.flatten(0, 1), labels.flatten())  # [B*S, V], [B*S]
        if float64:  # (an ignored target adds 0)
            nll = F.cross_entropy(*flat, ignore_index=-100, reduction="none").double().sum()
        else:
            nll = F.cross_entropy(*flat, ignore_index=-100, reduction="sum")
        keep = labels != -100
        stats = {"nll": nll, "count": keep.sum().float(), "correct": ((logits.argmax(-1) == labels) & keep).sum()}
        if task in ("lm", "seq2seq") and token_bytes is not None and token_bytes.numel():
            stats["bytes"] = (token_bytes[labels.clamp_min(0)] * keep).sum()
    if depth is not None and layers:
        w = torch.ones_like(depth, dtype=torch.float) if keep is None else keep.float()  # [B, S]
        stats["depth"] = (depth.float() * w).sum()
        stats["depth_tokens"] = w.sum()
        stats["layers"] = w.sum() * layers
    return stats


def add_stats(sums: dict[str, Tensor], stats: dict[str, Tensor]) -> dict[str, Tensor]:
    """Add one batch's ``batch_stats`` into running float64 ``sums`` (in place; also returned)."""
    for k, v in stats.items():
        sums[k] = sums.get(k, 0) + v.detach().double()
    return sums


def summarize(sums: dict[str, Tensor], task: str, prefix: str) -> dict[str, Tensor]:
    """Epoch metrics from summed statistics (see ``batch_stats``); aux losses are batch means."""
    count = sums["count"].clamp_min(1)
    loss = sums["nll"] / count
    if "abs_err" in sums:  # regress, continuous decision (loss: the mean squared error)
        out = {f"{prefix}/loss": loss, f"{prefix}/mse": loss, f"{prefix}/rmse": loss.sqrt()}
        out[f"{prefix}/mae"] = sums["abs_err"] / count
    else:
        out = {f"{prefix}/loss": loss, f"{prefix}/acc": sums["correct"] / count}
    if task in ("lm", "seq2seq", "mlm"):
        out[f"{prefix}/ppl"] = torch.exp(loss.clamp(max=50))
        if "bytes" in sums and sums["bytes"] > 0:
            out[f"{prefix}/bpb"] = sums["nll"] / (math.log(2) * sums["bytes"])
    if "depth" in sums and sums["layers"] > 0:
        out[f"{prefix}/depth"] = sums["depth"] / sums["depth_tokens"]
        out[f"{prefix}/compute_saved"] = 1 - sums["depth"] / sums["layers"]
    for k, v in sums.items():
        if k.startswith("aux/"):
            out[f"{prefix}/{k[4:]}"] = v / sums["batches"].clamp_min(1)
    return out
