"""The measuring protocol of the throughput benchmarks (``scripts/bench_train.py``, ``scripts/bench_seq2seq.py``),
parent side: every measurement is a fresh worker process, started once the machine is quiet and rerun when other
processes were busy while it ran; the description of the machine and versions that heads each report.

Nothing here imports torch: the parent only orchestrates."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib.common import ROOT, cpu_busy_s


def add_protocol_options(p: argparse.ArgumentParser) -> None:
    """The options every benchmark of this protocol takes: threads, the quiet-machine wait, reruns, timeout."""
    p.add_argument("--threads", type=int, default=2, help="torch/OMP/MKL threads per worker (default 2)")
    p.add_argument(
        "--quiet", type=float, default=0.25, help="before each run, wait until other processes use < this many cores"
    )
    p.add_argument("--max-wait", type=float, default=600, help="longest wait for --quiet, seconds (0: never wait)")
    p.add_argument(
        "--noisy", type=float, default=0.3, help="rerun a measurement if other processes used > this many cores"
    )
    p.add_argument("--retries", type=int, default=5, help="reruns of a noisy measurement (default 5)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per worker process")


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


def spawn(script: Path, worker_argv: list[str], args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Run ``script --worker *worker_argv --threads N`` in a fresh process once the machine is quiet; its last
    JSON line, with the wall time, the wait and the load seen before it started."""
    waited, load = wait_for_quiet(args) if args.max_wait > 0 else (0.0, float("nan"))
    env = dict(os.environ)
    t = str(args.threads)
    env.update({"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, str(script), "--worker", *worker_argv, "--threads", t]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {name} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1])
    res.update({"wall_s": round(time.perf_counter() - t0, 1), "waited_s": waited, "load_before": load})
    return res


def measure(
    run: Callable[[], dict[str, Any]],
    describe: Callable[[dict[str, Any]], str],
    label: str,
    args: argparse.Namespace,
    rejected: list[dict[str, Any]],
) -> dict[str, Any]:
    """One measurement (``run``: a ``spawn``); rerun, at most ``--retries`` times, while other processes used more
    than ``--noisy`` cores during it. Prints ``label``, ``describe(result)`` and the others' load of each try."""
    for attempt in range(args.retries + 1):
        res = run()
        res["attempt"] = attempt
        noisy = res["foreign_cores"] > args.noisy and attempt < args.retries
        tail = f"  others {res['foreign_cores']:.2f} cores (waited {res['waited_s']:.0f} s)  [{res['wall_s']:.0f} s]"
        print(f"{label} {describe(res)}" + tail + ("  -> noisy, rerun" if noisy else ""), flush=True)
        if not noisy:
            return res
        rejected.append(res)
    return res


def alternate(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """In-process timing: every call once per round, in turn (A B C A B C ...), for ``rounds`` rounds; the
    seconds of each call per system (warm-ups are the caller's)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def machine_meta(args: argparse.Namespace) -> dict[str, Any]:
    """Date, machine, versions, the commit, the protocol's settings and the command line of this run."""
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
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit, dirty = git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "xfam"))
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
        "quiet": args.quiet,
        "max_wait": args.max_wait,
        "noisy": args.noisy,
        "retries": args.retries,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
