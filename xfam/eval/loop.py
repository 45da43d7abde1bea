"""The evaluation loop over a checkpoint's data (what ``xfam eval`` runs; kNN-LM's loops read batches the same way).

``split_loader`` gives the run's loader of a split, rows in order; ``split_outputs`` runs the model over its
first batches, carrying a memory model's memory from batch to batch as training did; ``evaluate`` reports
a checkpoint's metrics on a split. For an early-exit model (``exit=calm``, ``exit=depth_adaptive``) every
batch also runs at full depth: the report adds the full model's metrics (``{split}/full/...``) and
``{split}/agreement``, the share of scored predictions whose top-1 equals the full model's;
``exit.KEY=VALUE`` words change the policy's inference options (threshold, measure, ...) first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
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
from xfam.model.checkpoint import load_model


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


@dataclass(frozen=True)
class Evaluation:
    """A checkpoint's metrics on a split (``{split}/loss`` ...), the batches scored and their size."""

    metrics: dict[str, float]
    batches: int
    batch_size: int


@torch.no_grad()
def evaluate_split(
    ckpt: str,
    split: str,
    batch_size: int | None = None,
    limit: int | None = None,
    device: str = "cpu",
    overrides: list[str] | None = None,
) -> Evaluation:
    """``ckpt``'s metrics on the first ``limit`` batches of ``split`` (all when None), after applying the
    ``exit.KEY=VALUE`` words in ``overrides``; an early-exit model's full-depth comparison included."""
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
    return Evaluation(metrics, int(sums.get("batches", 0)), batch_size or config["data"]["batch_size"])


def evaluate(
    ckpt: str,
    split: str,
    batch_size: int | None = None,
    limit: int | None = None,
    device: str = "cpu",
    overrides: list[str] | None = None,
) -> dict[str, float]:
    """The metrics of :func:`evaluate_split` (``{split}/loss``, ``{split}/bpb`` ...)."""
    return evaluate_split(ckpt, split, batch_size, limit, device, overrides).metrics
