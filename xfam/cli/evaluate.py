"""``xfam eval``: a checkpoint's metrics on a split of its data, without Lightning or Hydra.

For an early-exit model (``exit=calm``, ``exit=depth_adaptive``) every batch also runs at full depth:
the report adds the full model's metrics (``{split}/full/...``) and ``{split}/agreement``, the share
of scored predictions whose top-1 equals the full model's; ``exit.KEY=VALUE`` words change the
policy's inference options (threshold, measure, ...) first."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from rich.progress import Progress
from torch import Tensor
from torch.utils.data import DataLoader

from xfam.config import resolve_streams
from xfam.core.logs import log
from xfam.data.module import XfamDataModule
from xfam.eval.carry import carried_inputs, next_carry
from xfam.eval.inference import compares_full_depth, full_depth_stats, set_exit_options, summarize_full_depth
from xfam.eval.metrics import add_stats, batch_stats, summarize
from xfam.model.build import build_data
from xfam.training.lit.checkpoint import load_model


def split_loader(
    config: dict[str, Any], info: dict[str, Any], split: str, batch_size: int | None
) -> tuple[DataLoader, int]:
    """The run's data loader for ``split`` (warning when the data changed since training) and its batch size.

    Rows come in order; for a model with memory, as the contiguous streams its training used
    (``loader.streams``), so the memory can be carried from batch to batch (``split_outputs``)."""
    if batch_size is not None:
        config = {**config, "data": {**config["data"], "batch_size": batch_size}}
    source = build_data(config)
    source.prepare()
    if source.fingerprint != info.get("fingerprint"):
        log.warning(
            "the data now differs from the data the checkpoint was trained on (fingerprint %s, checkpoint %s)",
            source.fingerprint,
            info.get("fingerprint"),
        )
    streams, _ = resolve_streams(config)
    return XfamDataModule(source, seed=config["seed"], streams=streams)._eval_loader(split), source.batch_size


def split_outputs(
    model: torch.nn.Module,
    meta: dict[str, Any],
    split: str,
    batch_size: int | None,
    limit: int | None,
    device: str,
    label: str,
) -> Iterator[tuple[dict[str, Tensor], Any]]:
    """``(batch, model output)`` over the first ``limit`` batches of ``split``, with a progress bar; a
    model with memory gets the memory its previous batch wrote (cached evaluation, as in training)."""
    loader, size = split_loader(meta["config"], meta["data_info"], split, batch_size)
    total = min(len(loader), limit) if limit else len(loader)
    carry = None
    with Progress(transient=True) as bar:
        task = bar.add_task(f"{label} {split} ({total} batches of {size})", total=total)
        for batch in itertools.islice(loader, total):
            batch, layers, docs = {k: v.to(device) for k, v in batch.items()}, None, None
            if model.uses_memory:
                batch, layers, docs = carried_inputs(model, batch, carry, meta["data_info"].get("eos_id"))
            out = model(
                batch["input_ids"], key_padding=batch.get("key_padding"), segments=batch.get("segments"), memory=layers
            )
            if model.uses_memory:
                carry = next_carry(out.memory, docs)
            yield batch, out
            bar.advance(task)


@torch.no_grad()
def evaluate(
    ckpt: str, split: str, batch_size: int | None, limit: int | None, device: str, overrides: list[str] | None = None
) -> dict[str, float]:
    model, meta = load_model(ckpt, device)
    config, info = meta["config"], meta["data_info"]
    config = set_exit_options(model, config, overrides or [])
    compare = compares_full_depth(model)
    meta = {**meta, "config": config}
    token_bytes = torch.tensor(info["token_bytes"], device=device) if info.get("token_bytes") else None
    sums: dict[str, torch.Tensor] = {}
    for batch, out in split_outputs(model, meta, split, batch_size, limit, device, "eval"):
        add_stats(sums, batch_stats(info["task"], out.logits, batch, token_bytes, out.depth, model.num_layers))
        if compare:
            add_stats(sums, full_depth_stats(model, batch, info["task"], token_bytes, out.logits))
        sums["batches"] = sums.get("batches", 0) + 1
    metrics = {k: float(v) for k, v in summarize(sums, info["task"], split).items()}
    if compare:
        metrics |= {k: float(v) for k, v in summarize_full_depth(sums, info["task"], split).items()}
    where = f" with {' '.join(overrides)}" if overrides else ""
    size = batch_size or config["data"]["batch_size"]
    print(f"{ckpt} on {split} ({int(sums.get('batches', 0))} batches of {size}){where}:")
    for k, v in metrics.items():
        print(f"  {k:<24} {v:.4f}")
    return metrics
