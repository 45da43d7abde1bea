"""Activation checkpointing (``model.checkpoint_activations``): training memory and time per step, with and without.

    python scripts/exp_checkpointing.py           # depth 8 and 16, dim 256, seq 512, batch 8: into docs/results.md
    python scripts/exp_checkpointing.py --quick   # smoke run: small model, depth 2 and 4 (about 30 s), into <out>
    python scripts/exp_checkpointing.py --device cuda   # the same on a GPU: peak CUDA memory instead of RSS

Each (depth, checkpointing) pair runs in a fresh Python process (``--worker``), so one configuration's memory never
counts in another's: a causal byte-level LM (vocabulary 256, ``attention=vanilla`` with its default backend,
``pos=rope``, dropout 0.1, pre-norm GELU blocks, 4 heads, FFN 4x), AdamW, random tokens. It measures:

* **saved for backward** (one more forward after the timed steps): the exact bytes of the distinct non-parameter
  tensors one training forward keeps for the backward pass, from ``torch.autograd.graph.saved_tensors_hooks``; with
  checkpointing, the tensors saved outside the recomputed blocks plus each block's input, which
  ``torch.utils.checkpoint`` keeps to recompute from (its own hooks replace every tensor saved inside a block);
* **peak memory of a step**: on CPU, the process's peak resident set (``getrusage`` ``ru_maxrss``) minus its
  resident set before the first step (the model, optimiser and batch built; the step's peak includes the
  gradients and, from the first step on, AdamW's two states, the same in both arms), with glibc's mmap threshold
  fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the resident set; on CUDA,
  ``torch.cuda.max_memory_allocated`` minus the allocation before the first step;
* **time per step**: forward, backward and optimiser step, the median of ``--steps`` steps after one warm-up
  step (``--threads`` torch threads, default one: the shared 2-core machine runs other jobs, so the ratio between
  the arms is the measurement, not the seconds).

Raw results: ``<out>/results.json``; the report goes between ``<!-- experiments:checkpointing:start/end -->`` of
docs/results.md (appended under a ``## checkpointing`` heading when absent); ``--quick`` writes into ``<out>``
(default: a temporary folder), never into docs/.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
SECTION = "checkpointing"
MIB = 2**20
FULL = {"dim": 256, "seq": 512, "batch": 8, "depths": [8, 16], "steps": 5}
#: glibc returns a freed large block to the system only above its mmap threshold, which it raises after such frees;
#: fixed at 128 KiB, every tensor above it is mapped and unmapped, so the resident set follows what is allocated
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}
QUICK = {"dim": 64, "seq": 128, "batch": 2, "depths": [2, 4], "steps": 2}


# ---------------------------------------------------------------------------------------------- worker


def rss_now() -> int:
    """The process's resident set now, in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in this (fresh) process; returns its measurements."""
    import torch
    import torch.nn.functional as F

    import xfam.model.stack as stack_module
    from xfam.model.spec import ModelSpec
    from xfam.model.transformer import XfamModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    spec = ModelSpec(
        dim=args.dim,
        layers=args.depth,
        heads=4,
        max_len=args.seq,
        dropout=0.1,
        checkpoint_activations=bool(args.checkpoint),
    )
    none = {"name": "none"}
    model = XfamModel(
        spec, task="lm", vocab_size=256, attention={"name": "vanilla"}, pos={"name": "rope"}, memory=none, exit=none
    ).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_now()
    times = []
    for _ in range(1 + args.steps):
        start = time.perf_counter()
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak, peak_total = torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_allocated()
    else:
        peak_total = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux)
        peak = peak_total - base
    # exact bytes kept for the backward pass: saved tensors outside the blocks, and the blocks' inputs
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def note(t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t

    plain_checkpoint = stack_module.checkpoint

    def counting_checkpoint(fn: Any, *inputs: Any, **kw: Any) -> Any:
        for t in inputs:
            note(t)
        return plain_checkpoint(fn, *inputs, **kw)

    stack_module.checkpoint = counting_checkpoint
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved = loss()
    saved_bytes = sum(kept.values())
    stack_module.checkpoint = plain_checkpoint
    del saved
    model.zero_grad(set_to_none=True)
    return {
        "depth": args.depth,
        "checkpoint": bool(args.checkpoint),
        "params": sum(p.numel() for p in model.parameters()),
        "saved_bytes": saved_bytes,
        "peak_step_bytes": peak,
        "peak_total_bytes": peak_total,
        "base_bytes": base,
        "step_s": statistics.median(times[1:]),
        "warmup_s": times[0],
    }


# ---------------------------------------------------------------------------------------------- driver


def run_one(args: argparse.Namespace, sizes: dict[str, Any], depth: int, ckpt: bool) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        f"--depth={depth}",
        f"--checkpoint={int(ckpt)}",
        f"--dim={sizes['dim']}",
        f"--seq={sizes['seq']}",
        f"--batch={sizes['batch']}",
        f"--steps={sizes['steps']}",
        f"--threads={args.threads}",
        f"--device={args.device}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads), **MALLOC}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(rows: list[dict[str, Any]], sizes: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    memory = "peak CUDA memory of a step" if args.device == "cuda" else "peak RSS of a step"
    lines = [
        f"Command: `{command}` ({args.device}, torch threads: {args.threads}; each configuration in a fresh process; "
        f"the shared 2-core machine runs other jobs, so seconds are indicative and the ratio is the measurement). "
        f"Model: a causal byte-level LM, dim {sizes['dim']}, 4 heads, FFN 4x, `attention=vanilla` (default "
        f"backend), `pos=rope`, dropout 0.1; sequences of {sizes['seq']} tokens, batch {sizes['batch']}; AdamW. "
        f"Time: median of {sizes['steps']} steps (forward, backward, optimiser step) after one warm-up step.",
        "",
        f"| layers | checkpointing | params | saved for backward (MiB) | {memory} (MiB) | total peak (MiB) "
        "| s / step |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['depth']} | {'on' if r['checkpoint'] else 'off'} | {r['params']:,} | {r['saved_bytes'] / MIB:,.1f} "
            f"| {r['peak_step_bytes'] / MIB:,.0f} | {r['peak_total_bytes'] / MIB:,.0f} | {r['step_s']:.2f} |"
        )
    lines += ["", "Checkpointing against the plain path at the same depth:", ""]
    for depth in sizes["depths"]:
        off, on = (next(r for r in rows if r["depth"] == depth and r["checkpoint"] == c) for c in (False, True))
        lines.append(
            f"* {depth} layers: saved for backward {off['saved_bytes'] / MIB:,.1f} -> "
            f"{on['saved_bytes'] / MIB:,.1f} MiB "
            f"({off['saved_bytes'] / on['saved_bytes']:.1f}x less); {memory} {off['peak_step_bytes'] / MIB:,.0f} -> "
            f"{on['peak_step_bytes'] / MIB:,.0f} MiB ({on['peak_step_bytes'] / off['peak_step_bytes'] - 1:+.0%}); "
            f"time per step x{on['step_s'] / off['step_s']:.2f}."
        )
    lines += [
        "",
        "Saved for backward: exact bytes of the distinct non-parameter tensors a training forward keeps for the "
        "backward pass (`saved_tensors_hooks`); with checkpointing, those saved outside the blocks (embedding, final "
        "norm, head, loss) plus the block inputs `torch.utils.checkpoint` keeps to recompute from. The peak of a "
        "step also holds what is the same in both arms (gradients, AdamW's states, the logits and the loss's "
        "temporaries) and the one block being recomputed at a time, so it falls by less than the saved tensors.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, depth 2 and 4; report into --out")
    parser.add_argument("--out", default=None, help="folder for results.json (and the --quick report)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every worker (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("depth", "checkpoint", "dim", "seq", "batch", "steps"):
        parser.add_argument(f"--{name}", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return
    sizes = QUICK if args.quick else FULL
    from run_experiments import run_folder, write_section  # (not in the worker processes)

    out = run_folder(args.out, "exp_checkpointing", args.quick)
    rows = []
    for depth in sizes["depths"]:
        for ckpt in (False, True):
            started = time.perf_counter()
            rows.append(run_one(args, sizes, depth, ckpt))
            r = rows[-1]
            print(
                f"depth {depth} checkpointing {'on ' if ckpt else 'off'}: saved {r['saved_bytes'] / MIB:,.1f} MiB, "
                f"step peak {r['peak_step_bytes'] / MIB:,.0f} MiB, {r['step_s']:.2f} s/step "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    (out / "results.json").write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1))
    flags = " ".join(a for a in sys.argv[1:] if a.startswith("--") and not a.startswith("--out"))
    command = f"OMP_NUM_THREADS={args.threads} python scripts/exp_checkpointing.py {flags}".rstrip()
    body = report(rows, sizes, args, command)
    sys.path.insert(0, str(ROOT / "scripts"))

    write_section(out / "results.md" if args.quick else RESULTS, SECTION, body)
    print(f"report: {out / 'results.md' if args.quick else RESULTS}")


if __name__ == "__main__":
    main()
