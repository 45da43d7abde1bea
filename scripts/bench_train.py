#!/usr/bin/env python
"""Training-throughput benchmark: xfam against x-transformers and a minimal plain-PyTorch GPT.

Shape: vocab 256, width 256, 4 layers, 4 heads (head dim 64), batch 8 x 256 tokens, causal LM,
fp32, 2 torch threads. One training step = forward + cross-entropy + backward + AdamW step.

Systems (each measurement is a fresh worker process, ``--worker SYSTEM POS``, printing one JSON line):

* ``minimal``             -- a minimal GPT on ``F.scaled_dot_product_attention`` written below
                             (the yardstick: framework overhead should be ~0 relative to it);
* ``xtransformers``       -- ``x_transformers.TransformerWrapper`` + ``Decoder``, default attention;
* ``xtransformers_flash`` -- the same with ``attn_flash=True`` (SDPA);
* ``xfam``                -- ``XfamModel`` with xfam's own AdamW setup, in a plain loop;
* ``xfam_lightning``      -- ``XfamLitModule`` trained by ``lightning.Trainer`` (timed by a callback).

Protocol: for each positional encoding the systems alternate (A B C D E A B C D E ...) for
``--repeats`` rounds; each process times every step with ``time.perf_counter``, drops ``--warmup``
steps and takes the median of the next ``--steps``; the figure per system is the median over
rounds with the min-max spread. A matmul worker (2048^3 fp32, same thread count) runs at the start
of each round, for the model-FLOP-utilisation column. The parent process only orchestrates: it
never imports torch.

On a shared machine two threads on two cores are badly slowed by any other busy process, so the
parent waits for a quiet machine before each measurement (``--quiet``, ``--max-wait``) and reruns a
measurement during which other processes used more than ``--noisy`` cores (``--retries``).

    python scripts/bench_train.py --quick                 # a check that everything runs (~2 min)
    python scripts/bench_train.py --json run.json         # the full run (~20 min); docs/benchmarks.{md,png}
    python scripts/bench_train.py --systems minimal xfam --pos alibi --repeats 10 --no-docs --json ab.json
                                                          # a targeted follow-up (more rounds, fewer systems)
    python scripts/bench_train.py --from-json run.json --append-json ab.json --profile minimal xfam
                                                          # re-render with follow-ups and torch.profiler tables
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib.common import BATCH, NOTES_MARKER, POS, ROOT, SEQ, SYSTEMS, cpu_busy_s
from benchlib.report import RATIOS, ratios, render_md, render_png, summarize
from benchlib.workers import worker


def foreign_load(interval: float = 1.0) -> float:
    """Cores busy over ``interval`` seconds; the parent is idle meanwhile, so it is all other work."""
    b0, t0 = cpu_busy_s()[0], time.perf_counter()
    time.sleep(interval)
    return (cpu_busy_s()[0] - b0) / (time.perf_counter() - t0)


def wait_for_quiet(args: argparse.Namespace) -> tuple[float, float]:
    """Wait (at most ``--max-wait`` s) until other processes use under ``--quiet`` cores for 2 s."""
    t0, calm = time.perf_counter(), 0
    load = foreign_load()
    while time.perf_counter() - t0 < args.max_wait:
        calm = calm + 1 if load < args.quiet else 0
        if calm >= 2:
            break
        load = foreign_load()
    return round(time.perf_counter() - t0, 1), round(load, 2)


def spawn(system: str, pos: str, args: argparse.Namespace, warmup: int, steps: int) -> dict[str, Any]:
    waited, load = wait_for_quiet(args) if args.max_wait > 0 else (0.0, float("nan"))
    env = dict(os.environ)
    t = str(args.threads)
    env.update({"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system, pos]
    cmd += ["--warmup", str(warmup), "--steps", str(steps), "--threads", t]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {system}/{pos} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1])
    res.update({"wall_s": round(time.perf_counter() - t0, 1), "waited_s": waited, "load_before": load})
    return res


def measure(
    system: str, pos: str, args: argparse.Namespace, label: str, rejected: list, warmup: int, steps: int
) -> dict[str, Any]:
    """One measurement in a fresh process; rerun (at most ``--retries`` times) while it was noisy."""
    for attempt in range(args.retries + 1):
        res = spawn(system, pos, args, warmup, steps)
        res["attempt"] = attempt
        noisy = res["foreign_cores"] > args.noisy and attempt < args.retries
        if system == "matmul":
            body = f"{res['gflops']:8.1f} GFLOP/s (2048^3 fp32)"
        else:
            body = f"{BATCH * SEQ / res['step_s']:8.0f} tok/s  step {res['step_s'] * 1e3:6.1f} ms"
            if "peak_rss_mb" in res:
                body += f"  peak RSS {res['peak_rss_mb']:5.0f} MB"
        tail = f"  others {res['foreign_cores']:.2f} cores (waited {res['waited_s']:.0f} s)  [{res['wall_s']:.0f} s]"
        print(f"{label} {system:<20}" + body + tail + ("  -> noisy, rerun" if noisy else ""), flush=True)
        if not noisy:
            return res
        rejected.append(res)
    return res


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    total = len(args.pos) * args.repeats * (len(args.systems) + 1)
    started = time.perf_counter()
    for pos in args.pos:
        for rep in range(args.repeats):
            for system in ("matmul", *args.systems):
                elapsed = time.perf_counter() - started
                label = f"[{len(runs) + 1:3d}/{total} {elapsed:5.0f} s] pos={pos:<7} rep {rep + 1}/{args.repeats}"
                res = measure(system, pos, args, label, rejected, args.warmup, args.steps)
                res["repeat"] = rep
                runs.append(res)
    return {"meta": meta(args), "runs": runs, "rejected": rejected}


def run_profiles(args: argparse.Namespace, poses: list[str]) -> list[dict[str, Any]]:
    """One ``torch.profiler`` worker per (pos, system) of ``--profile``: op self-times per step."""
    out, rejected = [], []
    for pos in poses:
        for system in args.profile:
            label = f"[profile] pos={pos:<7}"
            res = measure(f"profile:{system}", pos, args, label, rejected, args.warmup, args.profile_steps)
            res.update({"system": system, "pos": pos, "steps": args.profile_steps})
            out.append(res)
    return out


def meta(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import version

    def ver(name: str) -> str:
        try:
            return version(name)
        except Exception:
            return "?"

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "xfam"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    )
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": ver("torch"),
        "lightning": ver("lightning"),
        "x_transformers": ver("x-transformers"),
        "xfam_commit": commit + (" (xfam/ has uncommitted changes)" if dirty else ""),
        "threads": args.threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "steps": args.steps,
        "quiet": args.quiet,
        "max_wait": args.max_wait,
        "noisy": args.noisy,
        "retries": args.retries,
        "systems": list(args.systems),
        "pos": list(args.pos),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="rounds of A B C D E per pos (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per process (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="discarded steps per process (default 5)")
    p.add_argument("--pos", nargs="+", choices=POS, default=list(POS), help="positional encodings")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems, in round order")
    p.add_argument("--threads", type=int, default=2, help="torch/OMP/MKL threads per worker (default 2)")
    p.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks.md", help="markdown report path")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks.png", help="chart path")
    p.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="render the docs from saved raw results")
    p.add_argument("--no-docs", action="store_true", help="print the summary only; write no md/png")
    p.add_argument("--quick", action="store_true", help="1 round, 2 warm-up + 4 timed steps (a smoke run)")
    p.add_argument(
        "--quiet", type=float, default=0.25, help="before each run, wait until other processes use < this many cores"
    )
    p.add_argument("--max-wait", type=float, default=600, help="longest wait for --quiet, seconds (0: never wait)")
    p.add_argument(
        "--noisy", type=float, default=0.3, help="rerun a measurement if other processes used > this many cores"
    )
    p.add_argument("--retries", type=int, default=5, help="reruns of a noisy measurement (default 5)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per worker process")
    p.add_argument(
        "--profile",
        nargs="*",
        choices=[x for x in SYSTEMS if x != "xfam_lightning"],
        default=None,
        help="also profile these systems (torch.profiler, one process per pos; bare --profile: minimal xfam)",
    )
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per process (default 3)")
    p.add_argument(
        "--append-json", type=Path, nargs="+", default=[], help="saved results of follow-up runs to report as well"
    )
    p.add_argument("--worker", nargs=2, metavar=("SYSTEM", "POS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        worker(args.worker[0], args.worker[1], args.warmup, args.steps, args.threads)
        return
    if args.quick:
        args.repeats, args.warmup, args.steps, args.max_wait, args.retries = 1, 2, 4, 0, 0
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        data["rendered_by"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    else:
        data = run_all(args)
    if args.profile is not None:
        args.profile = args.profile or ["minimal", "xfam"]
        data["profiles"] = run_profiles(args, data["meta"]["pos"])
    if args.append_json:
        data["followups"] = [json.loads(f.read_text()) for f in args.append_json]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
    summary = summarize(data)
    if not args.no_docs:
        png = args.png
        for path in (args.md, png):
            path.parent.mkdir(parents=True, exist_ok=True)
        render_png(data, summary, png)
        text = render_md(data, summary, png, args.md)
        if args.md.exists() and NOTES_MARKER in args.md.read_text():  # keep hand-written notes
            text += "\n" + NOTES_MARKER + args.md.read_text().split(NOTES_MARKER, 1)[1]
        args.md.write_text(text)
        print(f"wrote {args.md} and {png}")
    for pos in data["meta"]["pos"]:
        line = [f"pos={pos:<7}"] + [
            f"{s}={summary['table'][pos, s]['tps']:,.0f}"
            for s in data["meta"]["systems"]
            if (pos, s) in summary["table"]
        ]
        print("  ".join(line))
        for a, b, label, target in RATIOS:
            r = ratios(data, pos, a, b)
            if r:
                print(f"    {label}: {r[0]:.3f} [{r[1]:.3f}-{r[2]:.3f}]" + (f" target >= {target}" if target else ""))


if __name__ == "__main__":
    main()
