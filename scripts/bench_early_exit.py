#!/usr/bin/env python
"""Early exit in wall-clock time: generation with CALM and the Depth-Adaptive Transformer against the same models at
full depth, beside the layers they save (``xfam.model.propagate``: an exited token's later layers only produce its
keys and values).

Protocol: two byte-level LMs of the embedded corpus (width 256, 6 layers, 4 heads, rotary positions, rows of 512
bytes, 4 per batch, 400 steps; ``experiment=early_exit`` with ``exit=calm`` and ``exit=depth_adaptive``,
geometric exit classifier) are trained, or reused from ``--runs``. Each threshold is calibrated with Learn-then-Test
(``xfam calibrate``'s method: the share of an example's predictions that disagree with the full model, bounded by
``--delta`` with probability 1 - ``--epsilon``) on the validation split. Then, on prompts of 256 bytes of the test
split, greedy decoding of 256 new tokens (``generate(decoder="static")``, what ``generate`` picks for an early-exit
model: the fixed-shape cache, uncompiled; ``--decoder eager``: the growing cache) at batch 1 and 8, for three
systems, alternating for ``--rounds`` rounds after a warm-up each, medians:

* ``full``  -- the same model at full depth (``model.exit.full_depth()``);
* ``early`` -- early exit with state propagation (what ``generate`` runs);
* ``whole`` -- early exit whose exited tokens still run every later layer whole (xfam before state propagation).

new tokens/s = batch x 256 / wall time of one ``generate`` call (the prompt's pass included). Layers saved = 1 - mean
depth / layers of the generated tokens; wall saved = 1 - early time / full time; ratio = wall saved / layers saved.

    python scripts/bench_early_exit.py                 # train (or reuse), calibrate, measure, write docs/exit.md
    python scripts/bench_early_exit.py --quick         # one round, 32 new tokens, batch 1: a check (no docs)

``measure(model, prompt, new_tokens)`` is the measurement of one model and prompt, for other benchmarks
(scripts/bench_generate.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib.common import write_section  # noqa: E402
from benchlib.protocol import alternate  # noqa: E402

from xfam.cli.calibrate import candidates  # noqa: E402
from xfam.eval.calibrate import ltt_threshold  # noqa: E402
from xfam.eval.generate import generate  # noqa: E402
from xfam.eval.inference import threshold_sweep  # noqa: E402
from xfam.eval.loop import split_loader  # noqa: E402
from xfam.model.checkpoint import load_model  # noqa: E402
from xfam.model.stack import Stack  # noqa: E402

SHAPE = [
    "experiment=early_exit",
    "model.dim=256",
    "model.layers=6",
    "model.heads=4",
    "data.seq_len=512",
    "model.max_len=512",
    "data.batch_size=4",
    "trainer.max_steps=400",
    "trainer.val_check_interval=200",
]
MODELS = {"calm": ["exit=calm"], "depth_adaptive": ["exit=depth_adaptive"]}
MARKERS = ("<!-- bench_early_exit:start -->", "<!-- bench_early_exit:end -->")
DOC = ROOT / "docs" / "exit.md"


@contextlib.contextmanager
def whole_layers() -> Iterator[None]:
    """Within the context an exited token's copied state runs through every later layer whole (the stack has no
    ``run_layer_rows``): the early-exit traversal as it was before state propagation."""
    saved = Stack.run_layer_rows
    del Stack.run_layer_rows  # type: ignore[misc]
    try:
        yield
    finally:
        Stack.run_layer_rows = saved  # type: ignore[method-assign]


@torch.no_grad()
def measure(
    model: Any, prompt: Tensor, new_tokens: int, rounds: int = 3, whole: bool = True, decoder: str = "static"
) -> dict[str, Any]:
    """Greedy generation of ``new_tokens`` after ``prompt [B, T]`` by an early-exit ``model`` (``exit=calm`` or
    ``depth_adaptive``, at its current inference options) against the same model at full depth (and, with
    ``whole``, early exit whose exited tokens run every later layer whole), every system with ``decoder``
    (``static``, what ``generate`` picks for an early-exit model: the fixed-shape cache, uncompiled; or
    ``eager``: the growing cache), alternating for ``rounds`` rounds after one warm-up call each; median
    seconds per call.

    Returns ``batch``, ``prompt``, ``new``, ``seconds`` and ``tokens_per_s`` per system (``full``, ``early``,
    ``whole``), ``layers_saved`` (1 - mean depth / layers of the generated tokens), ``wall_saved`` (1 - early /
    full seconds), ``ratio`` (wall saved / layers saved), ``same_tokens`` (share of greedy tokens equal to full
    depth's) and ``whole_equal`` (early exit's tokens identical with and without state propagation)."""
    model.eval()

    def early() -> Any:
        return generate(model, prompt, new_tokens, temperature=0, decoder=decoder)

    def full() -> Any:
        with model.exit.full_depth():
            return generate(model, prompt, new_tokens, temperature=0, decoder=decoder)

    def old() -> Any:
        with whole_layers():
            return early()

    systems: dict[str, Callable[[], Any]] = {"full": full, "early": early, **({"whole": old} if whole else {})}
    results = {name: call() for name, call in systems.items()}  # warm-up
    seconds = {name: statistics.median(t) for name, t in alternate(systems, rounds).items()}
    batch, length = prompt.shape
    gen = results["early"]
    layers_saved = 0.0 if gen.depth is None else 1 - float(gen.depth.float().mean()) / model.num_layers
    wall_saved = 1 - seconds["early"] / seconds["full"]
    new_early, new_full = gen.tokens[:, length:], results["full"].tokens[:, length:]
    return {
        "batch": batch,
        "prompt": length,
        "new": new_tokens,
        "seconds": seconds,
        "tokens_per_s": {name: batch * new_tokens / s for name, s in seconds.items()},
        "layers_saved": layers_saved,
        "wall_saved": wall_saved,
        "ratio": wall_saved / layers_saved if layers_saved > 0 else None,
        "same_tokens": float((new_early == new_full).float().mean()),
        "whole_equal": bool(torch.equal(gen.tokens, results["whole"].tokens)) if whole else None,
    }


def train(runs: Path, name: str) -> Path:
    """``python train.py <SHAPE> <exit> name=bench_<name>`` into ``runs`` (reused when finished): its last
    checkpoint."""
    pattern = str(runs / f"bench_{name}" / "*" / "checkpoints" / "last.ckpt")
    if found := glob.glob(pattern):
        print(f"reusing {found[0]}", flush=True)
        return Path(found[0])
    cmd = [sys.executable, str(ROOT / "train.py"), *SHAPE, *MODELS[name], f"name=bench_{name}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "XFAM_RUNS": str(runs)}, cwd=ROOT)
    return Path(glob.glob(pattern)[0])


def batches(meta: dict[str, Any], split: str, limit: int) -> list[dict[str, Tensor]]:
    loader, _ = split_loader(meta["config"], meta["data_info"], split, None)
    return [b for _, b in zip(range(limit), loader, strict=False)]


def calibrate(model: Any, meta: dict[str, Any], delta: float, epsilon: float, limit: int) -> dict[str, Any]:
    """The Learn-then-Test threshold on ``limit`` validation batches (``xfam calibrate``'s default grid); set on
    the model's policy. None: no candidate passed (exits stay disabled)."""
    grid = candidates(model.exit, [])
    sweep = threshold_sweep(model, batches(meta, "validation", limit), "lm", grid)
    chosen = ltt_threshold(sweep["risk"], grid, delta, epsilon)
    threshold = grid[chosen] if chosen is not None else None
    model.exit.threshold = threshold if threshold is not None else 1.01
    risk = sweep["risk"].mean(0).tolist()
    return {
        "threshold": threshold,
        "delta": delta,
        "epsilon": epsilon,
        "examples": int(sweep["risk"].shape[0]),
        "risk": None if chosen is None else risk[chosen],
        "depth": None if chosen is None else sweep["depth"][chosen],
        "grid": grid,
        "sweep_depth": sweep["depth"],
        "sweep_risk": risk,
    }


def prompts(meta: dict[str, Any], batch: int, length: int) -> Tensor:
    """``[batch, length]`` prompts: the first ``length`` bytes of the first test rows."""
    rows = torch.cat([b["input_ids"] for b in batches(meta, "test", -(-batch // meta["config"]["data"]["batch_size"]))])
    return rows[:batch, :length]


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Measured {meta['date']} on {meta['machine']}, torch {meta['torch']}, {meta['threads']} torch thread(s); "
        f"`{meta['command']}`. Models: width 256, 6 layers, 4 heads, rotary positions, byte-level, 400 steps on the "
        f"embedded corpus; threshold by Learn-then-Test on {results[0]['calibration']['examples']} validation rows "
        f"(delta {results[0]['calibration']['delta']}, epsilon {results[0]['calibration']['epsilon']}); greedy, "
        f"prompt {results[0]['prompt']} bytes, {results[0]['new']} new tokens, decoder={meta['decoder']}, medians of "
        f"{meta['rounds']} alternating rounds.",
        "",
        "| model | threshold | batch | layers saved | full tok/s | early exit tok/s | whole layers tok/s "
        "| wall saved | wall / layers saved | same tokens as full |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c, t = r["calibration"], r["tokens_per_s"]
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['model']} | {c['threshold']} | {r['batch']} | {r['layers_saved']:.1%} | {t['full']:.0f} "
            f"| {t['early']:.0f} | {t.get('whole', float('nan')):.0f} | {r['wall_saved']:.1%} | {ratio} "
            f"| {r['same_tokens']:.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(ROOT / "runs" / "bench_early_exit"), help="training runs (reused)")
    parser.add_argument("--delta", type=float, default=0.1)
    parser.add_argument("--epsilon", type=float, default=0.05)
    parser.add_argument("--calib-batches", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one round, batch 1, 32 new tokens; no docs")
    parser.add_argument("--decoder", choices=["static", "eager"], default="static", help="generate's decoder")
    parser.add_argument("--out", default=None, help="also write the raw results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes, new, rounds = ((1,), 32, 1) if args.quick else ((1, 8), 256, args.rounds)
    results = []
    for name in MODELS:
        model, meta = load_model(train(Path(args.runs), name))
        cal = calibrate(model, meta, args.delta, args.epsilon, 2 if args.quick else args.calib_batches)
        print(name, "threshold", cal["threshold"], "risk", cal["risk"], "depth", cal["depth"], flush=True)
        for b in batch_sizes:
            r = measure(model, prompts(meta, b, 256), new, rounds, decoder=args.decoder)
            results.append({"model": name, "calibration": cal, **r})
            print(json.dumps({k: v for k, v in results[-1].items() if k != "calibration"}), flush=True)
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln),
        "?",
    )
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core {cpu} ({platform.machine()})",
        "torch": torch.__version__,
        "threads": args.threads,
        "rounds": rounds,
        "decoder": args.decoder,
        "command": " ".join(["python scripts/bench_early_exit.py", *sys.argv[1:]]),
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(report(results, meta))
    if not args.quick:
        write_section(DOC, *MARKERS, report(results, meta), new_heading="### Wall-clock time (measured)")


if __name__ == "__main__":
    main()
