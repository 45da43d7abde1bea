"""The host allocator setting: applied once, says what it did, and can be switched off."""

from __future__ import annotations

import platform

import pytest
import torch

from xfam.training import allocator


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(allocator, "_DONE", [])


def test_opt_out_leaves_the_allocator_alone(monkeypatch) -> None:
    monkeypatch.setenv("XFAM_KEEP_FREED_MEMORY", "0")
    assert allocator.keep_freed_memory() == "allocator: left as is (XFAM_KEEP_FREED_MEMORY=0)"


def test_applied_once_and_memory_still_works(monkeypatch) -> None:
    monkeypatch.delenv("XFAM_KEEP_FREED_MEMORY", raising=False)
    note = allocator.keep_freed_memory()
    if platform.libc_ver()[0] == "glibc":
        assert note.startswith("allocator: glibc keeps freed memory")
    assert allocator.keep_freed_memory() is note  # once per process
    for _ in range(3):  # large blocks are allocated, freed and reused without error
        x = torch.ones(64, 1024, 1024)
        assert float(x.sum()) == 64 * 1024 * 1024
        del x
