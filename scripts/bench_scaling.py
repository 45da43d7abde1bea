#!/usr/bin/env python
"""How training cost grows with width and with row length, for xfam and the minimal PyTorch model, and the peak
memory per token of the sparse and linear attention mechanisms against SDPA.

Training (``benchlib/scaling_workers.py``: bench_train.py's ``minimal`` and ``xfam`` models, learned positions,
4 layers, heads of 64, fp32, a causal LM, AdamW, 2 torch threads; ~2048 tokens per step: batch = 2048 / rows, at
least 1): widths ``--widths`` at rows 256, and rows ``--rows`` at width 256. Per point: tokens/s (the median of
the timed steps after the warm-up; fewer steps at the large sizes, ``--steps``/``--big-steps``), model-FLOP
utilisation against a 2048^3 fp32 matmul measured in the same run, and the peak RSS of the run (minus the RSS
before the model was built: parameters, gradients, optimiser state, activations). Each point is a fresh process,
after a wait for a quiet machine (``benchlib.protocol``).

Attention memory (``scripts/bench_attention.py``'s worker: batch 1, 4 heads, head dim 64, forward+backward,
bidirectional, glibc's allocator left as is): the peak RSS per token of every mechanism of ``--mechanisms``
over the row lengths.

    python scripts/bench_scaling.py --quick        # a smoke run (~2 min)
    python scripts/bench_scaling.py                # the full run (~12 min on a 2-core CPU): docs/scaling.{md,png}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchlib import protocol
from benchlib.common import ROOT, write_section
from benchlib.progress import progress
from benchlib.scaling_workers import flops, shape, worker

SYSTEMS = ("minimal", "xfam")
MECHANISMS = ("sdpa", "local", "longformer", "bigbird", "performer", "linformer")
START, END = "<!-- scaling:start -->", "<!-- scaling:end -->"
PAGE = "# Scaling: training cost vs width and row length\n"


def train_point(system: str, width: int, rows: int, args: argparse.Namespace, rejected: list) -> dict[str, Any]:
    big = width * width * max(1, 2048 // rows) * rows > 256 * 256 * 2048 * 2 or rows > 1024
    steps, warmup = (args.big_steps, 1) if big else (args.steps, args.warmup)
    argv = [system, str(width), str(rows), "--warmup", str(warmup), "--steps", str(steps)]

    def describe(res: dict[str, Any]) -> str:
        if system == "matmul":
            return f"matmul {res['gflops']:.1f} GFLOP/s"
        tps, peak = res["tokens_per_s"], res["peak_rss_mb"]
        return f"{system:<8} width {width:<5} rows {rows:<5} {tps:8.0f} tok/s  peak {peak:6.0f} MB"

    run = lambda: protocol.spawn(Path(__file__).resolve(), argv, args, f"{system}/{width}/{rows}")  # noqa: E731
    res = protocol.measure(run, describe, "", args, rejected)
    res.update({"steps": steps, "warmup": warmup})
    return res


def attention_point(name: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "XFAM_KEEP_FREED_MEMORY": "0"}
    cmd = [sys.executable, str(ROOT / "scripts/bench_attention.py"), "--worker", name, str(length), "0"]
    proc = subprocess.run(
        [*cmd, "--repeats", "1", "--threads", str(args.threads)], env=env, capture_output=True, text=True
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    print(f"attention {name:<11} L={length:<5} " + (f"{res['peak_mb']:7.1f} MB" if "peak_mb" in res else res["error"]))
    return {**res, "name": name, "L": length}


def run(args: argparse.Namespace) -> dict[str, Any]:
    grid = [(w, 256) for w in args.widths] + [(256, r) for r in args.rows if r != 256 or 256 not in args.widths]
    rejected: list = []
    total = 1 + len(grid) * len(args.systems) + len(args.mechanisms) * len(args.rows)
    train, attention = [], []
    with progress(total, "scaling") as tick:
        matmul = train_point("matmul", 256, 256, args, rejected)
        tick()
        for width, rows in grid:
            for system in args.systems:
                train.append(train_point(system, width, rows, args, rejected))
                tick()
        for length in args.rows:
            for name in args.mechanisms:
                attention.append(attention_point(name, length, args))
                tick()
    meta = protocol.machine_meta(args)
    return {"meta": meta, "matmul_gflops": matmul["gflops"], "train": train, "attention": attention}


def _find(train: list[dict[str, Any]], system: str, width: int, rows: int) -> dict[str, Any] | None:
    return next((r for r in train if r["system"] == system and r["width"] == width and r["rows"] == rows), None)


def render_md(data: dict[str, Any]) -> str:
    m, peak = data["meta"], data["matmul_gflops"]
    train = data["train"]
    lines = [
        f"`scripts/bench_scaling.py` ({m['date'][:10]}, {m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch "
        f"{m['torch']}; command `{m['command']}`). Training steps of bench_train.py's `minimal` (plain PyTorch on "
        "SDPA) and `xfam` models: learned positions, 4 layers, heads of 64, fp32, AdamW, about 2048 tokens per step "
        "(batch 2048 / rows, at least 1). MFU: model FLOPs per second (6 N tokens + the attention's 12 L S D per "
        "token) "
        f"over a 2048^3 fp32 matmul measured in the same run ({peak:.0f} GFLOP/s). Peak memory: the run's peak RSS "
        "minus the RSS before the model was built. Each point is one fresh process; the steps column says how many "
        "steps were timed (after the warm-up ones). MFU can pass 100%: the attention term counts the full L x L "
        "square (as bench_train.py counts it), while the causal SDPA kernel skips the masked half, which matters "
        "at long rows, and a 2048^3 matmul is not the machine's peak.",
        "",
        "![scaling](scaling.png)",
        "",
    ]
    for title, pts in (
        ("Width (rows 256)", sorted({(r["width"], 256) for r in train if r["rows"] == 256})),
        ("Row length (width 256)", sorted({(256, r["rows"]) for r in train if r["width"] == 256})),
    ):
        lines += [
            f"## {title}",
            "",
            "| width | rows | batch | system | steps | tokens/s | MFU | peak memory | xfam / minimal |",
        ]
        lines.append("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
        for width, rows in pts:
            for system in SYSTEMS:
                r = _find(train, system, width, rows)
                if r is None:
                    continue
                mfu = flops(width, rows) / r["step_s"] / (peak * 1e9)
                mini = _find(train, "minimal", width, rows)
                vs = f"{r['tokens_per_s'] / mini['tokens_per_s']:.2f}x" if system == "xfam" and mini else ""
                lines.append(
                    f"| {width} | {rows} | {shape(width, rows)['BATCH']} | {system} | {r['steps']} | "
                    f"{r['tokens_per_s']:,.0f} | {mfu:.1%} | {r['peak_rss_mb'] - r['rss_before_mb']:,.0f} MB | {vs} |"
                )
        lines.append("")
    att = data["attention"]
    lengths = sorted({r["L"] for r in att})
    names = list(dict.fromkeys(r["name"] for r in att))
    lines += [
        "## Attention: peak memory per token",
        "",
        "One bidirectional attention call, forward and backward (`scripts/bench_attention.py`'s worker: batch 1, 4 "
        "heads, head dim 64, fp32, each point a fresh process, glibc's allocator left as is, "
        "`XFAM_KEEP_FREED_MEMORY=0`): peak RSS minus the RSS before the inputs were made, divided by the row "
        "length, in KB per token (a falling row: a fixed cost spread over more tokens; a flat one: linear memory). "
        "Settings of bench_attention.py: local a 512 window (refused at L = 256, shorter than it), Longformer a 512 "
        "window and one global token, "
        "BigBird blocks of 64, Performer 256 features, Linformer k = 256.",
        "",
        "| mechanism | " + " | ".join(f"L={n}" for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name in names:
        cells = []
        for n in lengths:
            r = next((x for x in att if x["name"] == name and x["L"] == n), None)
            cells.append(f"{r['peak_mb'] * 1024 / n:,.1f}" if r and "peak_mb" in r else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(data: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, peak = data["train"], data["matmul_gflops"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for row, (axis, fixed, label) in enumerate((("width", "rows", "width"), ("rows", "width", "row length"))):
        for system, style in (("minimal", dict(color="k", ls="--")), ("xfam", dict(color="tab:blue"))):
            pts = sorted((r[axis], r) for r in train if r["system"] == system and r[fixed] == 256)
            xs = [x for x, _ in pts]
            metrics = (
                [r["tokens_per_s"] for _, r in pts],
                [flops(r["width"], r["rows"]) / r["step_s"] / (peak * 1e9) * 100 for _, r in pts],
                [r["peak_rss_mb"] - r["rss_before_mb"] for _, r in pts],
            )
            for col, (ys, ylabel) in enumerate(zip(metrics, ("tokens/s", "MFU (%)", "peak memory (MB)"))):
                ax = axes[row][col]
                ax.plot(xs, ys, marker="o", label=system, **style)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel(label)
                ax.set_ylabel(ylabel)
                ax.set_title(f"training: {ylabel} vs {label}")
                ax.grid(alpha=0.3, which="both")
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    att = data["attention"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(dict.fromkeys(r["name"] for r in att)):
        pts = sorted((r["L"], r["peak_mb"] * 1024 / r["L"]) for r in att if r["name"] == name and "peak_mb" in r)
        kw = dict(color="k", lw=2.5) if name == "sdpa" else dict(color=plt.get_cmap("tab10")(i), marker="o")
        ax.plot(*zip(*pts), label=name, **kw)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("row length L")
    ax.set_ylabel("peak memory per token (KB)")
    ax.set_title("attention forward+backward: peak memory per token")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png.with_name("scaling_attention.png"), dpi=100)
    plt.close(fig)


def write(data: dict[str, Any], md: Path) -> None:
    md.parent.mkdir(parents=True, exist_ok=True)
    chart(data, md.with_suffix(".png"))
    body = render_md(data).replace("![scaling](scaling.png)", f"![scaling]({md.stem}.png)")
    body += f"\n\n![attention memory per token]({md.stem}_attention.png)"
    write_section(md, START, END, body, new_file=PAGE)
    print(f"wrote {md}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512, 1024], help="widths at rows 256")
    p.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096], help="row lengths at width 256")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), help="attention memory: mechanisms")
    p.add_argument("--steps", type=int, default=6, help="timed steps at the small sizes (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps at the small sizes (default 2)")
    p.add_argument("--big-steps", type=int, default=2, help="timed steps at width 1024 or rows > 1024 (1 warm-up)")
    p.add_argument("--md", type=Path, default=ROOT / "docs/scaling.md", help="markdown page; its PNGs go beside it")
    p.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="render the docs from saved raw results")
    p.add_argument("--no-docs", action="store_true", help="write no md/png")
    p.add_argument("--quick", action="store_true", help="small grid, 1 step, no waiting (a smoke run)")
    protocol.add_protocol_options(p)
    p.set_defaults(max_wait=120, retries=1)
    p.add_argument("--worker", nargs=3, metavar=("SYSTEM", "WIDTH", "ROWS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), int(args.worker[2]), args.warmup, args.steps, args.threads)
        return
    if args.quick:
        args.widths, args.rows, args.steps, args.big_steps, args.warmup = [128, 256], [256, 512], 1, 1, 1
        args.max_wait, args.retries = 0, 0
    data = json.loads(args.from_json.read_text()) if args.from_json else run(args)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    if not args.no_docs:
        write(data, args.md)


if __name__ == "__main__":
    main()
