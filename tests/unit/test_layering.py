"""The package's layers hold: each module imports only the layers below it (docs/architecture.md).

Bottom up: ``core`` (contracts, registry, errors, logs; nothing of xfam) < ``kernels`` (the Triton
kernels and their references) < the slots ``attention``, ``pos``, ``memory``, ``exit`` (each: core,
kernels and its own engines, never another slot) and the engines ``data``, ``knnlm`` (core only) <
``model`` and ``config`` (and ``api``, the component authors' import) < ``eval`` (tools without
Lightning) < ``training`` (runner, Hydra glue, Lightning) < ``cli`` < ``testing`` (the contract test kit, which
needs pytest: nothing of xfam imports it). Every import counts, also one
inside a function, and no two modules import each other, directly or around a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLOTS = ("attention", "pos", "memory", "exit")
RANK = {
    "configs": 0,  # (the YAML files as a package: no code of its own)
    "core": 0,
    "kernels": 1,
    **dict.fromkeys(SLOTS, 2),
    "data": 2,
    "knnlm": 2,
    "model": 3,
    "config": 3,
    "api": 3,
    "eval": 4,
    "training": 5,
    "cli": 6,
    "testing": 7,  # the contract test kit: may import anything of xfam, and nothing of xfam imports it
}
#: Peers of one rank that may import each other (the model layer: validation builds model specs and
#: checks compatibility; the builder takes the validated config).
PEERS = {frozenset({"model", "config"}), frozenset({"model", "api"}), frozenset({"config", "api"})}


def modules() -> dict[str, Path]:
    """Every module of xfam (``xfam.kernels.*`` from the top-level ``kernels/`` folder)."""
    out = {}
    for path in sorted((ROOT / "xfam").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[0] == "kernels":
            parts = ["xfam", *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """The xfam modules ``name`` imports, anywhere in the file (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in found if m == "xfam" or m.startswith("xfam.")}


MODULES = modules()
GRAPH = {name: {m for m in imports(name, path) if m in MODULES and m != name} for name, path in MODULES.items()}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_sits_in_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if m != "xfam" and layer(m) not in RANK)
    assert not unplaced, f"modules outside the layers of docs/architecture.md: {unplaced}"


def violation(src: str, dst: str) -> str | None:
    a, b = layer(src), layer(dst)
    if a is None or b is None or a == b:
        return None
    if a in SLOTS + ("data", "knnlm") and b not in ("core", "kernels"):
        return f"{src} -> {dst}: a slot or engine imports only xfam.core and xfam.kernels"
    if a == "core" or (a == "kernels" and b != "core"):
        return f"{src} -> {dst}: {a} imports {'nothing of xfam' if a == 'core' else 'only xfam.core'}"
    if RANK[b] > RANK[a] or (RANK[b] == RANK[a] and frozenset({a, b}) not in PEERS):
        return f"{src} -> {dst}: {a} may not import {b} (a layer above or beside it)"
    return None


@pytest.mark.parametrize("src", sorted(MODULES))
def test_imports_follow_the_layers(src: str) -> None:
    bad = [v for dst in sorted(GRAPH[src]) if (v := violation(src, dst))]
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components over every import (packages count as their ``__init__``;
    a submodule importing its own package's ``__init__`` is the package loading, not a cycle)."""
    graph = {src: {d for d in dsts if not src.startswith(d + ".")} for src, dsts in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_layering_check_catches_a_slot_importing_another() -> None:
    assert violation("xfam.attention.vanilla", "xfam.pos.alibi")
    assert violation("xfam.memory.spalm", "xfam.training.lit.checkpoint")
    assert violation("xfam.core.mask", "xfam.attention")
    assert violation("xfam.model.build", "xfam.training.runner")
    assert violation("xfam.eval.loop", "xfam.cli.evaluate")
    assert violation("xfam.attention.vanilla", "xfam.core.mask") is None
    assert violation("xfam.model.build", "xfam.config") is None
    assert violation("xfam.cli.main", "xfam.testing") and violation("xfam.core.registry", "xfam.testing.doubles")
    assert violation("xfam.testing.matrix", "xfam.training.run_names") is None
