"""Regenerate the slot table of README.md from the registries (`xfam list --markdown`), and the block options'
tables of docs/blocks.md (from ``xfam.model.block_compat``).

python scripts/update_readme.py          # rewrite the table in place
python scripts/update_readme.py --check  # exit 1 if the README is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS_DOC = README.parent / "docs" / "blocks.md"
BLOCK = re.compile(r"(<!-- slot-table:start[^\n]*-->\n)(.*?)(<!-- slot-table:end -->)", re.S)
OPTIONS_BLOCK = re.compile(r"(<!-- block-table:start[^\n]*-->\n)(.*?)(<!-- block-table:end -->)", re.S)


def render(text: str) -> str:
    from xfam.cli.listing import markdown_table

    return BLOCK.sub(lambda m: m.group(1) + markdown_table() + "\n" + m.group(3), text)


def render_blocks(text: str) -> str:
    from xfam.cli.listing import block_markdown

    return OPTIONS_BLOCK.sub(lambda m: m.group(1) + block_markdown() + "\n" + m.group(3), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if the table is stale")
    args = parser.parse_args()
    stale = []
    for path, fn in ((README, render), (BLOCKS_DOC, render_blocks)):
        text = path.read_text()
        new = fn(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
                print(f"updated {path}")
    if args.check:
        sys.exit(1 if stale else 0)


if __name__ == "__main__":
    main()
