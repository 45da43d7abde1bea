"""End-to-end check of the fused attention kernel: the same training run twice, with
``attention=vanilla pos=alibi`` on the Triton kernel and on PyTorch's SDPA; the kernel must show in the
log and every step's training loss must stay within ``--tol`` (relative, default 1%) of the SDPA run's.

    python scripts/kernel_e2e.py                  # on a CUDA machine: 200 steps of the main job, bf16
    python scripts/kernel_e2e.py --interpret      # CPU, Triton's interpreter, 3 tiny steps (a check of the script)

Both runs are ``python train.py`` subprocesses with the same seed, data and batches; they differ only in
``attention.backend``. Writes ``<out>/kernel_e2e.json`` (the per-step losses and the verdict) and exits 1
when a check fails.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_LOG = "attention=vanilla backend=triton: Triton flash kernel"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tol", type=float, default=0.01, help="largest relative loss difference per step")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "kernel_e2e")
    p.add_argument("--interpret", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny model, 3 steps")
    p.add_argument("--set", nargs="*", default=[], help="extra train.py overrides for both runs")
    return p.parse_args(argv)


def train(backend: str, args: argparse.Namespace) -> tuple[list[float], str]:
    """Per-step training losses of one run and its log."""
    run_dir = args.out / backend
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time (train.py refuses to overwrite one)
    base = ["attention=vanilla", "pos=alibi", f"attention.backend={backend}", f"trainer.max_steps={args.steps}"]
    base += ["trainer.log_every_n_steps=1", "callbacks.progress_bar=none", f"hydra.run.dir={run_dir}"]
    if args.interpret:
        base += ["model.dim=32", "model.layers=2", "model.heads=2", "data.seq_len=32", "data.batch_size=2"]
        base += ["trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "trainer.val_check_interval=3"]
    else:
        base += ["trainer=gpu"]
    env = {**os.environ, "TRITON_INTERPRET": "1"} if args.interpret else dict(os.environ)
    res = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *base, *args.set], cwd=ROOT, env=env, capture_output=True, text=True
    )
    log = res.stdout + res.stderr
    if res.returncode != 0:
        sys.exit(f"the {backend} run failed (exit {res.returncode}):\n{log[-3000:]}")
    with (run_dir / "logs" / "version_0" / "metrics.csv").open() as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("train/loss")]
    return [float(r["train/loss"]) for r in sorted(rows, key=lambda r: int(r["step"]))], log


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.interpret:
        args.steps = min(args.steps, 3)
    kernel, kernel_log = train("triton", args)
    sdpa, _ = train("sdpa", args)
    rel = [abs(a - b) / abs(b) for a, b in zip(kernel, sdpa, strict=True)]
    checks = {
        "kernel in the log": KERNEL_LOG in kernel_log,
        f"{args.steps} steps each": len(kernel) == len(sdpa) == args.steps,
        f"every step within {args.tol:.0%}": max(rel) <= args.tol,
    }
    result = {"steps": args.steps, "max_rel_diff": max(rel), "checks": checks, "triton": kernel, "sdpa": sdpa}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_e2e.json").write_text(json.dumps(result, indent=1) + "\n")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(f"largest relative loss difference over {len(rel)} steps: {max(rel):.2e} (final losses {kernel[-1]:.4f} / "
          f"{sdpa[-1]:.4f}) -> {args.out / 'kernel_e2e.json'}")  # fmt: skip
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
