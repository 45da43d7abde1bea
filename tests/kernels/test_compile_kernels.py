"""scripts/compile_kernels.py: the fused path's launches compile for sm_90 on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compile_kernels.py"


def _nvidia_tools() -> bool:
    spec = importlib.util.find_spec("triton")
    return spec is not None and (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


def load_script():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("compile_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not _nvidia_tools(), reason="needs Triton with its NVIDIA backend (ptxas, cuobjdump)")
def test_attention_and_linear_kernels_compile_for_sm90_and_fit_its_shared_memory(tmp_path: Path) -> None:
    """The launches of causal and linear attention (Performer's m = 256 included) compile; none asks for
    more shared memory than an H100/H200 has (the linear kernels once asked for 390 KiB)."""
    out = tmp_path / "kernels.md"
    out.write_text("# Kernels\n\n<!-- compile_kernels:start -->\nold\n<!-- compile_kernels:end -->\nkept\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    args = ["--variants", "causal", "linear", "--dtypes", "bf16", "--head-dims", "64", "--out", str(out)]
    res = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    text = out.read_text()
    assert "old" not in text and text.endswith("kept\n")
    rows = [line for line in text.splitlines() if line.startswith("| flash_attention.")]
    assert [r.split(" | ")[0] for r in rows] == ["| flash_attention._fwd_kernel", "| flash_attention._dq_kernel",
                                                 "| flash_attention._dkdv_kernel"]  # fmt: skip
    linear = [line for line in text.splitlines() if line.startswith("| linear_attention.")]
    assert len(linear) == 6  # forward, backward and its finishing kernel, for m = 128 and 256
    for row in rows + linear:
        regs, shared = int(row.split(" | ")[5]), float(row.split(" | ")[7])
        assert 0 < regs <= 255 and shared <= 227


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_tools(), reason="needs Triton with its NVIDIA backend (ptxas, cuobjdump)")
def test_a_launch_beyond_the_targets_shared_memory_runs_with_smaller_tiles() -> None:
    """sm_86 (RTX 30xx, A10: 99 KiB per block): the T5 forward's H100 tiles ask for 128 KiB at Dh 64. The
    stand-in driver refuses them as a GPU would (OutOfResources) and the wrapper compiles smaller ones that fit.
    (Slow: 20-40 s of ptxas; test_tiles_shrink_until_they_fit_the_devices_shared_memory checks the same
    fallback in the interpreter.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["--arch", "86", "--variants", "t5", "--dtypes", "bf16", "--head-dims", "64", "--no-write"]
    res = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split(" | ") for line in res.stdout.splitlines() if line.startswith("| flash_attention.")]
    fwd = [(r[4], r[7]) for r in rows if r[0] == "| flash_attention._fwd_kernel"]  # (tiles, shared KiB)
    assert len(fwd) == 2 and fwd[0][1].endswith("*over*") and "stages=3" in fwd[0][0], fwd
    assert float(fwd[1][1]) <= 99 and fwd[1][0] != fwd[0][0]
    others = [float(r[7]) for r in rows if r[0] != "| flash_attention._fwd_kernel"]  # dq, dk/dv: fit at once
    assert len(others) == 2 and max(others) <= 99


def test_problems_name_compile_errors_and_shared_memory_beyond_the_target() -> None:
    script = load_script()
    base = {"variant": "alibi", "dtype": "bf16", "dh": 128, "kernel": "flash_attention._fwd_kernel"}
    rows = [
        {**base, "fresh": True, "shared": 100 * 1024, "regs": 200, "local": 0},
        {**base, "fresh": True, "shared": 240 * 1024, "regs": 200, "local": 0},
        {**base, "error": "CompilationError: boom"},
    ]
    found = script.problems(rows, 90)
    assert len(found) == 2
    assert "CompilationError: boom" in found[0] and "245760 B of shared memory > 232448" in found[1]
