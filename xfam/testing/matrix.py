"""The attention x pos matrix: a component paired with every one of xfam's own components of the other slot
(an attention with every ``pos``, a positional encoding with every ``attention``), in a causal language model
and in a bidirectional classifier.

The full composed configuration goes through ``xfam.config.validate`` (the check ``train.py`` runs). Either it
is refused, and every refusal names the component at fault and the alternatives or the fix, consistently with
``xfam.model.compat.matrix()``; or it is accepted, and a tiny model built from it runs forward and backward with
finite outputs and a finite, non-zero gradient on every trainable parameter.

Sequences are ``SEQ`` tokens (= ``model.max_len``, so fixed-length mechanisms fit). A mechanism's settings for
such short sequences come from the mechanism itself: its ``exact_params(SEQ)`` (the degenerate limit: a window or
block covering the sequence, one bucket ...) over its defaults, never from a table in this test.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from xfam.attention import ATTENTION
from xfam.config import _slot_problems, validate
from xfam.core.errors import ConfigError
from xfam.core.registry import defaults_of
from xfam.model import compat
from xfam.model.build import build_model
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel
from xfam.pos import POS
from xfam.testing._suite import each
from xfam.testing.doubles import assert_gradients, manual_seed, own_components

SEQ = 16
VOCAB, CLASSES = 13, 3
#: task -> (causal, data overrides: a synthetic source of that task at length SEQ)
TASKS = {
    "lm": (True, ["data=duplication", f"data.seq_len={SEQ}"]),
    "classify": (False, ["data=listops", f"data.seq_len={SEQ}", "data.min_length=5", f"data.max_length={SEQ}"]),
}
MODEL = ["model.dim=32", "model.layers=2", "model.heads=4", f"model.max_len={SEQ}"]


def pair_cases(comps) -> list:
    """``(attention, pos, task, params)``: the components of the class against xfam's own of the other slot."""
    if comps.slot == "attention":
        pairs = [(a, p) for a in comps.names for p in own_components(POS)]
    else:
        pairs = [(a, p) for a in own_components(ATTENTION) for p in comps.names]
    params = {comps.slot: dict(comps.params)}
    return [pytest.param(a, p, t, params, id=f"{a}-{p}-{t}") for a, p in pairs for t in TASKS]


@functools.cache
def composed(task: str) -> dict:
    """``python train.py <task data> <tiny model>`` as a plain config (composed once per task)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from xfam.training.run_names import CONFIG_DIR, register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*TASKS[task][1], *MODEL])
    GlobalHydra.instance().clear()
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    return plain


def config(attention: str, pos: str, task: str, params: dict | None = None) -> dict:
    """The composed config of ``attention=<attention> pos=<pos>``: each slot holds its signature defaults, the
    attention with its own settings for ``SEQ``-token sequences on top, then the ``params`` of each slot."""
    params = params or {}
    cfg = copy.deepcopy(composed(task))
    att_cls, pos_cls = ATTENTION.get(attention), POS.get(pos)
    cfg["attention"] = {"name": attention, **defaults_of(att_cls), **att_cls.exact_params(SEQ)}
    cfg["attention"].update(params.get("attention", {}))
    cfg["pos"] = {"name": pos, **defaults_of(pos_cls), **params.get("pos", {})}
    return cfg


def refusal(cfg: dict) -> list[str] | None:
    """The problems ``validate`` reports, or None when the configuration is accepted."""
    try:
        validate(cfg)
    except ConfigError as err:
        return err.problems
    return None


@each(("attention", "pos", "task", "params"), pair_cases)
def test_pair_builds_and_trains_or_is_refused_with_reason(attention, pos, task, params):
    causal = TASKS[task][0]
    cfg = config(attention, pos, task, params)
    problems = refusal(cfg)
    att_cls = ATTENTION.get(attention)
    pair_reason = compat.matrix()[(attention, pos)]  # None: attention and pos combine
    direction_ok = att_cls.causal if causal else att_cls.bidirectional
    if problems is None:
        assert pair_reason is None and direction_ok, "compat.matrix() or the capabilities predict a refusal"
        run_forward_backward(cfg, task)
        return
    for msg in problems:  # each names what is at fault and what would work instead
        assert f"attention={attention}" in msg or f"pos={pos}" in msg, msg
        assert "Alternatives:" in msg or "Fix:" in msg, msg
    explained = []
    if pair_reason is not None:  # the matrix's reason is one of the refusals
        explained += [m for m in problems if m.startswith(pair_reason)]
        assert explained, f"compat.matrix() says {pair_reason!r}, validate says {problems}"
    if not direction_ok:
        explained += [m for m in problems if ("cannot be causal" if causal else "causal-only") in m]
        assert explained, f"attention={attention} does not support this direction, validate says {problems}"
    # What the matrix and the direction do not explain is a component's own documented refusal.
    own = [m for m in problems if m not in explained]
    if own:
        sel = selection_of(cfg, causal, task)
        documented = set(att_cls.refusals(cfg["attention"], sel)) | set(POS.get(pos).refusals(cfg["pos"], sel))
        assert set(own) <= documented, f"unexplained refusals: {sorted(set(own) - documented)}"


def selection_of(cfg: dict, causal: bool, task: str) -> compat.Selection:
    """The selection ``validate`` hands to ``compat.check`` for this configuration."""
    problems, sel = _slot_problems(cfg, ModelSpec(**cfg["model"]), causal, task)
    assert not problems and sel is not None, problems
    return sel


def run_forward_backward(cfg: dict, task: str) -> None:
    manual_seed(0)
    model = build_model(cfg, {"task": task, "vocab_size": VOCAB, "num_classes": CLASSES}).train()
    assert isinstance(model, XfamModel)  # (a decoder or an encoder: no encoder-decoder here)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    if task == "lm":
        out = model(tokens)
        assert out.logits.shape == (2, SEQ, VOCAB)
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    else:
        pad = torch.ones(2, SEQ, dtype=torch.bool)
        pad[1, -5:] = False  # a padded row, as a classification batch has
        out = model(tokens, key_padding=pad)
        assert out.logits.shape == (2, CLASSES)
        loss = F.cross_entropy(out.logits, torch.tensor([0, 2]))
    assert torch.isfinite(out.logits).all()
    for name, value in out.aux.items():
        assert torch.isfinite(value).all(), name
        loss = loss + value
    loss.backward()
    assert_gradients(model, nonzero=True)
