"""Docstrings and type hints as Markdown: the pieces the reference pages are made of."""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from typing import Any

from xfam.cli.listing import _fmt
from xfam.core.registry import Range

SECTION = re.compile(r"^(\w[\w ]*):\s*$")
SEE_MODULE = re.compile(r"\s*(?:\(see the module docstring\)|[;,] see the module docstring)")


def md_escape(text: str) -> str:
    """Prose for Markdown: RST's ``code`` as `code`, and outside code spans ``<`` escaped (``<pad>`` would be read
    as an HTML tag and vanish)."""
    text = text.replace("``", "`")
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)


def paragraph(text: str) -> str:
    """A docstring paragraph as Markdown: an indented one is a code block, shown as written but for RST's code
    quotes (``ramp`` reads as ramp there: the block is code already)."""
    return text.replace("``", "") if text.startswith("    ") else md_escape(text)


def cell(text: str) -> str:
    """Text for one table cell: one line, ``|`` escaped. A code span with a ``|`` becomes plain text: GitHub needs
    the escape inside code too, and the site would show it there."""
    parts = re.split(r"(`[^`]*`)", md_escape(" ".join(text.split())))
    plain = [p.strip("`").replace("<", "&lt;") if p.startswith("`") and "|" in p else p for p in parts]
    return "".join(plain).replace("|", "\\|")


def fmt(value: Any) -> str:
    """A default as ``xfam list`` and the YAML configs write it (``null``, ``true``, ``[a, b]``)."""
    return "required" if value == "???" else _fmt(value)


def paragraphs(doc: str | None) -> list[str]:
    return [p for p in inspect.cleandoc(doc or "").split("\n\n") if p.strip()]


def summary(cls: type) -> str:
    """The first paragraph of the class docstring, on one line, without "see the module docstring"."""
    first = (paragraphs(cls.__doc__) or [""])[0]
    return SEE_MODULE.sub("", " ".join(first.split())).rstrip(".") + "."


def class_text(cls: type) -> list[str]:
    """The class docstring's paragraphs after the first, up to its first section (``Args:``)."""
    out = []
    for para in paragraphs(cls.__doc__)[1:]:
        if SECTION.match(para.splitlines()[0]):
            break
        out.append(para)
    return out


def module_text(cls: type, budget: int = 700) -> list[str]:
    """The opening paragraphs of the component's module docstring (the method, with its paper and section):
    paragraphs until ``budget`` characters, and the block a paragraph ending in ":" introduces."""
    paras = paragraphs(sys.modules[cls.__module__].__doc__)
    out: list[str] = []
    for para in paras:
        if sum(map(len, out)) >= budget and not (out and out[-1].rstrip().endswith(":")):
            break
        out.append(para)
    return out


def sections(doc: str | None) -> dict[str, dict[str, str]]:
    """``Args:``-style sections of a docstring: ``{"Args": {"name": "text", ...}}``; an entry ``a / b: text``
    describes both."""
    out: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    indent = key = None
    for line in inspect.cleandoc(doc or "").splitlines():
        if SECTION.match(line):
            current, indent, key = out.setdefault(line.strip()[:-1], {}), None, None
            continue
        if current is None or not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            current = None
            continue
        indent = indent or depth
        entry = re.match(r"^\s*([\w*][\w ,/*]*?):\s+(.*)$", line) if depth == indent else None
        if entry:
            names = [n.strip() for n in re.split(r"[/,]", entry.group(1))]
            key = tuple(names)
            for n in names:
                current[n] = entry.group(2).strip()
        elif key is not None:
            for n in key:
                current[n] += " " + line.strip()
    return out


def param_docs(cls: type) -> dict[str, str]:
    """Each parameter's description, from the ``Args:`` of the class or of its ``__init__``."""
    init = cls.__dict__.get("__init__")
    docs = sections(getattr(init, "__doc__", None)).get("Args", {})
    return {**docs, **sections(cls.__doc__).get("Args", {})}


def type_text(hint: Any) -> str:
    """An annotation as a reader writes a value: ``int``, ``window | block``, ``list of int``, ``float or null``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is inspect.Parameter.empty or hint is Any:
        return "any"
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{_fmt(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if hint is type(None):
        return "null"
    if origin in (list, tuple) or hint in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            inner = {type_text(a) for a in args}
            return (
                f"list of {len(args)} {inner.pop()}" if len(inner) == 1 else f"list ({', '.join(map(type_text, args))})"
            )
        return f"list of {type_text(args[0])}" if args else "list"
    if origin in (dict, typing.Mapping) or hint is dict:
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def _ranges(hint: Any) -> list[Range]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return [m for m in args[1:] if isinstance(m, Range)] + _ranges(args[0])
    return [r for a in args for r in _ranges(a)]


def range_text(hint: Any) -> str:
    """The bounds ``Range`` states in an ``Annotated`` hint (``≥ 1``, ``0 ≤ x < 1``); empty when none."""
    out = []
    for r in dict.fromkeys(_ranges(hint)):
        low = f"{_num(r.ge)} ≤ " if r.ge is not None else f"{_num(r.gt)} < " if r.gt is not None else ""
        high = f" ≤ {_num(r.le)}" if r.le is not None else f" < {_num(r.lt)}" if r.lt is not None else ""
        if low and high:
            out.append(f"{low}x{high}")
        elif low:
            out.append(("≥ " if r.ge is not None else "> ") + low.split(" ")[0])
        elif high:
            out.append(high.strip())
    return "; ".join(out)


def _num(value: float | None) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
