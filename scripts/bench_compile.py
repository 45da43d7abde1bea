#!/usr/bin/env python
"""Compiled training throughput: xfam eager and compiled (``trainer.compile``) against the minimal plain-PyTorch GPT
of ``scripts/bench_train.py``, eager and compiled, for every positional encoding both can express.

The shape, the minimal model, the batches, the step timing and the measuring protocol are bench_train.py's
(``benchlib``): vocab 256, width 256, 4 layers, 4 heads, batch 8 x 256, fp32, 2 torch threads; one training step =
forward + cross-entropy + backward + AdamW step, in a plain loop. Compiled: ``torch.compile`` of the model's call
(for xfam exactly what ``trainer.compile=true`` wraps, ``xfam.training.lit.compile.CompiledTraining``), mode
``default``; the loss and the optimizer stay eager in both. Each measurement is a fresh process; the four systems
alternate (A B C D A B C D ...) for ``--repeats`` rounds per encoding; a process drops ``--warmup`` steps
(compilation happens in the first) and takes the median of the next ``--steps``; the figure is the median over
rounds, and the ratio compiled xfam / compiled minimal the median of the per-round ratios (interleaved rounds see
the same machine load). Target: >= 0.98 on every encoding. Writes its table into docs/compile.md.

    python scripts/bench_compile.py                 # ~6 min on 2 cores
    python scripts/bench_compile.py --quick --no-docs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import protocol
from benchlib.common import BATCH, ROOT, SEQ, write_section
from benchlib.protocol import add_protocol_options

POS = ("none", "learned", "sinusoidal", "rope", "alibi")
SYSTEMS = ("minimal", "minimal_compiled", "xfam", "xfam_compiled")
MARKERS = ("<!-- bench:start -->", "<!-- bench:end -->")
TARGET = 0.98
XFAM_POS = {
    "none": {"name": "none"},
    "learned": {"name": "learned"},
    "sinusoidal": {"name": "sinusoidal"},
    "rope": {"name": "rope", "base": 10000.0},
    "alibi": {"name": "alibi", "num_heads": None},
}


def build(system: str, pos: str, total_steps: int) -> tuple[Any, Any, Any, Any]:
    """(the callable a step runs, the model, optimizer, scheduler) of one system."""
    from benchlib.workers import DATA_INFO, build_minimal, xfam_config

    if system.startswith("minimal"):
        model, opt, sched = build_minimal(pos)
    else:
        from xfam.config.specs import OptimSpec
        from xfam.model.build import build_model
        from xfam.training.lit.optim import make_optimizer

        cfg = {**xfam_config("learned"), "pos": XFAM_POS[pos]}
        model = build_model(cfg, DATA_INFO)
        made = make_optimizer(model, OptimSpec(**cfg["optim"]), total_steps, fused=True)  # as XfamLitModule at fp32
        opt, sched = made["optimizer"], made["lr_scheduler"]["scheduler"]
    call = model
    if system == "minimal_compiled":
        import torch

        call = torch.compile(model)
    elif system == "xfam_compiled":
        from xfam.training.lit.compile import CompiledTraining

        call = CompiledTraining(model, "default").call
    return call, model, opt, sched


def run_worker(system: str, pos: str, warmup: int, steps: int, threads: int) -> dict[str, Any]:
    import torch
    from benchlib.workers import _batches, _result, _rss_now_mb, timed, train_step

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    n = warmup + steps
    batches = _batches(min(n, 8))
    rss = _rss_now_mb()
    call, model, opt, sched = build(system, pos, n)
    model.train()
    losses: list[float] = []

    def step(i: int) -> None:
        losses.append(train_step(call, opt, sched, batches[i % len(batches)], not system.startswith("minimal")))

    times, cpu, _ = timed(step, n, warmup, False)
    res = {**_result(model, times, losses, rss, warmup), **cpu, "first_step_s": round(times[0], 2)}
    return {**res, "system": system, "pos": pos}


def describe(res: dict[str, Any]) -> str:
    return f"{res['system']:<17}{BATCH * SEQ / res['step_s']:8.0f} tok/s (first step {res['first_step_s']} s)"


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    total, started = len(args.pos) * args.repeats * len(SYSTEMS), time.perf_counter()
    script = Path(__file__).resolve()
    for pos in args.pos:
        for rep in range(args.repeats):
            for system in SYSTEMS:
                elapsed = time.perf_counter() - started
                label = f"[{len(runs) + 1:3d}/{total} {elapsed:5.0f} s] pos={pos:<10} rep {rep + 1}"
                argv = [system, pos, "--warmup", str(args.warmup), "--steps", str(args.steps)]
                name = f"{system}/{pos}"
                res = protocol.measure(
                    lambda a=argv, n=name: protocol.spawn(script, a, args, n), describe, label, args, rejected
                )
                res["repeat"] = rep
                runs.append(res)
    return {"meta": protocol.machine_meta(args), "runs": runs, "rejected": len(rejected)}


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per encoding: each system's median tokens/s, and the sorted per-round ratios of ``RATIOS``."""
    rows = []
    for pos in dict.fromkeys(r["pos"] for r in data["runs"]):
        by = {(r["system"], r["repeat"]): r["step_s"] for r in data["runs"] if r["pos"] == pos}
        reps = sorted({rep for _, rep in by})
        tps = {s: statistics.median(BATCH * SEQ / by[s, r] for r in reps if (s, r) in by) for s in SYSTEMS}
        ratios = {k: ratio(by, reps, *v) for k, v in RATIOS.items()}
        rows.append({"pos": pos, "tps": tps, **ratios})
    return rows


def ratio(by: dict[tuple[str, int], float], reps: list[int], a: str, b: str) -> list[float]:
    """Speed of ``a`` over speed of ``b`` in each round that measured both, sorted."""
    return sorted(by[b, r] / by[a, r] for r in reps if (a, r) in by and (b, r) in by)


RATIOS = {
    "compiled_vs_minimal": ("xfam_compiled", "minimal_compiled"),
    "xfam_speedup": ("xfam_compiled", "xfam"),
    "minimal_speedup": ("minimal_compiled", "minimal"),
}


def render(data: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    m = data["meta"]
    fmt = lambda r: f"{statistics.median(r):.3f} ({r[0]:.2f}-{r[-1]:.2f})" if r else "-"  # noqa: E731
    lines = [
        f"Measured {m['date'][:10]} on a {m['cores']}-core {m['cpu']} (shared), torch {m['torch']}, "
        f"{m['threads']} threads; `{m['command']}`; {len({r['repeat'] for r in data['runs']})} alternating rounds "
        f"per encoding, median of the per-process step medians (ratios: median and range of the per-round ratios; "
        f"{data['rejected']} noisy measurements rerun). Tokens per second of one training step.",
        "",
        "| pos | minimal | minimal compiled | xfam | xfam compiled | xfam compiled / minimal compiled "
        f"(target >= {TARGET}) | met | compile speed-up xfam | compile speed-up minimal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, ratio = r["tps"], r["compiled_vs_minimal"]
        met = "yes" if ratio and statistics.median(ratio) >= TARGET else "no"
        cells = [f"{t[s]:,.0f}" for s in SYSTEMS]
        lines.append(
            f"| {r['pos']} | {' | '.join(cells)} | {fmt(ratio)} | {met} | {fmt(r['xfam_speedup'])} | "
            f"{fmt(r['minimal_speedup'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds per encoding (default 5)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per process (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="discarded steps per process, compilation included (3)")
    p.add_argument("--pos", nargs="+", choices=POS, default=list(POS))
    p.add_argument("--md", type=Path, default=ROOT / "docs/compile.md")
    p.add_argument("--no-docs", action="store_true", help="print the table only")
    p.add_argument("--quick", action="store_true", help="1 round, 2 warm-up + 2 timed steps, no waiting (a smoke run)")
    add_protocol_options(p)
    p.add_argument("--worker", nargs=2, metavar=("SYSTEM", "POS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import json

        res = run_worker(*args.worker, args.warmup, args.steps, args.threads)
        print(json.dumps(res), flush=True)
        return
    if args.quick:
        args.repeats, args.warmup, args.steps, args.max_wait, args.retries = 1, 2, 2, 0, 0
    data = run_all(args)
    table = render(data, summarize(data))
    print(table)
    if not args.no_docs:
        write_section(args.md, *MARKERS, table, new_file="# Compiled training\n", new_heading="## Throughput")
        print(f"wrote {args.md}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
