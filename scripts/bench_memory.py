#!/usr/bin/env python
"""Transformer-XL cached evaluation vs the vanilla model's sliding window, per attention length L.

Transformer-XL (Dai et al., ACL 2019, arXiv:1901.02860, end of section 3.2 and "evaluation speed"
in section 4): in evaluation the vanilla model with a context of L tokens consumes a segment of L
tokens, makes one prediction at its last position, shifts the segment right by one and recomputes
it from scratch; Transformer-XL reuses the hidden states cached from the previous segments. The
paper measures up to 1,874x faster evaluation at attention length 3,800, a speed-up that grows with L.

Both methods score the same random token stream of ``--tokens`` T tokens with the same weights
(``XfamModel``: vanilla attention, ``memory=xl``, fp32, batch 1, eval mode, ``torch.no_grad``):

* sliding window: ``log p(x_t | x_{t-L} .. x_{t-1})`` from the last position of one forward over
  the L previous tokens (shift 1), for the last ``n`` positions of the stream. Timed twice: one
  window per forward (the paper's baseline) and B consecutive windows stacked into one
  ``[B, L]`` forward (``--window-batch``: the same FLOPs, larger matrix products). Each
  prediction costs a forward of L tokens: O(L^2) per token, O(T L^2) for the stream.
* XL cached: segments of S = L / 2 tokens (``--seg-frac``) with a per-layer memory of M = L - S
  states carried across segments, so every query attends to at most L positions (M memory plus
  its segment prefix, itself included), like the last position of a sliding window.

Time per evaluated token: sliding = wall time / windows; XL = wall time of the segments whose
memory was already full / their tokens. The methods alternate within each of ``--repeats`` rounds
after a warm-up; medians are reported, with the cores other processes used meanwhile. Also checked:
the batched windows equal one-at-a-time (max |diff|), and XL with a memory covering the whole stream
equals one full-sequence forward (within 1e-4). Bits per token of both are reported on the same
positions; they differ (different contexts) and, for an untrained model on a random stream, are
both ~log2(vocab).

    python scripts/bench_memory.py                          # L = 128 .. 1024, pos=xl: ~8 min on 2 threads
    python scripts/bench_memory.py --pos xl rope --lengths 256 1024
    python scripts/bench_memory.py --quick                  # a smoke run (under a minute)

Writes docs/memory_benchmarks.md and docs/memory_benchmarks.png after every point, so a cut-off run
leaves a partial table.

One file over 400 lines: the protocol, both evaluation paths and the report are read together, and the worker
re-runs this file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchlib.common import cpu_busy_s
from torch import Tensor

from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel

ROOT = Path(__file__).resolve().parent.parent
LN2 = math.log(2)
CHECK_TOL = 1e-4


# -- the two evaluations (no timing in here) ------------------------------------------------------


def build_model(
    pos: str, mem_len: int, *, layers: int, dim: int, heads: int, vocab: int, max_len: int, seed: int = 0
) -> XfamModel:
    """A causal LM with vanilla attention and ``memory=xl``, in eval mode. The memory has no
    parameters, so the same ``seed`` gives the same weights for every ``mem_len``."""
    torch.manual_seed(seed)
    model = XfamModel(
        ModelSpec(dim=dim, layers=layers, heads=heads, max_len=max_len),
        task="lm",
        vocab_size=vocab,
        attention={"name": "vanilla"},
        pos={"name": pos},
        memory={"name": "xl", "mem_len": mem_len},
        exit={"name": "none"},
    )
    return model.eval()


def _pick(logits: Tensor, targets: Tensor) -> Tensor:
    """``log p(target)`` from ``logits [N, V]`` and ``targets [N]`` -> ``[N]``."""
    return logits.float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]


@torch.no_grad()
def full_logprobs(model: XfamModel, tokens: Tensor) -> Tensor:
    """One causal forward over the whole stream ``tokens [T]``: ``log p(x_t | x_<t)``, t = 1..T-1 -> ``[T-1]``."""
    return _pick(model(tokens[None, :-1]).logits[0], tokens[1:])


@torch.no_grad()
def sliding_window_logprobs(model: XfamModel, tokens: Tensor, context: int, start: int, batch: int = 1) -> Tensor:
    """The vanilla model's evaluation: ``log p(x_t | x_{t-context} .. x_{t-1})`` for t = start..T-1 -> ``[T-start]``.

    Each prediction is the last position of a forward over its own window of ``context`` tokens
    (shift 1, recomputed from scratch); ``batch`` consecutive windows are stacked into one
    ``[batch, context]`` forward. Positions t < context have fewer previous tokens than that: one
    causal forward over ``x_0 .. x_{context-1}`` gives all of them (position t-1 of a causal model
    sees exactly ``x_0 .. x_{t-1}``, what a window cut at the stream's start would hold).
    """
    assert 1 <= start < tokens.numel()
    out = []
    if start < context:
        head = tokens[: min(context, tokens.numel())]
        out.append(_pick(model(head[None, :-1]).logits[0], head[1:])[start - 1 :])
    first = max(start, context)
    ends = torch.arange(first, tokens.numel(), device=tokens.device)  # [N]: predicted positions
    for i in range(0, ends.numel(), batch):
        t = ends[i : i + batch]
        windows = tokens[(t - context)[:, None] + torch.arange(context, device=tokens.device)]  # [b, context]
        out.append(_pick(model(windows).logits[:, -1], tokens[t]))
    return torch.cat(out)


@torch.no_grad()
def xl_cached_logprobs(
    model: XfamModel, tokens: Tensor, seg_len: int, seg_times: list[tuple[int, int, float]] | None = None
) -> Tensor:
    """Transformer-XL evaluation: the stream in segments of ``seg_len`` inputs, the model's memory
    (its ``mem_len`` states per layer) carried across them: ``log p(x_t | ...)``, t = 1..T-1 -> ``[T-1]``.

    ``seg_times``, if given, receives ``(first input position, inputs, seconds)`` per segment
    (the forward and the log-softmax of its predictions).
    """
    memory = model.init_memory(1, tokens.device)
    out, n = [], tokens.numel() - 1  # inputs x_0 .. x_{T-2} predict x_1 .. x_{T-1}
    for i in range(0, n, seg_len):
        t0 = time.perf_counter()
        seg = tokens[i : min(i + seg_len, n)]  # [S]
        res = model(seg[None], memory=memory)
        memory = res.memory
        out.append(_pick(res.logits[0], tokens[i + 1 : i + 1 + seg.numel()]))
        if seg_times is not None:
            seg_times.append((i, seg.numel(), time.perf_counter() - t0))
    return torch.cat(out)


def bits_per_token(logprobs: Tensor) -> float:
    return float(-logprobs.mean() / LN2)


def flop_ratio(length: int, seg: int, mem: int, layers: int, dim: int, vocab: int) -> float:
    """Model FLOPs per prediction, sliding / XL: matrix products (12 D^2 per layer and token, plus the
    D V head) and attention (4 D per visible query-key pair and layer, causal pairs only); the
    sliding window computes all L positions (and the head on all of them) for one prediction.
    Transformer-XL's relative-position terms are not counted."""
    dense = 2 * (layers * 12 * dim * dim + dim * vocab)  # per token
    attn = 4 * dim * layers  # per visible (query, key) pair
    sliding = length * dense + attn * length * (length + 1) / 2
    xl = seg * dense + attn * (seg * mem + seg * (seg + 1) / 2)
    return sliding / (xl / seg)


# -- measurement ------------------------------------------------------------------------------------


class Meter:
    """Wall time of a block, and the cores other processes used meanwhile (machine busy time from
    /proc/stat minus this process's own CPU time)."""

    def __enter__(self) -> Meter:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.t0, self.own0, self.busy0 = time.perf_counter(), ru.ru_utime + ru.ru_stime, cpu_busy_s()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.wall = time.perf_counter() - self.t0
        own = ru.ru_utime + ru.ru_stime - self.own0
        self.foreign = max(0.0, (cpu_busy_s()[0] - self.busy0 - own) / self.wall)


def wait_for_quiet(max_wait: float, quiet: float = 0.5) -> float:
    """Wait (at most ``max_wait`` s) until other processes use under ``quiet`` cores for 1 s; the load seen last."""
    t0, calm, load = time.perf_counter(), 0, float("nan")
    while time.perf_counter() - t0 < max_wait:
        b0, s0 = cpu_busy_s()[0], time.perf_counter()
        time.sleep(0.5)
        load = (cpu_busy_s()[0] - b0) / (time.perf_counter() - s0)
        calm = calm + 1 if load < quiet else 0
        if calm >= 2:
            break
    return load


def measure_point(pos: str, length: int, tokens: Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Both methods at one attention length, alternating within each round."""
    seg = max(1, round(length * args.seg_frac))
    mem = length - seg
    model = build_model(pos, mem, **_sizes(args), max_len=max(length, tokens.numel()), seed=args.seed)
    n = min(tokens.numel() - length, max(args.window_batch, args.sliding_tokens * 128 // length))
    start = tokens.numel() - n  # the sliding window scores the last n positions (all have L previous tokens)
    methods = {
        "sliding_1": lambda: sliding_window_logprobs(model, tokens, length, start, 1),
        "sliding_b": lambda: sliding_window_logprobs(model, tokens, length, start, args.window_batch),
    }
    sliding_window_logprobs(model, tokens, length, tokens.numel() - args.window_batch, args.window_batch)  # warm-up
    sliding_window_logprobs(model, tokens, length, tokens.numel() - 1, 1)
    xl_lp = xl_cached_logprobs(model, tokens, seg)
    times: dict[str, list[float]] = {k: [] for k in (*methods, "xl")}
    foreign: dict[str, list[float]] = {k: [] for k in times}
    lps: dict[str, Tensor] = {}

    def timed(name: str) -> tuple[float, float]:
        """(seconds per evaluated token, cores other processes used meanwhile)."""
        nonlocal xl_lp
        if name == "xl":
            segs: list[tuple[int, int, float]] = []
            with Meter() as m:
                xl_lp = xl_cached_logprobs(model, tokens, seg, segs)
            steady = [(k, s) for i, k, s in segs if i >= mem] or [(k, s) for _, k, s in segs]
            return sum(s for _, s in steady) / sum(k for k, _ in steady), m.foreign
        with Meter() as m:
            lps[name] = methods[name]()
        return m.wall / n, m.foreign

    rejected = 0
    for r in range(args.repeats):
        order = [*methods, "xl"]
        order = order[r % 3 :] + order[: r % 3]  # rotate: no method always first after the wait
        for i, name in enumerate(order):
            for attempt in range(args.retries + 1):
                if args.max_wait > 0 and (i == 0 or attempt > 0):
                    wait_for_quiet(args.max_wait)
                t, load = timed(name)
                if load <= args.noisy or attempt == args.retries:
                    break
                rejected += 1  # another process took a core meanwhile: with 2 threads on 2 cores, measure again
            times[name].append(t)
            foreign[name].append(round(load, 2))
    xl_same = xl_lp[start - 1 :]  # xl_lp[t - 1] is position t
    point = {
        "pos": pos,
        "L": length,
        "S": seg,
        "M": mem,
        "n_sliding": n,
        "tokens": tokens.numel(),
        "ms": {k: [round(x * 1e3, 4) for x in v] for k, v in times.items()},
        "flop_ratio": flop_ratio(length, seg, mem, args.layers, args.dim, args.vocab),
        "foreign_cores": foreign,
        "rejected": rejected,
        "batch_diff": float((lps["sliding_1"] - lps["sliding_b"]).abs().max()),
        "bpt_sliding": bits_per_token(lps["sliding_1"]),
        "bpt_xl_same": bits_per_token(xl_same),
        "bpt_xl_all": bits_per_token(xl_lp),
        "mean_abs_diff": float((lps["sliding_1"] - xl_same).abs().mean()),
    }
    return {**point, **medians(point, args.noisy)}


def medians(point: dict[str, Any], noisy: float) -> dict[str, float]:
    """Per method, the median ms/token of the measurements during which other processes used at most
    ``noisy`` cores (all of them if none was that quiet), and the speed-ups from those medians."""
    med = {}
    for k, v in point["ms"].items():
        quiet = [x for x, c in zip(v, point["foreign_cores"][k]) if c <= noisy]
        med[k] = statistics.median(quiet or v)
    return {
        "sliding_1_ms": med["sliding_1"],
        "sliding_b_ms": med["sliding_b"],
        "xl_ms": med["xl"],
        "speedup_1": med["sliding_1"] / med["xl"],
        "speedup_b": med["sliding_b"] / med["xl"],
    }


def full_memory_check(pos: str, tokens: Tensor, seg: int, args: argparse.Namespace) -> dict[str, Any]:
    """XL with a memory covering the whole stream must equal one full-sequence forward."""
    model = build_model(pos, tokens.numel(), **_sizes(args), max_len=tokens.numel(), seed=args.seed)
    diff = float((xl_cached_logprobs(model, tokens, seg) - full_logprobs(model, tokens)).abs().max())
    return {"pos": pos, "S": seg, "T": tokens.numel(), "max_abs_diff": diff, "ok": diff <= CHECK_TOL}


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    return {"layers": args.layers, "dim": args.dim, "heads": args.heads, "vocab": args.vocab}


# -- report -----------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def render(data: dict[str, Any], docs: Path) -> None:
    """docs/memory_benchmarks.md and .png from the results so far."""
    m = data["meta"]
    pts = [{**p, **medians(p, m["noisy"])} for p in data["points"]]
    b = m["window_batch"]
    out = [
        "# Memory: Transformer-XL cached evaluation vs the sliding window",
        "",
        f"`{m['command']}` ({m['date']}, {m.get('elapsed_s', 0) / 60:.0f} min; torch {m['torch']}, "
        f"{m['threads']} threads, CPU: {m['cpu']}).",
        "",
        f"Model: `XfamModel`, {m['layers']} layers x {m['dim']} wide, {m['heads']} heads, vocab {m['vocab']}, "
        f"vanilla attention, `memory=xl`, untrained (seed {m['seed']}); fp32, batch 1, eval mode, `torch.no_grad`. "
        f"Stream: {m['tokens']} uniformly random tokens. Transformer-XL (Dai et al. 2019, sec. 3.2 and 4) "
        "reports up to 1,874x faster evaluation than the vanilla model at attention length 3,800.",
        "",
        "* **sliding window, 1 per forward** (the paper's baseline): each prediction is the last position of a "
        "forward over its own L previous tokens (shift 1, recomputed from scratch).",
        f"* **sliding window, {b} per forward**: the same windows, {b} consecutive ones stacked into one "
        f"`[{b}, L]` forward (same FLOPs, larger matrix products; log-probs equal to one-at-a-time).",
        "* **XL cached**: segments of S tokens, per-layer memory of M = L - S cached states carried across "
        "segments; every query attends to at most M + S = L positions.",
        "",
        "Time per evaluated token: sliding = wall time / windows scored (the last *n* positions of the stream, "
        "fewer at larger L: per-token cost is what is compared); XL = wall time of the segments whose memory "
        f"was full / their tokens. {m['repeats']} rounds after a warm-up; the three methods alternate within a "
        "round (rotated order), in one process. The machine is shared, and two threads on two cores slow down "
        "several-fold when another process takes a core: before a round the script waits (at most "
        f"{m['max_wait']:g} s) until other processes use < 0.5 cores, and a measurement during which they used more "
        f"than {m['noisy']:g} cores is taken again after such a wait (at most {m['retries']} times, then kept). "
        f"Reported: the median of the measurements during which others used at most {m['noisy']:g} cores (of all "
        "of them if none was); the last column counts the kept measurements that were noisier than that, and "
        "the ones taken again. *FLOP ratio*: the speed-up that model FLOPs alone predict (matrix "
        "products plus causal attention pairs; XL's relative-position terms not counted).",
        "",
        "![memory benchmarks](memory_benchmarks.png)",
        "",
        f"| pos | L | S | M | n | sliding, 1/forward (ms/token) | sliding, {b}/forward (ms/token) "
        f"| XL cached (ms/token) | speed-up vs 1/forward | speed-up vs {b}/forward | FLOP ratio "
        "| bits/token sliding | bits/token XL | noisy measurements kept; retaken |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in pts:
        out.append(
            f"| {p['pos']} | {p['L']} | {p['S']} | {p['M']} | {p['n_sliding']} | {p['sliding_1_ms']:.2f} "
            f"| {p['sliding_b_ms']:.2f} | {p['xl_ms']:.3f} | {p['speedup_1']:,.0f}x | {p['speedup_b']:,.0f}x "
            f"| {p['flop_ratio']:,.0f}x | {p['bpt_sliding']:.4f} | {p['bpt_xl_same']:.4f} "
            f"| {_noisy(p, m['noisy'])} of {sum(map(len, p['ms'].values()))}; {p['rejected']} |"
        )
    out.append("")
    for pos in dict.fromkeys(p["pos"] for p in pts):
        rows = [p for p in pts if p["pos"] == pos]
        if len(rows) > 1:
            a, z = rows[0], rows[-1]
            slope = math.log(z["speedup_1"] / a["speedup_1"]) / math.log(z["L"] / a["L"])
            out.append(
                f"* pos={pos}: the speed-up over the paper's baseline grows from {a['speedup_1']:,.0f}x at L={a['L']} "
                f"to {z['speedup_1']:,.0f}x at L={z['L']} (log-log slope {slope:.2f}; FLOPs alone: "
                f"{a['flop_ratio']:,.0f}x to {z['flop_ratio']:,.0f}x)."
            )
    out += [
        "",
        "## Checks",
        "",
        "* Batched windows equal one window per forward: max |diff| of the log-probs "
        + ", ".join(f"{p['pos']} L={p['L']}: {p['batch_diff']:.1e}" for p in pts)
        + ".",
    ]
    for c in data["checks"]:
        out.append(
            f"* pos={c['pos']}: XL with a memory covering all {c['T']} tokens (segments of {c['S']}) vs one "
            f"full-sequence forward: max |diff| of the log-probs {c['max_abs_diff']:.1e} "
            f"({'within' if c['ok'] else '**outside**'} {CHECK_TOL:g})."
        )
    out += [
        "* Bits per token (same positions for both; XL also over the whole stream: "
        + ", ".join(f"{p['pos']} L={p['L']}: {p['bpt_xl_all']:.4f}" for p in pts)
        + f"). An untrained model on a uniform random stream: all ~log2({m['vocab']}) = {math.log2(m['vocab']):.0f}; "
        "the two differ because their contexts differ (the XL state reaches back beyond L through the "
        "layers' memories; a window does not), not by much for this model. Mean |diff| of the per-token "
        "log-probs: " + ", ".join(f"{p['pos']} L={p['L']}: {p['mean_abs_diff']:.1e}" for p in pts) + ".",
        "",
        "## Raw timings (ms/token of each kept measurement, in round order; cores other processes used meanwhile)",
        "",
    ]
    for p in pts:
        pairs = {k: zip(v, p["foreign_cores"][k]) for k, v in p["ms"].items()}
        cells = "; ".join(f"{k}: " + ", ".join(f"{x:.3f} ({c:.2f})" for x, c in v) for k, v in pairs.items())
        out.append(f"* {p['pos']} L={p['L']}: {cells}")
    out.append("")
    (docs / "memory_benchmarks.md").write_text("\n".join(out))
    if pts:
        _png(m, pts, docs / "memory_benchmarks.png")


def _noisy(point: dict[str, Any], noisy: float) -> int:
    return sum(c > noisy for v in point["foreign_cores"].values() for c in v)


def _png(m: dict[str, Any], pts: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    lengths = sorted({p["L"] for p in pts})
    for j, pos in enumerate(dict.fromkeys(p["pos"] for p in pts)):
        rows = [p for p in pts if p["pos"] == pos]
        ls = ("-", "--", ":")[j % 3]
        xs = [p["L"] for p in rows]
        for key, label, color in (
            ("sliding_1_ms", "sliding window, 1/forward", "C3"),
            ("sliding_b_ms", f"sliding window, {m['window_batch']}/forward", "C1"),
            ("xl_ms", "XL cached", "C0"),
        ):
            ax.plot(xs, [p[key] for p in rows], ls=ls, color=color, marker="o", label=f"{label} (pos={pos})")
        bx.plot(xs, [p["speedup_1"] for p in rows], ls=ls, color="C3", marker="o", label=f"vs 1/forward (pos={pos})")
        bx.plot(xs, [p["speedup_b"] for p in rows], ls=ls, color="C1", marker="o", label=f"vs batched (pos={pos})")
        if j == 0:  # the same for every pos
            bx.plot(xs, [p["flop_ratio"] for p in rows], color="0.6", label="FLOP ratio")
    for a, title, ylabel in (
        (ax, "evaluation time per token", "ms / token (median)"),
        (bx, "speed-up of XL cached evaluation", "sliding / XL"),
    ):
        a.set_xscale("log", base=2)
        a.set_xticks(lengths, [str(n) for n in lengths])
        a.set_yscale("log")
        a.set_xlabel("attention length L")
        a.set_ylabel(ylabel)
        a.set_title(title)
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=7)
    fig.suptitle(
        f"{m['layers']} layers x {m['dim']}, fp32, batch 1, {m['threads']} CPU threads, torch {m['torch']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- driver -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(args.seed))
    keys = ("layers", "dim", "heads", "vocab", "tokens", "repeats", "window_batch", "seed", "threads")
    keys += ("max_wait", "noisy", "retries")
    data: dict[str, Any] = {
        "meta": {
            **{k: getattr(args, k) for k in keys},
            "command": " ".join(["python scripts/bench_memory.py", *argv]).strip(),
            "date": datetime.datetime.now().isoformat(timespec="minutes"),
            "torch": torch.__version__,
            "cpu": cpu_model(),
        },
        "points": [],
        "checks": [],
    }
    elapsed0 = 0
    if args.resume:  # continue a cut-off run: keep its points, measure the missing ones with the same settings
        old = json.loads(args.json.read_text())
        changed = [k for k in keys if old["meta"].get(k) != data["meta"][k]]
        if changed:
            sys.exit(f"--resume: {args.json} was measured with other settings: {changed}")
        elapsed0 = old["meta"].get("elapsed_s", 0)
        data["meta"]["command"] = f"{old['meta']['command']}, resumed: {data['meta']['command']}"
        data["points"], data["checks"] = old["points"], old["checks"]

    def save() -> None:
        data["meta"]["elapsed_s"] = elapsed0 + round(time.perf_counter() - t_start)
        render(data, args.out)
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))

    t_start = time.perf_counter()
    for pos in args.pos:
        if not any(c["pos"] == pos for c in data["checks"]):
            check = full_memory_check(pos, tokens, max(1, round(min(args.lengths) * args.seg_frac)), args)
            data["checks"].append(check)
            print(f"pos={pos}: full-memory XL vs full forward max |diff| {check['max_abs_diff']:.2e}", flush=True)
            save()
        for length in args.lengths:
            if any(q["pos"] == pos and q["L"] == length for q in data["points"]):
                continue
            p = measure_point(pos, length, tokens, args)
            data["points"].append(p)
            print(
                f"pos={pos} L={length:<5} S={p['S']:<4} M={p['M']:<4} sliding {p['sliding_1_ms']:9.2f} ms/token "
                f"({p['sliding_b_ms']:8.2f} batched)  XL {p['xl_ms']:7.3f} ms/token  speed-up {p['speedup_1']:7.1f}x "
                f"({p['speedup_b']:6.1f}x)  [{time.perf_counter() - t_start:.0f} s]",
                flush=True,
            )
            save()
    return data


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024], help="attention lengths L")
    p.add_argument("--pos", nargs="+", default=["xl"], help="positional encodings (relative): xl (the paper's), rope")
    p.add_argument("--tokens", type=int, default=2048, help="stream length T")
    p.add_argument("--seg-frac", type=float, default=0.5, help="XL segment S = round(frac * L), memory M = L - S")
    p.add_argument(
        "--sliding-tokens",
        type=int,
        default=256,
        help="windows scored at L=128; scaled by 128/L (at least --window-batch) since a window costs ~L",
    )
    p.add_argument("--window-batch", type=int, default=16, help="windows per forward in the batched sliding run")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per point (median reported)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-wait", type=float, default=120.0, help="before a round, wait up to this long for a quiet CPU")
    p.add_argument("--noisy", type=float, default=0.3, help="retake a measurement if others used more cores")
    p.add_argument("--retries", type=int, default=3, help="retakes of a noisy measurement (then it is kept, and shown)")
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for memory_benchmarks.md/.png")
    p.add_argument("--json", type=Path, default=None, help="also save raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="only render the docs from saved results")
    p.add_argument("--resume", action="store_true", help="continue the cut-off run saved in --json (same settings)")
    p.add_argument("--quick", action="store_true", help="L = 128, 256; T = 512; 1 round; fewer windows; no waiting")
    if "--quick" in argv:  # new defaults: options given explicitly still win
        p.set_defaults(lengths=[128, 256], tokens=512, repeats=1, sliding_tokens=32, max_wait=0.0, retries=0)
    args = p.parse_args(argv)
    if args.from_json:
        render(json.loads(args.from_json.read_text()), args.out)
        return
    if args.resume and not (args.json and args.json.exists()):
        p.error("--resume needs --json FILE of the run to continue")
    bad = [n for n in args.lengths if not 2 <= n < args.tokens]
    if bad:
        p.error(f"--lengths {bad}: each L must be in [2, --tokens={args.tokens})")
    run(args, argv)
    print(f"wrote {args.out / 'memory_benchmarks.md'}")


if __name__ == "__main__":
    main()
