#!/usr/bin/env python
"""Decoding benchmark: new tokens per second of xfam's compiled fixed-shape step (``generate(decoder="compiled")``,
``xfam.eval.fast_decode``), in torch.compile's default mode and with ``compile_mode="max-autotune"`` (on a CPU the
weights frozen into the step, its GEMMs autotuned), against xfam's eager decoding (a growing cache: the path every
model supports, and what ``generate`` ran before the fixed-shape step) and x-transformers' cached ``generate``,
beside the roofline of the machine.

Shape: vocab 256, width 256, 4 layers, 4 heads (head dim 64), pre-LayerNorm, FFN 4x GELU, fp32, 2 torch threads,
random weights; greedy decoding of 256 new tokens after a prompt of 256 or 2048 tokens, batch 1 and 8. Models:

* ``vanilla``   -- dense attention, rotary positions (x-transformers: ``rotary_pos_emb=True``);
* ``alibi``     -- dense attention, ALiBi (x-transformers: ``alibi_pos_bias=True``);
* ``local``     -- a sliding window of 256 keys, rotary (its decode state a rolling window; no x-transformers peer);
* ``performer`` -- FAVOR+ running sums, rotary (no x-transformers peer);
* early exit -- the trained CALM and Depth-Adaptive models of ``scripts/bench_early_exit.py`` (width 256, 6 layers,
  thresholds calibrated with Learn-then-Test), decoded with the uncompiled fixed-shape step that ``generate`` picks
  for them (a token's depth varies, which one compiled graph cannot follow), against the same models at full
  depth: the wall-clock saving beside the layer saving (``--early-exit``, or ``--runs`` to reuse the models).

Protocol: one process; for each (model, batch, prompt) the systems alternate for ``--rounds`` rounds after a warm-up
call each (the compiled step compiles in its warm-up, timed apart); medians. new tokens/s = batch x 256 / wall time
of one ``generate`` call (the prompt's pass included: 256 tokens of 2048 is not negligible at batch 8, and every
system pays it). Greedy tokens of the compiled path are checked identical to the eager path's.

Roofline: one step's FLOPs (2 x multiply-adds of the projections, FFN and head, plus attention's q.k and p.v over the
keys a query sees) and bytes (weights once per step, plus the keys/values or running sums it reads), at the middle
of the generation, against the measured matmul rate (a 2048^3 sgemm) and the measured read bandwidth of a working
set of the step's size (in the 32 MB L3 cache when it fits); roofline time = max(FLOPs / rate, bytes / bandwidth),
fraction = roofline time / measured time per token.

    python scripts/bench_generate.py                  # the full run (~15 min), writes docs/decoding.md's tables
    python scripts/bench_generate.py --quick          # vanilla, batch 1, prompt 64, 32 new tokens: a check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchlib.common import DIM, HEADS, LAYERS, ROOT, VOCAB, write_section
from benchlib.protocol import alternate, machine_meta

sys.path.insert(0, str(ROOT))

from xfam.eval.generate import generate  # noqa: E402
from xfam.model.build import build_model  # noqa: E402

MODELS = {  # name: (attention, pos, x-transformers Decoder options or None)
    "vanilla": ({"name": "vanilla"}, "rope", {"rotary_pos_emb": True}),
    "alibi": ({"name": "vanilla"}, "alibi", {"alibi_pos_bias": True}),
    "local": ({"name": "local", "window": 256}, "rope", None),
    "performer": ({"name": "performer"}, "rope", None),
}
MAX_LEN, NEW = 4096, 256
MARKERS = ("<!-- bench_generate:start -->", "<!-- bench_generate:end -->")


def build_xfam(name: str) -> Any:
    attention, pos, _ = MODELS[name]
    model = {"name": "bench", "dim": DIM, "layers": LAYERS, "heads": HEADS, "dropout": 0.0, "max_len": MAX_LEN}
    cfg = {"model": model, "attention": attention, "pos": {"name": pos}, "memory": {"name": "none"}}
    return build_model({**cfg, "exit": {"name": "none"}}, {"task": "lm", "vocab_size": VOCAB}).eval()


def build_xtransformers(name: str) -> Any:
    from x_transformers import AutoregressiveWrapper, Decoder, TransformerWrapper

    options = MODELS[name][2]
    layers = Decoder(dim=DIM, depth=LAYERS, heads=HEADS, **options)
    pos = {"use_abs_pos_emb": False} if options else {}
    return AutoregressiveWrapper(TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_LEN, attn_layers=layers, **pos))


def calls(name: str, batch: int, prompt: int, new: int) -> dict[str, Any]:
    """``system -> (call, description)``: a call decodes ``new`` tokens greedily and returns ``[batch, new]``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, prompt), generator=g)
    model = build_xfam(name)
    out = {
        "xfam max-autotune": lambda: generate(
            model, ids, new, temperature=0, decoder="compiled", compile_mode="max-autotune"
        ).tokens[:, prompt:],
        "xfam compiled": lambda: generate(model, ids, new, temperature=0, decoder="compiled").tokens[:, prompt:],
        "xfam eager": lambda: generate(model, ids, new, temperature=0, decoder="eager").tokens[:, prompt:],
    }
    if MODELS[name][2] is not None:
        xt = build_xtransformers(name).eval()
        out["x-transformers"] = lambda: xt.generate(ids, new, temperature=0.0, cache_kv=True)
    return out


@torch.no_grad()
def run_case(name: str, batch: int, prompt: int, new: int, rounds: int) -> dict[str, Any]:
    """Every system of one case, alternating; medians, and the compiled path's tokens checked against eager's."""
    systems = calls(name, batch, prompt, new)
    first: dict[str, float] = {}
    tokens: dict[str, torch.Tensor] = {}
    for system, call in systems.items():  # warm-up (the compiled step compiles here)
        start = time.perf_counter()
        tokens[system] = call()
        first[system] = time.perf_counter() - start
    for system in ("xfam compiled", "xfam max-autotune"):
        if not torch.equal(tokens[system], tokens["xfam eager"]):
            raise RuntimeError(f"{name} batch {batch} prompt {prompt}: {system} and eager greedy tokens differ")
    times = alternate(systems, rounds)
    med = {s: statistics.median(t) for s, t in times.items()}
    return {
        "model": name,
        "batch": batch,
        "prompt": prompt,
        "new": new,
        "seconds": times,
        "first_call_s": first,
        "tokens_per_s": {s: batch * new / t for s, t in med.items()},
        **roofline(name, batch, prompt + new // 2),
    }


def step_cost(name: str, batch: int, keys: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decoding step of ``name`` at ``batch`` with ``keys`` tokens before the new one."""
    matmul = LAYERS * 12 * DIM * DIM + DIM * VOCAB  # weights read once per step
    flops, weights = 2 * matmul * batch, 4 * matmul
    attention, pos, _ = MODELS[name]
    if attention["name"] == "performer":  # running sums [H, m, Dh] per layer: read, updated, written; m = Dh
        state = LAYERS * DIM * (DIM // HEADS)
        return flops + 2 * 4 * state * batch, weights + 2 * 4 * state * batch
    seen = min(keys, attention.get("window", keys))
    return flops + 4 * LAYERS * seen * DIM * batch, weights + 2 * 4 * LAYERS * seen * DIM * batch


def roofline(name: str, batch: int, keys: int) -> dict[str, float]:
    flops, nbytes = step_cost(name, batch, keys)
    return {"step_flops": flops, "step_bytes": nbytes}


def machine_rates(sizes: list[float]) -> dict[str, Any]:
    """The sgemm rate (FLOP/s) and the read bandwidth (bytes/s) of working sets of ``sizes`` bytes (best of 5)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    bandwidth = {}
    for size in sorted(set(int(s) for s in sizes)):
        x = torch.randn(size // 4)
        for _ in range(3):
            x.sum()
        reps = max(1, int(2e8 // size))
        bandwidth[str(size)] = size * reps / min(_timed(_summing(x, reps)) for _ in range(5))
    return {"matmul_flops_per_s": 2 * 2048**3 / best, "read_bytes_per_s": bandwidth}


def _summing(x: torch.Tensor, reps: int) -> Any:
    return lambda: [x.sum() for _ in range(reps)]


def _timed(f: Any) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def render(data: dict[str, Any]) -> str:
    rate = data["rates"]["matmul_flops_per_s"]
    m = data["machine"]
    lines = [
        f"Measured on a {m['cores']}-core {m['cpu']} CPU on {m['date'][:10]} (torch {m['torch']}, x-transformers "
        f"{m['x_transformers']}, 2 threads, xfam {m['xfam_commit']}), `{data['command']}`; matmul rate "
        f"{rate / 1e9:.0f} GFLOP/s.",
        "",
        "| model | batch | prompt | system | new tokens/s | ms per token | vs xfam eager | vs x-transformers "
        "| roofline ms | fraction of roofline | first call (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in data["cases"]:
        tps = case["tokens_per_s"]
        bw = data["rates"]["read_bytes_per_s"][str(int(case["step_bytes"]))]
        limit = max(case["step_flops"] / rate, case["step_bytes"] / bw) * 1e3  # ms per step
        for system, value in tps.items():
            ms = 1e3 * case["batch"] / value  # per step: one new token per row
            eager = value / tps["xfam eager"]
            xt = f"{value / tps['x-transformers']:.2f}x" if "x-transformers" in tps else "-"
            frac = f"{limit / ms:.0%}" if system.startswith("xfam") else "-"
            lines.append(
                f"| {case['model']} | {case['batch']} | {case['prompt']} | {system} | {value:,.0f} | {ms:.2f} | "
                f"{eager:.2f}x | {xt} | {limit:.2f} | {frac} | {case['first_call_s'][system]:.1f} |"
            )
    return "\n".join(lines)


def early_exit_rows(runs: Path, rounds: int, new: int, batches: tuple[int, ...]) -> list[dict[str, Any]]:
    """The early-exit models' wall-clock and layer savings (``bench_early_exit.measure``), trained or reused."""
    import bench_early_exit as ee

    from xfam.model.checkpoint import load_model

    rows = []
    for name in ee.MODELS:
        model, meta = load_model(ee.train(runs, name))
        cal = ee.calibrate(model, meta, 0.1, 0.05, 32)
        for batch in batches:
            r = ee.measure(model, ee.prompts(meta, batch, 256), new, rounds, whole=False)
            rows.append({"model": name, "threshold": cal["threshold"], **r})
            print(f"    {name} batch {batch}: {r['tokens_per_s']}, layers saved {r['layers_saved']:.1%}", flush=True)
    return rows


def render_early_exit(rows: list[dict[str, Any]]) -> str:
    lines = [
        "Early exit (trained byte-level models, width 256, 6 layers; the uncompiled fixed-shape step):",
        "",
        "| model | threshold | batch | full depth tok/s | early exit tok/s | layers saved | wall-clock saved "
        "| wall / layers saved |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, ratio = r["tokens_per_s"], "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['model']} | {r['threshold']} | {r['batch']} | {t['full']:,.0f} | {t['early']:,.0f} "
            f"| {r['layers_saved']:.1%} | {r['wall_saved']:.1%} | {ratio} |"
        )
    return "\n".join(lines)


def render_png(data: dict[str, Any], path: Path) -> None:
    """New tokens/s of every system per case (log scale), the roofline as a dash over each case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases, systems = data["cases"], ["xfam max-autotune", "xfam compiled", "xfam eager", "x-transformers"]
    rate = data["rates"]["matmul_flops_per_s"]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cases) + 2), 4.6))
    width = 0.2
    for j, system in enumerate(systems):
        xs = [i + (j - 1.5) * width for i, c in enumerate(cases) if system in c["tokens_per_s"]]
        ys = [c["tokens_per_s"][system] for c in cases if system in c["tokens_per_s"]]
        ax.bar(xs, ys, width, label=system, color=f"C{j}")
    for i, c in enumerate(cases):  # the roofline's tokens/s: batch / roofline time per step
        bw = data["rates"]["read_bytes_per_s"][str(int(c["step_bytes"]))]
        limit = max(c["step_flops"] / rate, c["step_bytes"] / bw)
        ax.plot([i - 2 * width, i + 2 * width], [c["batch"] / limit] * 2, color="k", lw=1)
    ax.plot([], [], color="k", lw=1, label="roofline")
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)), [f"{c['model']}\nb{c['batch']} p{c['prompt']}" for c in cases], fontsize=7)
    ax.set_ylabel(f"new tokens/s ({cases[0]['new']} new, greedy; median)")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8)
    m = data["machine"]
    title = f"Decoding, width {DIM}, {LAYERS} layers, fp32, {m['cores']}-core {m['cpu']}, {m['date'][:10]}"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="vanilla, batch 1, prompt 64, 32 new tokens, 1 round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per system and case (default 3)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="models to run")
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--no-early-exit", action="store_true", help="skip the early-exit models (they train first)")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench_early_exit", help="early-exit models' runs")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/decoding.md")
    args = p.parse_args()
    torch.set_num_threads(2)
    if args.quick:
        plan, new, rounds = [("vanilla", 1, 64)], 32, 1
    else:
        plan = [(m, b, t) for m in args.models for b in (1, 8) for t in (256, 2048)]
        new, rounds = NEW, args.rounds
    cases = []
    for i, (name, batch, prompt) in enumerate(plan):
        print(f"[{i + 1}/{len(plan)}] {name} batch {batch} prompt {prompt}", flush=True)
        cases.append(run_case(name, batch, prompt, new, rounds))
        print("   ", {s: round(v) for s, v in cases[-1]["tokens_per_s"].items()}, flush=True)
    settings = argparse.Namespace(threads=2, quiet=None, max_wait=0, noisy=None, retries=0, timeout=None)
    data = {
        "machine": machine_meta(settings),
        "command": "python scripts/bench_generate.py" + (" --quick" if args.quick else ""),
        "cases": cases,
        "rates": machine_rates([c["step_bytes"] for c in cases]),
        "early_exit": [] if args.quick or args.no_early_exit else early_exit_rows(args.runs, rounds, new, (1, 8)),
    }
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    table = render(data) + (f"\n\n{render_early_exit(data['early_exit'])}" if data["early_exit"] else "")
    print(table)
    if not args.no_docs:
        render_png(data, ROOT / "docs" / "decoding.png")
        write_section(ROOT / "docs" / "decoding.md", *MARKERS, f"![new tokens/s per case](decoding.png)\n\n{table}")


if __name__ == "__main__":
    main()
