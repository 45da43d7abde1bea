"""Block options against the default block at equal budget, on the embedded corpus: bits per byte and stability.

    python scripts/exp_blocks.py                 # every arm at both learning rates, table + plot into docs/results.md
    python scripts/exp_blocks.py --quick         # smoke run: tiny models, a few steps; report into <out>/results.md
    python scripts/exp_blocks.py --dry-run       # compose and validate every run, train nothing
    python scripts/exp_blocks.py --only default,geglu --lrs 0.001

Every run is a byte-level LM on the main job's data (``data=text`` defaults: the Python standard library's own
sources), exactly ``python train.py hydra.run.dir=<out>/<arm>/lr<lr> <its overrides>`` (the commands go into the
report), trained in this process one after another (``xfam.train``) with ``--threads`` torch threads (default one:
see scripts/exp_finetune.py on oversubscribing the shared 2-core machine). Arms, all at the same steps, batches,
schedule and seed (the main job's optimiser: AdamW, cosine schedule, gradient clipping at 1.0):

* the default block, ``model=tiny`` made smaller: pre-LN, GELU FFN, plain residual add;
* ``model.ffn=geglu``: GELU-gated linear unit (Shazeer, 2020, arXiv:2002.05202), hidden width x 2/3 (same
  parameters);
* ``model.attn_qk_norm=l2``: QK-norm, cosine-similarity scores times a learned temperature (Henry et al., 2020,
  arXiv:2010.04245; g0 = log2(L^2 - L) with L = ``model.max_len``, set to the training length here);
* ``model.norm_position=sandwich``: Sandwich-LN, x + LN(f(LN(x))) (Ding et al., 2021, CogView, arXiv:2105.13290);
* ``model.residual=rezero``: x + alpha f(x), alpha = 0 at init, no norms (Bachlechner et al., 2020,
  arXiv:2003.04887);
* at 24 layers and a smaller width, three ways to join the residual: post-LN (the original Transformer),
  DeepNorm (Wang et al., 2022, DeepNet, arXiv:2203.00555: LN(alpha x + f(x)), alpha = (2N)^(1/4), branch weights
  initialised with gain beta = (8N)^(-1/4)) and pre-LN. DeepNorm's claim is about deep post-norm stacks, so it is
  compared with both at the same depth and width.

Each arm trains at two learning rates: the main job's ``optim.lr`` (1e-3) and ten times that, for stability. A run
counts as **diverged** when the trainer's non-finite guard stopped it (``trainer.nonfinite=stop``), when its final
validation loss is not finite, or when its training loss at the end (mean of the last tenth of the logged steps)
is not below its loss at step 0 (``diverged``). One seed per arm; one repeat of the default arm at a second seed
(``--repeat-seed``) gives a single draw of the seed-to-seed difference, the only noise yardstick the report has.

A run folder holding the finished (or diverged) run of the same config is reused, an unfinished one continued
(``ckpt_path=auto``), one of another config refused. Raw results: ``<out>/results.json``; the report goes between
``<!-- experiments:blocks:start/end -->`` of docs/results.md (the prose around it is kept), the plot (training
loss per arm) to docs/results_blocks.png. ``--quick`` writes into ``<out>`` (default: a temporary folder), never
into docs/.

One file over 400 lines: the runs, the divergence rule, the report and the plot belong to one experiment, and
docs/results.md cites this one command.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
SECTION = "blocks"
sys.path.insert(0, str(ROOT / "scripts"))
from exp_finetune import compose, shown  # noqa: E402
from memory_experiments import pyplot, save  # noqa: E402
from run_experiments import comparable, fmt, one_line, run_folder, write_section  # noqa: E402

BASE_LR = 1e-3  # the main job's optim.lr (configs/optim/adamw.yaml)
LRS = (BASE_LR, 10 * BASE_LR, 100 * BASE_LR)  # the main job's rate, 10x and 100x it


@dataclass(frozen=True)
class Budget:
    """Sizes of one invocation: steps of every run, its schedule, data shape, validation batches and models."""

    steps: int
    warmup: int  # optim.warmup_steps (the main job: 100 of 1,000 steps)
    seq_len: int
    batch: int
    val_batches: int  # trainer.limit_val_batches: the same first batches of the validation split for every run
    shallow: tuple[str, ...]  # model overrides of the default block and the single-option arms
    deep: tuple[str, ...]  # model overrides of the 24-layer trio
    data: tuple[str, ...] = ()  # data overrides besides the length and batch (--quick: a capped corpus)


REAL = Budget(
    steps=180,
    warmup=18,
    seq_len=128,
    batch=16,
    val_batches=16,
    shallow=("model.dim=64", "model.layers=4", "model.heads=4"),
    deep=("model.dim=32", "model.layers=24", "model.heads=2"),
)
QUICK = Budget(
    steps=4,
    warmup=1,
    seq_len=32,
    batch=4,
    val_batches=2,
    shallow=("model.dim=16", "model.layers=2", "model.heads=2"),
    deep=("model.dim=16", "model.layers=4", "model.heads=2"),
    data=("data.max_bytes=200000",),
)


@dataclass(frozen=True)
class Arm:
    """One block variant: its group (``shallow``: against the default block; ``deep``: the 24-layer trio), the
    model overrides that make it, and what they mean."""

    key: str
    group: str
    overrides: tuple[str, ...]
    what: str


ARMS = (
    Arm("default", "shallow", (), "pre-LN, GELU FFN, x + f(x) (the default block)"),
    Arm("geglu", "shallow", ("model.ffn=geglu",), "GEGLU FFN, hidden x 2/3 (Shazeer 2020)"),
    Arm("qk_norm", "shallow", ("model.attn_qk_norm=l2",), "cosine scores x learned g (Henry et al. 2020)"),
    Arm("sandwich", "shallow", ("model.norm_position=sandwich",), "x + LN(f(LN(x))) (CogView, Ding et al. 2021)"),
    Arm("rezero", "shallow", ("model.residual=rezero",), "x + alpha f(x), alpha0 = 0, no norms (Bachlechner 2020)"),
    Arm("deep_post", "deep", ("model.norm_position=post",), "post-LN: LN(x + f(x))"),
    Arm("deep_deepnorm", "deep", ("model.norm_position=deepnorm",), "LN(alpha x + f(x)), beta init (Wang et al. 2022)"),
    Arm("deep_pre", "deep", ("model.norm_position=pre",), "pre-LN: x + f(LN(x))"),
)
REFERENCE = {"shallow": "default", "deep": "deep_pre"}  # what each group's deltas are taken against


@dataclass
class Run:
    """One training run and what became of it."""

    arm: str
    lr: float
    seed: int
    overrides: list[str]
    run_dir: Path
    status: str = "pending"  # ok | reused | stopped (non-finite guard) | refused | failed | planned
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, training loss in nats)
    diverged: str | None = None  # why it counts as diverged; None: it did not
    params: int | None = None

    @property
    def label(self) -> str:
        return f"{self.arm}/lr{self.lr:g}" + (f"-s{self.seed}" if self.seed else "")

    @property
    def done(self) -> bool:
        return self.status in ("ok", "reused", "stopped")

    def command(self) -> str:
        return " ".join(["python train.py", f"hydra.run.dir={shown(self.run_dir)}", *map(shlex.quote, self.overrides)])


# ---------------------------------------------------------------------------------------------- runs


def common(b: Budget) -> list[str]:
    """What every run shares: the data shape, the schedule, one validation at the end, no test split, every
    training loss logged (the curves and the divergence test read them)."""
    return [
        *b.data,
        f"data.seq_len={b.seq_len}",
        f"data.batch_size={b.batch}",
        f"model.max_len={b.seq_len}",  # (QK-norm's g0 = log2(L^2 - L) at the training length; RoPE has no table)
        f"optim.warmup_steps={b.warmup}",
        f"trainer.max_steps={b.steps}",
        f"trainer.val_check_interval={b.steps}",
        f"callbacks.every_n_steps={b.steps}",
        f"trainer.limit_val_batches={b.val_batches}",
        "trainer.log_every_n_steps=1",
        "test=false",
        "callbacks.loss_curve=false",
        "callbacks.progress_bar=none",
    ]


def make_runs(b: Budget, out: Path, lrs: list[float], repeat_seed: int | None, only: set[str] | None) -> list[Run]:
    """Every arm at every learning rate (seed 0), then the default arm at ``repeat_seed`` and the first rate."""
    arms = [a for a in ARMS if only is None or a.key in only]
    runs = []
    for lr in lrs:
        for arm in arms:
            model = b.shallow if arm.group == "shallow" else b.deep
            overrides = [*common(b), *model, *arm.overrides, f"optim.lr={lr:g}", "seed=0"]
            runs.append(Run(arm.key, lr, 0, overrides, out / arm.key / f"lr{lr:g}"))
    if repeat_seed and any(a.key == "default" for a in arms):
        first = next(r for r in runs if r.arm == "default")
        overrides = [*first.overrides[:-1], f"seed={repeat_seed}"]
        runs.append(
            Run("default", first.lr, repeat_seed, overrides, out / "default" / f"lr{first.lr:g}-s{repeat_seed}")
        )
    return runs


def train(run: Run, dry_run: bool = False) -> Run:
    """Train ``run`` (or reuse / continue its folder); a refusal, failure or the non-finite guard's stop is recorded,
    not raised."""
    import yaml

    import xfam
    from xfam.core.errors import ConfigError
    from xfam.training.lit.nonfinite import NonFiniteError

    print(f"[{run.label}] {run.command()}", flush=True)
    try:
        cfg = compose(run.overrides)
        xfam.validate(cfg)
    except Exception as err:  # ConfigError, or Hydra's composition errors
        run.status, run.reason = "refused", f"{type(err).__name__}: {err}"
        print(f"    refused: {one_line(run.reason)}", flush=True)
        return run
    run.params = param_count(cfg)
    if dry_run:
        run.status = "planned"
        print(f"    planned: {run.params:,} parameters", flush=True)
        return run
    saved, record = run.run_dir / "config.yaml", run.run_dir / "driver.json"
    if saved.exists():
        if comparable(yaml.safe_load(saved.read_text())) != comparable(cfg):
            run.status = "refused"
            run.reason = f"{run.run_dir} holds a run of another config. Fix: --out <another folder>, or remove it."
            print(f"    refused: {run.reason}", flush=True)
            return run
        if record.exists():  # finished, or stopped by the guard: reused as it ended
            rec = json.loads(record.read_text())
            run.seconds, run.status, run.reason = rec["seconds"], rec["status"], rec.get("reason", "")
            run.status = "reused" if run.status == "ok" else run.status
            metrics = run.run_dir / "metrics.json"
            run.metrics = json.loads(metrics.read_text()) if metrics.exists() else {}
            return finish(run)
        cfg["ckpt_path"] = "auto"
    start = time.perf_counter()
    try:
        run.metrics = xfam.train(cfg, run.run_dir)
    except NonFiniteError as err:
        run.status, run.reason = "stopped", str(err)
    except ConfigError as err:
        run.status, run.reason = "refused", str(err)
    except Exception as err:  # recorded, not hidden: the other runs go on
        run.status, run.reason = "failed", f"{type(err).__name__}: {err}"
        print(traceback.format_exc(), file=sys.stderr, flush=True)
    else:
        run.status = "ok"
    run.seconds = time.perf_counter() - start
    if run.status in ("ok", "stopped"):
        rec = {"seconds": run.seconds, "status": run.status, "reason": run.reason, "command": run.command()}
        record.write_text(json.dumps(rec, indent=1))
    return finish(run)


def finish(run: Run) -> Run:
    """Read the run's training curve and decide whether it diverged."""
    if run.done:
        run.curve = train_curve(run.run_dir)
        run.diverged = diverged(run.curve, run.metrics.get("val/loss"), run.reason if run.status == "stopped" else "")
    shown_bpb = fmt(run.metrics.get("val/bpb"), 4)
    print(f"    {run.status}: val/bpb {shown_bpb}; diverged: {run.diverged or 'no'}", flush=True)
    return run


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of the model ``cfg`` builds (the vocabulary from its prepared data source)."""
    from xfam.model.build import build_model

    source = prepared(json.dumps(cfg["data"], sort_keys=True))
    info = {"task": source.task, "vocab_size": source.vocab_size, "num_classes": None}
    return sum(p.numel() for p in build_model(cfg, info).parameters())


@functools.lru_cache(maxsize=4)
def prepared(data: str) -> Any:
    """The prepared data source of the data config ``data`` (JSON), once per process."""
    from xfam.model.build import build_data

    source = build_data({"data": json.loads(data)})
    source.prepare()
    return source


def train_curve(run_dir: Path) -> list[tuple[int, float]]:
    """``(step, train/loss)`` of every logged step, from the run's CSV logs (all versions: a continued run)."""
    import csv

    out: dict[int, float] = {}
    for path in sorted(Path(run_dir).glob("logs/version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("train/loss") not in ("", None):
                    out[int(row["step"])] = float(row["train/loss"])
    return sorted(out.items())


# ------------------------------------------------------------------------------------------- stability


def diverged(curve: list[tuple[int, float]], val_loss: float | None, guard: str = "") -> str | None:
    """Why a run counts as diverged, or None: the non-finite guard stopped it (``guard``: its message), its final
    validation loss is not finite, a logged training loss is not finite, or its training loss at the end (the mean
    of the last tenth of the logged steps, at least one) is not below the loss at its first logged step."""
    if guard:
        return "non-finite guard: " + guard.split(":")[0]
    if val_loss is not None and not math.isfinite(val_loss):
        return f"validation loss {val_loss}"
    if not curve:
        return None
    losses = [loss for _, loss in curve]
    if not all(math.isfinite(x) for x in losses):
        step = next(s for s, x in curve if not math.isfinite(x))
        return f"training loss not finite at step {step}"
    tail = losses[-max(1, len(losses) // 10) :]
    end = statistics.fmean(tail)
    if end >= losses[0]:
        return f"final training loss {end:.3f} >= initial {losses[0]:.3f} nats"
    return None


def smooth(values: list[float], window: int = 10) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def rise_of(run: Run, warmup: int) -> str:
    """``worst_rise`` of a run for the report (``diverged`` for a run that did: its rise means nothing)."""
    return "diverged" if run.diverged else fmt(worst_rise(run.curve, warmup), 2)


def worst_rise(curve: list[tuple[int, float]], after: int, window: int = 10) -> float | None:
    """The largest rise of the smoothed training loss above its best value so far, over the steps after ``after``
    (the warmup), in bits per byte: 0 for a loss that only falls; a spike that recovered still shows here."""
    finite = [(s, x) for s, x in curve if math.isfinite(x)]
    if not finite:
        return None
    smoothed = smooth([x for _, x in finite], window)
    best, rise = math.inf, 0.0
    for (step, _), value in zip(finite, smoothed, strict=True):
        if step > after:
            rise = max(rise, value - best)
        best = min(best, value)
    return rise / math.log(2)


# ---------------------------------------------------------------------------------------------- report


def bpb(run: Run | None) -> float | None:
    return run.metrics.get("val/bpb") if run is not None and run.status in ("ok", "reused") else None


def cell(run: Run | None) -> str:
    """A run's validation bits per byte, or what stopped it."""
    if run is None:
        return "-"
    if run.status == "stopped":
        return "stopped"
    if not run.done:
        return f"**{run.status}**"
    value = fmt(bpb(run), 3)
    return f"{value} (diverged)" if run.diverged else value


def delta(run: Run | None, ref: Run | None) -> str:
    a, b = bpb(run), bpb(ref)
    return "-" if a is None or b is None or run is ref else f"{a - b:+.3f}"


def stability(run: Run | None) -> str:
    if run is None or not run.done:
        return "-" if run is None else f"**{run.status}**"
    return f"**diverged**: {run.diverged}" if run.diverged else "ok"


def noise(runs: list[Run]) -> tuple[Run, Run] | None:
    """The default arm at seed 0 and its repeat at another seed (same rate), when both finished."""
    repeat = next((r for r in runs if r.arm == "default" and r.seed and bpb(r) is not None), None)
    first = next((r for r in runs if r.arm == "default" and not r.seed and repeat and r.lr == repeat.lr), None)
    return (first, repeat) if first is not None and bpb(first) is not None else None


def verdicts(runs: list[Run], lr: float, yardstick: float | None) -> list[str]:
    """One computed line per arm at rate ``lr``: its difference from its group's reference, measured against
    ``yardstick`` (twice the one seed-to-seed difference measured; None: not measured)."""
    by = {(r.arm, r.lr): r for r in runs if not r.seed}
    lines = []
    for arm in ARMS:
        run, ref = by.get((arm.key, lr)), by.get((REFERENCE[arm.group], lr))
        if run is None or ref is None or run is ref or bpb(run) is None or bpb(ref) is None:
            continue
        d = bpb(run) - bpb(ref)
        if yardstick is None:
            word = "no seed repeat to compare with"
        elif abs(d) <= yardstick:
            word = "within twice the one seed difference measured: not resolved"
        else:
            word = (
                "lower" if d < 0 else "higher"
            ) + " by more than twice the one seed difference measured (suggestive)"
        lines.append(f"* `{arm.key}` vs `{REFERENCE[arm.group]}`: {d:+.3f} bits per byte, {word}.")
    return lines


def report(runs: list[Run], b: Budget, args: argparse.Namespace, png: str | None) -> str:
    lrs = sorted({r.lr for r in runs})
    deep = depth(b.deep)
    by = {(r.arm, r.lr): r for r in runs if not r.seed}
    arms = [a for a in ARMS if any(r.arm == a.key for r in runs)]
    trained = [r for r in runs if r.done]
    total = sum(r.seconds or 0 for r in trained)
    first = next((r for r in runs if r.arm == "default" and not r.seed), runs[0])
    quick = " --quick" if args.quick else ""
    lines = [
        f"Command: `OMP_NUM_THREADS={args.threads} python scripts/exp_blocks.py{quick}` (torch threads: "
        f"{args.threads}; runs one after another on the shared 2-core CPU, other jobs running: {total / 60:.1f} min of "
        f"training over {len(trained)} runs; not a speed measurement). The default arm's run, exactly:",
        "",
        "```bash",
        first.command(),
        "```",
        "",
        "The other runs add their arm's overrides (below), `optim.lr=` and `seed=` to the same command. Data: the "
        f"main job's embedded corpus (`data=text` defaults), rows of {b.seq_len} bytes, batch {b.batch}, "
        f"{b.steps} steps ({b.steps * b.seq_len * b.batch:,} bytes) for every run; AdamW, {b.warmup} warmup steps, "
        "cosine to 0.1 x, gradient clipping 1.0 (the main job's optimiser). Models: the five single-option arms are "
        f"`model=tiny` with {' '.join(f'`{o}`' for o in b.shallow)}; the {deep}-layer trio with "
        f"{' '.join(f'`{o}`' for o in b.deep)}. Validation bits per byte: the first {b.val_batches} batches of the "
        f"validation split ({b.val_batches * b.batch * b.seq_len:,} bytes, the same for every run), after the last "
        "step. **One seed per arm** (seed 0).",
        "",
        "| arm | overrides | what | params | "
        + " | ".join(f"val bpb, lr {lr:g} | Δ | stability, lr {lr:g}" for lr in lrs)
        + " |",
        "|---|---|---|---:|" + "---:|---:|---|" * len(lrs),
    ]
    for arm in arms:
        some = next((by[(arm.key, lr)] for lr in lrs if (arm.key, lr) in by), None)
        params = f"{some.params:,}" if some is not None and some.params else "-"
        overrides = " ".join(f"`{o}`" for o in arm.overrides) or "(none)"
        cells = []
        for lr in lrs:
            run, ref = by.get((arm.key, lr)), by.get((REFERENCE[arm.group], lr))
            cells += [cell(run), delta(run, ref), stability(run)]
        lines.append(f"| {arm.key} | {overrides} | {arm.what} | {params} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Δ: minus the group's reference at the same rate (`default` for the single-option arms, `deep_pre` for the "
        f"{deep}-layer trio). Stability: *diverged* when the non-finite guard stopped the run, the final validation "
        "loss is not finite, or the mean training loss of the last tenth of the steps is not below the loss at "
        "step 0. Largest rise of the training loss (10-step trailing mean) above its best so far, after warmup, in "
        "bits per byte (a recovered spike shows here; batch-to-batch variation alone gives a floor, of the size of "
        "most values at the lower rate): "
        + "; ".join(
            f"lr {lr:g}: "
            + ", ".join(
                f"{a.key} {rise_of(by[(a.key, lr)], b.warmup)}"
                for a in arms
                if (a.key, lr) in by and by[(a.key, lr)].curve
            )
            for lr in lrs
        )
        + ".",
        "",
    ]
    pair = noise(runs)
    yardstick = None
    if pair is not None:
        s0, s1 = pair
        d = bpb(s1) - bpb(s0)
        yardstick = 2 * abs(d)
        lines += [
            f"**Noise.** The default arm again at seed {s1.seed} (its init and data order; lr {s1.lr:g}): "
            f"{bpb(s1):.3f} against {bpb(s0):.3f} bits per byte, a difference of {d:+.3f}. That is one draw of the "
            "seed-to-seed difference, not its spread: the true spread may well be a few times larger or smaller. "
            f"Differences below about {yardstick:.3f} (twice it) are not resolved by this experiment; differences "
            "above it are suggestive, not established. It was measured on the default block only (the "
            f"{deep}-layer models may vary more between seeds).",
            "",
        ]
    else:
        lines += ["**Noise.** No seed repeat finished: the seed-to-seed spread was not measured.", ""]
    lines += [
        f"Computed against that yardstick, at lr {lrs[0]:g} (the rate the repeat ran at):",
        "",
        *verdicts(runs, lrs[0], yardstick),
    ]
    diverged_runs = [r for r in runs if r.done and r.diverged]
    lines += [
        "",
        "Diverged runs: "
        + (", ".join(f"`{r.label}` ({r.diverged})" for r in diverged_runs) if diverged_runs else "none")
        + ".",
    ]
    bad = [r for r in runs if not r.done]
    lines += [f"* `{r.label}`: **{r.status}**: {one_line(r.reason)}" for r in bad]
    if png:
        lines += ["", f"![blocks]({png})"]
    return "\n".join(lines)


def depth(model: tuple[str, ...]) -> int:
    """``model.layers`` of a budget's model overrides."""
    return int(next(o for o in model if o.startswith("model.layers=")).split("=")[1])


def plot(runs: list[Run], b: Budget, path: Path) -> None:
    """Training loss (bits per byte, 10-step trailing mean) per arm: one panel per group and learning rate."""
    plt = pyplot()
    lrs = sorted({r.lr for r in runs})
    fig, axes = plt.subplots(2, len(lrs), figsize=(5.5 * len(lrs), 8), squeeze=False)
    colors = {a.key: f"C{i}" for i, a in enumerate(ARMS)}
    for row, group in enumerate(("shallow", "deep")):
        for col, lr in enumerate(lrs):
            ax = axes[row][col]
            for run in runs:
                arm = next(a for a in ARMS if a.key == run.arm)
                if arm.group != group or run.lr != lr or not run.curve:
                    continue
                finite = [(s, x / math.log(2)) for s, x in run.curve if math.isfinite(x)]
                steps, values = [s for s, _ in finite], smooth([x for _, x in finite])
                style = "--" if run.seed else "-"
                label = run.arm + (f" (seed {run.seed})" if run.seed else "") + (" diverged" if run.diverged else "")
                ax.plot(steps, values, style, color=colors[run.arm], lw=1.3, label=label)
                if run.status == "stopped" and steps:
                    ax.plot(steps[-1], values[-1], "x", color=colors[run.arm], ms=9)
            layers = depth(b.shallow if group == "shallow" else b.deep)
            what = "single options" if group == "shallow" else "post / DeepNorm / pre"
            ax.set_title(f"{what} ({layers} layers), lr {lr:g}")
            ax.set_xlabel("step")
            ax.set_ylabel("training loss, bits per byte (10-step mean)")
            ax.set_ylim(top=8.5)
            ax.axhline(8.0, color="grey", lw=0.6, ls=":", label="8 bits: a uniform guess")
            ax.legend(fontsize=8)
    save(fig, path)


# ---------------------------------------------------------------------------------------------- driver


def record(run: Run) -> dict[str, Any]:
    out = dataclasses.asdict(run)
    return {**out, "run_dir": str(run.run_dir), "label": run.label, "command": run.command()}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny models, a few steps, capped data")
    parser.add_argument("--out", default=None, help="run folders (default runs/exp_blocks; --quick: a temp folder)")
    parser.add_argument(
        "--results", default=None, help=f"report into this file (default {shown(RESULTS)}; --quick: <out>/results.md)"
    )
    parser.add_argument("--no-results", action="store_true", help="write no report file and no plot")
    parser.add_argument(
        "--lrs", type=float, nargs="+", default=list(LRS), help="learning rates (default 1e-3 1e-2 1e-1)"
    )
    parser.add_argument("--repeat-seed", type=int, default=1, help="the default arm again at this seed (0: none)")
    parser.add_argument(
        "--only", default=None, help="comma-separated arms (default: all); " + ", ".join(a.key for a in ARMS)
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="compose and validate every run; train nothing")
    args = parser.parse_args(argv)
    known = {a.key for a in ARMS}
    if args.only and not set(args.only.split(",")) <= known:
        parser.error(f"--only: unknown arms {sorted(set(args.only.split(',')) - known)}; choose among {sorted(known)}")
    args.out = str(run_folder(args.out, "exp_blocks", args.quick))
    if args.results is None:
        args.results = str(Path(args.out) / "results.md") if args.quick else str(RESULTS)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    logging.getLogger("xfam").setLevel(logging.INFO)
    budget = QUICK if args.quick else REAL
    out = Path(args.out)
    only = set(args.only.split(",")) if args.only else None
    runs = make_runs(budget, out, args.lrs, args.repeat_seed or None, only)
    started = time.perf_counter()
    for i, run in enumerate(runs, 1):
        print(f"({i}/{len(runs)})", end=" ", flush=True)
        train(run, args.dry_run)
    results: dict[str, Any] = {"budget": dataclasses.asdict(budget), "runs": [record(r) for r in runs]}
    results["seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if args.dry_run:
        print(f"dry run: {sum(r.status == 'planned' for r in runs)} of {len(runs)} runs compose and validate")
        return results
    path = Path(args.results)
    png = path.with_name("results_blocks.png")
    body = report(runs, budget, args, None if args.no_results else png.name)
    results["report"] = body
    print(body, flush=True)
    if not args.no_results:
        plot(runs, budget, png)
        write_section(path, SECTION, body)
        print(f"wrote {path} ({SECTION}) and {png}", flush=True)
    print(f"results: {out / 'results.json'}; total {results['seconds'] / 60:.1f} min", flush=True)
    return results


if __name__ == "__main__":
    main()
