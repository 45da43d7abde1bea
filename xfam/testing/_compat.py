"""What ``xfam.config.validate`` would refuse about a tiny model's slot selection, without composing a config: a
contract runs a combination only where xfam accepts it, and says which refusal it skipped."""

from __future__ import annotations

from typing import Any

from xfam.attention import ATTENTION
from xfam.core.registry import defaults_of
from xfam.exit import EXIT
from xfam.memory import MEMORY
from xfam.model import compat
from xfam.pos import POS


def _chosen(registry: Any, slot: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    cls = registry.get(slot["name"])
    return cls, {**defaults_of(cls), **{k: v for k, v in slot.items() if k != "name"}}


def refusals(
    task: str = "lm",
    *,
    attention: dict[str, Any] | None = None,
    pos: dict[str, Any] | None = None,
    memory: dict[str, Any] | None = None,
    exit: dict[str, Any] | None = None,
    layers: int = 3,
) -> list[str]:
    """``compat.check``'s problems with this selection (a language model is causal, anything else bidirectional;
    batches are streams, as a memory needs)."""
    sel = compat.Selection(
        attention=[(*_chosen(ATTENTION, attention or {"name": "vanilla"}), False)],
        pos=_chosen(POS, pos or {"name": "none"}),
        memory=[_chosen(MEMORY, memory or {"name": "none"})] * layers,
        exit=_chosen(EXIT, exit or {"name": "none"}),
        causal=task == "lm",
        task=task,
        streams=True,
    )
    return compat.check(sel)
