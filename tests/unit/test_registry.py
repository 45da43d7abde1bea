"""The registry: decorator registration and strict, build-free validation of slot configs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pytest

from xfam.attention import ATTENTION
from xfam.core.errors import ConfigError, close_matches
from xfam.core.registry import Component, Range, Registry, check_params, defaults_of
from xfam.pos import POS


class Widget(Component):
    pass


def make_registry() -> Registry[Widget]:
    reg: Registry[Widget] = Registry("widget", Widget)

    @reg.register("sprocket")
    class Sprocket(Widget):
        def __init__(
            self,
            *,
            teeth: Annotated[int, Range(ge=3, le=100)] = 12,
            ratio: float = 1.5,
            mode: Literal["fast", "slow"] = "fast",
            label: str | None = None,
            dim: int,
        ):
            self.teeth, self.ratio, self.mode, self.label, self.dim = teeth, ratio, mode, label, dim

        @classmethod
        def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
            if params["mode"] == "slow" and params["teeth"] > 50:
                return ["mode=slow needs teeth <= 50. Fix: lower widget.teeth."]
            return []

    @reg.register("spring")
    class Spring(Widget):
        def __init__(self, *, stiffness: float, coils: list[int] | None = None):
            self.stiffness, self.coils = stiffness, coils

    @reg.register("sprocket_xl")
    class SprocketXL(Widget):
        def __init__(self) -> None:
            pass

    return reg


CTX = {"dim": 8}


def one_problem(reg: Registry, cfg: dict) -> str:
    problems = reg.check(cfg, CTX)
    assert len(problems) == 1, problems
    return problems[0]


def test_register_and_build_injects_only_named_structural_sizes():
    reg = make_registry()
    assert reg.names() == ["spring", "sprocket", "sprocket_xl"]
    assert "sprocket" in reg and "gear" not in reg
    w = reg.build({"name": "sprocket", "teeth": 20}, dim=8, heads=4)  # heads is not in its signature
    assert (w.teeth, w.ratio, w.dim) == (20, 1.5, 8)
    assert type(w).registry_name == "sprocket"


def test_unknown_name_lists_close_matches_and_every_choice():
    msg = one_problem(make_registry(), {"name": "sprockt"})
    assert msg.startswith("widget: unknown value 'sprockt'")
    assert "Did you mean 'sprocket'" in msg
    assert "Valid choices: spring, sprocket, sprocket_xl" in msg
    assert "Fix:" in msg
    with pytest.raises(ConfigError, match="Did you mean 'sprocket'"):
        make_registry().get("sprockt")


def test_unknown_name_in_a_real_slot():
    (msg,) = ATTENTION.check({"name": "vanila"}, {})
    assert "attention" in msg and "'vanilla'" in msg and "Valid choices:" in msg


def test_unknown_key_lists_close_matches_and_valid_keys():
    msg = one_problem(make_registry(), {"name": "sprocket", "teth": 5})
    assert "unknown key 'teth'" in msg
    assert "Did you mean 'teeth'" in msg
    assert "Valid keys: teeth, ratio, mode, label" in msg  # structural `dim` is not offered
    assert "Fix:" in msg


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("teeth", "many", "must be an integer"),
        ("teeth", True, "must be an integer"),  # a bool is not an int here
        ("teeth", 12.5, "must be an integer"),
        ("ratio", "high", "must be a number"),
        ("mode", "medium", "must be one of 'fast', 'slow'"),
        ("label", 3, "must be a string or must be null"),
    ],
)
def test_wrong_type(key, value, why):
    msg = one_problem(make_registry(), {"name": "sprocket", key: value})
    assert f"widget.{key}={value!r}" in msg and why in msg and "Fix:" in msg


def test_correct_types_pass():
    reg = make_registry()
    assert reg.check({"name": "sprocket", "teeth": 3, "ratio": 2, "mode": "slow", "label": None}, CTX) == []
    assert reg.check({"name": "spring", "stiffness": 1.0, "coils": [1, 2]}, CTX) == []
    assert "every item must be an integer" in one_problem(reg, {"name": "spring", "stiffness": 1, "coils": [1, "x"]})


@pytest.mark.parametrize(("value", "why"), [(2, "must be >= 3"), (101, "must be <= 100")])
def test_out_of_range(value, why):
    assert why in one_problem(make_registry(), {"name": "sprocket", "teeth": value})


def test_real_range_bound():
    (msg,) = ATTENTION.check({"name": "vanilla", "dropout": 1.0}, {})
    assert "attention.dropout=1.0" in msg and "must be < 1" in msg


def test_missing_required():
    msg = one_problem(make_registry(), {"name": "spring"})
    assert "widget.stiffness: missing required value" in msg and "Fix: set widget.stiffness=" in msg
    # a structural size is required too, but the builder injects it
    assert make_registry().check({"name": "sprocket"}, {}) == [
        "widget.dim: missing required value. Fix: set widget.dim=<value>."
    ]


def test_structural_key_in_slot_config_is_refused():
    msg = one_problem(make_registry(), {"name": "sprocket", "dim": 16})
    assert "widget.dim" in msg and "structural" in msg and "model.dim" in msg
    (msg,) = POS.check({"name": "alibi", "heads": 8}, {"heads": 8})
    assert "pos.heads" in msg and "model.heads" in msg


def test_cross_parameter_check_runs_after_the_signature_checks():
    msg = one_problem(make_registry(), {"name": "sprocket", "mode": "slow", "teeth": 60})
    assert msg == "widget (sprocket): mode=slow needs teeth <= 50. Fix: lower widget.teeth."


def test_several_problems_in_one_error():
    reg = make_registry()
    with pytest.raises(ConfigError) as info:
        reg.build({"name": "sprocket", "teeth": 1, "ratio": "x", "colour": "red"}, dim=8)
    err = info.value
    assert len(err.problems) == 3
    text = str(err)
    assert text.startswith("3 configuration problems:")
    assert "must be >= 3" in text and "must be a number" in text and "unknown key 'colour'" in text


def test_non_keyword_only_constructor_is_rejected_at_registration():
    reg = make_registry()
    with pytest.raises(TypeError, match="keyword-only.*'size'"):

        @reg.register("bad")
        class Bad(Widget):
            def __init__(self, size: int = 1):
                pass

    assert "bad" not in reg


def test_registration_rules():
    reg = make_registry()
    with pytest.raises(RuntimeError, match="registered twice"):

        @reg.register("spring")
        class Again(Widget):
            pass

    with pytest.raises(TypeError, match="must subclass Widget"):

        @reg.register("stranger")
        class Stranger:
            pass


def test_defaults_of():
    reg = make_registry()
    assert defaults_of(reg.get("sprocket")) == {"teeth": 12, "ratio": 1.5, "mode": "fast", "label": None}
    assert defaults_of(reg.get("spring")) == {"stiffness": "???", "coils": None}
    assert defaults_of(reg.get("sprocket_xl")) == {}
    assert defaults_of(reg.get("sprocket"), skip=()) == {
        "teeth": 12,
        "ratio": 1.5,
        "mode": "fast",
        "label": None,
        "dim": "???",
    }


def test_check_params_on_a_plain_function():
    def fn(*, lr: Annotated[float, Range(gt=0)], steps: int = 10):
        pass

    assert check_params(fn, {"lr": 0.1}, "optim") == []
    problems = check_params(fn, {"lr": 0, "stepz": 3}, "optim")
    assert any("optim.lr=0: must be > 0" in p for p in problems)
    assert any("unknown key 'stepz'" in p and "'steps'" in p for p in problems)


def test_close_matches():
    assert close_matches("alibi", ["alibi", "rope", "learned"])[0] == "alibi"
    assert "sinusoidal" in close_matches("sinus", ["sinusoidal", "rope"])
    assert close_matches("zzz", ["rope"]) == []
