"""The evaluation loop over a checkpoint's data (what ``xfam eval`` runs; kNN-LM's loops read batches the same way).

``split_loader`` gives the run's loader of a split, rows in order; ``split_outputs`` runs the model over its
first batches, carrying a memory model's memory from batch to batch as training did; ``evaluate`` reports
a checkpoint's metrics on a split. For an early-exit model (``exit=calm``, ``exit=depth_adaptive``) every
batch also runs at full depth: the report adds the full model's metrics (``{split}/full/...``) and
``{split}/agreement``, the share of scored predictions whose top-1 equals the full model's;
``exit.KEY=VALUE`` words change the policy's inference options (threshold, measure, ...) first.

Evaluation lengths (``xfam eval seq_len=N mem_len=M``; length extrapolation, Press et al., 2022, "Train
Short, Test Long", arXiv:2108.12409, whose non-overlapping protocol this is: each row of N tokens scored
from the start of the row, plus the memory a memory model carries into it): ``at_lengths`` rebuilds the
checkpoint's data with ``data.seq_len=N`` and sets each layer's memory length in evaluation to M, the
parameter its component calls its length: ``eval_mem_len`` where it has one (XL, SPALM: the evaluation
length, apart from the ``mem_len`` trained with), else ``mem_len`` (compressive: the uncompressed
memory; memorizing: its local cache). A length the model cannot take is refused first
(``xfam.eval.extrapolation.length_problem``: a learned position table has ``model.max_len`` rows).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from rich.progress import Progress
from torch import Tensor
from torch.utils.data import DataLoader

from xfam.config import resolve_streams
from xfam.config.task import TaskSpec
from xfam.core.errors import ConfigError
from xfam.core.logs import log
from xfam.core.registry import defaults_of, signature_params
from xfam.core.schedule import per_layer
from xfam.data.base import Split
from xfam.data.module import XfamDataModule
from xfam.data.tasks import task_collate
from xfam.eval.carry import carried_inputs, next_carry
from xfam.eval.extrapolation import length_problem
from xfam.eval.forward import forward_batch
from xfam.eval.inference import (
    clock,
    compares_full_depth,
    full_depth_stats,
    set_exit_options,
    summarize_full_depth,
)
from xfam.eval.metrics import add_stats, batch_stats, summarize
from xfam.eval.outputs import GeneratedTexts
from xfam.eval.rollout import task_rollouts
from xfam.eval.text_metrics import text_metrics
from xfam.memory import MEMORY
from xfam.model.build import build_data, build_model
from xfam.model.checkpoint_file import load_model_with
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel


def split_loader(
    config: dict[str, Any], info: dict[str, Any], split: str, batch_size: int | None, *, rebuilt: bool = False
) -> tuple[DataLoader, int]:
    """The run's data loader for ``split`` (warning when the data changed since training) and its batch size.

    Rows come in order; for a model with memory, as the contiguous streams its training used
    (``loader.streams``), so the memory can be carried from batch to batch (``split_outputs``).
    ``rebuilt``: the data is the run's at another ``data.seq_len`` (``at_lengths``), whose fingerprint (it
    covers the row length) cannot equal the checkpoint's, so it is not compared."""
    if batch_size is not None:
        config = {**config, "data": {**config["data"], "batch_size": batch_size}}
    source = build_data(config)
    source.prepare()
    if rebuilt:
        log.info("data rebuilt at data.seq_len=%s: its fingerprint is not compared", config["data"].get("seq_len"))
    elif source.fingerprint != info.get("fingerprint"):
        log.warning(
            "the data now differs from the data the checkpoint was trained on (fingerprint %s, checkpoint %s)",
            source.fingerprint,
            info.get("fingerprint"),
        )
    streams, _ = resolve_streams(config)
    arch = ModelSpec(**config["model"]).arch_for(info["task"])
    masking = dataclasses.asdict(TaskSpec(**config.get("task", {})))  # (a run before the task group: defaults)
    collate = task_collate(source, info, arch=arch, masking=masking, seed=config["seed"])
    module = XfamDataModule(source, seed=config["seed"], streams=streams, collate=collate)
    return module._eval_loader(cast(Split, split)), source.batch_size  # (a split name the command checked)


def split_outputs(
    model: XfamModel | EncoderDecoder,
    meta: dict[str, Any],
    split: str,
    batch_size: int | None,
    limit: int | None,
    device: str,
    label: str,
    *,
    rebuilt: bool = False,
    seconds: list[float] | None = None,
) -> Iterator[tuple[dict[str, Tensor], Any]]:
    """``(batch, model output)`` over the first ``limit`` batches of ``split``, with a progress bar; a
    model with memory gets the memory its previous batch wrote (cached evaluation, as in training).
    ``rebuilt``: ``meta["config"]`` holds other lengths than the run's (``split_loader``); ``seconds``: a list
    that gets the wall-clock seconds of each batch's forward pass."""
    loader, size = split_loader(meta["config"], meta["data_info"], split, batch_size, rebuilt=rebuilt)
    total = min(len(loader), limit) if limit else len(loader)
    carry = None
    with Progress(transient=True) as bar:
        task = bar.add_task(f"{label} {split} ({total} batches of {size})", total=total)
        for batch in itertools.islice(loader, total):
            batch, layers, docs = {k: v.to(device) for k, v in batch.items()}, None, None
            if model.uses_memory:
                batch, layers, docs = carried_inputs(model, batch, carry, meta["data_info"].get("eos_id"))
            start = clock(device)
            out = forward_batch(model, batch, memory=layers)
            if seconds is not None:
                seconds.append(clock(device) - start)
            if model.uses_memory:
                assert out.memory is not None  # (a memory model returns its new memory)
                carry = next_carry(out.memory, docs)
            yield batch, out
            bar.advance(task)


@dataclass(frozen=True)
class MemoryLength:
    """One layer's memory length in evaluation: the component, the parameter that sets it (``eval_mem_len``
    or ``mem_len``), the value used and the value in the checkpoint's config."""

    layer: int
    name: str
    key: str
    value: int
    trained: int


@dataclass(frozen=True)
class Evaluation:
    """A checkpoint's metrics on a split (``{split}/loss`` ...), the batches scored and their size, the
    row length used (``seq_len``; None for data without one) and the checkpoint's, and the memory
    length of each layer with memory."""

    metrics: dict[str, float]
    batches: int
    batch_size: int
    seq_len: int | None = None
    trained_seq_len: int | None = None
    memory: tuple[MemoryLength, ...] = ()


def _length_key(name: str) -> str | None:
    """The parameter a memory component calls its evaluation length (None: it keeps no fixed number of states)."""
    params = signature_params(MEMORY.get(name))
    return next((k for k in ("eval_mem_len", "mem_len") if k in params), None)


def _layer_length(cfg: dict[str, Any], key: str) -> int:
    """The length ``key`` sets in one layer's memory config (``eval_mem_len=null`` means ``mem_len``)."""
    full = {**defaults_of(MEMORY.get(cfg["name"])), **cfg}
    return full["mem_len"] if full[key] is None and key == "eval_mem_len" else full[key]


def memory_lengths(config: dict[str, Any], trained: dict[str, Any] | None = None) -> tuple[MemoryLength, ...]:
    """The memory length in evaluation of every layer of ``config`` with a memory that has one (and that of
    ``trained``, the checkpoint's config, for comparison)."""
    if "memory" not in config:
        return ()
    layers = config["model"]["layers"]
    now = per_layer(config["memory"], layers, "memory")
    before = per_layer((trained or config)["memory"], layers, "memory")
    out = []
    for i, (cfg, old) in enumerate(zip(now, before, strict=True)):
        if cfg["name"] != "none" and (key := _length_key(cfg["name"])) is not None:
            out.append(MemoryLength(i, cfg["name"], key, _layer_length(cfg, key), _layer_length(old, key)))
    return tuple(out)


def at_lengths(config: dict[str, Any], seq_len: int | None = None, mem_len: int | None = None) -> dict[str, Any]:
    """``config`` with the data at ``seq_len`` tokens per row and every memory keeping ``mem_len`` states in
    evaluation (module docstring); None keeps the run's. Refuses ``mem_len`` for a model without memory or
    with a memory that has no length."""
    out = dict(config)
    if seq_len is not None:
        if "seq_len" not in config["data"]:
            raise ConfigError(
                f"seq_len={seq_len}: data={config['data'].get('name')} has no data.seq_len to rebuild it with. "
                f"Fix: leave seq_len out."
            )
        out["data"] = {**config["data"], "seq_len": seq_len}
    if mem_len is None:
        return out
    layers = per_layer(config.get("memory", {"name": "none"}), config["model"]["layers"], "memory")
    named = sorted({c["name"] for c in layers if c["name"] != "none"})
    if not named:
        raise ConfigError(
            f"mem_len={mem_len}: this checkpoint has no memory (memory=none), so there is no memory length to "
            f"set. Fix: leave mem_len out (seq_len=N sets the evaluation length)."
        )
    if lacking := [n for n in named if _length_key(n) is None]:
        raise ConfigError(
            f"mem_len={mem_len}: memory={', '.join(lacking)} keeps no fixed number of past states (it has neither "
            f"eval_mem_len nor mem_len), so it has no length to set. Fix: leave mem_len out."
        )
    base = {k: v for k, v in config["memory"].items() if k != "per_layer"}
    schedule = [c if c["name"] == "none" else {**c, _length_key(c["name"]): mem_len} for c in layers]
    out["memory"] = {**base, "per_layer": schedule}  # one full item per layer (xfam.core.schedule's list form)
    return out


@torch.no_grad()
def evaluate_split(
    ckpt: str,
    split: str,
    batch_size: int | None = None,
    limit: int | None = None,
    device: str = "cpu",
    overrides: list[str] | None = None,
    *,
    seq_len: int | None = None,
    mem_len: int | None = None,
) -> Evaluation:
    """``ckpt``'s metrics on the first ``limit`` batches of ``split`` (all when None), after applying the
    ``exit.KEY=VALUE`` words in ``overrides``; an early-exit model's full-depth comparison included.
    ``seq_len`` / ``mem_len``: evaluate with rows of ``seq_len`` tokens and memories of ``mem_len`` states
    (``at_lengths``; None: the run's), refused before any data is read when the model cannot take them."""
    model, meta = load_model_with(ckpt, lambda cfg, info: build_model(at_lengths(cfg, seq_len, mem_len), info), device)
    trained, info = meta["config"], meta["data_info"]
    config = at_lengths(trained, seq_len, mem_len)
    rows = config["data"].get("seq_len")
    if rows is not None and (why := length_problem(model, rows, f"seq_len={rows}")) is not None:
        raise ConfigError(why)
    config = set_exit_options(model, config, overrides or [])
    compare = compares_full_depth(model)
    rebuilt = rows != trained["data"].get("seq_len")
    meta = {**meta, "config": config}
    token_bytes = torch.tensor(info["token_bytes"], device=device) if info.get("token_bytes") else None
    sums: dict[str, Any] = {}  # summed batch statistics (tensors) and the int count of batches
    texts = None
    if info["task"] == "seq2seq":
        texts = GeneratedTexts(info, TaskSpec(**config.get("task", {})), config["data"].get("target_len"))
    seconds: list[float] = []  # each batch's forward pass (an early-exit model's compared with full depth's)
    for batch, out in split_outputs(
        model, meta, split, batch_size, limit, device, "eval", rebuilt=rebuilt, seconds=seconds
    ):
        add_stats(sums, batch_stats(info["task"], out.logits, batch, token_bytes, out.depth, model.num_layers))
        if texts is not None:  # generated outputs, scored as text (BLEU, chrF, exact match)
            texts.add(model, batch)
        if compare:
            timed = seconds[-1] if len(seconds) > 1 else None  # (the first batch warms up)
            add_stats(sums, full_depth_stats(model, batch, info["task"], token_bytes, out.logits, timed))
        sums["batches"] = sums.get("batches", 0) + 1
    metrics = {k: float(v) for k, v in summarize(sums, info["task"], split).items()}
    if compare:
        metrics |= {k: float(v) for k, v in summarize_full_depth(sums, info["task"], split).items()}
    if texts is not None and texts.pairs:
        scores = text_metrics([h for h, _ in texts.pairs], [r for _, r in texts.pairs])
        metrics |= {f"{split}/{k}": v for k, v in scores.items()}
    metrics |= task_rollouts(model, info, TaskSpec(**config.get("task", {})), split, test=split != "validation")
    return Evaluation(
        metrics,
        int(sums.get("batches", 0)),
        batch_size or config["data"]["batch_size"],
        seq_len=rows,
        trained_seq_len=trained["data"].get("seq_len"),
        memory=memory_lengths(config, trained),
    )


def evaluate(
    ckpt: str,
    split: str,
    batch_size: int | None = None,
    limit: int | None = None,
    device: str = "cpu",
    overrides: list[str] | None = None,
    *,
    seq_len: int | None = None,
    mem_len: int | None = None,
) -> dict[str, float]:
    """The metrics of :func:`evaluate_split` (``{split}/loss``, ``{split}/bpb`` ...)."""
    return evaluate_split(ckpt, split, batch_size, limit, device, overrides, seq_len=seq_len, mem_len=mem_len).metrics
