"""The memory slot's experiments; tables go into docs/results.md, plots next to it.

    python scripts/memory_experiments.py copy      # repeated segments: XL memory of one segment vs none
    python scripts/memory_experiments.py text      # XL vs none on the embedded corpus, bits per byte
    python scripts/memory_experiments.py text --rope   # ... plus the same pair with pos=rope
    python scripts/memory_experiments.py recall    # far recall: memorizing vs short XL vs long XL vs none
    python scripts/memory_experiments.py all       # the three

Measured on the shared 2-core CPU (2 torch threads): copy 7 min, text 23 min (+ about as much again
with --rope), recall 14 min; on a quiet machine about half.
    python scripts/memory_experiments.py copy --set trainer.max_steps=20 --no-results   # a quick look
    python scripts/memory_experiments.py all --dry-run     # compose and validate every run, train nothing

Each run is exactly ``python train.py experiment=<experiment> <its overrides> <--set overrides>``
(the commands are printed and written into the tables), trained in this process one after another
(``--threads`` torch threads) into ``<out>/<experiment>/<label>`` with ``xfam.train``. The
experiment file (``configs/experiment/memory_*.yaml``) holds the shared backbone, data, optimiser,
steps and seed with ``memory=none``; a run changes nothing but its memory (and, for the RoPE pair
of ``text --rope``, its pos). A run directory that holds the finished run with the same config is
reused, an unfinished one is continued (``ckpt_path=auto``), one with another config is refused.

Reports (between ``<!-- experiments:memory_<name>:start/end -->`` markers of docs/results.md, under
``## memory_copy``, ``## memory_text``, ``## memory_recall``; the prose around them is kept):

* copy: the loss on the copy targets (``data.target_mask``) of the validation and test splits and
  its accuracy, against ln(symbols); plot: the training copy loss and the validation loss vs step.
* text: validation and test bits per byte; plot: validation bits per byte vs step.
* recall: answer accuracy and loss on the test split, against chance 1/num_values, with each run's
  reach (how far back a query can see) next to the key-query distance; plot: validation answer
  accuracy vs step and the test accuracy per method.

One file over 400 lines: the experiments share their runner and table writer, and docs/results.md cites this
one command.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from run_experiments import Run, add_run_options, compose, fmt, one_line, prepare_run, train_run, write_section  # noqa: E402

MEMORIZING = "+memory.per_layer={-1: {name: memorizing, store_size: 128, topk: 32}}"


@dataclass
class Experiment:
    """One comparison: an experiment file and its runs (label -> overrides)."""

    name: str  # section of the results file and stem of the plot
    experiment: str
    runs: dict[str, list[str]]


def experiments(args: argparse.Namespace) -> dict[str, Experiment]:
    text_runs = {"none": [], "xl": ["memory=xl", "memory.mem_len=64"]}
    if args.rope:
        text_runs |= {"none-rope": ["pos=rope"], "xl-rope": ["pos=rope", "memory=xl", "memory.mem_len=64"]}
    return {
        "copy": Experiment("memory_copy", "memory_copy", {"xl": ["memory=xl", "memory.mem_len=64"], "none": []}),
        "text": Experiment("memory_text", "memory_text", text_runs),
        "recall": Experiment(
            "memory_recall",
            "memory_recall",
            {
                "memorizing": ["memory=xl", "memory.mem_len=0", MEMORIZING],
                "xl-mem32": ["memory=xl", "memory.mem_len=32"],
                "xl-mem96": ["memory=xl", "memory.mem_len=96"],
                "none": [],
            },
        ),
    }


def command(run: Run) -> str:
    return " ".join(["python train.py", f"experiment={run.experiment}", *map(shlex.quote, run.overrides)])


def run_all(exp: Experiment, args: argparse.Namespace) -> list[Run]:
    """Train (or reuse) every run of ``exp``; a refused or failed run is recorded and the others go on."""
    out = Path(args.out)
    runs = [Run(exp.experiment, label, [*ov, *args.set]) for label, ov in exp.runs.items()]
    print(f"== {exp.name}: {len(runs)} runs into {out / exp.experiment}", flush=True)
    for i, run in enumerate(runs, 1):
        cfg, reusable = prepare_run(run, out)
        print(f"[{i}/{len(runs)}] {run.label}: {command(run)}", flush=True)
        if cfg is None:
            print(f"    {run.status}: {run.reason}", flush=True)
            continue
        if args.dry_run:
            run.status = "planned"
            continue
        train_run(run, cfg, reusable)
        shown = {k: round(v, 4) for k, v in run.metrics.items() if k.startswith("test/") and isinstance(v, float)}
        print(f"    {run.status}: {shown or run.reason} ({fmt(run.seconds, 0)} s)", flush=True)
    return runs


def curves(run: Run) -> dict[str, list[tuple[int, float]]]:
    """Every logged metric of a run as (step, value) pairs, from its CSV logs (all versions: a resumed run)."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(Path(run.run_dir).glob("logs/version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if key not in ("epoch", "step") and value not in ("", None):
                        out.setdefault(key, {})[int(row["step"])] = float(value)
    return {k: sorted(v.items()) for k, v in out.items()}


def done(runs: list[Run]) -> list[Run]:
    return [r for r in runs if r.status in ("ok", "reused")]


def status_rows(runs: list[Run]) -> list[str]:
    bad = [r for r in runs if r.status not in ("ok", "reused")]
    return [f"* `{r.label}`: **{r.status}**: {one_line(r.reason)}" for r in bad]


def header(exp: Experiment, runs: list[Run], args: argparse.Namespace) -> list[str]:
    which = exp.name.removeprefix("memory_")
    total = sum(r.seconds or 0 for r in runs)
    flags = "".join(f" --set {s}" for s in args.set) + (" --rope" if which == "text" and args.rope else "")
    return [
        f"Command: `python scripts/memory_experiments.py {which}{flags}` (torch threads: {args.threads}); "
        f"training wall time {total / 60:.1f} min over {len(done(runs))} runs, one at a time, on the shared "
        "2-core CPU. Each run, exactly:",
        "",
        "```bash",
        *[command(r) for r in runs],
        "```",
        "",
    ]


# ---------------------------------------------------------------------------------------------- copy


def copy_report(exp: Experiment, runs: list[Run], args: argparse.Namespace) -> str:
    cfg = compose(exp.experiment, runs[0].overrides)
    symbols = cfg["data"]["symbols"]
    lines = [
        *header(exp, runs, args),
        f"Loss (nats) and accuracy on the copy targets only; ln(V) = ln({symbols}) = {math.log(symbols):.3f} "
        f"is the loss of a uniform guess. Validation: the first {cfg['trainer']['limit_val_batches']} batches of "
        f"each stream, test: the first {cfg['trainer']['limit_test_batches']}.",
        "",
        "| run | memory | val copy loss | test copy loss | test copy acc | ln(V) | steps | train s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in done(runs):
        m = r.metrics
        memory = " ".join(o for o in r.overrides if o.startswith("memory")) or "none"
        lines.append(
            f"| {r.label} | `{memory}` | {m['val/loss']:.4f} | {m['test/loss']:.4f} | {m['test/acc']:.3f} | "
            f"{math.log(symbols):.3f} | {m['step']} | {fmt(r.seconds, 0)} |"
        )
    return "\n".join([*lines, *status_rows(runs)])


def plot_copy(runs: list[Run], path: Path, symbols: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r, color in zip(done(runs), ("C0", "C1", "C2", "C3"), strict=False):
        c = curves(r)
        if "train/loss" in c:
            ax.plot(*zip(*c["train/loss"], strict=True), color=color, alpha=0.5, label=f"{r.label}: train")
        if "val/loss" in c:
            ax.plot(*zip(*c["val/loss"], strict=True), "o-", color=color, label=f"{r.label}: validation")
    ax.axhline(math.log(symbols), color="k", ls=":", label=f"ln V = ln {symbols}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss on the copy targets (nats)")
    ax.set_title("Repeated segments: copy loss, XL memory vs none")
    ax.legend(fontsize=8)
    save(fig, path)


# ---------------------------------------------------------------------------------------------- text


def text_report(exp: Experiment, runs: list[Run], args: argparse.Namespace) -> str:
    cfg = compose(exp.experiment, runs[0].overrides)
    d, t = cfg["data"], cfg["trainer"]
    lines = [
        *header(exp, runs, args),
        f"Byte-level LM on the embedded corpus (`data=text` defaults: the Python standard library's sources), "
        f"segments of {d['seq_len']} bytes, batch {d['batch_size']}, {t['max_steps']} steps. Bits per byte on "
        f"the first {t['limit_val_batches']} (validation) and {t['limit_test_batches']} (test) batches of each "
        "stream: the same tokens for every run.",
        "",
        "| run | pos | memory | val bpb | test bpb | tokens/s (median) | train s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in done(runs):
        m = r.metrics
        rc = compose(exp.experiment, r.overrides)
        memory = rc["memory"]["name"] + (f", mem_len {rc['memory']['mem_len']}" if rc["memory"]["name"] == "xl" else "")
        lines.append(
            f"| {r.label} | {rc['pos']['name']} | {memory} | {m['val/bpb']:.4f} | {m['test/bpb']:.4f} | "
            f"{fmt(m.get('train/tokens_per_s'), 0)} | {fmt(r.seconds, 0)} |"
        )
    return "\n".join([*lines, *status_rows(runs)])


def plot_text(runs: list[Run], path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    ok = done(runs)
    for r in ok:
        c = curves(r)
        if "val/bpb" in c:
            ax.plot(*zip(*c["val/bpb"], strict=True), "o-", label=r.label)
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.set_title("Embedded corpus: XL memory vs none")
    ax.legend(fontsize=8)
    bx.bar([r.label for r in ok], [r.metrics["test/bpb"] for r in ok], color=[f"C{i}" for i in range(len(ok))])
    lo = min(r.metrics["test/bpb"] for r in ok)
    bx.set_ylim(lo * 0.95, max(r.metrics["test/bpb"] for r in ok) * 1.01)
    bx.set_ylabel("test bits per byte")
    for i, r in enumerate(ok):
        bx.text(i, r.metrics["test/bpb"], f"{r.metrics['test/bpb']:.3f}", ha="center", va="bottom", fontsize=8)
    save(fig, path)


# -------------------------------------------------------------------------------------------- recall


@torch.no_grad()
def recall_eval(run: Run, split: str = "test") -> dict[str, Any]:
    """Accuracy of a far_recall run on ``split`` by episode row: local answers (pairs row), filler rule
    (gap rows), far answers (query row), and far accuracy by key-query distance and by the asked pair's
    index in the pairs row. Runs the Lightning
    module's own evaluation path (``_eval_forward``: memory carried through the streams, cleared at
    episode boundaries) over the batches its test metric saw (the first ``trainer.limit_test_batches``
    of each stream); cached in ``<run>/recall_eval.json``."""
    from xfam.data.module import XfamDataModule
    from xfam.eval.metrics import add_stats, batch_stats, summarize
    from xfam.model.build import build_data
    from xfam.model.checkpoint import read
    from xfam.training.lit.module import XfamLitModule

    ckpt = Path(run.run_dir) / "checkpoints" / "last.ckpt"
    cache = Path(run.run_dir) / "recall_eval.json"
    saved = read(ckpt)
    stamp = {"step": saved["global_step"], "version": 2}
    if cache.exists() and all(json.loads(cache.read_text()).get(k) == v for k, v in stamp.items()):
        return json.loads(cache.read_text())
    cfg, info = saved["xfam"]["config"], saved["xfam"]["data_info"]
    module = XfamLitModule(cfg, info)
    module.load_state_dict(saved["state_dict"])
    module.eval()
    source = build_data(cfg)
    source.prepare()
    d = cfg["data"]
    rows, length, pairs, queries = d["gap_rows"] + 2, d["seq_len"], d["num_pairs"], d["num_queries"]
    limit = cfg["trainer"]["limit_test_batches"] or math.inf
    sums: dict[str, dict[str, torch.Tensor]] = {"local": {}, "filler": {}, "far": {}, "all": {}}
    by_distance: dict[int, list[int]] = {}
    by_pair: dict[int, list[int]] = {}  # the asked pair's index i in the pairs row
    module.on_test_epoch_start()  # fresh evaluation memory
    keys = None
    for t, batch in enumerate(XfamDataModule(source, seed=cfg["seed"], streams=True)._eval_loader(split)):
        if t >= limit:
            break
        out = module._eval_forward(batch)
        stats = batch_stats("lm", out.logits, batch, None)
        add_stats(sums["all"], stats)
        if t % rows == 0:
            add_stats(sums["local"], stats)
            keys = batch["input_ids"][:, 1 : 2 * pairs : 2]  # [B, P] the episode's keys (pairs are "v k")
        elif t % rows < rows - 1:
            add_stats(sums["filler"], stats)
        else:
            add_stats(sums["far"], stats)
            hit = out.logits.argmax(-1) == batch["labels"]  # [B, S]
            for j in range(queries):
                i = (keys == batch["input_ids"][:, 2 * j, None]).float().argmax(1)  # [B] pair index asked
                dist = (rows - 1) * length + 2 * j - (2 * i + 1)  # from the key at 2i + 1 to the query
                for di, pi, ok in zip(dist.tolist(), i.tolist(), hit[:, 2 * j].tolist(), strict=True):
                    for table, key in ((by_distance, di), (by_pair, pi)):
                        table.setdefault(key, [0, 0])
                        table[key][0] += ok
                        table[key][1] += 1
    result = {
        **stamp,
        **{
            f"{k}/{m}": float(v)
            for k, s in sums.items()
            if s and s["count"] > 0
            for m, v in summarize(s, "lm", "x").items()
        },
        "by_distance": {str(k): v[0] / v[1] for k, v in sorted(by_distance.items())},
        "by_pair": {str(k): v[0] / v[1] for k, v in sorted(by_pair.items())},
    }
    result = {k.replace("/x/", "/"): v for k, v in result.items()}
    cache.write_text(json.dumps(result, indent=1))
    return result


def reach(cfg: dict[str, Any]) -> str:
    """How far back a query at segment position t sees, beyond its own segment."""
    m, layers = cfg["memory"], cfg["model"]["layers"]
    for o in (m.get("per_layer") or {}).values():
        if o.get("name") == "memorizing":
            return f"kNN store: the last {o.get('store_size')} positions (its episode)"
    if m["name"] == "xl":
        return f"t + {m['mem_len']} (one layer), t + {layers * m['mem_len']} ({layers} layers)"
    return "its own segment (t)"


def recall_report(exp: Experiment, runs: list[Run], args: argparse.Namespace, evals: dict[str, dict]) -> str:
    cfg = compose(exp.experiment, runs[0].overrides)
    d, t = cfg["data"], cfg["trainer"]
    dist = (d["gap_rows"] + 1) * d["seq_len"] - 2 * d["num_pairs"] + 1
    lines = [
        *header(exp, runs, args),
        f"`data=far_recall`: episodes of {d['gap_rows'] + 2} rows of {d['seq_len']} tokens: {d['num_pairs']} pairs"
        + (f" and {d['local_queries']} local queries" if d["local_queries"] else "")
        + f", {d['gap_rows']} filler rows"
        + (" (the filler rule f_t+1 = pi(f_t-1), counted)" if d["filler_rule"] else " (uniform, not counted)")
        + f", {d['num_queries']} far queries; {d['num_keys']} keys, {d['num_values']} values, "
        f"{d['filler_symbols']} filler symbols; every episode a document (memory cleared at its end). Every far "
        f"query is >= {dist} positions after its key ((G+1)*S - 2P + 1). Accuracy on the first "
        f"{t['limit_test_batches']} test batches of each stream (the batches of the run's test metric), by "
        "episode row: **far answers** (the query row)"
        + (", the filler rule (gap rows: every model can learn it)" if d["filler_rule"] else "")
        + (", local answers (inside the pairs row)" if d["local_queries"] else "")
        + f". Chance on answers 1/{d['num_values']} = {1 / d['num_values']:.3f}, uniform loss "
        f"ln {d['num_values']} = {math.log(d['num_values']):.3f}.",
        "",
        "| run | memory | a query at segment position t sees back | far acc | far loss | filler acc | local acc "
        "| train s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in done(runs):
        e, rc = evals[r.label], compose(exp.experiment, r.overrides)
        memory = " ".join(o for o in r.overrides if "memory" in o) or "none"
        lines.append(
            f"| {r.label} | `{memory}` | {reach(rc)} | **{e['far/acc']:.3f}** | {e['far/loss']:.3f} | "
            f"{fmt(e.get('filler/acc'))} | {fmt(e.get('local/acc'))} | {fmt(r.seconds, 0)} |"
        )
    return "\n".join([*lines, *status_rows(runs)])


def plot_recall(runs: list[Run], evals: dict[str, dict], path: Path, chance: float) -> None:
    plt = pyplot()
    fig, ((ax, bx), (px, cx)) = plt.subplots(2, 2, figsize=(11, 8))
    ok = done(runs)
    for r in ok:
        c = curves(r)
        if "val/acc" in c:
            ax.plot(*zip(*c["val/acc"], strict=True), "o-", label=r.label)
        dist, pair = evals[r.label]["by_distance"], evals[r.label]["by_pair"]
        bx.plot([int(k) for k in dist], list(dist.values()), "o-", label=r.label)
        px.plot([int(k) for k in pair], list(pair.values()), "o-", label=r.label)
    for axis in (bx, px):  # the validation accuracy is mostly the filler rule: no chance line there
        axis.axhline(chance, color="k", ls=":", label="chance")
    for axis in (ax, bx, px):
        axis.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("validation accuracy (every counted target: mostly filler)")
    ax.set_title("Far recall: training")
    bx.set_xlabel("distance from key to query (positions)")
    bx.set_ylabel("far answer accuracy (test)")
    bx.set_title("Far answers by distance")
    px.set_xlabel("index i of the asked pair in the pairs row (key at position 2i + 1)")
    px.set_ylabel("far answer accuracy (test)")
    px.set_title("Far answers by the pair's place in its row")
    x = range(len(ok))
    cx.bar([i - 0.2 for i in x], [evals[r.label]["far/acc"] for r in ok], 0.4, label="far answers")
    other = "local" if "local/acc" in evals[ok[0].label] else "filler"
    cx.bar([i + 0.2 for i in x], [evals[r.label].get(f"{other}/acc", 0) for r in ok], 0.4, label=other)
    cx.set_xticks(list(x), [r.label for r in ok])
    cx.axhline(chance, color="k", ls=":")
    cx.set_ylim(0, 1.05)
    cx.set_ylabel("test accuracy")
    cx.legend(fontsize=8)
    save(fig, path)


# ---------------------------------------------------------------------------------------------- driver


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def report(which: str, exp: Experiment, runs: list[Run], args: argparse.Namespace) -> None:
    record = {"runs": [{**asdict(r), "command": command(r)} for r in runs]}
    out_dir = Path(args.out) / exp.experiment
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(record, indent=1, default=str))
    if not done(runs):
        print(f"{exp.name}: no run finished; nothing to report", flush=True)
        return
    cfg = compose(exp.experiment, runs[0].overrides)
    png = Path(args.results).with_name(f"results_{exp.name}.png")
    if which == "copy":
        body = copy_report(exp, runs, args)
        plot = lambda: plot_copy(runs, png, cfg["data"]["symbols"])  # noqa: E731
    elif which == "text":
        body = text_report(exp, runs, args)
        plot = lambda: plot_text(runs, png)  # noqa: E731
    else:
        evals = {r.label: recall_eval(r) for r in done(runs)}
        body = recall_report(exp, runs, args, evals)
        plot = lambda: plot_recall(runs, evals, png, 1 / cfg["data"]["num_values"])  # noqa: E731
    print(body, flush=True)
    if not args.no_results:
        plot()
        write_section(Path(args.results), exp.name, body + f"\n\n![{exp.name}]({png.name})")
        print(f"wrote {args.results} and {png}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["copy", "text", "recall", "all"])
    parser.add_argument("--rope", action="store_true", help="text: add the pos=rope pair (none, xl)")
    add_run_options(parser, threads=2)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    chosen = ["copy", "text", "recall"] if args.which == "all" else [args.which]
    started = time.perf_counter()
    for which in chosen:
        exp = experiments(args)[which]
        runs = run_all(exp, args)
        if not args.dry_run:
            report(which, exp, runs, args)
    print(f"total {(time.perf_counter() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
