"""``xfam list``: every slot and component, read from the registries (nothing is hand-maintained)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xfam.config import SLOTS
from xfam.core import plugins
from xfam.core.registry import Component, Registry, defaults_of
from xfam.data.base import DATA
from xfam.model import block_compat, compat

if TYPE_CHECKING:
    from xfam.cli.grammar import Args


def capabilities(registry: Registry) -> list[str]:
    """The capability flags a slot's base class declares (its ClassVar attributes; ``*_why`` are the reasons
    shown in refusals, not capabilities)."""
    annotations = registry.base.__annotations__.items()
    return [k for k, v in annotations if "ClassVar" in str(v) and not k.startswith("_") and not k.endswith("_why")]


def summary(cls: type[Component]) -> str:
    """One line: the first sentence of the class docstring, and its paper."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    line = " ".join(doc.split()).rstrip(".")
    return f"{line} ({cls.paper})" if getattr(cls, "paper", "") else line


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "null"
    if isinstance(value, (frozenset, set, tuple, list)):
        return "[" + ", ".join(map(str, sorted(value) if isinstance(value, (set, frozenset)) else value)) + "]"
    return str(value)


def _rows() -> list[tuple[str, str, type, Registry]]:
    return [(slot, name, cls, reg) for slot, reg in {**SLOTS, "data": DATA}.items() for name, cls in reg.items()]


def listing() -> str:
    lines = []
    for slot, reg in {**SLOTS, "data": DATA}.items():
        lines.append(f"== {slot} ({len(reg.names())}) ==")
        caps = capabilities(reg)
        for name, cls in reg.items():
            provider = plugins.origin(cls)
            lines.append(f"  {name:<12} {summary(cls)}" + (f" [plugin: {provider}]" if provider else ""))
            params = defaults_of(cls)
            if params:
                lines.append("      params: " + ", ".join(f"{k}={_fmt(v)}" for k, v in params.items()))
            if caps:
                lines.append("      capabilities: " + ", ".join(f"{c}={_fmt(getattr(cls, c))}" for c in caps))
        lines.append("")
    lines.append("== attention x pos ==")
    table = compat.matrix()
    atts = sorted({a for a, _ in table})
    poss = sorted({p for _, p in table})
    width = max(map(len, poss)) + 2
    lines.append(" " * 14 + "".join(p.ljust(width) for p in poss))
    notes = {(a, p): compat.setting_refusals(a, p) for a, p in table if table[a, p] is None}
    for a in atts:
        cells = ["NO" if table[a, p] is not None else "yes*" if notes[a, p] else "yes" for p in poss]
        lines.append(a.ljust(14) + "".join(c.ljust(width) for c in cells))
    reasons = sorted({r for r in table.values() if r})
    lines += [f"  NO: {r}" for r in reasons]
    lines += sorted({f"  yes*: not at its default settings: {r}" for rs in notes.values() for r in rs})
    lines += ["", *block_listing()]
    lines.append("\nMemory components need relative positions and contiguous streams (loader.streams=auto picks them)")
    lines.append("unless they say otherwise;")
    lines.append("`python train.py ...` checks the whole selection before it starts and names alternatives.")
    return "\n".join(lines)


def block_listing() -> list[str]:
    """The block options (``model.*``) with their papers and what each is refused with (``compat.block_matrix``:
    columns are attention mechanisms, ``memory``, ``exit=<policy>`` and ``reversible``); every other slot
    component combines with them."""
    lines = ["== block options (model.*; docs/blocks.md) =="]
    table = compat.block_matrix()
    for row, option in block_compat.OPTIONS.items():
        override = " ".join(f"model.{k}={_fmt(v)}" for k, v in option.override.items())
        lines.append(f"  {override:<34} {option.what} ({option.paper})")
        refused = [col for col, why in table[row].items() if why]  # (why: the refusals, empty where allowed)
        atts = [c for c in refused if "=" not in c and c not in ("memory", "reversible")]
        others = [c for c in refused if c not in atts]
        if refused:
            parts = ([f"attention in [{', '.join(atts)}]"] if atts else []) + others
            lines.append(f"      refused with: {'; '.join(parts)}")
    lines.append("  (every other option combines with every attention, pos, memory and exit component; the refusals'")
    lines.append("  reasons are printed by `python train.py ...` before it starts)")
    return lines


def block_markdown() -> str:
    """docs/blocks.md's option table and option x slot matrix (``scripts/generate_docs.py`` writes them)."""
    table = compat.block_matrix()
    out = ["| override | what it changes | paper | refused with |", "|---|---|---|---|"]
    for row, option in block_compat.OPTIONS.items():
        override = " ".join(f"`model.{k}={_fmt(v)}`" for k, v in option.override.items())
        refused = ", ".join(f"`{c}`" for c, why in table[row].items() if why) or "—"
        out.append(f"| {override} | {option.what.replace('|', '/')} | {option.paper} | {refused} |")
    cols = list(next(iter(table.values())))
    out += [
        "",
        "| option | " + " | ".join(c.removeprefix("exit=") for c in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for row, cells in table.items():
        out.append(f"| `{row}` | " + " | ".join("no" if cells[c] else "yes" for c in cols) + " |")
    out += [
        "",
        "Why not (the message validation prints; for the attention columns, the first refused mechanism's):",
        "",
    ]
    for row, cells in table.items():
        atts = [c for c in cells if c in compat.ATTENTION and cells[c]]
        shown = atts[:1] + [c for c in cells if cells[c] and c not in compat.ATTENTION]
        out += [f"* `{row}` with `{c}`: {' '.join(cells[c])}" for c in shown]
    return "\n".join(out)


def short_capabilities(cls: type, registry: Registry) -> str:
    """Capabilities in a few words: the flags that are on, and the values that are not flags."""
    out = []
    for c in capabilities(registry):
        v = getattr(cls, c)
        if v is True:
            out.append(c)
        elif v not in (False, None, ()) and not isinstance(v, bool):
            out.append(f"{c}={_fmt(v)}")
    return ", ".join(out) or "—"


def markdown_table() -> str:
    """The slot table in markdown (``xfam list --markdown``): xfam's own components."""
    out = ["| slot | component | method | parameters (defaults) | capabilities |", "|---|---|---|---|---|"]
    for slot, name, cls, reg in _rows():
        if not plugins.is_builtin(cls):
            continue
        params = ", ".join(f"`{k}={_fmt(v)}`" for k, v in defaults_of(cls).items()) or "—"
        text = summary(cls).replace("``", "`").replace("|", "\\|")
        out.append(f"| {slot} | `{name}` | {text} | {params} | {short_capabilities(cls, reg)} |")
    return "\n".join(out)


def run(args: Args) -> None:
    """``xfam list``: the listing, or the slot table in markdown (``markdown=true``); installed plugins (entry points)
    and the modules of ``plugins=`` included."""
    plugins.load(args.plugins)
    print(markdown_table() if args.markdown else listing())
