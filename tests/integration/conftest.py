"""Fixtures for end-to-end tests: a small text corpus and an isolated environment."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twenty-four small text documents (deterministic)."""
    root = tmp_path_factory.mktemp("corpus")
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "wizards",
        "quietly",
        "hex",
        "jovial",
        "bards",
    ]
    for i in range(24):
        lines = [" ".join(words[(i + j + k) % len(words)] for k in range(8)) for j in range(40)]
        (root / f"doc{i:02d}.txt").write_text(f"# document {i}\n" + "\n".join(lines) + "\n")
    return root


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path_factory.getbasetemp() / "runs"
    monkeypatch.setenv("XFAM_RUNS", str(runs))
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_dir = tmp_path_factory.getbasetemp() / "wandb"
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(wandb_dir))
