#!/usr/bin/env python
"""Memory models in training: xfam ``memory=xl`` and ``memory=compressive`` against x-transformers' Transformer-XL
recurrence, tokens per second side by side.

Shape: that of ``scripts/bench_train.py`` (vocab 256, width 256, 4 layers, 4 heads, batch 8 x segment 256, fp32,
2 torch threads), a memory of 256 states per layer, T5 relative position biases in both libraries. One training
step = zero_grad, forward over the segment with the previous step's memory, cross-entropy (plus the compressive
memory's reconstruction loss), backward, AdamW step; the new memory is fed to the next step. The systems are in
``benchlib/memory_workers.py``.

Protocol: ``benchlib.protocol``, as bench_train.py: every measurement a fresh process, the systems alternating for
``--repeats`` rounds, the median of ``--steps`` steps after ``--warmup``, a wait for a quiet machine before each
measurement and reruns of noisy ones. Target: xfam >= 1.2x x-transformers. ``--profile`` adds each system's
``torch.profiler`` op table (self CPU ms per step) to the report.

    python scripts/bench_memory_models.py --quick             # a smoke run (~1 min)
    python scripts/bench_memory_models.py --profile           # the full run (~8 min): docs/benchmarks.md section

Writes a section of docs/benchmarks.md (kept when bench_train.py rewrites the page) and
docs/benchmarks_memory_models.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchlib import common, protocol
from benchlib.common import BATCH, ROOT, SEQ
from benchlib.memory_workers import LABELS, MEM_LEN, SYSTEMS, worker
from benchlib.progress import progress

START, END = "<!-- memory-models:start -->", "<!-- memory-models:end -->"
HEADING = "## Memory models: xfam memory=xl / compressive vs x-transformers' recurrence"
TARGET = 1.2


def measure(system: str, args: argparse.Namespace, label: str, rejected: list, steps: int) -> dict[str, Any]:
    argv = [system, "--warmup", str(args.warmup), "--steps", str(steps)]

    def describe(res: dict[str, Any]) -> str:
        if system == "matmul":
            return f"{system:<22}{res['gflops']:8.1f} GFLOP/s"
        return f"{system:<22}{BATCH * SEQ / res['step_s']:8.0f} tok/s  step {res['step_s'] * 1e3:6.1f} ms"

    run = lambda: protocol.spawn(Path(__file__).resolve(), argv, args, system)  # noqa: E731
    return protocol.measure(run, describe, label, args, rejected)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    runs, rejected, profiles = [], [], []
    total = args.repeats * (len(args.systems) + 1) + (len(args.systems) if args.profile else 0)
    with progress(total, "memory models") as tick:
        for rep in range(args.repeats):
            for system in ("matmul", *args.systems):
                res = measure(system, args, f"[round {rep + 1}/{args.repeats}]", rejected, args.steps)
                res["repeat"] = rep
                runs.append(res)
                tick()
        for system in args.systems if args.profile else ():
            res = measure(f"profile:{system}", args, "[profile]", rejected, args.profile_steps)
            res["system"] = system
            profiles.append(res)
            tick()
    meta = {**protocol.machine_meta(args), "repeats": args.repeats, "warmup": args.warmup, "steps": args.steps}
    return {"meta": meta, "runs": runs, "rejected": rejected, "profiles": profiles, "systems": list(args.systems)}


def summarize(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per system: median tokens/s over rounds, min, max, peak RSS; and the matmul GFLOP/s."""
    out = {}
    for system in [*data["systems"], "matmul"]:
        rs = [r for r in data["runs"] if r["system"] == system]
        if not rs:
            continue
        if system == "matmul":
            out[system] = {"gflops": statistics.median(r["gflops"] for r in rs)}
            continue
        tps = [BATCH * SEQ / r["step_s"] for r in rs]
        out[system] = {
            "tps": statistics.median(tps),
            "lo": min(tps),
            "hi": max(tps),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
            "rounds": len(rs),
        }
    return out


def ratio(data: dict[str, Any], a: str, b: str) -> tuple[float, float, float] | None:
    """Median and range over rounds of tokens/s of ``a`` over ``b`` in the same round."""
    by = {(r["system"], r["repeat"]): r["step_s"] for r in data["runs"] if "step_s" in r}
    rs = [by[b, i] / by[a, i] for i in range(data["meta"]["repeats"]) if (a, i) in by and (b, i) in by]
    return (statistics.median(rs), min(rs), max(rs)) if rs else None


def render_md(data: dict[str, Any], png: Path) -> str:
    s, m = summarize(data), data["meta"]
    lines = [
        f"`scripts/bench_memory_models.py` ({m['date'][:10]}, {m['cpu']}, {m['cores']} cores, {m['threads']} threads, "
        f"torch {m['torch']}, x-transformers {m['x_transformers']}; command `{m['command']}`). Vocab 256, width 256, 4 "
        f"layers, 4 heads, batch 8 x segment 256, fp32, a memory of {MEM_LEN} states per layer fed from step to step, "
        "T5 relative position biases (xfam `pos=t5`, x-transformers `rel_pos_bias=True`, no absolute embedding); "
        "`memory=compressive` keeps its defaults besides (128 compressed slots of rate 3, a learned convolution and "
        "its attention-reconstruction loss), so it attends to 640 keys where the others attend to 512. "
        f"Median over {m['repeats']} alternating rounds of the median of {m['steps']} steps after {m['warmup']} "
        "warm-up steps, each a fresh process (bench_train.py's protocol).",
        "",
        f"![memory models]({png.name})",
        "",
        "| system | tokens/s | range | peak RSS | vs x-transformers |",
        "|---|---:|---:|---:|---:|",
    ]
    for system in data["systems"]:
        if system not in s:
            continue
        r = s[system]
        vs = ratio(data, system, "xtransformers_xl") if system != "xtransformers_xl" else None
        cell = "—" if vs is None else f"{vs[0]:.2f}x [{vs[1]:.2f}-{vs[2]:.2f}]"
        spread = f"{r['lo']:,.0f}-{r['hi']:,.0f}"
        lines.append(f"| {LABELS[system]} | {r['tps']:,.0f} | {spread} | {r['peak_rss_mb']:,.0f} MB | {cell} |")
    verdicts = []
    for system in ("xfam_xl", "xfam_compressive"):
        vs = ratio(data, system, "xtransformers_xl")
        if vs:
            verdicts.append(f"{LABELS[system]} {vs[0]:.2f}x ({'met' if vs[0] >= TARGET else 'not met'})")
    lines += ["", f"Target: xfam >= {TARGET}x x-transformers: " + "; ".join(verdicts) + "."]
    lines += profile_tables(data)
    return "\n".join(lines)


def profile_tables(data: dict[str, Any]) -> list[str]:
    """The ops with the most self CPU time per step, side by side for the profiled systems."""
    profs = {p["system"]: p for p in data.get("profiles", [])}
    if not profs:
        return []
    ops: list[str] = []
    for p in profs.values():
        ops += [k for k in list(p["ops"])[:12] if k not in ops]
    names = list(profs)
    out = [
        "",
        "Where the time goes (`torch.profiler`, self CPU ms per step, one process per system; profiling slows a "
        "step, so compare the columns with each other):",
        "",
        "| op | " + " | ".join(LABELS[n] for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for op in ops:
        cells = [f"{profs[n]['ops'][op][0]:.1f}" if op in profs[n]["ops"] else "—" for n in names]
        out.append(f"| `{op}` | " + " | ".join(cells) + " |")
    out.append("| all ops | " + " | ".join(f"{profs[n]['ops_total_ms']:.0f}" for n in names) + " |")
    return out


def chart(data: dict[str, Any]):
    def draw(png: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        s = summarize(data)
        names = [n for n in data["systems"] if n in s]
        fig, ax = plt.subplots(figsize=(7, 3.2))
        vals = [s[n]["tps"] for n in names]
        err = [[s[n]["tps"] - s[n]["lo"] for n in names], [s[n]["hi"] - s[n]["tps"] for n in names]]
        colors = ["tab:blue" if n.startswith("xfam") else "tab:gray" for n in names]
        ax.barh([LABELS[n] for n in names], vals, xerr=err, color=colors)
        ax.set_xlabel("training tokens/s (median over rounds; bars: min-max)")
        ax.set_title(f"memory models, width 256, 4 layers, batch 8 x 256, memory {MEM_LEN}")
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)

    return draw


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems, in round order")
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per process (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="discarded steps per process (default 3)")
    p.add_argument("--profile", action="store_true", help="also profile each system (torch.profiler)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per process (default 3)")
    p.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks.md", help="markdown page (a section of it)")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks_memory_models.png", help="chart path")
    p.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="render the docs from saved raw results")
    p.add_argument("--no-docs", action="store_true", help="print the summary only")
    p.add_argument("--quick", action="store_true", help="1 round, 1 warm-up + 2 timed steps, no waiting")
    protocol.add_protocol_options(p)
    p.add_argument("--worker", nargs=1, metavar="SYSTEM", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.warmup, args.steps, args.threads)
        return
    if args.quick:
        args.repeats, args.warmup, args.steps, args.max_wait, args.retries = 1, 1, 2, 0, 0
    data = json.loads(args.from_json.read_text()) if args.from_json else run_all(args)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    if not args.no_docs:
        common.write_report(args.md, args.png, (START, END), HEADING, chart(data), render_md(data, args.png))
        print(f"wrote {args.md} and {args.png}")
    for system, r in summarize(data).items():
        print(f"{system:<22}" + (f"{r['tps']:8.0f} tok/s" if "tps" in r else f"{r['gflops']:8.1f} GFLOP/s"))
    for system in ("xfam_xl", "xfam_compressive"):
        if vs := ratio(data, system, "xtransformers_xl"):
            print(f"{system} / xtransformers_xl: {vs[0]:.2f}x [{vs[1]:.2f}-{vs[2]:.2f}]  target >= {TARGET}")


if __name__ == "__main__":
    sys.exit(main())
