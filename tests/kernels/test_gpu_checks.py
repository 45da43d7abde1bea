"""scripts/gpu_checks.sh rehearsed on CPU (CPU=1: Triton's interpreter, tiny sizes): the one script a CUDA
host runs must work end to end before anyone spends GPU time on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_checks_rehearse_on_cpu_and_leave_their_files(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_CURRENT_TEST")}
    env |= {"CPU": "1", "OUT": str(tmp_path / "out"), "PY": sys.executable, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        ["bash", "scripts/gpu_checks.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    log = res.stdout + res.stderr
    for step in ("parity", "e2e", "inductor", "decoding", "bench"):
        assert f"{step} exit 0" in log, log[-4000:]
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["bench.txt", "benchmarks.kernels.jsonl", "benchmarks.md", "e2e.txt", "gpu.txt",
                     "kernel_e2e.json", "parity.txt"]  # fmt: skip
    assert "bench_kernels:start" in (tmp_path / "out" / "benchmarks.md").read_text()
