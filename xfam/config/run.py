"""``RunConfig``: a validated run configuration, typed, as ``xfam.config.validate`` returns it.

Validation derives the model spec, every layer's slot configs, the compatibility selection and the stream
layout anyway; the stages after it (``xfam.training.runner``, the Lightning module, ``build_model``) read
them here instead of deriving them again from the plain dict's keys. The plain dict stays in ``raw``, for
what records the config as written: checkpoints, ``config.yaml``, hyperparameters and loggers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from xfam.config.specs import CallbacksSpec, LoaderSpec, LoggerSpec, OptimSpec, RunSpec
from xfam.config.task import TaskSpec
from xfam.model import compat
from xfam.model.init_from import FinetuneSpec
from xfam.model.spec import ModelSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderStack:
    """The encoder of an encoder-decoder as validation derived it: its spec (``model`` with ``encoder.layers``,
    bidirectional), each layer's attention config and its positional encoding's."""

    spec: ModelSpec
    attention: tuple[dict[str, Any], ...]
    pos: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A valid configuration (built by ``validate`` only). Frozen: no field can be reassigned, and its
    dicts are its own (copied from the validated config, so a later change to that dict changes nothing
    here); the per-layer configs are tuples.

    Attributes:
        raw: the plain, resolved config dict, for checkpoints, the run record and loggers only.
        spec: the ``model`` section.
        attention: each layer's attention config (``xfam.core.schedule.per_layer`` applied: a layer's own
            ``per_head`` groups stay in it, for its mechanism), one per layer.
        memory: each layer's memory config, one per layer.
        pos, exit: the positional encoding's and the exit policy's configs (one for the whole model).
        task_spec: the ``task`` section; ``arch``: the model shape (``model.arch``, ``auto`` resolved).
        encoder: the encoder stack of an encoder-decoder (None otherwise); ``cross``: its decoder's
            cross-attention config, one per layer (empty otherwise).
        selection: the chosen classes and parameters of every slot, as ``xfam.model.compat`` checked them.
        streams: whether batches are contiguous streams (``loader.streams``; ``auto``: when a memory
            needs them), and ``streams_why``, the reason the run logs.
        run, loader, optim, logger, callbacks: the typed plain sections (``xfam.config.specs``).
        finetune: how ``run.init_from`` loads a checkpoint's weights and what trains how (``xfam.model.init_from``).
    """

    raw: dict[str, Any]
    spec: ModelSpec
    attention: tuple[dict[str, Any], ...]
    memory: tuple[dict[str, Any], ...]
    pos: dict[str, Any]
    exit: dict[str, Any]
    task_spec: TaskSpec
    arch: str
    encoder: EncoderStack | None
    cross: tuple[dict[str, Any], ...]
    selection: compat.Selection
    streams: bool
    streams_why: str
    run: RunSpec
    loader: LoaderSpec
    optim: OptimSpec
    logger: LoggerSpec
    callbacks: CallbacksSpec
    finetune: FinetuneSpec

    @property
    def task(self) -> str:
        """What is trained: ``lm``, ``mlm``, ``classify``, ``tag`` or ``seq2seq`` (``xfam.config.task``)."""
        return self.selection.task

    @property
    def causal(self) -> bool:
        """Whether attention is causal (``model.causal``, or from the task when null)."""
        return self.selection.causal
