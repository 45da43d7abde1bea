"""Shared test setup: one torch thread per process, a fixed seed per test, the test doubles registered once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Import the doubles under one name ("doubles") whatever pytest's import mode, so each toy registers once.
sys.path.insert(0, str(Path(__file__).parent))
import doubles  # noqa: E402,F401  (registers the toy_ components)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
