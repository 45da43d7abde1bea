"""Run the attention and length-extrapolation experiments and write their tables (and plots) into docs/results.md.

    python scripts/run_experiments.py lra_listops             # ListOps: every attention, one shared backbone
    python scripts/run_experiments.py lsh_copy                # duplication: lsh at 1/2/4/8 eval rounds vs local
    python scripts/run_experiments.py extrapolation           # every pos trained at L=64, evaluated at 64..1024
    python scripts/run_experiments.py all                     # all three
    python scripts/run_experiments.py lra_listops --only vanilla,lsh --set trainer.max_steps=50
    python scripts/run_experiments.py all --dry-run           # compose and validate every run, train nothing

The runs are listed in scripts/experiments.yaml: each is exactly
``python train.py experiment=<experiment> <its overrides> <--set overrides>``, trained in this
process one after another (``--threads`` torch threads) into ``<out>/<experiment>/<run>``. A run
directory that already holds the finished run with the same config is reused, so an interrupted
sweep continues where it stopped (an unfinished run resumes from its last checkpoint); a
directory holding a different config is refused. A run refused by validation or failing in
training is recorded with its reason and the sweep goes on.

After the runs: ListOps tables report each attention's test accuracy against vanilla and against
the majority-class rate of the test split (counted from its labels); runs with ``eval_hashes``
in the sweep file are evaluated on the test split once per number of evaluation hash rounds
(``attention.eval_hashes``, through the Python API: ``xfam eval`` takes no overrides). Sweeps with
``eval_lengths`` (extrapolation) evaluate every run's last checkpoint on the first ``eval_tokens``
targets of the test split at each evaluation length, with each protocol of ``eval_protocols``
(``nonoverlapping`` chunks, or ``sliding`` windows moved by ``eval_stride``; see
xfam/eval/extrapolation.py), cached in ``<run>/extrapolation.json``; a length the model refuses (learned
positions past ``model.max_len``) is recorded as refused with the model's message. Tables go
between ``<!-- experiments:<name>:start/end -->`` markers of the results file (the prose around
them is kept), raw results to ``<out>/<experiment>/results.json``, plots next to the results file.

One file over 400 lines: the three experiments share their training loop, tables and plots, and the docs cite
this one command.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = ROOT / "scripts" / "experiments.yaml"
RESULTS = ROOT / "docs" / "results.md"
IGNORED = ("ckpt_path", "callbacks.progress_bar")  # may differ between a run and its reuse


@dataclass
class Run:
    """One run of a sweep and what became of it."""

    experiment: str
    label: str
    overrides: list[str]
    status: str = "pending"  # ok | reused | refused | failed | planned
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    params: int | None = None
    run_dir: str = ""
    eval_hashes: list[dict[str, Any]] = field(default_factory=list)
    lengths: list[dict[str, Any]] = field(default_factory=list)  # extrapolation: one entry per (protocol, L)
    eval_seconds: float | None = None

    @property
    def command(self) -> str:
        return " ".join(["python train.py", f"experiment={self.experiment}", *self.overrides])

    @property
    def status_cell(self) -> str:
        """The status column of a report table: ok, or the status and its reason."""
        return "ok" if self.status in ("ok", "reused") else f"**{self.status}**: {one_line(self.reason)}"

    @property
    def attention(self) -> str:
        names = [o.split("=", 1)[1] for o in self.overrides if o.startswith("attention=")]
        return names[0] if names else "(experiment default)"

    @property
    def settings(self) -> str:
        return " ".join(o for o in self.overrides if not o.startswith("attention="))


def compose(experiment: str, overrides: list[str]) -> dict[str, Any]:
    """The plain config ``python train.py experiment=<experiment> <overrides>`` would train."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from xfam.training.run_names import CONFIG_DIR, register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose("train", overrides=[f"experiment={experiment}", *overrides])
        return copy.deepcopy(OmegaConf.to_container(cfg, resolve=True))
    finally:
        GlobalHydra.instance().clear()


def load_sweeps(path: Path) -> dict[str, dict[str, Any]]:
    sweeps = yaml.safe_load(path.read_text())
    for name, sweep in sweeps.items():
        if not isinstance(sweep, dict) or "experiment" not in sweep or not isinstance(sweep.get("runs"), dict):
            raise SystemExit(f"{path}: sweep {name!r} needs 'experiment' and a mapping 'runs'")
    return sweeps


def comparable(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config without the keys that do not change what is trained."""
    out = copy.deepcopy(cfg)
    for key in IGNORED:
        section, _, leaf = key.rpartition(".")
        (out.get(section, {}) if section else out).pop(leaf, None)
    return out


def prepare_run(run: Run, out: Path) -> tuple[dict[str, Any] | None, bool]:
    """Compose and validate ``run``; returns (config, reusable). Refusals set the run's status."""
    from xfam.config import validate
    from xfam.core.errors import ConfigError

    try:
        cfg = compose(run.experiment, run.overrides)
        validate(cfg)
    except ConfigError as err:
        run.status, run.reason = "refused", str(err)
        return None, False
    except Exception as err:  # Hydra composition errors (an unknown key, a bad override)
        run.status, run.reason = "refused", f"{type(err).__name__}: {err}"
        return None, False
    run_dir = out / run.experiment / run.label
    run.run_dir = str(run_dir)
    saved = run_dir / "config.yaml"
    if saved.exists():
        if comparable(yaml.safe_load(saved.read_text())) != comparable(cfg):
            run.status = "refused"
            run.reason = (
                f"{run_dir} holds a run with a different config. Fix: --out <another folder>, or remove that "
                "run directory yourself."
            )
            return None, False
        cfg["ckpt_path"] = "auto"  # the same run: reuse it when finished, continue it otherwise
    return cfg, (run_dir / "metrics.json").exists() and (run_dir / "driver.json").exists()


def train_run(run: Run, cfg: dict[str, Any], reusable: bool) -> None:
    import xfam
    from xfam.core.errors import ConfigError
    from xfam.model.build import build_model

    run_dir = Path(run.run_dir)
    if reusable:
        run.metrics = json.loads((run_dir / "metrics.json").read_text())
        run.seconds = json.loads((run_dir / "driver.json").read_text()).get("seconds")
        run.status = "reused"
    else:
        start = time.perf_counter()
        try:
            run.metrics = xfam.train(cfg, run_dir)
        except ConfigError as err:
            run.status, run.reason = "refused", str(err)
            return
        except Exception as err:  # recorded, not hidden: the sweep goes on
            run.status, run.reason = "failed", f"{type(err).__name__}: {err}"
            print(f"{run.experiment}/{run.label} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            return
        run.seconds = time.perf_counter() - start
        run.status = "ok"
        (run_dir / "driver.json").write_text(json.dumps({"seconds": run.seconds, "command": run.command}, indent=1))
    from xfam.model.checkpoint import read

    info = read(run_dir / "checkpoints" / "last.ckpt")["xfam"]["data_info"]
    run.params = sum(p.numel() for p in build_model(cfg, info).parameters())


def label_stats(cfg: dict[str, Any]) -> dict[str, Any]:
    """From the data itself: the test split's class counts, and the accuracy on the test split of the
    root-operator rule (predict the train split's most common label among trees with the same first
    token after ``<cls>``, i.e. the same root operator), a context-free heuristic a model can learn
    without parsing the tree."""
    from xfam.model.build import build_data

    source = build_data(cfg)
    source.prepare()
    test, train = source.split("test"), source.split("train")
    counts = Counter(int(y) for y in test["label"])
    by_root: dict[int, Counter] = {}
    for ids, y in zip(train["input_ids"], train["label"]):
        by_root.setdefault(int(ids[1]), Counter())[int(y)] += 1
    fallback = max(counts, key=counts.get)
    rule = {root: c.most_common(1)[0][0] for root, c in by_root.items()}
    hits = sum(rule.get(int(ids[1]), fallback) == int(y) for ids, y in zip(test["input_ids"], test["label"]))
    cls, top = counts.most_common(1)[0]
    n = sum(counts.values())
    return {"test_examples": n, "majority_class": cls, "majority_rate": top / n, "root_rule_acc": hits / n}


def evaluate(ckpt: Path, attention: dict[str, Any], split: str) -> dict[str, float]:
    """Metrics of a checkpoint on ``split`` with ``attention`` settings changed (e.g. eval_hashes)."""
    import torch

    from xfam.data.module import XfamDataModule
    from xfam.eval.metrics import batch_stats, summarize
    from xfam.model.build import build_data, build_model
    from xfam.model.checkpoint import read

    saved = read(ckpt)
    meta = saved["xfam"]
    cfg = copy.deepcopy(meta["config"])
    cfg["attention"].update(attention)
    model = build_model(cfg, meta["data_info"])
    model.load_state_dict(
        {k.removeprefix("model."): v for k, v in saved["state_dict"].items() if k.startswith("model.")}
    )
    model.eval()
    source = build_data(cfg)
    source.prepare()
    sums: dict[str, Any] = {}
    task = meta["data_info"]["task"]
    with torch.no_grad():
        for batch in XfamDataModule(source, seed=cfg["seed"])._eval_loader(split):
            out = model(batch["input_ids"], key_padding=batch.get("key_padding"), segments=batch.get("segments"))
            for k, v in batch_stats(task, out.logits, batch, None).items():
                sums[k] = sums.get(k, 0) + v.double()
    return {k.split("/", 1)[1]: float(v) for k, v in summarize(sums, task, split).items()}


def eval_rounds(run: Run, rounds: list[int], split: str = "test") -> None:
    """Evaluate the run's last checkpoint once per number of evaluation hash rounds."""
    from xfam.model.checkpoint import read

    ckpt = Path(run.run_dir) / "checkpoints" / "last.ckpt"
    saved = read(ckpt)
    trained = {"trained_hashes": saved["xfam"]["config"]["attention"].get("n_hashes"), "step": saved["global_step"]}
    cache = Path(run.run_dir) / f"eval_hashes_{split}.json"
    if run.status == "reused" and cache.exists():
        done = json.loads(cache.read_text())
        if [e["eval_hashes"] for e in done] == rounds and all(e["step"] == trained["step"] for e in done):
            run.eval_hashes = done
            return
    for r in rounds:
        start = time.perf_counter()
        metrics = evaluate(ckpt, {"eval_hashes": r}, split)
        run.eval_hashes.append({"eval_hashes": r, **trained, **metrics, "seconds": time.perf_counter() - start})
        print(f"    eval_hashes={r}: {split} acc {metrics['acc']:.4f}  loss {metrics['loss']:.4f}", flush=True)
    cache.write_text(json.dumps(run.eval_hashes, indent=1))


def eval_lengths(run: Run, sweep: dict[str, Any]) -> None:
    """Evaluate the run's last checkpoint at every length and protocol of the sweep (xfam.eval.extrapolation);
    cached in ``<run>/extrapolation.json``, reused while the settings and the checkpoint's step match."""
    from xfam.eval.extrapolation import evaluate_checkpoint
    from xfam.model.checkpoint import read

    ckpt = Path(run.run_dir) / "checkpoints" / "last.ckpt"
    settings = {**length_settings(sweep), "step": read(ckpt)["global_step"]}
    cache = Path(run.run_dir) / "extrapolation.json"
    if cache.exists() and (done := json.loads(cache.read_text()))["settings"] == settings:
        run.lengths, run.eval_seconds = done["results"], done["seconds"]
        return
    start = time.perf_counter()
    kwargs = {k: settings[k] for k in ("stride", "tokens", "split")}
    run.lengths = evaluate_checkpoint(ckpt, settings["lengths"], settings["protocols"], **kwargs)
    run.eval_seconds = time.perf_counter() - start
    cache.write_text(json.dumps({"settings": settings, "results": run.lengths, "seconds": run.eval_seconds}, indent=1))
    for e in run.lengths:
        what = (
            f"refused: {one_line(e['refused'], 120)}"
            if "refused" in e
            else f"ppl {e['ppl']:.3f} ({e['seconds']:.0f} s)"
        )
        print(f"    L={e['length']:<5} {e['protocol']:<14} {what}", flush=True)


def length_settings(sweep: dict[str, Any]) -> dict[str, Any]:
    """The extrapolation evaluation of a sweep entry (its ``eval_*`` keys), with defaults."""
    from xfam.eval.extrapolation import DEFAULT_STRIDE, PROTOCOLS

    return {
        "lengths": [int(x) for x in sweep["eval_lengths"]],
        "protocols": list(sweep.get("eval_protocols", PROTOCOLS)),
        "stride": int(sweep.get("eval_stride", DEFAULT_STRIDE)),
        "tokens": int(sweep.get("eval_tokens", 16384)),
        "split": "test",
    }


# ---------------------------------------------------------------------------------------------- report


def fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def one_line(text: str, limit: int = 300) -> str:
    text = re.sub(r"\s+", " ", text).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def budget_line(runs: list[Run]) -> str:
    done = [r for r in runs if r.seconds is not None]
    total = sum(r.seconds for r in done)
    return (
        f"Training wall time: {total / 60:.1f} min over {len(done)} runs "
        "(each: data, training, validation, test; one at a time)."
    )


def listops_report(runs: list[Run], summary: dict[str, Any]) -> str:
    base = next((r for r in runs if r.label == "vanilla" and "test/acc" in r.metrics), None)
    vanilla = base.metrics["test/acc"] if base else None
    maj = summary["majority_rate"]
    lines = [
        f"Test split: {summary['test_examples']} examples; majority class {summary['majority_class']} "
        f"(rate **{maj:.3f}**, counted from the split's labels); uniform chance 0.100; the root-operator rule "
        f"(the train split's most common label for the tree's root operator, no parsing) scores "
        f"**{summary['root_rule_acc']:.3f}**.",
        "",
        "| attention | settings | test acc | vs vanilla | vs majority | val acc | test loss | params | train s "
        "| status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        acc = r.metrics.get("test/acc")
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{r.label}`",
                    f"`{r.settings}`" if r.settings else "-",
                    fmt(acc),
                    f"{acc - vanilla:+.3f}" if acc is not None and vanilla is not None else "-",
                    f"{acc - maj:+.3f}" if acc is not None else "-",
                    fmt(r.metrics.get("val/acc")),
                    fmt(r.metrics.get("test/loss")),
                    f"{r.params:,}" if r.params else "-",
                    fmt(r.seconds, 0),
                    r.status_cell,
                ]
            )
            + " |"
        )
    return "\n".join(lines + ["", budget_line(runs)])


def copy_report(runs: list[Run], summary: dict[str, Any]) -> str:
    chance = summary["chance"]
    lines = [
        f"Token accuracy on the second copy of w, test split ({summary['test_examples']} sequences); "
        f"chance 1/{summary['symbols']} = {chance:.3f}.",
        "",
        "| run | settings | test acc | test loss | train s | status |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in runs:
        lines.append(
            f"| `{r.label}` | `{r.command.removeprefix('python train.py ')}` | {fmt(r.metrics.get('test/acc'), 4)} | "
            f"{fmt(r.metrics.get('test/loss'), 4)} | {fmt(r.seconds, 0)} | {r.status_cell} |"
        )
    for r in runs:
        if not r.eval_hashes:
            continue
        first = r.eval_hashes[0]
        lines += [
            "",
            f"`{r.label}` (trained with {first['trained_hashes']} hash round(s), checkpoint of step {first['step']}) "
            "evaluated with 1 to 8 rounds (`attention.eval_hashes`; same weights, same test split):",
            "",
            "| eval hash rounds | test acc | test loss |",
            "|---:|---:|---:|",
        ]
        lines += [f"| {e['eval_hashes']} | {e['acc']:.4f} | {e['loss']:.4f} |" for e in r.eval_hashes]
    return "\n".join(lines + ["", budget_line(runs)])


def extrapolation_report(runs: list[Run], summary: dict[str, Any]) -> str:
    train_len, lengths = summary["train_len"], summary["lengths"]
    stride = summary["stride"]
    lines = [
        f"Perplexity (bytes; lower is better) on the same {summary['tokens']:,} targets (the first of the test "
        f"split's stream) at each evaluation length L; in brackets the ratio to the same model at L = {train_len}, "
        f"its training length. `nonoverlapping`: consecutive chunks of L, each from scratch; `sliding`: windows "
        f"of L moved by {stride} tokens, each scoring its last {stride} (every target after the first window "
        f"has at least L - {stride} tokens of context).",
    ]
    notes: dict[str, str] = {}
    for protocol in summary["protocols"]:
        lines += [
            "",
            f"**{protocol}**" + (f" (stride {stride})" if protocol == "sliding" else ""),
            "",
            "| pos | " + " | ".join(f"L={n}" for n in lengths) + " |",
            "|---|" + "---:|" * len(lengths),
        ]
        for r in runs:
            by_len = {e["length"]: e for e in r.lengths if e["protocol"] == protocol}
            base = by_len.get(train_len, {}).get("ppl")
            cells = []
            for n in lengths:
                e = by_len.get(n)
                if e is None:
                    cells.append("-")
                elif "refused" in e:
                    notes.setdefault(r.label, e["refused"])
                    cells.append("refused")
                else:
                    ratio = f" ({e['ppl'] / base:.2f}×)" if base else ""
                    cells.append(f"{e['ppl']:.3f}{ratio}")
            lines.append(f"| `{r.label}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"| run | command | params | test loss (L={train_len} rows) | train s | eval s | status |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        lines.append(
            f"| `{r.label}` | `{r.command.removeprefix('python train.py ')}` | "
            f"{f'{r.params:,}' if r.params else '-'} | {fmt(r.metrics.get('test/loss'), 4)} | {fmt(r.seconds, 0)} | "
            f"{fmt(r.eval_seconds, 0)} | {r.status_cell} |"
        )
    for label, message in notes.items():
        lines += ["", f"`{label}` refused the longer lengths: {one_line(message, 400)}"]
    evals = [r.eval_seconds for r in runs if r.eval_seconds is not None]
    return "\n".join(
        lines + ["", budget_line(runs) + f" Evaluation wall time: {sum(evals) / 60:.1f} min over {len(evals)} runs."]
    )


def plot_extrapolation(runs: list[Run], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    protocols, lengths = summary["protocols"], summary["lengths"]
    fig, axes = plt.subplots(1, len(protocols), figsize=(5.6 * len(protocols), 5.6), sharey=True, squeeze=False)
    colors = [*plt.get_cmap("tab10").colors, "black", "darkgoldenrod", "navy", "lime"]
    markers = "osD^v<>pPhX*"
    ppls = [e["ppl"] for r in runs for e in r.lengths if "ppl" in e]
    for ax, protocol in zip(axes[0], protocols):
        for i, r in enumerate(runs):
            pts = [(e["length"], e["ppl"]) for e in r.lengths if e["protocol"] == protocol and "ppl" in e]
            if not pts:
                continue
            refused = any("refused" in e for e in r.lengths if e["protocol"] == protocol)
            xs, ys = zip(*pts)
            ax.plot(
                xs,
                ys,
                "-" if i < 10 else "--",  # tab10 runs out: later runs dashed
                color=colors[i % len(colors)],
                marker=markers[i % len(markers)],
                ms=5,
                lw=1.5,
                label=r.label + (" (refuses L > max_len)" if refused else ""),
            )
        ax.axvline(summary["train_len"], color="k", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [str(n) for n in lengths])
        if ppls:
            ticks = [t for t in (4, 5, 6, 7, 8, 10, 12, 15, 20, 30, 40, 50, 70, 100, 150, 200, 300) if t < max(ppls)]
            ax.set_yticks([t for t in ticks if t > min(ppls) * 0.9] or ticks, minor=False)
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("evaluation length L (tokens)")
        title = f"{protocol}" + (f" (stride {summary['stride']})" if protocol == "sliding" else "")
        ax.set_title(f"{title}; trained at L={summary['train_len']}")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("test perplexity per byte (log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_listops(runs: list[Run], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if "test/acc" in r.metrics]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar([r.label for r in done], [r.metrics["test/acc"] for r in done], color="tab:blue")
    ax.axhline(
        summary["majority_rate"], color="tab:red", ls="--", label=f"majority class {summary['majority_rate']:.3f}"
    )
    rule = summary["root_rule_acc"]
    ax.axhline(rule, color="tab:green", ls="-.", label=f"root-operator rule {rule:.3f}")
    base = next((r for r in done if r.label == "vanilla"), None)
    if base:
        ax.axhline(base.metrics["test/acc"], color="k", ls=":", label=f"vanilla {base.metrics['test/acc']:.3f}")
    ax.set_ylabel("test accuracy")
    ax.set_title("ListOps (CPU scale): one backbone, every attention")
    ax.tick_params(axis="x", rotation=60)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_copy(runs: list[Run], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(9, 3.6))
    colors = iter(["tab:orange", "tab:gray", "tab:purple", "tab:brown"])
    for r in runs:
        if not r.eval_hashes and "test/acc" in r.metrics:
            ax.axhline(r.metrics["test/acc"], color=next(colors, "k"), ls=":", lw=2, label=f"{r.label} (no hashing)")
    ax.axhline(summary["chance"], color="tab:red", ls="--", lw=1, label=f"chance 1/{summary['symbols']}")
    for r in runs:
        if r.eval_hashes:
            xs = [e["eval_hashes"] for e in r.eval_hashes]
            for a in (ax, zoom):
                a.plot(xs, [e["acc"] for e in r.eval_hashes], "o-", color="tab:blue", label=r.label)
            for x, e in zip(xs, r.eval_hashes):
                zoom.annotate(f"{e['acc']:.4f}", (x, e["acc"]), textcoords="offset points", xytext=(0, 6), ha="center")
    for a in (ax, zoom):
        a.set_xscale("log", base=2)
        a.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        a.set_xlabel("evaluation hash rounds")
    ax.set_ylabel("test accuracy (second copy)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Duplication task: test accuracy")
    zoom.set_title("LSH only (zoomed)")
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_section(results: Path, name: str, body: str) -> None:
    start, end = f"<!-- experiments:{name}:start -->", f"<!-- experiments:{name}:end -->"
    block = f"{start}\n{body}\n{end}"
    text = results.read_text() if results.exists() else "# Experiments\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + f"\n\n## {name}\n\n{block}\n"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(text)


# ---------------------------------------------------------------------------------------------- driver


def run_sweep(name: str, sweep: dict[str, Any], args: argparse.Namespace) -> list[Run]:
    only = set(args.only.split(",")) if args.only else None
    runs = [
        Run(sweep["experiment"], label, [*map(str, overrides), *args.set])
        for label, overrides in sweep["runs"].items()
        if only is None or label in only
    ]
    out = Path(args.out)
    print(f"== {name}: {len(runs)} runs into {out / sweep['experiment']}", flush=True)
    started, trained = time.perf_counter(), 0
    for i, run in enumerate(runs, 1):
        cfg, reusable = prepare_run(run, out)
        print(f"[{i}/{len(runs)}] {run.label}: {run.command}", flush=True)
        if cfg is None:
            print(f"    {run.status}: {run.reason}", flush=True)
            continue
        if args.dry_run:
            run.status = "planned"
            continue
        train_run(run, cfg, reusable)
        trained += run.status == "ok"
        acc, loss = run.metrics.get("test/acc"), run.metrics.get("test/loss")
        elapsed = time.perf_counter() - started
        print(
            f"    {run.status}"
            + (
                f": test acc {acc:.4f}"
                if acc is not None
                else f": test loss {loss:.4f}"
                if loss is not None
                else f": {run.reason}"
            )
            + (f", {run.seconds:.0f} s" if run.seconds else "")
            + f" (sweep {elapsed / 60:.1f} min"
            + (f", ~{elapsed / trained * (len(runs) - i) / 60:.0f} min left)" if trained else ")"),
            flush=True,
        )
        if run.status in ("ok", "reused") and run.label in sweep.get("eval_hashes_runs", []):
            eval_rounds(run, list(sweep.get("eval_hashes", [1, 2, 4, 8])))
        if run.status in ("ok", "reused") and "eval_lengths" in sweep:
            eval_lengths(run, sweep)
    return runs


def summarize_sweep(name: str, sweep: dict[str, Any], runs: list[Run], args: argparse.Namespace) -> dict[str, Any]:
    done = [r for r in runs if r.status in ("ok", "reused")]
    if not done:
        return {}
    cfg = compose(sweep["experiment"], done[0].overrides)
    data = cfg["data"]
    if "eval_lengths" in sweep:
        return {"kind": "extrapolation", "train_len": data["seq_len"], **length_settings(sweep)}
    if data["name"] == "listops":
        return {"kind": "classify", **label_stats(cfg)}
    return {
        "kind": "copy",
        "test_examples": data["num_test"],
        "symbols": data["symbols"],
        "chance": 1 / data["symbols"],
    }


#: Report and plot of each kind of sweep summary.
REPORTS = {
    "classify": (listops_report, plot_listops),
    "copy": (copy_report, plot_copy),
    "extrapolation": (extrapolation_report, plot_extrapolation),
}


def runs_root() -> Path:
    """Where experiment runs go: the repository's ``runs/``, or ``XFAM_RUNS`` (as for train.py)."""
    return Path(os.environ.get("XFAM_RUNS", ROOT / "runs"))


def run_folder(out: str | None, name: str, quick: bool) -> Path:
    """An experiment script's run folder, created: ``out`` when given, else a fresh temporary folder for a
    ``--quick`` smoke run (never beside the real runs), else ``<runs root>/<name>``."""
    import tempfile

    folder = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"{name}_")) if quick else runs_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def add_run_options(parser: argparse.ArgumentParser, threads: int) -> None:
    """The options every experiment driver shares: overrides, where runs and results go, threads, dry run."""
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override added to every run (repeatable)"
    )
    parser.add_argument("--out", default=str(runs_root()), help="runs go to <out>/<experiment>/<run> (default: runs/)")
    parser.add_argument("--results", default=str(RESULTS), help="markdown file that receives the tables")
    parser.add_argument("--no-results", action="store_true", help="do not write the results file and plots")
    parser.add_argument("--threads", type=int, default=threads, help=f"torch threads (default {threads})")
    parser.add_argument("--dry-run", action="store_true", help="compose and validate every run; train nothing")


def main(argv: list[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiments", nargs="+", help="sweep names of the sweep file, or 'all'")
    parser.add_argument("--sweeps", default=str(SWEEPS), help="sweep file (default: scripts/experiments.yaml)")
    parser.add_argument("--only", default=None, help="comma-separated run labels to run (default: all)")
    add_run_options(parser, threads=1)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    sweeps = load_sweeps(Path(args.sweeps))
    names = list(sweeps) if args.experiments == ["all"] else args.experiments
    unknown = [n for n in names if n not in sweeps]
    if unknown:
        parser.error(f"unknown sweep(s) {unknown}; choose among {sorted(sweeps)} or 'all'")
    results, everything = Path(args.results), []
    for name in names:
        sweep = sweeps[name]
        runs = run_sweep(name, sweep, args)
        everything += runs
        if args.dry_run:
            continue
        summary = summarize_sweep(name, sweep, runs, args)
        record = {"summary": summary, "runs": [{**asdict(r), "command": r.command} for r in runs]}
        out_dir = Path(args.out) / sweep["experiment"]
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(record, indent=1, default=str))
        if not summary:
            print(f"{name}: no run finished; nothing to report", flush=True)
            continue
        make_report, plot = REPORTS[summary["kind"]]
        report = make_report(runs, summary)
        print(report, flush=True)
        if not args.no_results:
            png = results.with_name(f"{results.stem}_{name}.png")
            plot(runs, summary, png)
            write_section(results, name, report + f"\n\n![{name}]({png.name})")
            print(f"wrote {results} and {png}", flush=True)
    bad = [r for r in everything if r.status in ("refused", "failed")]
    if bad:
        print(f"{len(bad)} run(s) refused or failed: {', '.join(f'{r.experiment}/{r.label}' for r in bad)}")
    return everything


if __name__ == "__main__":
    main()
    sys.exit(0)
