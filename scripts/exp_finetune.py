"""The fine-tuning recipes of docs/finetuning.md, run and measured.

    python scripts/exp_finetune.py all                        # the three recipes, tables into docs/finetuning.md
    python scripts/exp_finetune.py memorizing --seeds 0,1,2   # decoder -> memory=memorizing vs no memory
    python scripts/exp_finetune.py longformer                 # Longformer, staged: window and length doubled
    python scripts/exp_finetune.py interpolation              # RoPE (and learned) position interpolation, 64 -> 128
    python scripts/exp_finetune.py all --quick                # smoke test: tiny model, a few steps, 1-2 min

Recipes (every run a byte-level LM on the embedded corpus, ``data=text``: the Python standard library's sources):

* ``memorizing`` (Wu et al., 2022, "Memorizing Transformers", arXiv:2203.08913, sec. 4: a pretrained model
  fine-tuned to use the kNN memory): per seed, a plain decoder pretrained briefly, then fine-tuned from its
  weights (``init_from``) for the same steps on the same batches three times: with the kNN memory at one depth,
  with it and its gate started almost closed (``gate_bias``), and without memory (the fair control: as much
  extra training, no memory). Validation bits per byte, mean and spread over the seeds, and the paired
  differences from the control.
* ``longformer`` (Beltagy et al., 2020, "Longformer", arXiv:2004.05150, sec. 4.2 "Training": staged training,
  each phase doubling the window and the sequence length and halving the learning rate): a causal Longformer
  trained at window w and length L, then from those weights at 2w and 2L with half the learning rate; each
  stage's validation bits per byte and every checkpoint's at both lengths on the same validation bytes,
  next to one stage at 2w, 2L from scratch for the same number of steps.
* ``interpolation`` (Chen et al., 2023, "Extending Context Window of Large Language Models via Positional
  Interpolation", arXiv:2306.15595): the pretrained RoPE decoder (trained at L) fine-tuned briefly at 2L with
  ``pos.interpolation=2`` and without; and a ``pos=learned`` decoder whose table of L rows is grown to 2L by
  ``finetune.interpolate=[pos.table.weight]`` or by ``finetune.allow_mismatch=true`` (its first L rows copied).
  Bits per byte at L, 2L and 4L on the same validation bytes before and after.

Each training run is exactly ``python train.py hydra.run.dir=<out>/<run> <its overrides>`` (the commands are
printed and written into the docs), trained in this process one after another (``xfam.train``) into
``<out>/<run>``, with ``--threads`` torch threads: one by default, since the model is small and on the shared
2-core machine two threads ran 8 times slower than one (1,950 against 16,800 bytes/s: the cores were
oversubscribed). The plain decoder's pretraining is shared by ``memorizing`` and ``interpolation``. A run
folder holding the finished run of the same config is reused, an unfinished one is continued
(``ckpt_path=auto``), one of another config is refused (remove ``--out`` to start over). Evaluations use the
non-overlapping protocol of ``xfam eval seq_len=N`` (each row of N bytes scored from its start) on the first
``eval_tokens`` bytes of the validation split, the same bytes for every model and length
(``xfam.eval.extrapolation``). Raw results: ``<out>/results.json`` (``--json``); tables: between the
``<!-- experiments:finetune_<recipe>:start/end -->`` markers of docs/finetuning.md (the prose around them is
kept; ``--quick`` writes no docs unless ``--docs`` is given).

One file over 400 lines: the three recipes share their runner, evaluation and table writer, and
docs/finetuning.md cites this one command.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
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
DOCS = ROOT / "docs" / "finetuning.md"
sys.path.insert(0, str(ROOT / "scripts"))
from run_experiments import comparable, fmt, one_line, run_folder, write_section  # noqa: E402

RECIPES = ("memorizing", "longformer", "interpolation")
#: How each report introduces the command line of its recipe.
WHAT = {
    "memorizing": "The recipe for the first seed (the others change `seed=` and the folders)",
    "longformer": "The two stages",
    "interpolation": "Pretraining, the fine-tune at 2L with interpolation, and its evaluation at 2L",
}


@dataclass(frozen=True)
class Budget:
    """Sizes of one invocation: the model (``model=tiny`` made smaller), steps per run, validation batches,
    evaluation bytes, memory store."""

    pretrain: int  # steps of each plain decoder (recipes 1 and 3)
    finetune: int  # steps of each memorizing fine-tune arm
    stages: tuple[int, int]  # steps of Longformer's two stages
    extend: int  # steps of each fine-tune at 2L (recipe 3)
    warmup: int  # warmup steps of a run from scratch (fine-tunes: warmup // 5)
    val_batches: int  # trainer.limit_val_batches (of each of the 16 streams)
    eval_tokens: int  # validation bytes of the length evaluations
    store: int  # memorizing store_size (pairs per stream)
    model: tuple[str, ...]  # model overrides of every run


REAL = Budget(
    pretrain=600,
    finetune=300,
    stages=(200, 100),
    extend=300,
    warmup=50,
    val_batches=40,
    eval_tokens=32768,
    store=1024,
    model=("model.dim=64", "model.layers=2", "model.heads=4"),
)
QUICK = Budget(
    pretrain=6,
    finetune=3,
    stages=(3, 3),
    extend=3,
    warmup=2,
    val_batches=2,
    eval_tokens=512,
    store=64,
    model=("model.dim=32", "model.layers=2", "model.heads=2"),
)
SEQ = 64  # L: the plain decoder's training length (recipes 1 and 3)
WINDOW = 32  # w: Longformer's first window (its first length: 4w = 128)


@dataclass
class Stage:
    """One training run of a recipe and what became of it."""

    label: str
    overrides: list[str]
    run_dir: Path
    status: str = "pending"  # ok | reused | refused | failed
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None

    @property
    def ckpt(self) -> Path:
        return self.run_dir / "checkpoints" / "last.ckpt"

    @property
    def done(self) -> bool:
        return self.status in ("ok", "reused")

    def command(self) -> str:
        return " ".join(["python train.py", f"hydra.run.dir={shown(self.run_dir)}", *map(shlex.quote, self.overrides)])


def shown(path: Path) -> str:
    """``path`` as the docs show it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ---------------------------------------------------------------------------------------------- runs


def common(b: Budget, seq_len: int = SEQ, batch: int = 16) -> list[str]:
    """What every run shares: the model, the data (``batch`` contiguous streams of ``seq_len`` bytes: runs of one
    length read the same batches and are validated on the same bytes), a final validation only, no test split."""
    return [
        *b.model,
        f"data.seq_len={seq_len}",
        f"data.batch_size={batch}",
        "loader.streams=true",
        f"trainer.limit_val_batches={b.val_batches}",
        "trainer.log_every_n_steps=10",
        "test=false",
        "callbacks.loss_curve=false",
        "callbacks.progress_bar=none",
    ]


def steps(n: int) -> list[str]:
    return [f"trainer.max_steps={n}", f"trainer.val_check_interval={n}", f"callbacks.every_n_steps={n}"]


def finetune_opt(b: Budget, lr: float = 0.001) -> list[str]:
    return [f"optim.lr={lr}", f"optim.warmup_steps={max(1, b.warmup // 5)}"]


def make(out: Path, label: str, overrides: list[str]) -> Stage:
    """A stage trained into ``<out>/<label>``."""
    return Stage(label, overrides, out / label)


def pretrain(b: Budget, out: Path, seed: int, pos: str = "rope") -> Stage:
    """The plain decoder (``model=tiny``, ``pos``) trained briefly at L; ``pos=learned`` gets a table of L rows."""
    table = ["pos=learned", f"model.max_len={SEQ}"] if pos == "learned" else []
    label = f"pretrain-s{seed}" + ("-learned" if pos == "learned" else "")
    opt = ["optim.lr=0.002", f"optim.warmup_steps={b.warmup}"]
    return make(out, label, [*common(b), *table, f"seed={seed}", *opt, *steps(b.pretrain)])


#: The memorizing layer's initial gate logit b_g in the ablation arm: g = sigmoid(-3) = 0.047, so the fine-tune
#: starts close to the pretrained model instead of at an even mix of its local attention and the retrieval.
CLOSED_GATE = -3.0


def memorizing_layer(b: Budget, gate_bias: float | None = None) -> list[str]:
    """The kNN memory at one depth (the paper: one layer near the top, the 9th of 12; here the top one of 2), no
    other memory (``memory=xl`` with ``mem_len=0`` in the other layers: none); ``gate_bias``: its b_g at the start
    (None: the component's default 0, an even mix)."""
    gate = "" if gate_bias is None else f", gate_bias: {gate_bias}"
    return [
        "memory=xl",
        "memory.mem_len=0",
        f"+memory.per_layer={{-1: {{name: memorizing, store_size: {b.store}, topk: 32{gate}}}}}",
    ]


@dataclass
class Arms:
    """One seed of the memorizing recipe: the pretraining, and three fine-tunes from it on the same batches for
    the same steps: without memory (the control), with the kNN layer, and with the kNN layer's gate closed."""

    pre: Stage
    none: Stage
    knn: Stage
    closed: Stage

    def stages(self) -> list[Stage]:
        return [self.pre, self.none, self.knn, self.closed]


def memorizing_runs(b: Budget, out: Path, seeds: list[int]) -> list[Arms]:
    arms = []
    for seed in seeds:
        pre = pretrain(b, out, seed)
        arm = [*common(b), f"seed={seed}", f"init_from={shown(pre.ckpt)}", *finetune_opt(b), "finetune.lr_new=0.01"]
        control = make(out, f"memorizing/none-s{seed}", [*arm, *steps(b.finetune)])
        memory = make(out, f"memorizing/knn-s{seed}", [*arm, *memorizing_layer(b), *steps(b.finetune)])
        closed = [*arm, *memorizing_layer(b, CLOSED_GATE), *steps(b.finetune)]
        arms.append(Arms(pre, control, memory, make(out, f"memorizing/knn-closed-s{seed}", closed)))
    return arms


def longformer_runs(b: Budget, out: Path) -> list[Stage]:
    """Stage 1 (w, L = 4w, lr), stage 2 from its weights (2w, 2L, lr / 2), and one stage at (2w, 2L) from scratch
    for the steps of both (the control). Every step holds 2,048 bytes: 16 rows of L, 8 of 2L."""
    attn = ["attention=longformer", "attention.global_tokens=[]"]  # the paper's char-LM: no global tokens
    s1, s2 = b.stages
    scratch = ["optim.lr=0.002", f"optim.warmup_steps={b.warmup}"]
    first = make(out, "longformer/stage1", [*common(b, 4 * WINDOW), *attn, f"attention.window={WINDOW}", *scratch])
    first.overrides += steps(s1)
    double = [*common(b, 8 * WINDOW, batch=8), *attn, f"attention.window={2 * WINDOW}"]
    second = make(out, "longformer/stage2", [*double, f"init_from={shown(first.ckpt)}", *finetune_opt(b)])
    second.overrides += steps(s2)
    return [first, second, make(out, "longformer/single", [*double, *scratch, *steps(s1 + s2)])]


def interpolation_runs(b: Budget, out: Path, seed: int) -> dict[str, Stage]:
    """RoPE: the pretrained decoder, fine-tuned at 2L with and without ``pos.interpolation=2``; learned: a decoder
    with a table of L rows, fine-tuned at 2L with the table interpolated or its overlap copied. Every step at 2L
    holds the bytes of a step at L: 8 rows of 2L."""
    rope, learned = pretrain(b, out, seed), pretrain(b, out, seed, "learned")
    at_2l = [*common(b, 2 * SEQ, batch=8), f"seed={seed}", *finetune_opt(b), *steps(b.extend)]
    extend = [*at_2l, f"init_from={shown(rope.ckpt)}"]
    grow = [*at_2l, "pos=learned", f"model.max_len={2 * SEQ}", f"init_from={shown(learned.ckpt)}"]
    return {
        "rope": rope,
        "rope-pi": make(out, "interpolation/rope-pi", [*extend, "pos.interpolation=2"]),
        "rope-plain": make(out, "interpolation/rope-plain", extend),
        "learned": learned,
        "learned-pi": make(out, "interpolation/learned-pi", [*grow, "finetune.interpolate=[pos.table.weight]"]),
        "learned-overlap": make(out, "interpolation/learned-overlap", [*grow, "finetune.allow_mismatch=true"]),
    }


# -------------------------------------------------------------------------------------------- driver


def compose(overrides: list[str]) -> dict[str, Any]:
    """The plain config ``python train.py <overrides>`` would train."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from xfam.training.run_names import CONFIG_DIR, register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose("train", overrides=overrides)
        return copy.deepcopy(OmegaConf.to_container(cfg, resolve=True))
    finally:
        GlobalHydra.instance().clear()


def train(stage: Stage) -> Stage:
    """Train ``stage`` (or reuse / continue its folder); a refusal or failure is recorded, not raised."""
    import yaml

    import xfam
    from xfam.core.errors import ConfigError

    if stage.status != "pending":  # (a shared pretraining, already handled)
        return stage
    print(f"[{stage.label}] {stage.command()}", flush=True)
    try:
        cfg = compose(stage.overrides)
        xfam.validate(cfg)
    except Exception as err:  # ConfigError, or Hydra's composition errors
        stage.status, stage.reason = "refused", f"{type(err).__name__}: {err}"
        print(f"    refused: {one_line(stage.reason)}", flush=True)
        return stage
    saved, record = stage.run_dir / "config.yaml", stage.run_dir / "driver.json"
    if saved.exists():
        if comparable(yaml.safe_load(saved.read_text())) != comparable(cfg):
            stage.status = "refused"
            stage.reason = f"{stage.run_dir} holds a run of another config. Fix: --out <another folder>, or remove it."
            print(f"    refused: {stage.reason}", flush=True)
            return stage
        if (stage.run_dir / "metrics.json").exists() and record.exists():
            stage.metrics = json.loads((stage.run_dir / "metrics.json").read_text())
            stage.seconds, stage.status = json.loads(record.read_text())["seconds"], "reused"
            print(f"    reused: val/bpb {fmt(stage.metrics.get('val/bpb'), 4)}", flush=True)
            return stage
        cfg["ckpt_path"] = "auto"
    start = time.perf_counter()
    try:
        stage.metrics = xfam.train(cfg, stage.run_dir)
    except ConfigError as err:
        stage.status, stage.reason = "refused", str(err)
    except Exception as err:  # recorded, not hidden: the other runs go on
        stage.status, stage.reason = "failed", f"{type(err).__name__}: {err}"
        print(traceback.format_exc(), file=sys.stderr, flush=True)
    else:
        stage.status, stage.seconds = "ok", time.perf_counter() - start
        record.write_text(json.dumps({"seconds": stage.seconds, "command": stage.command()}, indent=1))
    shown_metric = fmt(stage.metrics.get("val/bpb"), 4) if stage.done else one_line(stage.reason)
    print(f"    {stage.status}: val/bpb {shown_metric} ({fmt(stage.seconds, 0)} s)", flush=True)
    return stage


# -------------------------------------------------------------------------------------------- evaluation


class Evaluator:
    """Bits per byte of checkpoints at several lengths on the same first ``tokens`` validation bytes
    (``xfam.eval.extrapolation``: the non-overlapping protocol of ``xfam eval seq_len=N``)."""

    def __init__(self, reference: Path, tokens: int):
        """``reference``: a checkpoint whose data gives the bytes (every model here reads the same corpus)."""
        from xfam.eval.extrapolation import split_stream
        from xfam.model.build import build_data
        from xfam.model.checkpoint import read

        meta = read(reference)["xfam"]
        source = build_data(meta["config"])
        source.prepare()
        self.stream = split_stream(source, "validation", tokens)  # [tokens + 1]
        self.token_bytes = meta["data_info"].get("token_bytes")

    def bpb(self, ckpt: Path, lengths: list[int], pos: dict[str, Any] | None = None) -> dict[int, float | str]:
        """``{length: bits per byte, or the refusal}``; ``pos``: settings of the pos section changed before the
        model is built (e.g. ``{"interpolation": 2.0}``: position interpolation without training)."""
        from xfam.eval.extrapolation import evaluate_length, length_problem
        from xfam.model.build import build_model
        from xfam.model.checkpoint_file import load_model_with

        def build(cfg: dict[str, Any], info: dict[str, Any]) -> Any:
            return build_model({**cfg, "pos": {**cfg["pos"], **(pos or {})}}, info)

        model, _ = load_model_with(ckpt, build, "cpu")
        out: dict[int, float | str] = {}
        for length in lengths:
            if (why := length_problem(model, length)) is not None:
                out[length] = "refused: " + one_line(why, 120)
                continue
            res = evaluate_length(
                model, self.stream, length, "nonoverlapping", token_bytes=self.token_bytes, progress=False
            )
            out[length] = res.bpb
        return out


def cell(value: float | str | None, digits: int = 4) -> str:
    if isinstance(value, str):
        return "refused" if value.startswith("refused") else value
    return fmt(value, digits)


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def gate_mean(ckpt: Path) -> float | None:
    """Mean over heads of the memorizing layer's gate g = sigmoid(b_g): the weight of the retrieved values."""
    import torch

    from xfam.model.checkpoint import read

    state = read(ckpt)["state_dict"]
    gates = [
        torch.sigmoid(v.float()) for k, v in state.items() if k.startswith("model.memories.") and k.endswith(".gate")
    ]
    return float(torch.cat(gates).mean()) if gates else None


# -------------------------------------------------------------------------------------------- recipes


def run_memorizing(b: Budget, out: Path, seeds: list[int], done: dict[str, Stage]) -> dict[str, Any]:
    rows = []
    for arms in memorizing_runs(b, out, seeds):
        arms.pre = done.setdefault(arms.pre.label, arms.pre)
        for stage in arms.stages():
            train(stage)
        row: dict[str, Any] = {"seed": int(arms.pre.label.split("-s")[1])}
        row |= {key: s.metrics.get("val/bpb") if s.done else None for key, s in vars(arms).items()}
        row |= {f"gate_{key}": gate_mean(s.ckpt) if s.done else None for key, s in vars(arms).items() if key != "pre"}
        rows.append({**row, "runs": [stage_record(s) for s in arms.stages()]})
    summary: dict[str, Any] = {"rows": rows}
    for key in ("pre", "none", "knn", "closed"):
        values = [r[key] for r in rows]
        summary[key] = mean_sd(values) if values and None not in values else None
    for arm in ("knn", "closed"):
        ok = [r for r in rows if None not in (r["none"], r[arm])]
        summary[f"diffs_{arm}"] = [r[arm] - r["none"] for r in ok]
    return summary


def memorizing_report(summary: dict[str, Any], b: Budget, args: argparse.Namespace) -> str:
    rows = summary["rows"]
    records = [s for r in rows for s in r["runs"]]
    lines = [
        header("memorizing", records, args),
        "```bash",
        chain_text(rows[0]["runs"][:3]),
        "```",
        "",
        f"The gate ablation: the same kNN layer started almost closed, `gate_bias: {CLOSED_GATE}` in its per-layer "
        f"item: `{rows[0]['runs'][3]['command']}`.",
        "",
        f"Validation bits per byte (the first {b.val_batches} batches of each of the 16 streams: "
        f"{b.val_batches * 16 * SEQ:,} bytes, the same for every run; the memory carried from batch to batch, as in "
        f"training). Pretraining: {b.pretrain} steps; each fine-tune: {b.finetune} steps on the same batches. "
        f"Model: {model_text(b)}; kNN store {b.store:,} pairs per stream (the last {b.store // SEQ} segments), "
        "top-32. g: the kNN layer's gate sigmoid(b_g) at the end, mean over heads (the share of the retrieved "
        f"values in its output; at the start 0.5, and {1 / (1 + math.exp(-CLOSED_GATE)):.3f} with b_g = "
        f"{CLOSED_GATE}); Δ: minus the no-memory fine-tune of the same seed.",
        "",
        f"| seed | pretrained ({b.pretrain} steps) | fine-tuned, no memory | memorizing | Δ | g | "
        f"memorizing, gate closed | Δ | g |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {cell(r['pre'])} | {cell(r['none'])} | {cell(r['knn'])} | {delta(r['knn'], r['none'])} | "
            f"{fmt(r['gate_knn'], 3)} | {cell(r['closed'])} | {delta(r['closed'], r['none'])} | "
            f"{fmt(r['gate_closed'], 3)} |"
        )
    if all(summary[k] is not None for k in ("pre", "none", "knn", "closed")):
        dk, dc = mean_sd(summary["diffs_knn"]), mean_sd(summary["diffs_closed"])
        lines.append(
            f"| mean ± sd | {pm(summary['pre'])} | {pm(summary['none'])} | {pm(summary['knn'])} | "
            f"**{pm(dk, True)}** | | {pm(summary['closed'])} | **{pm(dc, True)}** | |"
        )
        lines += ["", verdict(summary["diffs_knn"], "memorizing"), "", verdict(summary["diffs_closed"], "gate closed")]
    return "\n".join(lines + failures(records))


def delta(value: float | None, base: float | None) -> str:
    return "-" if value is None or base is None else f"{value - base:+.4f}"


def pm(stats: tuple[float, float], signed: bool = False) -> str:
    """``mean ± sd``."""
    return f"{stats[0]:+.4f} ± {stats[1]:.4f}" if signed else f"{stats[0]:.4f} ± {stats[1]:.4f}"


def verdict(diffs: list[float], arm: str) -> str:
    """One sentence, from the numbers: whether an arm beat the no-memory control, by the paired differences
    (arm minus control, one per seed)."""
    if not diffs:
        return f"Verdict ({arm}): no seed finished both runs."
    n, lower = len(diffs), sum(d < 0 for d in diffs)
    mean, sd = mean_sd(diffs)
    se = sd / math.sqrt(n) if n > 1 else math.inf
    if lower == n and mean + 2 * se < 0:
        word = "**helped**: lower bits per byte on every seed, the mean difference more than two standard errors"
    elif lower == 0 and mean - 2 * se > 0:
        word = "**hurt**: higher bits per byte on every seed, the mean difference more than two standard errors"
    else:
        word = "**made no difference that these seeds can resolve** (no gain from the memory at this scale)"
    spread = f"; standard error {se:.4f})." if n > 1 else "; one seed: no spread)."
    return (
        f"Verdict ({arm}, computed): the memory {word}; below the control on {lower} of {n} seeds, paired "
        f"difference {mean:+.4f} ± {sd:.4f} bits per byte (mean ± sample sd over seeds{spread}"
    )


def run_longformer(b: Budget, out: Path) -> dict[str, Any]:
    stages = [train(s) for s in longformer_runs(b, out)]
    lengths = [4 * WINDOW, 8 * WINDOW]
    evals: dict[str, Any] = {}
    ready = [s for s in stages if s.done]
    if ready:
        ev = Evaluator(ready[0].ckpt, b.eval_tokens)
        evals = {s.label: ev.bpb(s.ckpt, lengths) for s in ready}
    return {"stages": [stage_record(s) for s in stages], "evals": evals, "lengths": lengths}


def longformer_report(summary: dict[str, Any], b: Budget, args: argparse.Namespace) -> str:
    stages, lengths = summary["stages"], summary["lengths"]
    lines = [
        header("longformer", stages, args),
        "```bash",
        chain_text(stages[:2]),
        "```",
        "",
        f"Causal Longformer ({model_text(b)}), no global tokens, 2,048 bytes a step; the control: "
        "`" + stages[2]["command"] + "`. Validation bits per byte: each run's own (the first "
        f"{b.val_batches} batches of each of its streams, at its length), and every checkpoint's at both lengths on "
        f"the same first {b.eval_tokens:,} validation bytes (non-overlapping rows, as `xfam eval seq_len=N`).",
        "",
        "| run | start | window | seq_len | lr | steps | val bpb (own) | "
        + " | ".join(f"bpb at {n}" for n in lengths)
        + " | train s |",
        "|---|---|---|---|---|---|---|" + "---|" * len(lengths) + "---|",
    ]
    for s in stages:
        cfg = s["config"]
        start = "stage1's weights" if s["label"].endswith("stage2") else "scratch"
        ev = summary["evals"].get(s["label"], {})
        lines.append(
            f"| {s['label'].split('/')[1]} | {start} | {cfg.get('window')} | {cfg.get('seq_len')} | {cfg.get('lr')} | "
            f"{cfg.get('steps')} | {cell(s['metrics'].get('val/bpb'))} | "
            + " | ".join(cell(ev.get(n, ev.get(str(n)))) for n in lengths)
            + f" | {fmt(s['seconds'], 0)} |"
        )
    return "\n".join(lines + failures(stages))


def run_interpolation(b: Budget, out: Path, seed: int, done: dict[str, Stage]) -> dict[str, Any]:
    runs = interpolation_runs(b, out, seed)
    runs = {k: done.setdefault(s.label, s) for k, s in runs.items()}
    for stage in runs.values():
        train(stage)
    lengths = [SEQ, 2 * SEQ, 4 * SEQ]
    evals: dict[str, Any] = {}
    ready = {k: s for k, s in runs.items() if s.done}
    if ready:
        ev = Evaluator(next(iter(ready.values())).ckpt, b.eval_tokens)
        for key, stage in ready.items():
            evals[key] = ev.bpb(stage.ckpt, lengths)
        if "rope" in ready:
            evals["rope+pi0"] = ev.bpb(runs["rope"].ckpt, lengths, {"interpolation": 2.0})
    return {"runs": {k: stage_record(s) for k, s in runs.items()}, "evals": evals, "lengths": lengths, "seed": seed}


ROWS = {
    "rope": ("rope", "trained at 64 (pretraining)", "-"),
    "rope+pi0": ("rope", "the same weights, `pos.interpolation=2`, no training", "-"),
    "rope-pi": ("rope", "+ {n} steps at 128, `pos.interpolation=2`", "{s}"),
    "rope-plain": ("rope", "+ {n} steps at 128, no interpolation", "{s}"),
    "learned": ("learned", "trained at 64, a table of 64 rows", "-"),
    "learned-pi": ("learned", "+ {n} steps at 128, table interpolated to 128 rows (`finetune.interpolate`)", "{s}"),
    "learned-overlap": ("learned", "+ {n} steps at 128, rows 64-127 fresh (`finetune.allow_mismatch`)", "{s}"),
}


def interpolation_report(summary: dict[str, Any], b: Budget, args: argparse.Namespace) -> str:
    runs, lengths, evals = summary["runs"], summary["lengths"], summary["evals"]
    lines = [
        header("interpolation", list(runs.values()), args),
        "```bash",
        chain_text([runs["rope"], runs["rope-pi"]])
        + f" && \\\n  xfam eval ckpt={shown(Path(runs['rope-pi']['run_dir']) / 'checkpoints' / 'last.ckpt')} "
        f"seq_len={2 * SEQ} split=validation",
        "```",
        "",
        "With `pos=learned`, the table grown from 64 to 128 rows by interpolation:",
        "",
        "```bash",
        chain_text([runs["learned"], runs["learned-pi"]]),
        "```",
        "",
        f"Bits per byte on the same first {b.eval_tokens:,} validation bytes, cut into non-overlapping rows of the "
        f"evaluation length (as `xfam eval seq_len=N`). The RoPE decoder is the memorizing recipe's pretrained one "
        f"(seed {summary['seed']}; {model_text(b)}), the learned one the same with `pos=learned`; each fine-tune: "
        f"{b.extend} steps of 8 rows of {2 * SEQ} bytes (the bytes of a step at {SEQ}). A learned table refuses "
        "lengths past its rows.",
        "",
        "| pos | model | " + " | ".join(f"bpb at {n}" for n in lengths) + " | train s |",
        "|---|---|" + "---|" * len(lengths) + "---|",
    ]
    for key, (pos, text, secs) in ROWS.items():
        if key not in evals:
            continue
        ev, run = evals[key], runs.get(key, {})
        cells = " | ".join(cell(ev.get(n, ev.get(str(n)))) for n in lengths)
        seconds = secs.format(s=fmt(run.get("seconds"), 0))
        lines.append(f"| {pos} | {text.format(n=b.extend)} | {cells} | {seconds} |")
    return "\n".join(lines + failures(list(runs.values())))


# -------------------------------------------------------------------------------------------- reports


def stage_record(stage: Stage) -> dict[str, Any]:
    """A stage as the JSON results and the tables hold it (with the settings the tables show)."""
    ov = dict(o.lstrip("+").split("=", 1) for o in stage.overrides)
    config = {
        "window": ov.get("attention.window"),
        "seq_len": ov.get("data.seq_len"),
        "lr": ov.get("optim.lr"),
        "steps": ov.get("trainer.max_steps"),
    }
    return {
        **{k: v for k, v in dataclasses.asdict(stage).items() if k != "run_dir"},
        "run_dir": str(stage.run_dir),
        "command": stage.command(),
        "config": config,
    }


def chain_text(records: list[dict[str, Any]]) -> str:
    return " && \\\n  ".join(r["command"] for r in records)


def model_text(b: Budget) -> str:
    return "`model=tiny` with " + " ".join(f"`{o}`" for o in b.model)


def header(recipe: str, records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    done = {r["label"]: r["seconds"] or 0 for r in records if r["status"] in ("ok", "reused")}
    seeds = f" --seeds {','.join(map(str, args.seeds))}" if recipe == "memorizing" else ""
    quick = " --quick" if args.quick else ""
    threads = f"{args.threads} torch thread" + ("s" if args.threads > 1 else "")
    return (
        f"Command: `OMP_NUM_THREADS={args.threads} python scripts/exp_finetune.py {recipe}{seeds}{quick}` "
        f"({threads}, the shared 2-core CPU, one run at a time): {sum(done.values()) / 60:.1f} min of training "
        f"over {len(done)} runs. {WHAT[recipe]}, exactly:\n"
    )


def failures(records: list[dict[str, Any]]) -> list[str]:
    bad = {r["label"]: r for r in records if r["status"] not in ("ok", "reused")}
    return [f"* `{label}`: **{r['status']}**: {one_line(r['reason'])}" for label, r in bad.items()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=[*RECIPES, "all"])
    parser.add_argument("--seeds", default="0,1,2", help="pretraining seeds of the memorizing recipe (default 0,1,2)")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, a few steps, no docs written")
    parser.add_argument("--out", default=None, help="run folders (default runs/exp_finetune; --quick: a temp folder)")
    parser.add_argument("--json", default=None, help="raw results (default <out>/results.json)")
    parser.add_argument("--docs", default=None, help=f"tables into this file (default {shown(DOCS)}; --quick: none)")
    parser.add_argument("--no-docs", action="store_true", help="write no tables")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see the module docstring)")
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not args.seeds:
        parser.error("--seeds: give at least one seed, e.g. --seeds 0,1,2")

    import torch

    torch.set_num_threads(args.threads)
    logging.getLogger("xfam").setLevel(logging.INFO)  # as train.py: each run's train.log gets its init_from table
    budget = QUICK if args.quick else REAL
    out = run_folder(args.out, "exp_finetune", args.quick)
    docs = None if args.no_docs else Path(args.docs) if args.docs else None if args.quick else DOCS
    chosen = list(RECIPES) if args.which == "all" else [args.which]
    shared: dict[str, Stage] = {}  # the pretraining runs two recipes share, by label
    results: dict[str, Any] = {"budget": dataclasses.asdict(budget), "out": str(out)}
    started = time.perf_counter()
    for recipe in chosen:
        t0 = time.perf_counter()
        print(f"== {recipe} into {out}", flush=True)
        if recipe == "memorizing":
            summary = run_memorizing(budget, out, args.seeds, shared)
            body = memorizing_report(summary, budget, args)
        elif recipe == "longformer":
            summary = run_longformer(budget, out)
            body = longformer_report(summary, budget, args)
        else:
            summary = run_interpolation(budget, out, args.seeds[0], shared)
            body = interpolation_report(summary, budget, args)
        summary["seconds"] = time.perf_counter() - t0
        results[recipe] = summary
        print(body, flush=True)
        if docs is not None:
            write_section(docs, f"finetune_{recipe}", body)
            print(f"wrote {docs} (finetune_{recipe})", flush=True)
    results["seconds"] = time.perf_counter() - started
    path = Path(args.json) if args.json else out / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"results: {path}; total {results['seconds'] / 60:.1f} min", flush=True)
    return results


if __name__ == "__main__":
    main()
