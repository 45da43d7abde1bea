"""Renamed: ``scripts/generate_docs.py`` regenerates the README's slot list, docs/blocks.md's tables and the
reference pages of docs/reference/ (``--check`` as before). This name stays as an alias."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate_docs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
