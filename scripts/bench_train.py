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
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import protocol
from benchlib.common import BATCH, NOTES_MARKER, POS, ROOT, SEQ, SYSTEMS
from benchlib.protocol import add_protocol_options
from benchlib.report import RATIOS, ratios, render_md, render_png, summarize
from benchlib.workers import worker

#: A hand-written overview right under the page's title, kept (like the notes) when the report is rewritten.
OVERVIEW = re.compile(r"<!-- overview:start -->.*?<!-- overview:end -->", re.S)


def spawn(system: str, pos: str, args: argparse.Namespace, warmup: int, steps: int) -> dict[str, Any]:
    argv = [system, pos, "--warmup", str(warmup), "--steps", str(steps)]
    return protocol.spawn(Path(__file__).resolve(), argv, args, f"{system}/{pos}")


def measure(
    system: str, pos: str, args: argparse.Namespace, label: str, rejected: list, warmup: int, steps: int
) -> dict[str, Any]:
    """One measurement in a fresh process; rerun (at most ``--retries`` times) while it was noisy."""

    def describe(res: dict[str, Any]) -> str:
        if system == "matmul":
            return f"{system:<20}{res['gflops']:8.1f} GFLOP/s (2048^3 fp32)"
        body = f"{system:<20}{BATCH * SEQ / res['step_s']:8.0f} tok/s  step {res['step_s'] * 1e3:6.1f} ms"
        return body + (f"  peak RSS {res['peak_rss_mb']:5.0f} MB" if "peak_rss_mb" in res else "")

    return protocol.measure(lambda: spawn(system, pos, args, warmup, steps), describe, label, args, rejected)


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
    return {
        **protocol.machine_meta(args),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "steps": args.steps,
        "systems": list(args.systems),
        "pos": list(args.pos),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="rounds of A B C D E per pos (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per process (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="discarded steps per process (default 5)")
    p.add_argument("--pos", nargs="+", choices=POS, default=list(POS), help="positional encodings")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems, in round order")
    p.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks.md", help="markdown report path")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks.png", help="chart path")
    p.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="render the docs from saved raw results")
    p.add_argument("--no-docs", action="store_true", help="print the summary only; write no md/png")
    p.add_argument("--quick", action="store_true", help="1 round, 2 warm-up + 4 timed steps (a smoke run)")
    add_protocol_options(p)
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
        if args.md.exists() and (overview := OVERVIEW.search(args.md.read_text())):  # and the overview under the title
            title, rest = text.split("\n", 1)
            text = f"{title}\n\n{overview.group(0)}\n{rest}"
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
