"""Where the Triton kernels can run, and why not (shared by every kernel and by the dispatch).

* CUDA tensors with Triton installed, on a GPU of compute capability 8.0 or newer (Ampere on, as
  Triton supports): compiled kernels.
* CPU tensors with ``TRITON_INTERPRET=1`` set before the kernels were imported: Triton's interpreter
  (docs/architecture.md: 100-500x slower than SDPA, for parity tests at small sizes; its bf16 arithmetic is
  wrong, so kernels upcast bf16 loads to fp32).
* Anything else: not at all; ``why_not`` says why, for the error of an explicit ``backend=triton``.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

#: Triton supports NVIDIA GPUs of compute capability 8.0 and newer (its README). On a 7.5 (T4), compiled for
#: sm_75 without a GPU (scripts/compile_kernels.py), most attention kernels spilled registers and the linear
#: attention backward asked for 67 KiB of shared memory of 64.
MIN_CAPABILITY = (8, 0)


def interpreting() -> bool:
    """Triton's interpreter is on (it must be set before ``triton.jit`` decorates a kernel)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def why_not(device: torch.device, interpreted: bool | None = None) -> str | None:
    """None when the kernels can run on ``device``; else the reason and the fix. ``interpreted``: whether the
    caller's kernels were decorated for the interpreter (``interpreting()`` at its import), when it knows."""
    if not triton_installed():
        return "Triton is not installed (pip install triton; Linux only). Fix: backend=auto or a PyTorch backend."
    if device.type == "cuda":
        major, minor = capability(device.index if device.index is not None else torch.cuda.current_device())
        if (major, minor) < MIN_CAPABILITY:
            return (
                f"Triton's kernels need an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                f"or newer (Ampere on); this one is {major}.{minor}. Fix: backend=auto (takes the PyTorch path on "
                f"this GPU), or a PyTorch backend."
            )
        return None
    if device.type == "cpu" and interpreting():
        if interpreted is False:
            return (
                "TRITON_INTERPRET=1 was set after the kernel modules were imported, so their kernels were compiled "
                "for a GPU. Fix: set it before the first import of xfam.kernels (tests/conftest.py does), or use a "
                "PyTorch backend."
            )
        return None
    return (
        f"Triton kernels run on CUDA devices, or on CPU only under TRITON_INTERPRET=1 (a slow interpreter for "
        f"tests); this tensor is on {device.type}. Fix: backend=auto (takes the Triton path on CUDA and the "
        f"PyTorch path elsewhere), or run on a GPU."
    )


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (looked up once)."""
    return torch.cuda.get_device_capability(index)
