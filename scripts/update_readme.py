"""Regenerate the slot table of README.md from the registries (`xfam list --markdown`).

python scripts/update_readme.py          # rewrite the table in place
python scripts/update_readme.py --check  # exit 1 if the README is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- slot-table:start[^\n]*-->\n)(.*?)(<!-- slot-table:end -->)", re.S)


def render(text: str) -> str:
    from xfam.cli.listing import markdown_table

    return BLOCK.sub(lambda m: m.group(1) + markdown_table() + "\n" + m.group(3), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if the table is stale")
    args = parser.parse_args()
    text = README.read_text()
    new = render(text)
    if args.check:
        sys.exit(0 if new == text else 1)
    README.write_text(new)
    print(f"updated {README}")


if __name__ == "__main__":
    main()
