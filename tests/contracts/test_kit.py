"""The contract test kit itself (``xfam.testing``): what ``contract_tests`` builds for a component, and its errors.

That the classes run, and pass, is every other file here (xfam's own components) and tests/plugin_example (a
package outside ``xfam.``); that nothing of xfam imports the kit is tests/unit/test_layering.py."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import xfam.testing
from xfam.attention import ATTENTION
from xfam.config import SLOTS
from xfam.core.errors import ConfigError
from xfam.testing import SUITES, contract_tests
from xfam.testing._suite import contracts


def ids(cls: type, test: str) -> list[str]:
    """The ids of ``test``'s cases in a class from ``contract_tests``."""
    marks = getattr(cls, test).pytestmark
    values = [m.args[1] for m in marks if m.name == "parametrize"]
    return [v.id for v in values[0]]


def test_the_kit_registers_nothing() -> None:
    """No ``register(`` in its source, and no registered class comes from it (its doubles are plain classes)."""
    for path in Path(xfam.testing.__file__).parent.glob("*.py"):
        calls = [
            n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute) and n.attr == "register"
        ]
        assert not calls, f"{path.name} registers a component"
    for registry in SLOTS.values():
        assert not [n for n, c in registry.items() if c.__module__.startswith("xfam.testing")]


def test_a_class_holds_every_contract_of_the_slot_that_applies() -> None:
    cls = contract_tests("attention", "toy_causal_only")  # causal only, no score bias, no modifier, no backends
    tests = {n for n in vars(cls) if n.startswith("test_")}
    every = {
        fn.__name__ for part in SUITES["attention"] for fn in contracts(importlib.import_module(f"xfam.testing.{part}"))
    }
    left_out = {
        "test_a_score_bias_is_added_after_the_scaling",  # accepts_bias = False
        "test_parity_with_reference_under_a_score_modifier",  # hosts_modifiers = False
        "test_aux_losses_are_summed_over_layers_and_reach_every_layer",  # aux_loss = False
        "test_backend_equals_the_reference_path",  # no backend parameter
    }
    assert tests == every - left_out
    assert ids(cls, "test_deterministic") == ["toy_causal_only-causal"]  # no bidirectional case
    assert inspect.getsource(cls.test_deterministic) == inspect.getsource(xfam.testing.attention.test_deterministic)


def test_params_reach_every_case_and_a_pinned_backend_is_the_only_one() -> None:
    cls = contract_tests("attention", "local", params={"backend": "dense"})
    assert ids(cls, "test_deterministic") == ["local-dense-causal", "local-dense-bidir"]
    values = next(m.args[1] for m in cls.test_deterministic.pytestmark if m.name == "parametrize")
    assert all(v.values[1] == {"backend": "dense"} for v in values)
    assert not hasattr(cls, "test_backend_equals_the_reference_path")


def test_xfail_marks_the_matching_cases_strictly() -> None:
    cls = contract_tests(
        "attention", ATTENTION.get("local"), xfail={"test_deterministic[*-bidir]": "why", "test_no_causal_leak": "x"}
    )
    values = next(m.args[1] for m in cls.test_deterministic.pytestmark if m.name == "parametrize")
    marked = {v.id: [m.kwargs for m in v.marks] for v in values}
    assert marked["local-block-bidir"] == [{"strict": True, "reason": "why"}] and marked["local-block-causal"] == []
    assert any(m.name == "xfail" and m.kwargs["strict"] for m in cls.test_no_causal_leak.pytestmark)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: contract_tests("attn", "vanilla"), "unknown slot 'attn'. Valid slots: attention, pos, memory, exit"),
        (lambda: contract_tests("attention", "gated"), "import the module that registers it"),
        (lambda: contract_tests("attention", type("Gated", (), {})), "is not a registered attention component"),
        (lambda: contract_tests("pos", "rope", parts=["attention"]), "unknown parts ['attention'] for pos"),
        (lambda: contract_tests("pos", "rope", xfail={"test_nothing": "?"}), "match no test of pos=rope"),
        (lambda: contract_tests("pos", "rope", xfail={"test_deterministic_given_a_seed[x*]": "?"}), "match no test"),
        (lambda: contract_tests("pos", "rope", xfail={"deterministic": "?"}), "is not 'test_name'"),
    ],
)
def test_mistakes_are_one_error_naming_the_fix(call, message) -> None:
    with pytest.raises(ConfigError) as err:
        call()
    assert message in str(err.value)
