"""``validate`` returns a frozen ``RunConfig``: what it derives, typed, equal to what the stages after it derived
from the plain dict before; ``build_model`` builds the same model from it as from the dict."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import xfam
from tests.integration.helpers import compose_cfg
from xfam.attention import AttentionMechanism
from xfam.config import RunConfig, _slot_problems, resolve_streams, validate
from xfam.config.specs import CallbacksSpec, LoaderSpec, LoggerSpec, OptimSpec, RunSpec
from xfam.core.schedule import per_layer
from xfam.model.spec import ModelSpec

SMALL = ["model.dim=32", "model.layers=3", "model.heads=2", "model.max_len=64", "data.seq_len=32"]
SCHEDULE = "+attention.per_layer={-1: {dropout: 0.1}, 0: {name: local, window: 8}}"
INFO = {"task": "lm", "vocab_size": 257, "num_classes": None}


@pytest.fixture(scope="module")
def xl_cfg() -> dict:
    return compose_cfg([*SMALL, "memory=xl", "pos=none", SCHEDULE])


@pytest.fixture(scope="module")
def plain_cfg() -> dict:
    return compose_cfg([*SMALL, "memory=none", SCHEDULE])


def test_fields_are_what_the_dict_gives(xl_cfg: dict) -> None:
    rc = validate(xl_cfg)
    assert isinstance(rc, RunConfig)
    assert rc.raw == xl_cfg
    spec = ModelSpec(**xl_cfg["model"])
    assert rc.spec == spec
    attention = per_layer(xl_cfg["attention"], spec.layers, "attention")
    assert list(rc.attention) == attention
    assert [a["name"] for a in rc.attention] == ["local", "vanilla", "vanilla"]  # the schedule, per layer
    assert [a.get("dropout") for a in rc.attention][1:] == [xl_cfg["attention"]["dropout"], 0.1]
    assert all("per_layer" not in a for a in rc.attention)
    assert list(rc.memory) == per_layer(xl_cfg["memory"], spec.layers, "memory")
    assert rc.pos == xl_cfg["pos"] and rc.exit == xl_cfg["exit"]
    assert rc.selection == _slot_problems(xl_cfg, spec, True, "lm")[1]
    assert (rc.task, rc.causal) == ("lm", True)
    assert rc.run == RunSpec(**{k: v for k, v in xl_cfg.items() if k in {f.name for f in dataclasses.fields(RunSpec)}})
    assert rc.loader == LoaderSpec(**xl_cfg["loader"])
    assert rc.optim == OptimSpec(**xl_cfg["optim"])
    assert rc.logger == LoggerSpec(**xl_cfg["logger"])
    assert rc.callbacks == CallbacksSpec(**xl_cfg["callbacks"])


def test_streams_decision(xl_cfg: dict, plain_cfg: dict) -> None:
    xl, plain = validate(xl_cfg), validate(plain_cfg)
    assert (xl.streams, xl.streams_why) == resolve_streams(xl_cfg)
    assert xl.streams is True and "memory=xl" in xl.streams_why
    assert (plain.streams, plain.streams_why) == resolve_streams(plain_cfg)
    assert plain.streams is False and xl.selection.streams and not plain.selection.streams


def test_frozen_and_its_own_copy(plain_cfg: dict) -> None:
    cfg = compose_cfg([*SMALL, "memory=none"])
    rc = validate(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.streams = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.spec = ModelSpec()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.spec.dim = 64  # type: ignore[misc]
    assert isinstance(rc.attention, tuple) and isinstance(rc.memory, tuple)
    cfg["model"]["dim"] = 64  # a later change to the validated dict does not reach the RunConfig
    cfg["attention"]["dropout"] = 0.5
    assert rc.raw["model"]["dim"] == 32 and rc.spec.dim == 32
    assert rc.attention[0]["dropout"] != 0.5 and rc.raw["attention"]["dropout"] != 0.5


def test_validate_still_raises_every_problem(plain_cfg: dict) -> None:
    bad = compose_cfg([*SMALL, "model.heads=3", "optim.lr=-1"])
    with pytest.raises(xfam.ConfigError) as err:
        validate(bad)
    assert len(err.value.problems) >= 2


@pytest.mark.parametrize("which", ["xl_cfg", "plain_cfg"])
def test_build_model_from_run_config_equals_from_dict(which: str, request: pytest.FixtureRequest) -> None:
    cfg = request.getfixturevalue(which)
    rc = validate(cfg)
    torch.manual_seed(0)
    from_dict = xfam.build_model(cfg, INFO)
    torch.manual_seed(0)
    from_rc = xfam.build_model(rc, INFO)
    a, b = from_dict.state_dict(), from_rc.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    mechanisms = lambda model: [m.registry_name for m in model.modules() if isinstance(m, AttentionMechanism)]  # noqa: E731
    assert mechanisms(from_rc) == mechanisms(from_dict) == ["local", "vanilla", "vanilla"]
    tokens = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        assert torch.equal(from_dict.eval()(tokens).logits, from_rc.eval()(tokens).logits)


def test_lit_module_records_the_plain_dict(plain_cfg: dict) -> None:
    """The checkpoint's hyperparameters are the plain dict whichever the module was given (its format stays)."""
    from xfam.training.lit.module import XfamLitModule

    rc = validate(plain_cfg)
    torch.manual_seed(0)
    from_rc = XfamLitModule(rc, INFO)
    torch.manual_seed(0)
    from_dict = XfamLitModule(plain_cfg, INFO)
    assert from_rc.config == plain_cfg and type(from_rc.config) is dict
    assert dict(from_rc.hparams) == dict(from_dict.hparams) == {"config": plain_cfg, "data_info": INFO}
    assert from_rc._hparams_name == from_dict._hparams_name == "kwargs"
    assert from_rc.run_config is rc and from_dict.run_config is None
    a, b = from_rc.state_dict(), from_dict.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a) and list(a) == list(b)
