"""The generic component registry (one per slot) and signature-driven validation.

A component registers itself with ``@REGISTRY.register("name")`` on its class; the name equals its
YAML file name. Its constructor is keyword-only and annotated, and the signature is the only place
its defaults live (the YAML mirrors them and a test keeps the two equal). Structural sizes
(``dim``, ``heads``, ``max_len``, ``causal`` ...) are injected by the model builder: a component
asks for one by naming it in its signature, and a slot YAML may not set it.

Validation reads the signature and never constructs anything, so a whole configuration can be
checked before any tensor is allocated; ``Range`` in an ``Annotated`` hint states a bound.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from xfam.core.errors import ConfigError, close_matches, unknown_choice
from xfam.core.plugins import DuplicateComponent, is_builtin

T = TypeVar("T", bound="Component")

#: What the model builder injects; a component receives the ones its signature names (``out_dim``:
#: the head's output size, vocabulary or classes, for exit policies with their own classifiers). ``shared``
#: is one dict per model, for components that share modules across layers (Linformer's
#: layer-wise projections). ``long_term``: the store a memory asks for (``Memory.needs_store``), opened by
#: the model builder (``xfam.core.store``).
STRUCTURAL = (
    "dim",
    "heads",
    "kv_heads",
    "head_dim",
    "max_len",
    "causal",
    "num_layers",
    "layer",
    "vocab_size",
    "out_dim",
    "shared",
    "long_term",
)
#: Keys of a slot config that are not constructor parameters (see ``xfam.core.schedule``).
RESERVED = ("name", "per_layer", "per_head")


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric bound for ``Annotated[int, Range(ge=1)]``; ``None`` means unbounded."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def violation(self, value: float) -> str | None:
        for bound, op, ok in (
            (self.ge, ">=", lambda b: value >= b),
            (self.gt, ">", lambda b: value > b),
            (self.le, "<=", lambda b: value <= b),
            (self.lt, "<", lambda b: value < b),
        ):
            if bound is not None and not ok(bound):
                return f"must be {op} {bound}"
        return None


Positive = Range(gt=0)
NonNegative = Range(ge=0)
Probability = Range(ge=0, lt=1)


def type_problem(value: Any, hint: Any) -> str | None:
    """Why ``value`` does not fit the annotation ``hint`` (``None`` when it fits)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is inspect.Parameter.empty:
        return None
    if origin is typing.Annotated:
        why = type_problem(value, args[0])
        if why is None and value is not None:
            for meta in args[1:]:
                if isinstance(meta, Range) and (why := meta.violation(value)):
                    break
        return why
    if origin is typing.Literal:
        return None if value in args else f"must be one of {', '.join(repr(a) for a in args)}"
    if origin in (typing.Union, types.UnionType):
        whys = [type_problem(value, a) for a in args]
        return None if any(w is None for w in whys) else " or ".join(w for w in whys if w)
    if hint is type(None):
        return None if value is None else "must be null"
    if hint is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "must be a number"
    if hint is str:
        return None if isinstance(value, str) else "must be a string"
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return "must be a list"
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed-length tuple
            if len(value) != len(args):
                return f"must be a list of {len(args)} items"
            whys = [type_problem(v, a) for v, a in zip(value, args)]
            return next((f"every item {w}" for w in whys if w), None)
        for item in value if args else ():
            if why := type_problem(item, args[0]):
                return f"every item {why}"
        return None
    if origin is dict or hint is dict or origin is Mapping:
        return None if isinstance(value, Mapping) else "must be a mapping"
    return None


def signature_params(fn: Callable) -> dict[str, inspect.Parameter]:
    """The keyword parameters of a class constructor or function, ``self`` and ``**kw`` excluded."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    sig = inspect.signature(target)
    # A dataclass's generated __init__ carries string annotations; resolve them on the class.
    hints = typing.get_type_hints(fn if dataclasses.is_dataclass(fn) else target, include_extras=True)
    factories = {f.name: f.default_factory for f in dataclasses.fields(fn)} if dataclasses.is_dataclass(fn) else {}
    out = {}
    for p in sig.parameters.values():
        if p.name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        factory = factories.get(p.name)
        default = factory() if callable(factory) else p.default  # (a field without one has MISSING there)
        out[p.name] = p.replace(annotation=hints.get(p.name, p.annotation), default=default)
    return out


def defaults_of(fn: Callable, skip: tuple[str, ...] = STRUCTURAL) -> dict[str, Any]:
    """Every user-settable parameter of ``fn`` with its default (``???`` when required)."""
    return {n: ("???" if p.default is p.empty else p.default) for n, p in signature_params(fn).items() if n not in skip}


def check_params(
    fn: Callable,
    params: Mapping[str, Any],
    where: str,
    injected: Mapping[str, Any] | None = None,
    structural: tuple[str, ...] = STRUCTURAL,
) -> list[str]:
    """Problems with calling ``fn(**params, **injected)``: unknown, missing, mistyped or out of range.

    ``where`` names the config section in messages (``attention``, ``model`` ...). Keys listed
    in ``structural`` are refused in ``params`` because the builder injects them.
    """
    injected = dict(injected or {})
    sig = signature_params(fn)
    settable = [n for n in sig if n not in structural]
    problems = []
    for key, value in params.items():
        if key in structural and key in sig:
            problems.append(
                f"{where}.{key}: is a structural size injected from the model config; remove it "
                f"from {where} and set model.{key} instead."
            )
        elif key not in sig:
            near = close_matches(key, settable)
            hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            problems.append(
                f"{where}: unknown key {key!r}.{hint} Valid keys: {', '.join(settable) or '(none)'}. "
                f"Fix: remove it or use one of the valid keys."
            )
        elif why := type_problem(value, sig[key].annotation):
            problems.append(f"{where}.{key}={value!r}: {why}. Fix: set {where}.{key} to a valid value.")
    for name, p in sig.items():
        if p.default is p.empty and name not in params and name not in injected:
            problems.append(f"{where}.{name}: missing required value. Fix: set {where}.{name}=<value>.")
    return problems


class Component:
    """Mixin of every slot base class: the two validation hooks a component may override."""

    registry_name: str = ""
    #: The method's source, shown by ``xfam list`` and the README table (e.g. "Press et al., 2022").
    paper: str = ""

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        """Problems with ``params`` (defaults filled in) that span parameters or depend on the
        structural sizes in ``ctx``; each a sentence that ends with the fix."""
        return []

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        """Reasons this component cannot run with the rest of the slot selection
        (an ``xfam.model.compat.Selection``); each names the alternatives."""
        return []

    def own_init_modules(self) -> Iterable[Any]:
        """Submodules this component initialises itself, which the model's weight initialisation
        (N(0, ``model.init_std``) for every linear and embedding) must leave as they are: e.g. a halting
        unit's bias, or an MLP kept at PyTorch's default init. Default: none."""
        return ()


class Registry(Generic[T]):
    """Named components of one slot, with strict, build-free validation (see ``Component``)."""

    def __init__(self, slot: str, base: type):
        self.slot = slot
        self.base = base
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name in self._classes:
                raise DuplicateComponent(self.slot, name, self._classes[name], cls)
            if not issubclass(cls, self.base):
                raise TypeError(f"{cls.__name__} must subclass {self.base.__name__} to be a {self.slot}")
            bad = [p.name for p in signature_params(cls).values() if p.kind is not p.KEYWORD_ONLY]
            if bad:
                raise TypeError(f"{cls.__name__}: constructor parameters must be keyword-only: {bad}")
            cls.registry_name = name
            self._classes[name] = cls
            return cls

        return deco

    def names(self) -> list[str]:
        return sorted(self._classes)

    def items(self) -> Iterator[tuple[str, type[T]]]:
        return iter(sorted(self._classes.items()))

    def builtin(self) -> list[tuple[str, type[T]]]:
        """xfam's own components, by name: no plugin's, no test double's (``xfam.core.plugins.is_builtin``)."""
        return [(name, cls) for name, cls in self.items() if is_builtin(cls)]

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def get(self, name: str) -> type[T]:
        if name not in self._classes:
            raise ConfigError(self.unknown(name))
        return self._classes[name]

    def unknown(self, name: object) -> str:
        return unknown_choice(self.slot, name, self._classes, f"pass {self.slot}=<one of the valid choices>.")

    def check(self, cfg: Mapping[str, Any], ctx: Mapping[str, Any], where: str | None = None) -> list[str]:
        """Every problem with building ``cfg`` (a slot config with ``name``) in context ``ctx``."""
        where = where or self.slot
        name = cfg.get("name")
        if name not in self._classes:
            return [self.unknown(name)]
        cls = self._classes[name]
        params = {k: v for k, v in cfg.items() if k not in RESERVED}
        problems = check_params(cls, params, where, injected=ctx)
        if not problems:
            full = {**defaults_of(cls), **params}
            problems += [f"{where} ({name}): {p}" for p in cls.check(full, ctx)]
        return problems

    def build(self, cfg: Mapping[str, Any], **ctx: Any) -> T:
        """Validate and construct; ``ctx`` entries are passed only where the signature names them."""
        if problems := self.check(cfg, ctx):
            raise ConfigError(problems)
        cls = self._classes[cfg["name"]]
        sig = signature_params(cls)
        params = {k: v for k, v in cfg.items() if k not in RESERVED}
        params.update({k: v for k, v in ctx.items() if k in sig})
        return cls(**params)
