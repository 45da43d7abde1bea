"""Shared test setup: one torch thread per process, a fixed seed per test, the test doubles registered once."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# A fresh datasets cache per test session (set before `datasets` is imported): tests never read
# what another session or a user's runs cached, and leave the user's cache alone.
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="xfam-test-hf-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Without a GPU the Triton kernels' parity tests run in Triton's interpreter, which must be switched on
# before any kernel is decorated (xfam imports kernel modules lazily, so this is early enough).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Import the doubles under one name ("doubles") whatever pytest's import mode, so each toy registers once.
sys.path.insert(0, str(Path(__file__).parent))
import doubles  # noqa: E402,F401  (registers the toy_ components)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Every test starts with one torch thread and leaves it so: a script run in-process that sets its
    own thread count (a benchmark's --threads) would otherwise change later tests' float sums, and
    with them every exactness check against a subprocess (which runs on one thread)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)
