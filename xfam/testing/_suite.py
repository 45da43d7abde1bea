"""How ``contract_tests`` turns the contract modules into one pytest class.

A contract module (``xfam/testing/attention.py``, ``pos.py`` ...) holds plain pytest test functions. Each
declares its parameters with ``@each(argnames, values)``, as ``pytest.mark.parametrize`` would, except that
``values`` may be a function of the ``Components`` under test, so the cases are computed per class
(every mask direction a mechanism supports, every backend it has). ``contract_tests`` copies every function
of the slot's parts into a fresh class, applies the parametrisations in decorator order (so the test ids
are those a stack of ``parametrize`` marks gives) and leaves out a contract with no case for the
components (a causal-leak test for a bidirectional-only mechanism). The functions themselves are shared:
xfam's own ``tests/contracts`` build their classes with the same call.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pytest

from xfam.core import plugins
from xfam.core.errors import ConfigError
from xfam.core.registry import Registry
from xfam.testing.doubles import manual_seed

#: The parts (modules of xfam.testing) each slot's class holds, in this order.
SUITES: dict[str, tuple[str, ...]] = {
    "attention": ("attention", "decode", "aux_losses", "backends", "matrix", "yaml_defaults"),
    "pos": ("pos", "backends", "matrix", "yaml_defaults"),
    "memory": ("memory", "yaml_defaults"),
    "exit": ("exit", "yaml_defaults"),
}

Values = Sequence[Any] | Callable[["Components"], Sequence[Any]]
ParameterSet = type(pytest.param())  # what pytest.param returns (pytest does not export the class)


@dataclasses.dataclass(frozen=True)
class Components:
    """What one class tests: registered components of one slot, with the config set on top of their defaults."""

    slot: str
    names: tuple[str, ...]
    params: Mapping[str, Any]

    @property
    def registry(self) -> Registry:
        return registry_of(self.slot)

    def cls(self, name: str) -> type:
        return self.registry.get(name)


def registry_of(slot: str) -> Registry:
    from xfam.config import SLOTS

    return SLOTS[slot]


def each(argnames: str | Sequence[str], values: Values) -> Callable[[Callable], Callable]:
    """``pytest.mark.parametrize(argnames, values)``, with ``values`` computed from the ``Components`` when callable."""

    def deco(fn: Callable) -> Callable:
        fn.__dict__.setdefault("contract_params", []).append((argnames, values))
        return fn

    return deco


def contracts(module: types.ModuleType) -> list[Callable]:
    """The test functions of a contract module, in the order they are defined."""
    fns = [f for n, f in vars(module).items() if n.startswith("test_") and inspect.isfunction(f)]
    return sorted((f for f in fns if f.__module__ == module.__name__), key=lambda f: f.__code__.co_firstlineno)


def resolve(slot: str, component: Any) -> tuple[str, ...]:
    """Registry names of ``component``: a name, a registered class, or a list of them."""
    if slot not in SUITES:
        raise ConfigError(f"contract_tests: unknown slot {slot!r}. Valid slots: {', '.join(SUITES)}.")
    items = [component] if isinstance(component, (str, type)) else list(component)
    if not items:
        raise ConfigError(f"contract_tests({slot!r}, ...): no component given. Fix: pass a name or a class.")
    plugins.load_entry_points()  # an installed plugin's components, registered through its entry point
    registry, names = registry_of(slot), []
    for item in items:
        if inspect.isclass(item):
            name = getattr(item, "registry_name", "")
            if name not in registry or registry.get(name) is not item:
                raise ConfigError(
                    f"contract_tests: {item.__module__}.{item.__qualname__} is not a registered {slot} component. "
                    f'Fix: decorate it with @{slot.upper()}.register("<name>") (from xfam.api) and import its module '
                    "before calling contract_tests."
                )
        elif isinstance(item, str):
            name = item
            if name not in registry:
                raise ConfigError(
                    f"contract_tests: {registry.unknown(name)} If it is yours, import the module that registers it "
                    "(or install the package whose entry point does) before calling contract_tests."
                )
        else:
            raise ConfigError(f"contract_tests: {item!r} is neither a {slot} name nor a class. Fix: pass one.")
        names.append(name)
    return tuple(names)


def _pattern(key: str) -> tuple[str, re.Pattern | None]:
    """``test_name`` or ``test_name[id pattern]`` (``*``: any text) -> (test name, id regex or None)."""
    match = re.fullmatch(r"(test_\w+)(?:\[(.+)\])?", key)
    if match is None:
        raise ConfigError(f"contract_tests: xfail key {key!r} is not 'test_name' or 'test_name[id pattern]'.")
    name, ids = match.groups()
    return name, None if ids is None else re.compile(".*".join(map(re.escape, ids.split("*"))))


def _with_xfails(values: Sequence[Any], xfails: list[tuple[re.Pattern, str, str]], used: set[str]) -> list[Any]:
    out = []
    for value in values:
        for regex, reason, key in xfails:
            if isinstance(value, ParameterSet) and value.id is not None and regex.fullmatch(value.id):
                used.add(key)
                value = pytest.param(*value.values, id=value.id, marks=[*value.marks, _strict_xfail(reason)])
        out.append(value)
    return out


def _strict_xfail(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=reason)


def _instantiate(fn: Callable, comps: Components, xfail: Mapping[str, str], used: set[str]) -> Callable | None:
    """A copy of ``fn`` with its parametrisations for ``comps`` (None when a parametrisation has no case)."""
    test = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    test.__doc__, test.__qualname__, test.__module__ = fn.__doc__, fn.__qualname__, fn.__module__
    keys = [(key, *_pattern(key), reason) for key, reason in xfail.items()]
    ids = [(regex, reason, key) for key, name, regex, reason in keys if name == fn.__name__ and regex is not None]
    for argnames, values in fn.__dict__.get("contract_params", []):
        values = list(values(comps) if callable(values) else values)
        if not values:
            return None
        test = pytest.mark.parametrize(argnames, _with_xfails(values, ids, used))(test)
    for key, name, regex, reason in keys:
        if name == fn.__name__ and regex is None:
            used.add(key)
            test = _strict_xfail(reason)(test)
    return test


def _seed(self: Any) -> None:
    manual_seed(0)  # every contract starts from the same random state, with or without xfam's conftest


def contract_tests(
    slot: str,
    component: str | type | Iterable[str | type],
    *,
    params: Mapping[str, Any] | None = None,
    parts: Iterable[str] | None = None,
    xfail: Mapping[str, str] | None = None,
) -> type:
    """The contract tests of ``slot`` for ``component``, as a pytest class (see ``xfam.testing``)."""
    names = resolve(slot, component)
    chosen = tuple(parts) if parts is not None else SUITES[slot]
    if unknown := [p for p in chosen if p not in SUITES[slot]]:
        valid = ", ".join(SUITES[slot])
        raise ConfigError(f"contract_tests: unknown parts {unknown} for {slot}. Valid parts: {valid}.")
    comps, xfail = Components(slot, names, dict(params or {})), dict(xfail or {})
    # (named as xfam's own conftest fixture, which it replaces in the class: one seeding per test, not two)
    namespace: dict[str, Any] = {"_seed": pytest.fixture(autouse=True)(_seed)}
    used: set[str] = set()
    tests: dict[str, str] = {}
    for part in chosen:
        for fn in contracts(importlib.import_module(f"xfam.testing.{part}")):
            assert fn.__name__ not in tests, f"{fn.__name__} is in both {tests.get(fn.__name__)} and {part}"
            tests[fn.__name__] = part
            if (test := _instantiate(fn, comps, xfail, used)) is not None:
                namespace[fn.__name__] = staticmethod(test)
    if unused := sorted(set(xfail) - used):
        raise ConfigError(
            f"contract_tests: xfail keys {unused} match no test of {slot}={', '.join(names)}. Valid test names: "
            f"{', '.join(tests)} (optionally with [id pattern], * for any text)."
        )
    label = "_".join(names) if len(names) <= 3 else f"{len(names)}_components"
    namespace["__doc__"] = f"The {slot} contracts of xfam.testing for {slot}={', '.join(names)}."
    return type(f"Contracts_{slot}_{label}", (), namespace)
