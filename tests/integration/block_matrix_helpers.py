"""Helpers for tests/integration/test_block_matrix.py: the block option x slot matrix, run through the path
training takes (a composed config, ``xfam.validate``, ``xfam.build_model(run_config, info)``).

Sizes: dim 32, 2 layers, 4 heads, ``SEQ`` = 16 tokens (= ``model.max_len``, so fixed-length mechanisms fit);
a mechanism's settings for such short sequences are its own ``exact_params(SEQ)`` (its degenerate limit),
as in tests/contracts/test_attention_pos_matrix.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from doubles import decode_logits, xfam_components

import xfam
import xfam.model.build
from tests.integration.helpers import compose_cfg
from xfam.attention import ATTENTION
from xfam.config.run import RunConfig
from xfam.core.errors import ConfigError
from xfam.core.registry import Registry, defaults_of
from xfam.exit import EXIT
from xfam.exit._base import target_nll
from xfam.memory import MEMORY
from xfam.model import block_compat
from xfam.model.block import Block
from xfam.model.transformer import XfamModel
from xfam.pos import POS
from xfam.testing.doubles import assert_gradients

SEQ = 16
VOCAB, CLASSES = 13, 3
MODEL = ["model.dim=32", "model.layers=2", "model.heads=4", f"model.max_len={SEQ}"]
#: data overrides per kind of run: a causal LM, a bidirectional classifier, contiguous streams (memory)
DATA = {
    "lm": ["data=duplication", f"data.seq_len={SEQ}"],
    "classify": ["data=listops", f"data.seq_len={SEQ}", "data.min_length=5", f"data.max_length={SEQ}"],
    "streams": ["data=repeat_segments", f"data.seq_len={SEQ}", "loader.streams=auto"],
}
#: the matrix's columns besides the attention mechanisms (``xfam.model.compat.block_matrix``)
SLOT_COLUMNS = ["memory", *(f"exit={n}" for n in xfam_components(EXIT) if n != "none"), "reversible"]


@functools.cache
def _composed(kind: str) -> dict:
    """``python train.py <data of kind> <tiny model>`` as a plain config (composed once per kind)."""
    return compose_cfg([*DATA[kind], *MODEL])


def task_of(attention: str) -> str:
    """Causal LM where the mechanism can be causal, else a bidirectional classifier."""
    return "lm" if ATTENTION.get(attention).causal else "classify"


def config(option: str | None, column: str = "vanilla", pos: str | None = None) -> dict:
    """The composed config of block option ``option`` (a row of ``block_compat.OPTIONS``; None: the plain block)
    with the matrix column ``column`` (an attention mechanism, ``memory``, ``exit=<policy>`` or ``reversible``;
    the others at their defaults: attention=vanilla, pos=rope, memory=none, exit=none)."""
    attention = column if column in ATTENTION.names() else "vanilla"
    cfg = copy.deepcopy(_composed("streams" if column == "memory" else task_of(attention)))
    cls = ATTENTION.get(attention)
    cfg["attention"] = {"name": attention, **defaults_of(cls), **cls.exact_params(SEQ)}
    if pos is not None:
        cfg["pos"] = {"name": pos, **defaults_of(POS.get(pos))}
    if column == "memory":
        cfg["memory"] = {"name": "xl", **defaults_of(MEMORY.get("xl")), "mem_len": SEQ}
    if column.startswith("exit="):
        name = column.split("=", 1)[1]
        cfg["exit"] = {"name": name, **defaults_of(EXIT.get(name))}
    if column == "reversible":
        cfg["model"]["reversible"] = True
    if option is not None:
        override = block_compat.OPTIONS[option].override
        cfg["model"].update(override)
        if "layer_order" in override:  # (its string has one 'a' per layer)
            cfg["model"]["layers"] = override["layer_order"].count("a")
    return cfg


@contextlib.contextmanager
def nothing_built() -> Iterator[None]:
    """Fail the test if a model, a block or any registered component is constructed inside the block."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("something was built while the configuration was being validated")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(xfam.model.build, "build_model", refuse)
        mp.setattr(XfamModel, "__init__", refuse)
        mp.setattr(Block, "__init__", refuse)
        mp.setattr(Registry, "build", refuse)
        yield


def validate(cfg: dict) -> RunConfig | list[str]:
    """``xfam.validate(cfg)``'s RunConfig, or the problems of its ConfigError; nothing may be built meanwhile."""
    with nothing_built():
        try:
            return xfam.validate(cfg)
        except ConfigError as err:
            return err.problems


def build(run: RunConfig, seed: int = 0) -> XfamModel:
    """The model training builds from a validated config (``xfam.build_model(run_config, data_info)``)."""
    torch.manual_seed(seed)
    task = run.selection.task
    model = xfam.build_model(run, {"task": task, "vocab_size": VOCAB, "num_classes": CLASSES})
    assert isinstance(model, XfamModel)
    return model


def batch(task: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(tokens [2, SEQ], key_padding or None, targets)``: next-token ids (-100 at the end) for an LM, class
    labels ``[2]`` with a padded second row for a classifier."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    if task == "lm":
        return tokens, None, torch.cat((tokens[:, 1:], torch.full((2, 1), -100)), dim=1)
    pad = torch.ones(2, SEQ, dtype=torch.bool)
    pad[1, -5:] = False
    return tokens, pad, torch.tensor([0, 2])


def loss_of(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """The training loss: the mean target NLL plus every auxiliary loss (``xfam.training.lit.module``)."""
    assert torch.isfinite(out.logits).all(), "non-finite logits"
    nll, keep = target_nll(out.logits, targets)
    loss = nll.sum() / keep.sum()
    for name, value in out.aux.items():
        assert torch.isfinite(value).all(), f"aux loss {name} is not finite"
        loss = loss + value
    assert torch.isfinite(loss), "non-finite loss"
    return loss


def train_step(run: RunConfig) -> XfamModel:
    """Build ``run``'s model, run one training forward and backward (with the exit policy's targets; two
    segments of a stream through the memory), check the loss and the gradients; the model comes back."""
    model = build(run).train()
    task = run.selection.task
    tokens, pad, targets = batch(task)
    if run.selection.has_memory:
        later, _, later_targets = batch(task, seed=2)
        first = model(tokens, memory=model.init_memory(2, tokens.device), targets=targets)
        out = model(later, memory=first.memory, targets=later_targets)
        targets = later_targets
        assert out.memory is not None and len(out.memory) == run.spec.layers
    else:
        out = model(tokens, key_padding=pad, targets=targets)
    expected = (2, SEQ, VOCAB) if task == "lm" else (2, CLASSES)
    assert out.logits.shape == expected
    loss_of(out, targets).backward()
    assert_gradients(model)
    return model


def assert_causal(model: XfamModel, at: int = 9) -> None:
    """In evaluation, changing token ``at`` changes no earlier output (and does change output ``at``)."""
    model.eval()
    x, _, _ = batch("lm", seed=3)
    y = x.clone()
    y[:, at] = (y[:, at] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    assert torch.allclose(a[:, :at], b[:, :at], atol=1e-5), "a later token changed an earlier output"
    assert not torch.allclose(a[:, at], b[:, at], atol=1e-6), "the changed token changed nothing"


def assert_decode_equals_recompute(model: XfamModel, prompt: int = 5, step: int = 1) -> None:
    """Decoding with the cache (``prompt`` tokens, then ``step`` per call) gives the full pass's logits."""
    model.eval()
    x, _, _ = batch("lm", seed=4)
    with torch.no_grad():
        full, decoded = model(x).logits, decode_logits(model, x, prompt, step)
    err = (decoded - full).abs().max().item()
    assert err < 1e-5, f"decoding differs from the full pass by {err:.2e}"


def option_names(option: str) -> list[str]:
    """The config keys that turn ``option`` on, as a refusal must name them: ``model.<field>``."""
    return [f"model.{k}" for k in block_compat.OPTIONS[option].override]


def column_names(column: str) -> list[str]:
    """What a refusal must name of the column: the mechanism, the memory, the exit policy or reversible."""
    if column in ATTENTION.names():
        return [f"attention={column}"]
    if column == "memory":
        return ["memory"]
    if column == "reversible":
        return ["model.reversible"]
    return [column]  # exit=<policy>
