"""Lets the example plugin's tests run from a source checkout, uninstalled: its folder goes on ``sys.path`` so
``import xfam_example_plugin`` finds the package (installed, the same package is found either way). Inside xfam's
own test run this makes every run exercise the contract test kit on a component outside ``xfam.``."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
