"""``xfam eval``: a checkpoint's metrics on a split of its data, without Lightning or Hydra."""

from __future__ import annotations

import torch
from rich.progress import Progress

from xfam.build import build_data
from xfam.data.module import XfamDataModule
from xfam.lit.checkpoint import load_model
from xfam.logs import log
from xfam.metrics import batch_stats, summarize


@torch.no_grad()
def evaluate(ckpt: str, split: str, batch_size: int | None, limit: int | None, device: str) -> dict[str, float]:
    model, meta = load_model(ckpt, device)
    config, info = meta["config"], meta["data_info"]
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
    loader = XfamDataModule(source, seed=config["seed"])._eval_loader(split)
    token_bytes = torch.tensor(info["token_bytes"], device=device) if info.get("token_bytes") else None
    total = min(len(loader), limit) if limit else len(loader)
    sums: dict[str, torch.Tensor] = {}
    with Progress(transient=True) as bar:
        task = bar.add_task(f"eval {split}", total=total)
        for i, batch in enumerate(loader):
            if i == total:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(batch["input_ids"], key_padding=batch.get("key_padding"), segments=batch.get("segments"))
            stats = batch_stats(info["task"], out.logits, batch, token_bytes, out.depth, model.num_layers)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0) + v.double()
            sums["batches"] = sums.get("batches", 0) + 1
            bar.advance(task)
    metrics = {k: float(v) for k, v in summarize(sums, info["task"], split).items()}
    print(f"{ckpt} on {split} ({total} batches of {source.batch_size}):")
    for k, v in metrics.items():
        print(f"  {k:<20} {v:.4f}")
    return metrics
