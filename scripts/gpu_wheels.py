"""Wheels of the packages xfam needs beyond torch, triton and lightning, into ``.whl/`` (git-ignored), for a CUDA
host without a package index.

    python scripts/gpu_wheels.py            # (make gpu-wheels) then copy the checkout with .whl/ to the GPU host

A CUDA image often has torch, triton and lightning but no package index; hydra, omegaconf and ``datasets``
travel as wheels. The versions are those installed here, so the GPU run uses what the test suite ran with;
they are built for the host's Python (``--python``, default 3.12, x86-64 Linux).
pyarrow travels too: ``datasets`` needs a newer one than the image may hold. scripts/gpu_checks.sh installs
whatever is in ``.whl/`` into a folder on PYTHONPATH before anything else runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Not on a typical CUDA image (or too old there), with xfam's import of each on the training path.
PACKAGES = ("hydra-core", "omegaconf", "datasets", "dill", "multiprocess", "fsspec", "pyarrow")
SOURCE_ONLY = ("antlr4-python3-runtime",)  # omegaconf's parser; no wheel on PyPI: built here (pure Python)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / ".whl")
    p.add_argument("--python", default="3.12", help="the GPU host's Python version")
    args = p.parse_args(argv)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in PACKAGES]
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    platforms = [x for plat in PLATFORMS for x in ("--platform", plat)]
    subprocess.run(
        [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", args.python,
         "--implementation", "cp", *platforms, "-d", str(args.out), *pins],
        check=True,
    )  # fmt: skip
    built = [f"{name}=={importlib.metadata.version(name)}" for name in SOURCE_ONLY]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(args.out), *built], check=True)
    wheels = sorted(args.out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB -> {args.out}:")
    for w in wheels:
        print("  ", w.name)
    if len(wheels) != len(PACKAGES) + len(SOURCE_ONLY):
        sys.exit(f"expected {len(PACKAGES) + len(SOURCE_ONLY)} wheels")


if __name__ == "__main__":
    main()
