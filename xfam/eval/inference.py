"""Inference with an exit policy: changing its inference options on a trained model, and comparing
it with the full-depth model it shortens (``xfam eval``, ``xfam generate``, ``xfam calibrate``).

``xfam eval`` also times both passes of every batch after the first (which warms up): ``{split}/seconds`` and
``{split}/full/seconds``, the wall-clock saving ``{split}/wall_saved`` = 1 - seconds / full seconds, and
``{split}/wall_per_layer_saved``, its ratio to the layer applications saved (``compute_saved``): 1 when the
time falls as the layers do. In a whole-sequence pass an exited token's later layers still produce its keys and
values and attend (later tokens read them); only their FFNs are skipped (``xfam.model.propagate``)."""

from __future__ import annotations

import time
from typing import Any

import torch
import yaml
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.eval.forward import forward_batch
from xfam.eval.metrics import add_stats, batch_stats, summarize
from xfam.exit._base import EXIT, EarlyExitPolicy
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.transformer import XfamModel


def set_exit_options(model: XfamModel | EncoderDecoder, config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``exit.KEY=VALUE`` words (e.g. ``exit.threshold=0.8``) to the model's exit policy, after
    validating the changed exit config as training would; returns the config with the new exit section.
    Only options that do not change trained parameters (the policy's ``inference_options``) may change."""
    if not overrides:
        return config
    policy = model.exit
    allowed = policy.inference_options if isinstance(policy, EarlyExitPolicy) else ()
    changes: dict[str, Any] = {}
    for word in overrides:
        key, eq, value = word.partition("=")
        name = key.removeprefix("exit.")
        if not eq or not key.startswith("exit."):
            raise ConfigError(f"{word!r}: expected exit.KEY=VALUE, e.g. exit.threshold=0.8.")
        if name not in allowed:
            valid = ", ".join(f"exit.{n}" for n in allowed) or "none (this policy has no inference options)"
            raise ConfigError(
                f"{key}: not an inference option of exit={config['exit']['name']}; options that change trained "
                f"parameters cannot change after training. Valid: {valid}."
            )
        changes[name] = yaml.safe_load(value)
    exit_cfg = {**config["exit"], **changes}
    ctx = {**model.spec.structural(model.causal), "out_dim": model.head.out_features}
    EXIT.build(exit_cfg, **ctx)  # validates types, ranges and cross-parameter rules (raises ConfigError)
    for name, value in changes.items():
        setattr(policy, name, type(getattr(policy, name))(value))
    return {**config, "exit": exit_cfg}


def compares_full_depth(model: XfamModel | EncoderDecoder) -> bool:
    """Whether the model's exit policy can leave the stack early (so a full-depth comparison means something)."""
    return isinstance(model.exit, EarlyExitPolicy)


@torch.no_grad()
def full_depth_logits(model: XfamModel | EncoderDecoder, batch: dict[str, Tensor]) -> Tensor:
    """The logits of the same model on ``batch`` with every layer run for every token."""
    with model.exit.full_depth():
        return forward_batch(model, batch).logits


def full_depth_stats(
    model: XfamModel | EncoderDecoder,
    batch: dict[str, Tensor],
    task: str,
    token_bytes: Tensor | None,
    early_logits: Tensor,
    early_seconds: float | None = None,
) -> dict[str, Tensor]:
    """One batch's sums for the comparison with full depth: the full model's ``batch_stats`` (keys
    ``full/...``) and the top-1 agreement of ``early_logits`` with it (``agree`` of ``agree_count``). Given the
    wall-clock seconds of the early-exit pass that produced ``early_logits``, the full-depth pass is timed too
    (``seconds``, ``full/seconds``)."""
    device = early_logits.device
    start = clock(device)
    full = full_depth_logits(model, batch)
    full_seconds = clock(device) - start
    stats = {f"full/{k}": v for k, v in batch_stats(task, full, batch, token_bytes).items()}
    keep = batch["labels"] != -100 if task != "classify" else None
    stats["agree"], stats["agree_count"] = agreement(early_logits, full, keep)
    if early_seconds is not None:
        stats["seconds"], stats["full/seconds"] = torch.tensor(early_seconds), torch.tensor(full_seconds)
    return stats


def clock(device: torch.device | str) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has finished (CUDA runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def summarize_full_depth(sums: dict[str, Tensor], task: str, prefix: str) -> dict[str, Tensor]:
    """``{prefix}/full/...`` metrics and ``{prefix}/agreement`` from sums of ``full_depth_stats``."""
    out = summarize({k[5:]: v for k, v in sums.items() if k.startswith("full/")}, task, f"{prefix}/full")
    out[f"{prefix}/agreement"] = sums["agree"] / sums["agree_count"].clamp_min(1)
    if "seconds" in sums and sums["full/seconds"] > 0:  # the timed passes (``xfam eval``)
        out[f"{prefix}/seconds"], out[f"{prefix}/full/seconds"] = sums["seconds"], sums["full/seconds"]
        out[f"{prefix}/wall_saved"] = 1 - sums["seconds"] / sums["full/seconds"]
        if "depth" in sums and sums["layers"] > 0 and sums["depth"] < sums["layers"]:
            layer_saved = 1 - sums["depth"] / sums["layers"]  # (``compute_saved``)
            out[f"{prefix}/wall_per_layer_saved"] = out[f"{prefix}/wall_saved"] / layer_saved
    return out


def agreement(early: Tensor, full: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Summed count of predictions whose argmax equals the full model's, and the count compared
    (``early``/``full`` ``[B, S, V]`` or ``[B, C]``; ``keep`` marks the predictions that count)."""
    same = early.argmax(-1) == full.argmax(-1)
    if keep is None:
        keep = torch.ones_like(same)
    return (same & keep).sum().float(), keep.sum().float()


@torch.no_grad()
def threshold_sweep(
    model: XfamModel | EncoderDecoder,
    batches: list[dict[str, Tensor]],
    task: str,
    thresholds: list[float],
    token_bytes: Tensor | None = None,
) -> dict[str, Any]:
    """Run ``batches`` at full depth and at each threshold of the model's early-exit policy.

    Returns per example (row) the share of its scored predictions whose top-1 differs from the full
    model's, ``risk [n, K]`` (the loss Learn-then-Test bounds), and per threshold the mean ``depth``,
    ``loss`` (NLL per target) and ``bpb`` ``[K]``, plus the full model's ``full_loss`` / ``full_bpb``.
    """
    policy = model.exit
    assert isinstance(policy, EarlyExitPolicy)  # (the caller's model exits early: compares_full_depth)
    before = policy.threshold
    full: list[Tensor] = []
    rows: list[Tensor] = []
    sums: list[dict[str, Tensor]] = []
    for batch in batches:
        full.append(full_depth_logits(model, batch))  # [B, S, V]
    try:
        for threshold in thresholds:
            policy.threshold = float(threshold)
            risk: list[Tensor] = []
            total: dict[str, Tensor] = {}
            for batch, ref in zip(batches, full, strict=True):
                out = forward_batch(model, batch)
                per_token = task != "classify"
                keep = batch["labels"] != -100 if per_token else torch.ones_like(batch["label"], dtype=torch.bool)
                differ = (out.logits.argmax(-1) != ref.argmax(-1)) & keep
                per_row = differ.float().sum(-1) / keep.sum(-1).clamp_min(1) if per_token else differ.float()
                risk.append(per_row[keep.view(keep.shape[0], -1).any(-1)])
                add_stats(total, batch_stats(task, out.logits, batch, token_bytes, out.depth, model.num_layers))
            rows.append(torch.cat(risk))
            sums.append(total)
    finally:
        policy.threshold = before
    full_total: dict[str, Tensor] = {}
    for batch, ref in zip(batches, full, strict=True):
        add_stats(full_total, batch_stats(task, ref, batch, token_bytes))

    def metric(s: dict[str, Tensor]) -> dict[str, Tensor]:
        return summarize(s, task, "m")

    result: dict[str, Any] = {
        "thresholds": list(thresholds),
        "risk": torch.stack(rows, dim=1),  # [n, K]
        "depth": [float(metric(s)["m/depth"]) for s in sums],
        "loss": [float(metric(s)["m/loss"]) for s in sums],
        "full_loss": float(metric(full_total)["m/loss"]),
    }
    if "bytes" in full_total:
        result["bpb"] = [float(metric(s)["m/bpb"]) for s in sums]
        result["full_bpb"] = float(metric(full_total)["m/bpb"])
    return result
