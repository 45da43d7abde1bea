"""The public API without the training stack: ``import xfam``, ``xfam.build_model`` and ``xfam.load_model``
(and loading and running a checkpoint with it) import neither Lightning nor Hydra, checked in a fresh
interpreter each, since this test session has imported both long ago."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "old_checkpoint" / "step-0000003.ckpt"
HEAVY = ("lightning", "pytorch_lightning", "hydra", "omegaconf")

LOAD_AND_RUN = f"""
import torch
model, meta = xfam.load_model({str(FIXTURE)!r})
with torch.no_grad():
    out = model(torch.arange(32).view(2, 16) * 7 % 97)
assert out.logits.shape[:2] == (2, 16) and torch.isfinite(out.logits).all()
"""

CASES = {
    "import xfam": "",
    "xfam.build_model": "xfam.build_model",
    "xfam.load_model": "xfam.load_model",
    "build and validate": "xfam.validate, xfam.build_data, xfam.ConfigError",
    "load and run a checkpoint": LOAD_AND_RUN,
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_public_api_imports_no_lightning_and_no_hydra(case: str) -> None:
    code = f"import sys\nimport xfam\n{CASES[case]}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", f"{case} imported {done.stdout.strip()}"
