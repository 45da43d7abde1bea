"""The public Python API: build from a plain config, validate, and nothing heavy at import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import xfam


def test_build_and_validate_from_a_plain_config() -> None:
    from tests.integration.helpers import compose_cfg

    cfg = compose_cfg(["model.dim=32", "model.layers=1", "model.heads=2", "pos=alibi"])
    xfam.validate(cfg)
    info = {"task": "lm", "vocab_size": 257, "num_classes": None}
    model = xfam.build_model(cfg, info)
    assert model(torch.randint(0, 257, (1, 8))).logits.shape == (1, 8, 257)
    cfg["model"]["heads"] = 3
    with pytest.raises(xfam.ConfigError, match="does not divide"):
        xfam.validate(cfg)
    with pytest.raises(AttributeError):
        xfam.no_such_thing  # noqa: B018


def test_import_xfam_is_cheap() -> None:
    code = "import sys, xfam; print('torch' in sys.modules, 'lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_every_slot_package_imports_first_in_a_fresh_interpreter() -> None:
    """No import cycle depends on which package a user (or a plugin) imports first."""
    packages = ["xfam.pos", "xfam.attention", "xfam.memory", "xfam.exit"]
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:2]]"
    for name in packages:
        done = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"import {name} first fails:\n{done.stderr[-2000:]}"
