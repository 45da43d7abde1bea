"""The exit slot's experiments; tables go into docs/results.md, plots next to it.

    python scripts/exit_experiments.py calm      # early exit on the embedded-corpus LM (~12 min train + ~6 min)
    python scripts/exit_experiments.py act       # UT + ACT on parity of varying difficulty, a tau sweep (~20 min)
    python scripts/exit_experiments.py calm --ckpt runs/early_exit/.../checkpoints/last.ckpt   # reuse a model

``calm`` trains ``experiment=early_exit`` (unless ``--ckpt``) and, on the first ``--limit`` batches of
the test split: the bits per byte of every static exit (all tokens leave after layer n: per-exit
quality), a threshold sweep (mean layers used vs bits per byte, and disagreement with the full
model) for each confidence measure (softmax response, hidden-state saturation, the learned
classifier), and the Learn-then-Test check: the per-example disagreement losses of the validation
and test splits pooled, split at random into calibration and test halves many times; in each split
the threshold is calibrated on one half and its disagreement measured on the other
(``xfam.eval.calibrate.split_check``).

``act`` trains ``experiment=act_parity`` with ``exit=act`` at each ponder cost tau of ``--taus`` on a
variant where depth pays: vectors of 8 entries whose entries reach the read-out position (entry 0,
``pool=cls``) only through a window of radius 1 (``attention=local window=2``, ``pos=rope`` to tell
left from right), so the parity of the first k entries needs about k steps; up to 12 steps, halting
bias -1 (p starts near 0.27, so early training sees several steps). It reports the mean ponder
steps N at the read-out position and the accuracy per difficulty k on the test split.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from run_experiments import RESULTS, write_section  # noqa: E402

from xfam.eval.calibrate import split_check  # noqa: E402
from xfam.eval.inference import threshold_sweep  # noqa: E402
from xfam.eval.loop import split_loader  # noqa: E402
from xfam.eval.metrics import add_stats, batch_stats, summarize  # noqa: E402
from xfam.model.checkpoint import load_model  # noqa: E402

MEASURES = {
    "softmax": [1.01, 0.99, 0.98, 0.96, 0.94, 0.92, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1],
    "saturation": [1.01, 0.9999, 0.9995, 0.999, 0.998, 0.996, 0.993, 0.99, 0.98, 0.97, 0.95, 0.9, 0.8],
    "classifier": [1.01, 0.99, 0.98, 0.96, 0.94, 0.92, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1],
}


def train(out: Path, name: str, overrides: list[str]) -> Path:
    """``python train.py <overrides> name=<name>`` into ``out`` (reused when finished); its last checkpoint."""
    found = glob.glob(str(out / name / "*" / "checkpoints" / "last.ckpt"))
    if found:
        print(f"reusing {found[0]}", flush=True)
        return Path(found[0])
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"name={name}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "XFAM_RUNS": str(out)}, cwd=ROOT)
    return Path(glob.glob(str(out / name / "*" / "checkpoints" / "last.ckpt"))[0])


def load_batches(config: dict, info: dict, split: str, limit: int) -> list[dict[str, torch.Tensor]]:
    loader, _ = split_loader(config, info, split, None)
    return [b for _, b in zip(range(limit), loader, strict=False)]


@torch.no_grad()
def metrics(model: Any, batches: list[dict], task: str, token_bytes: torch.Tensor | None) -> dict[str, float]:
    sums: dict[str, torch.Tensor] = {}
    for b in batches:
        out = model(b["input_ids"], key_padding=b.get("key_padding"))
        add_stats(sums, batch_stats(task, out.logits, b, token_bytes, out.depth, model.num_layers))
    return {k.split("/", 1)[1]: float(v) for k, v in summarize(sums, task, "m").items()}


# ------------------------------------------------------------------------------------------------ calm


@torch.no_grad()
def without_propagation(model: Any, batches: list[dict], thresholds: list[float], token_bytes: torch.Tensor) -> dict:
    """The same exit decisions, but every layer still computed for every token, so later tokens attend to
    full-depth states (the CALM code's ``oracle_cache``): the quality lost to state propagation. Returns
    mean ``depth`` and ``bpb`` per threshold."""
    policy, layers = model.exit, model.num_layers
    sums: list[dict[str, torch.Tensor]] = [{} for _ in thresholds]
    states: list[torch.Tensor] = []  # the input of layer 1, then every layer's output [B, S, D]
    hooks = [model.blocks[0].register_forward_pre_hook(lambda m, a: states.append(a[0]))]
    hooks += [blk.register_forward_hook(lambda m, a, o: states.append(o[0])) for blk in model.blocks]
    for b in batches:
        states.clear()
        with policy.full_depth():
            model(b["input_ids"])
        conf = torch.stack(
            [policy.confidence(n, states[n - 1], states[n], model.head_logits) for n in range(1, layers)]
        )

        for k, threshold in enumerate(thresholds):
            exits = (conf >= threshold) & (torch.arange(1, layers).view(-1, 1, 1) >= policy.min_layer)  # [L-1, B, S]
            depth = torch.where(exits.any(0), exits.float().argmax(0) + 1, layers)  # first confident layer
            hidden = torch.stack(states[1:]).gather(0, (depth - 1)[None, ..., None].expand(1, *states[1].shape))[0]
            logits = model.head_logits(hidden)
            add_stats(sums[k], batch_stats("lm", logits, b, token_bytes, depth, layers))
    for h in hooks:
        h.remove()
    out = [summarize(s, "lm", "m") for s in sums]
    return {"depth": [float(m["m/depth"]) for m in out], "bpb": [float(m["m/bpb"]) for m in out]}


def calm(args: argparse.Namespace) -> None:
    ckpt = Path(args.ckpt) if args.ckpt else train(Path(args.out), "early_exit", ["experiment=early_exit"])
    model, meta = load_model(ckpt)
    info, policy = meta["data_info"], model.exit
    token_bytes = torch.tensor(info["token_bytes"])
    test = load_batches(meta["config"], info, "test", args.limit)
    val = load_batches(meta["config"], info, "validation", args.limit)
    layers = model.num_layers
    per_exit = []
    for n in range(1, layers + 1):
        policy.exit_at = n if n < layers else 0
        policy.threshold = 0.5 if n < layers else 1.01
        per_exit.append(metrics(model, test, "lm", token_bytes)["bpb"])
    policy.exit_at = 0
    print("per-exit bpb:", [round(v, 4) for v in per_exit], flush=True)
    sweeps, checks = {}, {}
    for measure, grid in MEASURES.items():
        policy.measure = measure
        sweeps[measure] = threshold_sweep(model, test, "lm", grid, token_bytes)
        sweeps[measure]["no_propagation"] = without_propagation(model, test, grid, token_bytes)
        pooled = torch.cat((threshold_sweep(model, val, "lm", grid, token_bytes)["risk"], sweeps[measure]["risk"]))
        checks[measure] = {
            delta: split_check(pooled, grid, delta, args.epsilon, repeats=args.repeats) for delta in args.deltas
        }
        print(measure, [(round(d, 2), round(b, 4)) for d, b in zip(sweeps[measure]["depth"], sweeps[measure]["bpb"])])
    raw = {"ckpt": str(ckpt), "per_exit_bpb": per_exit, "sweeps": _jsonable(sweeps), "checks": _jsonable(checks)}
    (Path(args.out) / "early_exit_results.json").write_text(json.dumps(raw, indent=1))
    plot_calm(per_exit, sweeps, RESULTS.parent / "results_early_exit.png")
    write_section(RESULTS, "early_exit", calm_report(per_exit, sweeps, checks, args, len(test), layers))


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist() if x.dim() == 0 else None  # per-example matrices stay out of the JSON
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items() if not isinstance(v, torch.Tensor) or v.dim() == 0}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def best_point(sweep: dict, full_bpb: float, budget: float) -> int | None:
    """The threshold with the fewest layers whose bpb is within ``budget`` (relative) of full depth."""
    ok = [k for k, b in enumerate(sweep["bpb"]) if b <= full_bpb * (1 + budget)]
    return min(ok, key=lambda k: sweep["depth"][k]) if ok else None


def calm_report(per_exit: list, sweeps: dict, checks: dict, args: argparse.Namespace, batches: int, layers: int) -> str:
    full = per_exit[-1]
    lines = [
        f"Test split, first {batches} batches of 16 x 128 bytes; model: `experiment=early_exit` "
        f"({layers} layers). Command: `python scripts/exit_experiments.py calm`.",
        "",
        "**Per-exit quality** (every token leaves after layer n; `exit.exit_at=n`):",
        "",
        "| layer n | " + " | ".join(str(n) for n in range(1, layers + 1)) + " |",
        "|---|" + "---|" * layers,
        "| bits per byte | " + " | ".join(f"{v:.3f}" for v in per_exit) + " |",
        "",
        "**Threshold sweeps**: for each measure, the threshold with the fewest mean layers whose bits per byte "
        "stays within 1% / 3% of full depth, and what it saves:",
        "",
        "| measure | within 1%: threshold | layers | saved | bpb | disagree "
        "| within 3%: threshold | layers | saved | bpb | bpb, no propagation |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, sw in sweeps.items():
        cells = [m]
        for budget in (0.01, 0.03):
            k = best_point(sw, full, budget)
            if k is None:
                cells += ["-"] * 5
                continue
            d = sw["depth"][k]
            cells += [f"{sw['thresholds'][k]}", f"{d:.2f}", f"{1 - d / layers:.0%}", f"{sw['bpb'][k]:.3f}"]
            if budget == 0.01:
                cells.append(f"{float(sw['risk'][:, k].mean()):.1%}")
            else:
                free = sw["no_propagation"]
                cells.append(f"{free['bpb'][k]:.3f} ({free['depth'][k]:.2f} layers)")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Full depth: {full:.3f} bits per byte. Plot: `docs/results_early_exit.png`. *No propagation*: the same "
        "exit decisions with every layer still computed for every token, so later tokens attend to full-depth "
        "states (the CALM code's `oracle_cache`; saves nothing): what copying exited states costs.",
        "",
        f"**Calibration (Learn-then-Test)**: validation and test examples pooled, {args.repeats} random "
        f"calibration/test halves, epsilon = {args.epsilon}; share of splits whose test disagreement stays <= delta "
        "(the guarantee asks >= 1 - epsilon), and the mean layers (on the test split) of the chosen thresholds:",
        "",
        "| measure | " + " | ".join(f"delta {d}: share ok | layers" for d in args.deltas) + " |",
        "|---|" + "---|---|" * len(args.deltas),
    ]
    for m, per_delta in checks.items():
        cells = [m]
        for d in args.deltas:
            c = per_delta[d]
            depths = [sweeps[m]["depth"][k] for k in c["chosen"] if k is not None]
            mean_depth = f"{sum(depths) / len(depths):.2f}" if depths else "- (none chosen)"
            cells += [f"{c['share_ok']:.2f}", mean_depth]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_calm(per_exit: list, sweeps: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    layers = len(per_exit)
    ax.plot(range(1, layers + 1), per_exit, "k.--", label="static exit (all tokens at layer n)")
    for (m, sw), color in zip(sweeps.items(), ("C0", "C1", "C2"), strict=False):
        ax.plot(sw["depth"], sw["bpb"], "o-", ms=3, color=color, label=f"CALM, {m}")
        free = sw["no_propagation"]
        ax.plot(free["depth"], free["bpb"], ":", color=color, label=f"{m}, every layer computed (no propagation)")
    ax.set_xlabel("mean layers used per token")
    ax.set_ylabel("test bits per byte")
    ax.set_title("Early exit: compute vs quality")
    ax.legend(fontsize=8)
    for m, sw in sweeps.items():
        bx.plot(sw["depth"], [float(sw["risk"][:, k].mean()) for k in range(len(sw["depth"]))], "o-", ms=3, label=m)
    bx.set_xlabel("mean layers used per token")
    bx.set_ylabel("disagreement with the full model (top-1)")
    bx.set_title("Consistency with the full model")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- act

ACT_BASE = [
    "experiment=act_parity",
    "exit=act",
    "exit.halting_bias=-1.0",
    "model.layers=12",
    "data.seq_len=8",
    "model.max_len=8",
    "attention=local",
    "attention.window=2",
    "model.pool=cls",
    "pos=rope",
]


@torch.no_grad()
def ponder_by_difficulty(ckpt: Path) -> dict[int, dict[str, float]]:
    model, meta = load_model(ckpt)
    loader, _ = split_loader(meta["config"], meta["data_info"], "test", None)
    by_k: dict[int, dict[str, float]] = {}
    for b in loader:
        out = model(b["input_ids"])
        steps = model.exit.last["steps"][:, 0]  # N at the read-out position (entry 0, pool=cls)
        correct = out.logits.argmax(-1) == b["label"]
        for k in b["difficulty"].unique().tolist():
            sel = b["difficulty"] == k
            acc = by_k.setdefault(k, {"n": 0, "steps": 0.0, "correct": 0.0})
            acc["n"] += int(sel.sum())
            acc["steps"] += float(steps[sel].sum())
            acc["correct"] += float(correct[sel].sum())
    return {k: {"steps": v["steps"] / v["n"], "acc": v["correct"] / v["n"]} for k, v in sorted(by_k.items())}


def act(args: argparse.Namespace) -> None:
    results = {}
    for tau in args.taus:
        ckpt = train(Path(args.out), f"act_local_tau{tau}", [*ACT_BASE, f"exit.tau={tau}"])
        results[tau] = ponder_by_difficulty(ckpt)
        print(tau, {k: (round(v["steps"], 2), round(v["acc"], 2)) for k, v in results[tau].items()}, flush=True)
    (Path(args.out) / "act_results.json").write_text(json.dumps(results, indent=1))
    plot_act(results, RESULTS.parent / "results_act.png")
    ks = sorted(next(iter(results.values())))
    lines = [
        "Test split (1,000 rows); `python scripts/exit_experiments.py act`. Mean ponder steps N at the read-out "
        "position and accuracy, per difficulty k:",
        "",
        "| tau | " + " | ".join(f"k={k}" for k in ks) + " | mean N | accuracy |",
        "|---|" + "---|" * (len(ks) + 2),
    ]
    for tau, by_k in results.items():
        n = sum(v["steps"] for v in by_k.values()) / len(by_k)
        acc = sum(v["acc"] for v in by_k.values()) / len(by_k)
        cells = [f"{by_k[k]['steps']:.2f} ({by_k[k]['acc']:.2f})" for k in ks]
        lines.append(f"| {tau} | " + " | ".join(cells) + f" | {n:.2f} | {acc:.2f} |")
    lines += ["", "Cells: mean N (accuracy). Plot: `docs/results_act.png`."]
    write_section(RESULTS, "act_parity", "\n".join(lines))


def plot_act(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for tau, by_k in results.items():
        ks = sorted(by_k)
        ax.plot(ks, [by_k[k]["steps"] for k in ks], "o-", label=f"tau = {tau}")
    ax.set_xlabel("difficulty k (nonzero entries)")
    ax.set_ylabel("mean ponder steps N")
    ax.set_title("UT + ACT on parity through a radius-1 window")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which", required=True)
    p = sub.add_parser("calm", help="threshold sweeps, per-exit quality and LTT checks on the embedded-corpus LM")
    p.add_argument("--ckpt", default=None, help="an experiment=early_exit checkpoint (default: train one)")
    p.add_argument("--limit", type=int, default=40, help="batches of each split used")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    p.add_argument("--epsilon", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=200)
    p = sub.add_parser("act", help="ponder steps vs difficulty for several tau")
    p.add_argument("--taus", type=float, nargs="+", default=[0.001, 0.003, 0.01])
    for p in sub.choices.values():
        p.add_argument("--out", default=str(ROOT / "runs" / "exit_experiments"), help="run directory root")
        p.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    {"calm": calm, "act": act}[args.which](args)


if __name__ == "__main__":
    main()
