"""Per-layer and per-head schedules: one documented config form for every slot that needs one.

A slot config selects one component; papers that vary it by depth or by head (Sparse
Transformer's interleaved patterns, Longformer's growing windows, routing heads beside local
heads, a retrieval layer at one depth) use two optional keys of the slot config:

``per_layer`` -- overrides for some layers, merged over the slot's own keys. Either a mapping
from layer specs to overrides, where a spec is an index (``"2"``, negative counts from the top:
``"-1"``), an inclusive range (``"0-3"``) or a comma list (``"0,2"``)::

    attention: {name: vanilla, per_layer: {"-1": {dropout: 0.1}}}

or a list of overrides applied cyclically (layer l takes item ``l % len``)::

    attention: {name: strided, per_layer: [{pattern: strided}, {pattern: fixed}]}

``per_head`` (attention only) -- split every layer's heads into groups, each its own component,
outputs concatenated in group order; each item gives ``heads`` plus overrides::

    attention: {name: vanilla, per_head: [{heads: 2}, {heads: 2, name: local, window: 64}]}

An override may change ``name`` (a different component for that layer or group); it then starts
from that component's defaults, since the slot's own keys (a composed YAML holds every default of
the slot's component) belong to the slot's component. Group sizes must add up to ``model.heads``
(and be multiples of heads per key/value head under grouped-query).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xfam.core.errors import ConfigError

_SCHEDULE_KEYS = ("per_layer", "per_head")


def _layer_spec(spec: str, num_layers: int) -> list[int]:
    layers = []
    for part in str(spec).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-") if not part.startswith("-") else (part, "", "")
        try:
            idx = list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise ConfigError(
                f"per_layer key {spec!r} is not a layer spec. Fix: use an index ('2', '-1'), "
                f"a range ('0-3') or a comma list ('0,2')."
            ) from None
        for i in idx:
            if not -num_layers <= i < num_layers:
                raise ConfigError(
                    f"per_layer key {spec!r}: layer {i} is outside 0..{num_layers - 1} (model.layers="
                    f"{num_layers}). Fix: name existing layers only."
                )
            layers.append(i % num_layers)
    return layers


def per_layer(slot_cfg: Mapping[str, Any], num_layers: int, slot: str) -> list[dict[str, Any]]:
    """The slot config of each layer (``per_layer`` resolved and removed)."""
    base = {k: v for k, v in slot_cfg.items() if k != "per_layer"}
    sched = slot_cfg.get("per_layer")
    out = [dict(base) for _ in range(num_layers)]
    if sched is None:
        return out
    if isinstance(sched, (list, tuple)):
        if not sched:
            raise ConfigError(f"{slot}.per_layer is an empty list. Fix: remove it or give at least one override.")
        for layer in range(num_layers):
            out[layer] = _merge(base, _override(sched[layer % len(sched)], f"{slot}.per_layer[{layer % len(sched)}]"))
        return out
    if not isinstance(sched, Mapping):
        raise ConfigError(
            f"{slot}.per_layer must be a mapping of layer specs or a list. Fix: see xfam/core/schedule.py."
        )
    seen: dict[int, str] = {}
    for spec, override in sched.items():
        for layer in _layer_spec(spec, num_layers):
            if layer in seen:
                raise ConfigError(
                    f"{slot}.per_layer: layer {layer} is named by both {seen[layer]!r} and {spec!r}. "
                    f"Fix: give every layer at most one override."
                )
            seen[layer] = str(spec)
            out[layer] = _merge(base, _override(override, f"{slot}.per_layer[{spec!r}]"))
    return out


def per_head(layer_cfg: Mapping[str, Any], heads: int, kv_heads: int, slot: str) -> list[tuple[int, dict[str, Any]]]:
    """Head groups of one layer as ``(head_count, component config)``; one group when unscheduled."""
    base = {k: v for k, v in layer_cfg.items() if k not in _SCHEDULE_KEYS}
    groups = layer_cfg.get("per_head")
    if groups is None:
        return [(heads, base)]
    if not isinstance(groups, (list, tuple)) or not groups:
        raise ConfigError(
            f"{slot}.per_head must be a non-empty list of {{heads: n, ...}}. Fix: see xfam/core/schedule.py."
        )
    out, per_kv = [], heads // kv_heads
    for i, item in enumerate(groups):
        item = _override(item, f"{slot}.per_head[{i}]")
        n = item.pop("heads", None)
        if not isinstance(n, int) or n < 1 or n % per_kv:
            raise ConfigError(
                f"{slot}.per_head[{i}].heads={n!r}: must be a positive multiple of {per_kv} (query heads per "
                f"key/value head). Fix: set heads on every group."
            )
        out.append((n, _merge(base, item)))
    total = sum(n for n, _ in out)
    if total != heads:
        raise ConfigError(
            f"{slot}.per_head: groups cover {total} heads but model.heads={heads}. "
            f"Fix: make the group sizes add up to {heads}."
        )
    return out


def _merge(base: Mapping[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``; one that names another component keeps only base's schedule keys."""
    if "name" in override and override["name"] != base.get("name"):
        base = {k: v for k, v in base.items() if k in _SCHEDULE_KEYS}
    return {**base, **override}


def _override(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where} must be a mapping of overrides, got {item!r}. Fix: e.g. {{window: 64}}.")
    if "per_layer" in item:
        raise ConfigError(f"{where}: per_layer cannot be nested. Fix: move it to the slot level.")
    return dict(item)
