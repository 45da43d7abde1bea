"""Regenerate every generated page and section of the documentation from the code.

python scripts/generate_docs.py           # rewrite what is stale (`make generated`)
python scripts/generate_docs.py --check   # change nothing; exit 1 and name every stale file (`make docs`, a test)

What it writes:

* docs/reference/index.md: every built-in component of every slot, one line each (name, method, paper,
  parameters, capabilities); docs/reference/{attention,pos,memory,exit,data}.md: a section per component
  (docstring, paper, parameters with type, default and range, capabilities, what it is refused with, a command
  that trains with it). From the registries; a test's or a plugin's components are left out.
* docs/reference/cli.md: what `xfam --help`, `xfam <command> --help` and `python train.py --help` print.
* README.md, between `<!-- slots:start -->` and `<!-- slots:end -->`: one line per slot with its components.
* docs/blocks.md, between `<!-- block-table:start -->` and `<!-- block-table:end -->`: the block options'
  table and their compatibility with the slots (``xfam.cli.listing.block_markdown``).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

README = ROOT / "README.md"
BLOCKS_DOC = ROOT / "docs" / "blocks.md"
REFERENCE = ROOT / "docs" / "reference"
SLOTS_BLOCK = re.compile(r"(<!-- slots:start[^\n]*-->\n)(.*?)(<!-- slots:end -->)", re.S)
OPTIONS_BLOCK = re.compile(r"(<!-- block-table:start[^\n]*-->\n)(.*?)(<!-- block-table:end -->)", re.S)


class MarkersMissing(Exception):
    """A file whose generated section has lost its start/end markers."""


def between(pattern: re.Pattern[str], body: Callable[[], str], what: str) -> Callable[[str], str]:
    """A rewrite of ``text`` with ``body()`` between the markers ``pattern`` matches."""

    def rewrite(text: str) -> str:
        if not pattern.search(text):
            raise MarkersMissing(f"no {what} markers (the generated section's start and end comments)")
        return pattern.sub(lambda m: m.group(1) + body() + "\n" + m.group(3), text, count=1)

    return rewrite


def render_readme(text: str) -> str:
    """README.md with its slot list regenerated."""
    from docgen.components import readme_slots

    return between(SLOTS_BLOCK, readme_slots, "<!-- slots:start --> / <!-- slots:end -->")(text)


def render_blocks(text: str) -> str:
    """docs/blocks.md with its block options' tables regenerated."""
    from xfam.cli.listing import block_markdown

    return between(OPTIONS_BLOCK, block_markdown, "<!-- block-table:start --> / <!-- block-table:end -->")(text)


def targets() -> dict[Path, Callable[[str], str]]:
    """Every generated file and how to make it from its present text (whole pages ignore it)."""
    from docgen.cli import cli_page
    from docgen.components import PAGES, index_page, slot_page

    out: dict[Path, Callable[[str], str]] = {REFERENCE / "index.md": lambda _: index_page()}
    for slot, page in PAGES.items():
        out[REFERENCE / f"{page}.md"] = lambda _, slot=slot: slot_page(slot)
    out[REFERENCE / "cli.md"] = lambda _: cli_page()
    out[README] = render_readme
    out[BLOCKS_DOC] = render_blocks
    return out


@contextlib.contextmanager
def builtin_only() -> Iterator[None]:
    """The registries as a plain installation has them: components of a test (``toy_*``) or of a plugin hidden,
    also from the alternatives the compatibility messages name."""
    from docgen.components import REGISTRIES

    saved = {slot: registry._classes for slot, registry in REGISTRIES.items()}
    for registry in REGISTRIES.values():
        registry._classes = dict(registry.builtin())
    try:
        yield
    finally:
        for slot, classes in saved.items():
            REGISTRIES[slot]._classes = classes


def generate(check: bool) -> tuple[list[Path], list[str]]:
    """Regenerate (or, with ``check``, only compare) every target: the stale files and the problems."""
    with builtin_only():
        return _generate(check)


def _generate(check: bool) -> tuple[list[Path], list[str]]:
    stale, problems = [], []
    for path, make in targets().items():
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        try:
            new = make(old)
        except MarkersMissing as err:
            problems.append(f"{path.relative_to(ROOT)}: {err}")
            continue
        if new != old:
            stale.append(path)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(new, encoding="utf-8")
    return stale, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    stale, problems = generate(args.check)
    for path in stale:
        print(f"{'stale' if args.check else 'updated'}: {path.relative_to(ROOT)}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if args.check and stale:
        print("Fix: python scripts/generate_docs.py (or `make generated`), and commit the result.", file=sys.stderr)
    return 1 if problems or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
