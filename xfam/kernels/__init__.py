"""Triton kernels, importable as ``xfam.kernels.<module>``.

The code lives in the repository's top-level ``kernels/`` folder, each kernel beside its PyTorch
reference (docs/architecture.md); ``kernels`` is a PyPI distribution name, so the folder is mapped
into the xfam namespace here instead of being a top-level package of its own. Nothing here imports
Triton: a kernel module is imported only when a mechanism takes its path (``backend=triton``, or
``backend=auto`` on CUDA), so ``TRITON_INTERPRET=1`` set before that still takes effect.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "kernels")]
