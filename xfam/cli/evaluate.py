"""``xfam eval``: a checkpoint's metrics on a split of its data, without Lightning or Hydra.

For an early-exit model (``exit=calm``, ``exit=depth_adaptive``) every batch also runs at full depth:
the report adds the full model's metrics (``{split}/full/...``) and ``{split}/agreement``, the share
of scored predictions whose top-1 equals the full model's; ``exit.KEY=VALUE`` words change the
policy's inference options (threshold, measure, ...) first."""

from __future__ import annotations

from typing import Any

import torch
from rich.progress import Progress
from torch.utils.data import DataLoader

from xfam.build import build_data
from xfam.data.module import XfamDataModule
from xfam.exit.inference import compares_full_depth, full_depth_stats, set_exit_options, summarize_full_depth
from xfam.lit.checkpoint import load_model
from xfam.logs import log
from xfam.metrics import add_stats, batch_stats, summarize


def split_loader(
    config: dict[str, Any], info: dict[str, Any], split: str, batch_size: int | None
) -> tuple[DataLoader, int]:
    """The run's data loader for ``split`` (warning when the data changed since training) and its batch size."""
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
    return XfamDataModule(source, seed=config["seed"])._eval_loader(split), source.batch_size


@torch.no_grad()
def evaluate(
    ckpt: str, split: str, batch_size: int | None, limit: int | None, device: str, overrides: list[str] | None = None
) -> dict[str, float]:
    model, meta = load_model(ckpt, device)
    config, info = meta["config"], meta["data_info"]
    config = set_exit_options(model, config, overrides or [])
    compare = compares_full_depth(model)
    loader, batch_size = split_loader(config, info, split, batch_size)
    token_bytes = torch.tensor(info["token_bytes"], device=device) if info.get("token_bytes") else None
    total = min(len(loader), limit) if limit else len(loader)
    sums: dict[str, torch.Tensor] = {}
    with Progress(transient=True) as bar:
        task = bar.add_task(f"eval {split}", total=total)
        for i, batch in enumerate(loader):
            if i == total:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            inputs = {"key_padding": batch.get("key_padding"), "segments": batch.get("segments")}
            out = model(batch["input_ids"], **inputs)
            add_stats(sums, batch_stats(info["task"], out.logits, batch, token_bytes, out.depth, model.num_layers))
            if compare:
                add_stats(sums, full_depth_stats(model, batch, info["task"], token_bytes, out.logits))
            sums["batches"] = sums.get("batches", 0) + 1
            bar.advance(task)
    metrics = {k: float(v) for k, v in summarize(sums, info["task"], split).items()}
    if compare:
        metrics |= {k: float(v) for k, v in summarize_full_depth(sums, info["task"], split).items()}
    where = f" with {' '.join(overrides)}" if overrides else ""
    print(f"{ckpt} on {split} ({total} batches of {batch_size}){where}:")
    for k, v in metrics.items():
        print(f"  {k:<24} {v:.4f}")
    return metrics
