"""AdamW with decay/no-decay parameter groups and a warmup + decay learning-rate schedule.

A fine-tuning run (``init_from``, ``xfam.model.init_from``) splits each of the two groups once more, into the
parameters loaded from the checkpoint and the new ones, each with its own learning rate (``finetune.lr_loaded``,
``finetune.lr_new``); the schedule multiplies every group's base learning rate. Frozen parameters
(``finetune.freeze``) are in no group.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from xfam.config.specs import OptimSpec
from xfam.model.init_from import ParamSplit, split_of, split_params

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig

LINEAR_MAPS = (nn.Linear, nn.Conv1d, nn.ConvTranspose1d)


def param_groups(model: nn.Module, spec: OptimSpec, split: ParamSplit | None = None) -> list[dict]:
    """Weight matrices of linear maps decay: ``weight`` of ``nn.Linear`` and the convolutions, and the matrices a
    component names in its ``decay_params`` (Linformer's length projections, Sinkhorn's sorting network, XL's
    W_R). Nothing else does, as in GPT-2/minGPT: biases and bias vectors (XL's u, v), norm gains, per-head
    scalars, relative-position tables (T5, Shaw), persistent memory vectors and, unless ``decay_embeddings``,
    ``nn.Embedding`` tables (tokens, learned positions, memory tokens). Decaying those only shrinks them
    towards zero, which for a table means its rarely-seen rows.

    Two groups, decay and no decay; with a fine-tuning ``split``, four named ones, always in this order and
    each kept even when empty (a resumed run's optimizer state maps onto them): ``loaded``, ``loaded_no_decay``
    (at ``split.lr_loaded``), ``new``, ``new_no_decay`` (at ``split.lr_new``; null: ``spec.lr``)."""
    decay, no_decay = _decay_split(model, spec)
    if split is None:
        return [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
    loaded = {id(p) for p in split_params(model, split.loaded)[0]}
    groups = []
    for part, lr, was_loaded in (("loaded", split.lr_loaded, True), ("new", split.lr_new, False)):
        for suffix, params, wd in (("", decay, spec.weight_decay), ("_no_decay", no_decay, 0.0)):
            group = [p for p in params if (id(p) in loaded) == was_loaded]
            lr = spec.lr if lr is None else lr
            groups.append({"params": group, "weight_decay": wd, "lr": lr, "name": part + suffix})
    return groups


def _decay_split(model: nn.Module, spec: OptimSpec) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trainable parameters (each once), split into those that decay and the others (``param_groups``)."""
    decayed: set[int] = set()
    for m in model.modules():
        names = ("weight",) if isinstance(m, LINEAR_MAPS) else getattr(m, "decay_params", ())
        decayed.update(id(p) for n, p in m.named_parameters(recurse=False) if n in names)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}  # a tied head is a table too
    decayed = decayed | tables if spec.decay_embeddings else decayed - tables
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if id(p) in decayed else no_decay).append(p)
    return decay, no_decay


def lr_factor(step: int, spec: OptimSpec, total_steps: int) -> float:
    """Multiplier of ``spec.lr`` at optimizer step ``step`` (0-based)."""
    if step < spec.warmup_steps:
        return (step + 1) / (spec.warmup_steps + 1)
    if spec.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - spec.warmup_steps) / max(1, total_steps - spec.warmup_steps))
    floor = spec.min_lr_ratio
    if spec.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(
    model: nn.Module, spec: OptimSpec, total_steps: int, fused: bool = False
) -> OptimizerLRSchedulerConfig:
    """What ``LightningModule.configure_optimizers`` returns: AdamW stepped with a per-step schedule. The
    parameter groups are split for fine-tuning when the runner marked ``model`` with a ``ParamSplit``
    (``xfam.model.init_from.mark_split``).

    ``fused`` selects PyTorch's fused AdamW kernel (2.5x faster than the default step on CPU in
    ``scripts/bench_train.py``'s profile); Lightning refuses it with gradient clipping under
    mixed precision, so the module asks for it only at full precision.
    """
    opt = torch.optim.AdamW(
        param_groups(model, spec, split_of(model)),
        lr=spec.lr,
        betas=(spec.betas[0], spec.betas[1]),
        eps=spec.eps,
        fused=fused or None,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, spec, total_steps))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "name": "lr"}}
