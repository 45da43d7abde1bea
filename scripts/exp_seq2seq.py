"""The sequence-to-sequence experiments; tables go into docs/results.md, plots next to it.

    python scripts/exp_seq2seq.py arch     # encoder-decoder vs decoder-only (source as a prefix), docstrings
    python scripts/exp_seq2seq.py mlm      # MLM self-pretraining then fine-tuning vs from scratch, ListOps
    python scripts/exp_seq2seq.py calm     # CALM on the seq2seq decoder: layers saved vs quality, Learn-then-Test
    python scripts/exp_seq2seq.py all      # the three, one after another
    python scripts/exp_seq2seq.py arch --quick     # ~1 min smoke run: tiny data and steps; results into <out>
    python scripts/exp_seq2seq.py all --dry-run    # compose and validate every run, train nothing

Measured on the shared 2-core CPU (2 torch threads, runs one after another): arch 42 min (4 runs, on a heavily
loaded machine: the seed-0 pair took 11 of them), mlm 8 min, calm 7 min; --quick about 15-60 s each.

Every training run is exactly ``python train.py experiment=<experiment> <its overrides> <--set overrides>``
(the commands go into the tables), trained in this process one after another (``--threads`` torch threads)
into ``<out>/<experiment>/<label>``; a finished run with the same config is reused, an unfinished one
continued (``scripts/run_experiments.py``'s runner). Raw results go to ``<out>/<experiment>/results.json``,
tables between ``<!-- experiments:<section>:start/end -->`` markers of the results file (sections
``seq2seq_arch``, ``listops_spt``, ``seq2seq_calm``; the prose around them is kept), plots next to it.
``--quick`` trains a few steps on capped data into ``<out>/exp_seq2seq_quick`` and writes its tables there
(``results.md``), never into docs/.

One file over 400 lines: the three experiments share their runner, tables and plots, and docs/results.md cites
this one command.

* ``arch`` (``experiment=seq2seq_docstrings``): an encoder-decoder (Vaswani et al., 2017, arXiv:1706.03762)
  and a decoder-only model reading the source as a prefix (T5's prefix-LM layout, Raffel et al., 2020,
  arXiv:1910.10683, sec. 3.2; the loss on the target only), at equal parameters: the decoder's depth is the
  one whose parameter count is closest to the encoder-decoder's (``decoder_depth``: every depth is built and
  counted), and equal budget (steps, batch, optimiser). Per seed: teacher-forced test loss, bits per byte and
  token accuracy (every test pair, from the run's test), and greedy outputs of the first ``--gen-rows`` test
  pairs, one pair at a time for both shapes, scored with BLEU, chrF and exact match
  (``xfam.eval.text_metrics``; at most the data's ``target_len`` new tokens). Speed: training pairs and
  tokens per second (source + target + EOS) measured side by side on the same pairs, the two models
  interleaved, medians after warm-up (``train_throughput``), and greedy decoding tokens per second at batch 1,
  measured the same way (``generation_throughput``).
* ``mlm`` (``experiment=listops_mlm`` then ``experiment=listops_spt``): self-pretraining (Amos et al., 2023,
  "Never Train from Scratch", arXiv:2310.02980): BERT's masked-LM objective (Devlin et al., 2019,
  arXiv:1810.04805) on ListOps' own training trees, without their labels, then fine-tuning on the labels
  (``init_from``), against the same encoder from scratch at the fine-tuning budget and at the whole budget
  (pretraining + fine-tuning steps). ``write_corpus`` writes each training tree as a file whose bytes are
  its token ids, which ``data=text``'s byte tokenizer reads back as exactly those ids: the pretrained
  embedding's first 17 rows are ListOps' vocabulary, and ``finetune.allow_mismatch`` copies them.
* ``calm`` (``experiment=seq2seq_calm``): CALM (Schuster et al., 2022, arXiv:2207.07061) on the decoder of an
  encoder-decoder: per-exit quality (every token leaves after layer n), threshold sweeps of the three
  confidence measures (mean decoder layers, test bits per byte, disagreement with the full model), greedy
  generation with early exit (chrF and BLEU against the references and against the full model's outputs,
  mean layers per generated token), the Learn-then-Test threshold (Angelopoulos et al., arXiv:2110.01052)
  calibrated on the validation split and checked on the test split and on repeated random splits, and
  ``xfam calibrate`` run on the checkpoint as a user would.

One file over 400 lines: the three experiments share their runner, evaluation helpers and table writer, and
docs/results.md cites this one command.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from memory_experiments import curves, pyplot, save  # noqa: E402
from run_experiments import (  # noqa: E402
    Run,
    add_run_options,
    compose,
    fmt,
    label_stats,
    one_line,
    prepare_run,
    train_run,
    write_section,
)

ARCH, CALM, FINETUNE, PRETRAIN = "seq2seq_docstrings", "seq2seq_calm", "listops_spt", "listops_mlm"
#: The runs' own generation during validation and test is off: the script generates (and times) it itself, with
#: at most target_len new tokens (validation's default is the batch's longest reference).
NO_GEN = ["task.eval_generate_rows=0"]
SECTIONS = {"arch": "seq2seq_arch", "mlm": "listops_spt", "calm": "seq2seq_calm"}
_SHORT = ["trainer.limit_val_batches=1", "trainer.limit_test_batches=2", "optim.warmup_steps=1"]
_PAIRS = ["data.max_files=40", "trainer.max_steps=4", "trainer.val_check_interval=4", *_SHORT]
QUICK = {  # --quick: the same runs on capped data, a few steps
    ARCH: _PAIRS,
    CALM: _PAIRS,
    FINETUNE: ["data.num_train=96", "data.num_val=32", "data.num_test=32", "trainer.max_steps=4"]
    + ["trainer.val_check_interval=2", *_SHORT],
    PRETRAIN: ["data.seq_len=16", "data.val_fraction=0.2", "data.test_fraction=0.2", "trainer.max_steps=4"]
    + ["trainer.val_check_interval=4", *_SHORT],
}
GRIDS = {  # CALM thresholds, most conservative first (1.01: no exits); saturation is a cosine near 1
    "softmax": [1.01, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05],
    "saturation": [1.01, 0.9999, 0.9995, 0.999, 0.998, 0.995, 0.99, 0.98, 0.95, 0.9, 0.8],
    "classifier": [1.01, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05],
}


# ---------------------------------------------------------------------------------------------- runner


def base(experiment: str, args: argparse.Namespace) -> list[str]:
    """The overrides every run of ``experiment`` gets: the quick ones, then ``--set``."""
    return [*(QUICK[experiment] if args.quick else []), *args.set]


def command(run: Run) -> str:
    return " ".join(["python train.py", f"experiment={run.experiment}", *map(shlex.quote, run.overrides)])


def ok(run: Run) -> bool:
    return run.status in ("ok", "reused")


def ckpt_of(run: Run) -> Path:
    return Path(run.run_dir) / "checkpoints" / "last.ckpt"


def train_all(runs: list[Run], args: argparse.Namespace) -> None:
    """Train (or reuse) each run; a refused or failed one is recorded and the others go on."""
    for i, run in enumerate(runs, 1):
        cfg, reusable = prepare_run(run, Path(args.out))
        print(f"[{i}/{len(runs)}] {run.label}: {command(run)}", flush=True)
        if cfg is None:
            print(f"    {run.status}: {one_line(run.reason)}", flush=True)
            continue
        if args.dry_run:
            run.status = "planned"
            continue
        train_run(run, cfg, reusable)
        shown = {k: round(v, 4) for k, v in run.metrics.items() if k.startswith("test/") and isinstance(v, float)}
        print(f"    {run.status} ({fmt(run.seconds, 0)} s): {shown or run.reason}", flush=True)


def status_lines(runs: list[Run]) -> list[str]:
    bad = [f"* `{r.label}`: **{r.status}**: {one_line(r.reason)}" for r in runs if not ok(r)]
    return ["", *bad] if bad else []


def spread(values: list[float], digits: int = 3) -> str:
    """``mean (min-max)`` over seeds, or the one value."""
    if not values:
        return "-"
    mean = f"{statistics.fmean(values):.{digits}f}"
    return mean if len(values) == 1 else f"{mean} ({min(values):.{digits}f}-{max(values):.{digits}f})"


@functools.lru_cache(maxsize=8)
def _prepared(data_json: str) -> Any:
    from xfam.model.build import build_data

    source = build_data({"data": json.loads(data_json)})
    source.prepare()
    return source


def prepared(cfg: dict[str, Any]) -> Any:
    """The prepared data source of ``cfg`` (one per data config in this process)."""
    return _prepared(json.dumps(cfg["data"], sort_keys=True))


# ------------------------------------------------------------------------------------------- pairs data


def pair_collate(model: Any, source: Any) -> Any:
    """The batch layout ``model`` trained on: the source's own (encoder-decoder) or the prefix LM's."""
    from xfam.data.seq2seq import collate_prefix_lm
    from xfam.model.encoder_decoder import EncoderDecoder

    if isinstance(model, EncoderDecoder):
        return source.collate
    return functools.partial(collate_prefix_lm, pad_id=source.pad_id, bos_id=source.bos_id, eos_id=source.eos_id)


def pair_batches(model: Any, cfg: dict[str, Any], split: str, rows: int | None, size: int) -> list[dict]:
    """The first ``rows`` pairs of ``split`` (None: all), in order, in batches of ``size`` in ``model``'s layout (the
    rows and layout of ``xfam.eval.loop.split_loader``, here for any row count and batch size)."""
    source = prepared(cfg)
    ds = source.split(split)
    n, collate = len(ds) if rows is None else min(rows, len(ds)), pair_collate(model, source)
    return [collate([ds[i] for i in range(s, min(s + size, n))]) for s in range(0, n, size)]


@torch.no_grad()
def generation(model: Any, info: dict, batches: list[dict], max_new: int, depth_of: Any = None) -> dict[str, Any]:
    """Greedy outputs of ``batches`` (``xfam.eval.outputs.generate_outputs``, as validation generates them, with
    at most ``max_new`` new tokens), scored against the references with BLEU, chrF and exact match; decoding
    steps (generated tokens, EOS included) per second; with ``depth_of`` (an early-exit encoder-decoder) the
    mean decoder layers per generated token."""
    from xfam.data.tokenize import tokenizer_from_state
    from xfam.eval.outputs import as_text, generate_outputs, references
    from xfam.eval.text_metrics import text_metrics

    tok, eos = tokenizer_from_state(info["tokenizer"]), info["eos_id"]
    hyps, refs, steps, seconds, layers, depths = [], [], 0, 0.0, 0.0, []
    hook = model.decoder.register_forward_hook(lambda m, a, out: depths.append(out.depth[:, -1])) if depth_of else None
    try:
        for b in batches:
            depths.clear()
            start = time.perf_counter()
            out = generate_outputs(model, b, bos_id=info["bos_id"], eos_id=eos, max_new_tokens=max_new)
            seconds += time.perf_counter() - start
            made = [min(len(h) + 1, max_new) for h in out]  # decoding steps of each row (its EOS included)
            if hook is not None:
                d = torch.stack(depths, dim=1).float()  # [B, T] layers used at each step
                layers += sum(float(d[i, :n].sum()) for i, n in enumerate(made))
            hyps += [as_text(h, tok) for h in out]
            refs += [as_text(r, tok) for r in references(b, eos)]
            steps += sum(made)
    finally:
        if hook is not None:
            hook.remove()
    result = {**text_metrics(hyps, refs), "rows": len(hyps), "tokens": steps, "tokens_per_s": steps / seconds}
    result |= {"hyps": hyps, "refs": refs}
    if hook is not None:
        result["depth"] = layers / steps
    return result


# ------------------------------------------------------------------------------------------------ arch


def param_count(cfg: dict[str, Any], arch: str, layers: int) -> int:
    """Parameters of the model ``cfg`` builds with ``model.arch`` and ``model.layers`` set (no data read)."""
    from xfam.model.build import build_data, build_model

    source = build_data(cfg)
    info = {"task": source.task, "vocab_size": source.vocab_size, "num_classes": None}
    c = copy.deepcopy(cfg)
    c["model"].update(arch=arch, layers=layers)
    return sum(p.numel() for p in build_model(c, info).parameters())


def decoder_depth(cfg: dict[str, Any], most: int = 16) -> dict[str, Any]:
    """The decoder-only depth (1..``most``) whose parameter count is closest to the encoder-decoder of ``cfg``
    (ties: the shallower), with every count tried."""
    target = param_count(cfg, cfg["model"]["arch"], cfg["model"]["layers"])
    tried = {n: param_count(cfg, "decoder", n) for n in range(1, most + 1)}
    best = min(tried, key=lambda n: (abs(tried[n] - target), n))
    return {"layers": best, "encdec_params": target, "decoder_params": tried[best], "tried": tried}


def arch_runs(args: argparse.Namespace, depth: int) -> list[Run]:
    b, runs = base(ARCH, args), []
    for seed in args.seeds:
        runs.append(Run(ARCH, f"encdec-s{seed}", [f"seed={seed}", *NO_GEN, *b]))
        dec = ["model.arch=decoder", f"model.layers={depth}", f"seed={seed}", *NO_GEN]
        runs.append(Run(ARCH, f"decoder-s{seed}", [*dec, *b]))
    return runs


def train_throughput(cfgs: dict[str, dict], steps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Training speed of each config's model on the same training pairs: forward, backward and an AdamW step per
    batch, the models interleaved (the order alternating each batch) so that a change of machine load hits all;
    medians over ``steps`` batches after ``warmup``. Tokens: source + target + EOS of each pair (the same for
    both layouts)."""
    from xfam.eval.forward import forward_batch
    from xfam.model.build import build_model, data_info

    source = prepared(next(iter(cfgs.values())))
    info, ds, size = data_info(source), source.split("train"), source.batch_size
    torch.manual_seed(0)
    models = {k: build_model(c, info) for k, c in cfgs.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    rates: dict[str, list[tuple[float, float]]] = {k: [] for k in cfgs}
    for i in range(warmup + steps):
        rows = [ds[j] for j in range(i * size, (i + 1) * size)]
        tokens = sum(len(r["source"]) + len(r["target"]) + 1 for r in rows)
        for k in list(cfgs) if i % 2 == 0 else list(reversed(cfgs)):
            batch, start = pair_collate(models[k], source)(rows), time.perf_counter()
            out = forward_batch(models[k], batch)
            F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
            opts[k].step()
            opts[k].zero_grad()
            dt = time.perf_counter() - start
            if i >= warmup:
                rates[k].append((size / dt, tokens / dt))
    return {
        k: {"pairs_per_s": statistics.median(p for p, _ in v), "tokens_per_s": statistics.median(t for _, t in v)}
        for k, v in rates.items()
    }


def arch(args: argparse.Namespace) -> dict[str, Any]:
    from xfam.model.checkpoint import load_model

    cfg = compose(ARCH, base(ARCH, args))
    depth = decoder_depth(cfg)
    print(f"decoder-only depth {depth['layers']}: {depth['decoder_params']:,} params vs {depth['encdec_params']:,}")
    runs = arch_runs(args, depth["layers"])
    train_all(runs, args)
    if args.dry_run:
        return {}
    evals = {r.label: cached_generation(r, args) for r in filter(ok, runs)}
    dec = compose(ARCH, ["model.arch=decoder", f"model.layers={depth['layers']}", *base(ARCH, args)])
    speed = train_throughput({"encdec": cfg, "decoder": dec}, args.bench_steps, args.bench_warmup)
    first = {shape_of(r): r for r in reversed(runs) if ok(r)}  # each shape's run of the first seed
    if len(first) == 2:
        gen_speed = generation_throughput({k: load_model(ckpt_of(r))[0] for k, r in first.items()}, args)
        speed = {k: {**v, "gen_tokens_per_s": gen_speed[k]} for k, v in speed.items()}
    result = {"depth": depth, "runs": runs, "evals": evals, "speed": speed}
    body = arch_report(cfg, result, args)
    png = publish(args, "arch", result, body)
    if png is not None:
        plot_arch(runs, evals, png)
    return result


def cached_generation(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """``generation`` of the run's last checkpoint on the first ``--gen-rows`` test pairs, one at a time; cached in
    ``<run>/generation.json`` (for the same rows and step)."""
    from xfam.model.checkpoint import load_model

    path, stamp = Path(run.run_dir) / "generation.json", {"rows": args.gen_rows, "step": run.metrics.get("step")}
    if path.exists() and json.loads(path.read_text()).get("stamp") == stamp:
        return json.loads(path.read_text())["result"]
    model, meta = load_model(ckpt_of(run))
    model.eval()
    batches = pair_batches(model, meta["config"], "test", args.gen_rows, 1)
    e = generation(model, meta["data_info"], batches, meta["config"]["data"]["target_len"])
    print(f"{run.label}: BLEU {e['bleu']:.2f} chrF {e['chrf']:.2f} EM {e['exact_match']:.3f}", flush=True)
    path.write_text(json.dumps({"stamp": stamp, "result": e}))
    return e


@torch.no_grad()
def generation_throughput(models: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """Greedy decoding speed at batch 1, side by side: each model decodes exactly ``target_len`` new tokens for
    each of the first ``--bench-steps`` test pairs (never stopping: the encoder-decoder's stop token is set to
    the padding id, which it never predicts; the decoder-only model has none), the models interleaved; the median
    tokens per second after the first pair (warm-up)."""
    from xfam.eval.generate import generate
    from xfam.eval.translate import translate
    from xfam.model.encoder_decoder import EncoderDecoder

    rates: dict[str, list[float]] = {k: [] for k in models}
    cfg = compose(ARCH, base(ARCH, args))
    info, steps = data_info_of(cfg), cfg["data"]["target_len"]
    pairs = {k: pair_batches(m, cfg, "test", args.bench_steps + 1, 1) for k, m in models.items()}
    for i in range(args.bench_steps + 1):
        for k in list(models) if i % 2 == 0 else list(reversed(models)):
            model, b = models[k].eval(), pairs[k][i]
            start = time.perf_counter()
            if isinstance(model, EncoderDecoder):
                kw = {"bos_id": info["bos_id"], "eos_id": info["pad_id"], "max_new_tokens": steps}
                made = translate(model, b["input_ids"], b.get("key_padding"), **kw).tokens.shape[1]
            else:
                prompt = int((b["labels"][0] != -100).nonzero()[0, 0]) + 1  # the source and BOS
                made = generate(model, b["input_ids"][:, :prompt], steps, temperature=0.0).tokens.shape[1] - prompt
            if i:
                rates[k].append(made / (time.perf_counter() - start))
    return {k: statistics.median(v) for k, v in rates.items()}


def data_info_of(cfg: dict[str, Any]) -> dict[str, Any]:
    from xfam.model.build import data_info

    return data_info(prepared(cfg))


def shape_of(run: Run) -> str:
    return "decoder" if "model.arch=decoder" in run.overrides else "encdec"


def arch_report(cfg: dict[str, Any], result: dict[str, Any], args: argparse.Namespace) -> str:
    depth, runs, evals, speed = result["depth"], result["runs"], result["evals"], result["speed"]
    d, t, m = cfg["data"], cfg["trainer"], cfg["model"]
    enc = cfg["encoder"]["layers"] or m["layers"]
    diff = depth["decoder_params"] / depth["encdec_params"] - 1
    tried = ", ".join(f"{n}: {c:,}" for n, c in depth["tried"].items() if abs(n - depth["layers"]) <= 2)
    done = [r for r in runs if ok(r)]
    lines = [
        f"Command: `python scripts/exp_seq2seq.py arch{flags(args)}` (torch threads: {args.threads}); training wall "
        f"time {sum(r.seconds or 0 for r in done) / 60:.1f} min over {len(done)} runs, one at a time, on the "
        "shared 2-core CPU. Each run, exactly:",
        "",
        "```bash",
        *[command(r) for r in runs],
        "```",
        "",
        f"`data=docstrings`: sources cut to {d['source_len']} bytes, targets to {d['target_len'] - 1} bytes + EOS; "
        f"width {m['dim']}, {m['heads']} heads, RoPE, {t['max_steps']} steps of {d['batch_size']} pairs, AdamW "
        f"lr {cfg['optim']['lr']}. **Equal parameters**: the encoder-decoder ({enc} + {m['layers']} layers) has "
        f"{depth['encdec_params']:,}; every decoder-only depth was built and counted ({tried}, ...) and the "
        f"closest, {depth['layers']} layers, has {depth['decoder_params']:,} ({diff:+.2%}). Teacher-forced "
        "metrics on every test pair (the run's test); generated outputs (greedy, one pair at a time, at most "
        f"{d['target_len']} tokens) on the first {args.gen_rows} test pairs.",
        "",
        "| run | shape | layers | params | test loss | test bpb | test acc | BLEU | chrF | exact match | train s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in done:
        mt, e = r.metrics, evals[r.label]
        layers = f"{enc} + {m['layers']}" if shape_of(r) == "encdec" else str(depth["layers"])
        lines.append(
            f"| {r.label} | {shape_of(r)} | {layers} | {r.params:,} | {mt['test/loss']:.4f} | {mt['test/bpb']:.4f} | "
            f"{mt['test/acc']:.4f} | {e['bleu']:.2f} | {e['chrf']:.2f} | {e['exact_match']:.3f} | "
            f"{fmt(r.seconds, 0)} |"
        )
    lines += [
        "",
        f"**By shape**, mean (min-max) over seeds {', '.join(map(str, args.seeds))}; training speed measured side "
        f"by side on the same {args.bench_steps} batches of training pairs (median after {args.bench_warmup} "
        "warm-up batches, the models interleaved; tokens = source + target + EOS); generation speed: greedy "
        f"decoding of exactly {d['target_len']} new tokens for each of {args.bench_steps} test pairs at batch 1, the "
        f"seed-{args.seeds[0]} models interleaved (median after one warm-up pair):",
        "",
        "| shape | test bpb | BLEU | chrF | exact match | train pairs/s | train tokens/s | gen tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in ("encdec", "decoder"):
        mine = [r for r in done if shape_of(r) == shape]
        e = [evals[r.label] for r in mine]
        s = speed[shape]
        lines.append(
            f"| {shape} | {spread([r.metrics['test/bpb'] for r in mine])} | {spread([x['bleu'] for x in e], 2)} | "
            f"{spread([x['chrf'] for x in e], 2)} | {spread([x['exact_match'] for x in e])} | "
            f"{s['pairs_per_s']:.1f} | {s['tokens_per_s']:.0f} | {fmt(s.get('gen_tokens_per_s'), 0)} |"
        )
    first = next((evals[r.label] for r in done), None)
    if first:
        lines += ["", "First test pairs, reference -> outputs of each seed-" + str(args.seeds[0]) + " model:", ""]
        shown = [r for r in done if r.label.endswith(f"-s{args.seeds[0]}")]
        for i in range(min(3, first["rows"])):
            outs = "; ".join(f"{shape_of(r)}: `{one_line(evals[r.label]['hyps'][i], 120)}`" for r in shown)
            lines.append(f"* `{one_line(first['refs'][i], 120)}` -> {outs}")
    return "\n".join([*lines, *status_lines(runs)])


def plot_arch(runs: list[Run], evals: dict[str, dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [2, 1, 1.4]})
    done, colors = [r for r in runs if ok(r)], {"encdec": "C0", "decoder": "C1"}
    for r in done:
        c = curves(r).get("train/loss")
        if c:
            steps, values = zip(*c, strict=True)
            ax.plot(steps, values, color=colors[shape_of(r)], alpha=0.8, label=r.label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per target token)")
    ax.set_title("Docstrings: training loss")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    panels = ((bx, [("test bpb", lambda r: r.metrics["test/bpb"])]), (cx, []))
    panels[1][1].extend((name, lambda r, m=m: evals[r.label][m]) for name, m in (("BLEU", "bleu"), ("chrF", "chrf")))
    for axis, metrics in panels:
        for k, (_, value) in enumerate(metrics):
            for j, shape in enumerate(colors):
                values = [value(r) for r in done if shape_of(r) == shape]
                x = 2 * k + 0.8 * j
                mean = statistics.fmean(values) if values else 0
                axis.bar(x, mean, 0.7, color=colors[shape], alpha=0.6, label=shape if k == 0 else None)
                axis.plot([x] * len(values), values, "k.", ms=8)
        axis.set_xticks([2 * k + 0.4 for k in range(len(metrics))], [name for name, _ in metrics])
        axis.legend(fontsize=8)
    bx.set_ylabel("bits per target byte (teacher-forced), dots: seeds")
    bx.set_title("Test split, every pair")
    cx.set_ylabel("score (0-100), dots: seeds")
    cx.set_title("Greedy outputs, first test pairs")
    save(fig, path)


# ------------------------------------------------------------------------------------------------- mlm


def write_corpus(cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
    """ListOps' training trees of ``cfg`` as files ``tree<i>.ids`` whose bytes are the tree's token ids (``<cls>``
    first): ids 1..16, valid UTF-8 without NUL, so ``data=text``'s byte tokenizer reads back exactly those ids.
    Rewritten only when the trees change (``corpus.json`` holds the data's fingerprint)."""
    source = prepared(cfg)
    stamp, want = folder / "corpus.json", {"fingerprint": source.fingerprint}
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == want["fingerprint"]:
        return json.loads(stamp.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("tree*.ids"):
        old.unlink()
    trees = source.split("train").with_format(None)["input_ids"]
    for i, ids in enumerate(trees):
        (folder / f"tree{i:05d}.ids").write_bytes(bytes(ids))
    info = {**want, "trees": len(trees), "tokens": sum(map(len, trees))}
    stamp.write_text(json.dumps(info))
    return info


def transfer_report(model_cfg: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    """What ``init_from`` copies from the MLM checkpoint into the classifier (counted on a fresh model)."""
    from xfam.model.build import build_model, data_info
    from xfam.model.init_from import FinetuneSpec, init_from

    source = prepared(model_cfg)
    model = build_model(model_cfg, data_info(source))
    report = init_from(model, ckpt, FinetuneSpec(allow_mismatch=True), data_info(source))
    return {
        status: [f"{e.name} {list(e.old) if e.old else '(none)'} -> {list(e.new)}" for e in entries]
        for status, entries in (("loaded", report.loaded), ("new", report.new), ("mismatched", report.mismatched))
    } | {"dropped": [e.name for e in report.dropped]}


def mlm_runs(args: argparse.Namespace, corpus: Path, pre_ckpt: Path, steps: int) -> list[Run]:
    b, runs = base(FINETUNE, args), []
    for seed in args.seeds:
        runs.append(Run(FINETUNE, f"scratch-s{seed}", [f"seed={seed}", *b]))
        ft = [f"init_from={pre_ckpt}", "finetune.allow_mismatch=true", f"seed={seed}"]
        runs.append(Run(FINETUNE, f"spt-s{seed}", [*ft, *b]))
    first = args.seeds[0]
    runs.append(Run(FINETUNE, f"scratch-long-s{first}", [f"seed={first}", *b, f"trainer.max_steps={steps}"]))
    return runs


def mlm(args: argparse.Namespace) -> dict[str, Any]:
    ft_cfg = compose(FINETUNE, base(FINETUNE, args))
    corpus = Path(args.out) / FINETUNE / "corpus"
    if args.dry_run and not corpus.exists():
        print(f"(dry run: the corpus {corpus} is not written, so the pretraining run is composed only)")
        pre_cfg = compose(PRETRAIN, [f"data.paths=[{corpus}]", *base(PRETRAIN, args)])
        total = pre_cfg["trainer"]["max_steps"] + ft_cfg["trainer"]["max_steps"]
        runs = mlm_runs(args, corpus, corpus / "mlm.ckpt", total)
        train_all([r for r in runs if not any(o.startswith("init_from") for o in r.overrides)], args)
        return {"pretrain_steps": pre_cfg["trainer"]["max_steps"]}
    made = write_corpus(ft_cfg, corpus)
    print(f"corpus: {made['trees']} trees, {made['tokens']:,} tokens in {corpus}", flush=True)
    pre = Run(PRETRAIN, "mlm", [f"data.paths=[{corpus}]", *base(PRETRAIN, args)])
    train_all([pre], args)
    pre_cfg = compose(PRETRAIN, pre.overrides)
    total = pre_cfg["trainer"]["max_steps"] + ft_cfg["trainer"]["max_steps"]
    runs = mlm_runs(args, corpus, ckpt_of(pre), total)
    if not ok(pre) and not args.dry_run:
        runs = [r for r in runs if not r.label.startswith("spt")]
    train_all(runs, args)
    if args.dry_run:
        return {}
    result = {
        "corpus": made,
        "pretrain": pre,
        "runs": runs,
        "labels": label_stats(ft_cfg) | {"val_root_rule_acc": root_rule(ft_cfg, "validation")},
        "transfer": transfer_report(ft_cfg, ckpt_of(pre)) if ok(pre) else {},
    }
    body = mlm_report(ft_cfg, pre_cfg, result, args)
    png = publish(args, "mlm", result, body)
    if png is not None:
        plot_mlm(runs, result["labels"], png)
    return result


def root_rule(cfg: dict[str, Any], split: str) -> float:
    """Accuracy on ``split`` of the root-operator rule: the train split's most common label among trees with the same
    root operator (the token after ``<cls>``), as ``label_stats`` scores it on the test split."""
    from collections import Counter

    source = prepared(cfg)
    train, rows = source.split("train").with_format(None), source.split(split).with_format(None)
    by_root: dict[int, Counter] = {}
    for ids, y in zip(train["input_ids"], train["label"], strict=True):
        by_root.setdefault(ids[1], Counter())[y] += 1
    rule = {root: c.most_common(1)[0][0] for root, c in by_root.items()}
    return statistics.fmean(rule.get(ids[1]) == y for ids, y in zip(rows["input_ids"], rows["label"], strict=True))


def kind_of(run: Run) -> str:
    return run.label.rsplit("-s", 1)[0]


def mlm_report(ft: dict[str, Any], pre_cfg: dict[str, Any], result: dict[str, Any], args: argparse.Namespace) -> str:
    pre, runs, labels, transfer = result["pretrain"], result["runs"], result["labels"], result["transfer"]
    d, m = ft["data"], ft["model"]
    done = [r for r in [pre, *runs] if ok(r)]
    pm = pre.metrics
    lines = [
        f"Command: `python scripts/exp_seq2seq.py mlm{flags(args)}` (torch threads: {args.threads}); training wall "
        f"time {sum(r.seconds or 0 for r in done) / 60:.1f} min over {len(done)} runs, one at a time, on the "
        "shared 2-core CPU. Each run, exactly (`<corpus>`: the folder the script writes):",
        "",
        "```bash",
        command(pre).replace(str(Path(args.out) / FINETUNE / "corpus"), "<corpus>"),
        *[command(r).replace(str(ckpt_of(pre)), "<mlm>/checkpoints/last.ckpt") for r in runs],
        "```",
        "",
        f"`data=listops`: trees of {d['min_length'] + 1} to {d['max_length'] - 1} tokens (depth <= {d['max_depth']}, "
        f"<= {d['max_args']} arguments), {d['num_train']:,} / {d['num_val']} / {d['num_test']} train / validation / "
        f"test trees; encoder of {m['layers']} layers, width {m['dim']}, {m['heads']} heads, RoPE, CLS pooling, "
        f"batch {d['batch_size']}, AdamW lr {ft['optim']['lr']}. Pretraining corpus: the "
        f"{result['corpus']['trees']:,} training trees ({result['corpus']['tokens']:,} tokens, labels unused), "
        f"{pre_cfg['trainer']['max_steps']} steps of {pre_cfg['data']['batch_size']} x {pre_cfg['data']['seq_len']} "
        f"tokens, 15% of the tokens selected (80% [MASK], 20% kept). "
        + (
            f"Pretraining reached masked-token accuracy {fmt(pm.get('val/acc'))} (loss {fmt(pm.get('val/loss'))}) "
            f"on its validation trees ({pre_cfg['data']['val_fraction']:.0%} of the files). "
            if ok(pre)
            else ""
        )
        + f"Fine-tuning copies {len(transfer.get('loaded', []))} tensors exactly and the first rows of the "
        f"embedding (mismatched: {'; '.join(transfer.get('mismatched', [])) or '-'}), and starts the head afresh "
        f"(new: {'; '.join(transfer.get('new', [])) or '-'}).",
        "",
        f"Test split: {labels['test_examples']} trees; majority class {labels['majority_class']} (rate "
        f"**{labels['majority_rate']:.3f}**); the root-operator rule (the train split's most common label per root "
        f"operator, no parsing) scores **{labels['root_rule_acc']:.3f}** (validation: "
        f"{labels['val_root_rule_acc']:.3f}).",
        "",
        "| run | start | steps | test acc | val acc | test loss | train s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if ok(r):
            start = "MLM checkpoint" if kind_of(r) == "spt" else "scratch"
            mt = r.metrics
            lines.append(
                f"| {r.label} | {start} | {mt['step']} | {mt['test/acc']:.3f} | {mt['val/acc']:.3f} | "
                f"{mt['test/loss']:.3f} | {fmt(r.seconds, 0)} |"
            )
    lines += [
        "",
        "By start, mean (min-max) over seeds:",
        "",
        "| run | seeds | test acc | val acc |",
        "|---|---|---|---|",
    ]
    for kind in dict.fromkeys(kind_of(r) for r in runs):
        mine = [r for r in runs if ok(r) and kind_of(r) == kind]
        if mine:
            acc, val = [r.metrics["test/acc"] for r in mine], [r.metrics["val/acc"] for r in mine]
            lines.append(f"| {kind} | {len(mine)} | {spread(acc)} | {spread(val)} |")
    return "\n".join([*lines, *status_lines([pre, *runs])])


def plot_mlm(runs: list[Run], labels: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colors = {"scratch": "C0", "spt": "C1", "scratch-long": "C2"}
    for r in filter(ok, runs):
        c = curves(r).get("val/acc")
        if c:
            steps, values = zip(*c, strict=True)
            ax.plot(steps, values, "o-", ms=3, color=colors.get(kind_of(r), "C3"), label=r.label)
    ax.axhline(labels["val_root_rule_acc"], color="k", ls="--", label="root-operator rule (validation)")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("validation accuracy")
    ax.set_title("ListOps: MLM self-pretraining vs scratch")
    ax.legend(fontsize=8)
    save(fig, path)


# ------------------------------------------------------------------------------------------------ calm


@torch.no_grad()
def teacher_forced(model: Any, batches: list[dict], token_bytes: torch.Tensor) -> dict[str, float]:
    from xfam.eval.forward import forward_batch
    from xfam.eval.metrics import add_stats, batch_stats, summarize

    sums: dict[str, torch.Tensor] = {}
    for b in batches:
        out = forward_batch(model, b)
        add_stats(sums, batch_stats("seq2seq", out.logits, b, token_bytes, out.depth, model.num_layers))
    return {k.split("/", 1)[1]: float(v) for k, v in summarize(sums, "seq2seq", "m").items()}


def set_policy(policy: Any, measure: str = "softmax", threshold: float = 1.01, exit_at: int = 0) -> None:
    policy.measure, policy.threshold, policy.exit_at = measure, threshold, exit_at


def consistency(out: dict[str, Any], full: dict[str, Any]) -> dict[str, float]:
    """CALM's textual consistency: the early-exit outputs scored against the full model's (chrF, identical share)."""
    from xfam.eval.text_metrics import text_metrics

    scores = text_metrics(out["hyps"], full["hyps"])
    return {"chrf_vs_full": scores["chrf"], "same_as_full": scores["exact_match"]}


def cli_calibrate(ckpt: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """``xfam calibrate`` on the checkpoint, as a user runs it; its exit status, chosen threshold and output."""
    words = [f"ckpt={ckpt}", "split=validation", "delta=0.1", "epsilon=0.1", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    p = subprocess.run([sys.executable, "-m", "xfam.cli", "calibrate", *words], capture_output=True, text=True, env=env)
    chosen = re.search(r"chosen: exit\.threshold=(\S+)", p.stdout)
    text = (p.stdout + p.stderr).strip().splitlines()
    shown = [line for line in text if "examples/s" not in line][-20:]
    return {
        "words": ["xfam calibrate", *words[1:]],
        "returncode": p.returncode,
        "chosen": chosen and chosen[1],
        "output": shown,
    }


def calm(args: argparse.Namespace) -> dict[str, Any]:
    from xfam.eval.calibrate import ltt_threshold, split_check
    from xfam.eval.inference import threshold_sweep
    from xfam.model.checkpoint import load_model

    run = Run(CALM, "calm", [*NO_GEN, *base(CALM, args)])
    train_all([run], args)
    if args.dry_run or not ok(run):
        return {"run": run}
    model, meta = load_model(ckpt_of(run))
    model.eval()
    cfg, info, policy, layers = meta["config"], meta["data_info"], model.exit, model.num_layers
    token_bytes, size, max_new = torch.tensor(info["token_bytes"]), cfg["data"]["batch_size"], cfg["data"]["target_len"]
    test, val = pair_batches(model, cfg, "test", None, size), pair_batches(model, cfg, "validation", None, size)
    gen_batches = pair_batches(model, cfg, "test", args.gen_rows, size)
    gens: dict[tuple[str, float, int], dict] = {}

    def gen(measure: str, threshold: float, exit_at: int = 0) -> dict[str, Any]:
        key = (measure, threshold, exit_at)
        if key not in gens:
            set_policy(policy, measure, threshold, exit_at)
            gens[key] = generation(model, info, gen_batches, max_new, depth_of=True)
        return gens[key]

    static = []
    for n in range(1, layers + 1):
        set_policy(policy, exit_at=n % layers)  # (n = layers: exit_at 0 and threshold above 1, the full model)
        g = gen("softmax", 1.01, n % layers)
        static.append({"layer": n, **teacher_forced(model, test, token_bytes), "gen_depth": g["depth"]})
        static[-1] |= {k: g[k] for k in ("chrf", "bleu", "exact_match", "tokens_per_s")}
    full = gen("softmax", 1.01)
    print("static:", [(s["layer"], round(s["bpb"], 3), round(s["chrf"], 2)) for s in static], flush=True)
    sweeps, ltt, checks = {}, {}, {}
    for measure, grid in GRIDS.items():
        set_policy(policy, measure)
        sweep = threshold_sweep(model, test, "seq2seq", grid, token_bytes)
        val_risk = threshold_sweep(model, val, "seq2seq", grid, token_bytes)["risk"]
        sweep["disagree"] = sweep["risk"].double().mean(0).tolist()
        pooled = torch.cat((val_risk, sweep["risk"]))
        ltt[measure], checks[measure] = {}, {}
        for delta in args.deltas:
            k = ltt_threshold(val_risk, grid, delta, args.epsilon)
            point = {"index": k, "threshold": None if k is None else grid[k]}
            if k is not None:
                g = gen(measure, grid[k])
                point |= {"depth": sweep["depth"][k], "bpb": sweep["bpb"][k], "disagree": sweep["disagree"][k]}
                point |= {"gen_depth": g["depth"], "chrf": g["chrf"], "bleu": g["bleu"], **consistency(g, full)}
            ltt[measure][delta] = point
            check = split_check(pooled, grid, delta, args.epsilon, repeats=args.repeats)
            picked = [sweep["depth"][i] for i in check["chosen"] if i is not None]
            checks[measure][delta] = {"share_ok": check["share_ok"], "none_chosen": check["none_chosen"]}
            checks[measure][delta]["mean_depth"] = statistics.fmean(picked) if picked else None
        sweep.pop("risk")
        sweeps[measure] = sweep
        print(measure, [(round(d, 2), round(b, 3)) for d, b in zip(sweep["depth"], sweep["bpb"], strict=True)])
    curve = [
        {"threshold": t, **strip(gen("softmax", t)), **consistency(gen("softmax", t), full)} for t in args.gen_grid
    ]
    cli = [cli_calibrate(ckpt_of(run), args, []), cli_calibrate(ckpt_of(run), args, ["exit.measure=saturation"])]
    result = {"run": run, "layers": layers, "static": static, "sweeps": sweeps, "ltt": ltt, "checks": checks}
    result |= {"generation": curve, "full": strip(full), "cli": cli, "test_pairs": sum(len(b["labels"]) for b in test)}
    result["val_pairs"] = sum(len(b["labels"]) for b in val)
    body = calm_report(cfg, result, args)
    png = publish(args, "calm", result, body)
    if png is not None:
        plot_calm(result, png)
    return result


def strip(gen: dict[str, Any]) -> dict[str, Any]:
    """A generation result without its texts."""
    return {k: v for k, v in gen.items() if k not in ("hyps", "refs")}


def calm_report(cfg: dict[str, Any], result: dict[str, Any], args: argparse.Namespace) -> str:
    run, layers, static, sweeps = result["run"], result["layers"], result["static"], result["sweeps"]
    d, t, m = cfg["data"], cfg["trainer"], cfg["model"]
    full_bpb = static[-1]["bpb"]
    lines = [
        f"Command: `python scripts/exp_seq2seq.py calm{flags(args)}` (torch threads: {args.threads}); training "
        f"{fmt(run.seconds and run.seconds / 60, 1)} min (`{command(run)}`), on the shared 2-core CPU.",
        "",
        f"Encoder-decoder on `data=docstrings` ({cfg['encoder']['layers']} encoder + {layers} decoder layers, width "
        f"{m['dim']}, {t['max_steps']} steps of {d['batch_size']} pairs, `exit=calm`: the shared head on every "
        f"decoder layer, CALM's weights w_n ~ n, the exit classifier trained alongside). Teacher-forced metrics on "
        f"all {result['test_pairs']} test pairs; greedy generation (batches of {d['batch_size']}, at most "
        f"{d['target_len']} tokens) on the first {args.gen_rows}: chrF/BLEU against the references, chrF against "
        "the full model's own outputs and the share identical to them (CALM's textual consistency), mean decoder "
        "layers per generated token.",
        "",
        "**Per-exit quality** (every token leaves after decoder layer n; `exit.exit_at=n`):",
        "",
        "| layer n | " + " | ".join(str(s["layer"]) for s in static) + " |",
        "|---|" + "---:|" * layers,
        "| test bits per byte | " + " | ".join(f"{s['bpb']:.3f}" for s in static) + " |",
        "| generated chrF | " + " | ".join(f"{s['chrf']:.2f}" for s in static) + " |",
        "| generated BLEU | " + " | ".join(f"{s['bleu']:.2f}" for s in static) + " |",
        "",
        f"**Threshold sweeps** (test, teacher-forced; full depth {full_bpb:.3f} bits per byte): for each measure, the "
        "threshold with the fewest mean layers whose bits per byte stays within 1% / 3% of full depth:",
        "",
        "| measure | within 1%: threshold | layers | saved | bpb | disagree | within 3%: threshold | layers | saved "
        "| bpb | disagree |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for measure, sw in sweeps.items():
        cells = [measure]
        for budget in (0.01, 0.03):
            fits = [k for k, b in enumerate(sw["bpb"]) if b <= full_bpb * (1 + budget)]
            if not fits:
                cells += ["-"] * 5
                continue
            k = min(fits, key=lambda i: sw["depth"][i])
            dk = sw["depth"][k]
            cells += [f"{sw['thresholds'][k]}", f"{dk:.2f}", f"{1 - dk / layers:.0%}", f"{sw['bpb'][k]:.3f}"]
            cells.append(f"{sw['disagree'][k]:.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    full = result["full"]
    lines += [
        "",
        f"**Generation with early exit** (softmax response; full depth: chrF {full['chrf']:.2f}, BLEU "
        f"{full['bleu']:.2f}; *saved* counts layer applications, as CALM does: the skipped layers still run here, "
        "on the copied state, so that later tokens find their keys and values):",
        "",
        "| threshold | layers per token | saved | chrF | BLEU | chrF vs full | same as full |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in result["generation"]:
        lines.append(
            f"| {g['threshold']} | {g['depth']:.2f} | {1 - g['depth'] / layers:.0%} | {g['chrf']:.2f} | "
            f"{g['bleu']:.2f} | {g['chrf_vs_full']:.1f} | {g['same_as_full']:.2f} |"
        )
    lines += [
        "",
        f"**Learn-then-Test**: per-pair risk = the share of its target tokens whose top-1 differs from the full "
        f"model's (teacher-forced); thresholds calibrated on the {result['val_pairs']} validation pairs with "
        f"epsilon = {args.epsilon}, then measured on the test pairs (teacher-forced disagreement and bits per byte; "
        "generation on the first test pairs):",
        "",
        "| measure | delta | threshold | test disagree | layers | bpb | gen layers | chrF | chrF vs full | "
        "splits ok | layers (splits) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for measure, per_delta in result["ltt"].items():
        for delta, p in per_delta.items():
            c = result["checks"][measure][delta]
            if p["threshold"] is None:
                cells = ["none (exits off)", "-", "-", "-", "-", "-", "-"]
            else:
                cells = [f"{p['threshold']}", f"{p['disagree']:.1%}", f"{p['depth']:.2f}", f"{p['bpb']:.3f}"]
                cells += [f"{p['gen_depth']:.2f}", f"{p['chrf']:.2f}", f"{p['chrf_vs_full']:.1f}"]
            split_depth = fmt(c["mean_depth"], 2)
            lines.append(f"| {measure} | {delta} | " + " | ".join(cells) + f" | {c['share_ok']:.2f} | {split_depth} |")
    lines += [
        "",
        f"*splits ok*: validation and test pairs pooled, {args.repeats} random calibration/test halves; the share "
        "whose test-half disagreement stays <= delta (the guarantee asks >= 1 - epsilon), and the mean test layers "
        "of the thresholds chosen.",
        "",
        "`xfam calibrate` on this checkpoint:",
        "",
    ]
    for c in result["cli"]:
        state = f"chose exit.threshold={c['chosen']}" if c["chosen"] else "chose none"
        state = state if c["returncode"] == 0 else f"**failed** (exit status {c['returncode']})"
        lines += [f"* `{' '.join(c['words'])}`: {state}", "", "```", *c["output"][-8:], "```", ""]
    return "\n".join(lines).rstrip()


def plot_calm(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    static, layers = result["static"], result["layers"]
    ax.plot([s["layer"] for s in static], [s["bpb"] for s in static], "k.--", label="static exit (all tokens at n)")
    for (measure, sw), color in zip(result["sweeps"].items(), ("C0", "C1", "C2"), strict=True):
        ax.plot(sw["depth"], sw["bpb"], "o-", ms=3, color=color, label=f"CALM, {measure}")
        for delta, p in result["ltt"][measure].items():
            if p["threshold"] is not None:
                ax.plot(p["depth"], p["bpb"], "*", ms=11, color=color)
            if p["threshold"] is not None and measure == "softmax":
                ax.annotate(
                    f"LTT d={delta}", (p["depth"], p["bpb"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
    ax.set_xlabel("mean decoder layers per target token")
    ax.set_ylabel("test bits per byte (teacher-forced)")
    ax.set_title("CALM on the seq2seq decoder (stars: LTT thresholds)")
    ax.legend(fontsize=8)
    bx.plot([s["gen_depth"] for s in static], [s["chrf"] for s in static], "k.--", label="static exit")
    g = result["generation"]
    bx.plot([x["depth"] for x in g], [x["chrf"] for x in g], "o-", color="C0", label="softmax: chrF vs references")
    bx.plot([x["depth"] for x in g], [x["chrf_vs_full"] for x in g], "s:", color="C0", label="softmax: chrF vs full")
    bx.set_xlabel("mean decoder layers per generated token")
    bx.set_ylabel("chrF")
    bx.set_xlim(0.8, layers + 0.2)
    bx.set_title("Greedy generation with early exit")
    bx.legend(fontsize=8)
    save(fig, path)


# ---------------------------------------------------------------------------------------------- driver


def flags(args: argparse.Namespace) -> str:
    return (" --quick" if args.quick else "") + "".join(f" --set {shlex.quote(s)}" for s in args.set)


def jsonable(x: Any) -> Any:
    if isinstance(x, Run):
        return {**asdict(x), "command": command(x)}
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


def publish(args: argparse.Namespace, which: str, result: dict[str, Any], body: str) -> Path | None:
    """Write the raw results, print the table and put it into the results file; the plot's path (None: no plot)."""
    out = Path(args.out) / {"arch": ARCH, "mlm": FINETUNE, "calm": CALM}[which] / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(jsonable(result), indent=1, default=str))
    print(body, flush=True)
    if args.no_results:
        return None
    section, results = SECTIONS[which], Path(args.results)
    png = results.with_name(f"results_{section}.png")
    write_section(results, section, body + f"\n\n![{section}]({png.name})")
    print(f"wrote {results}, {png} and {out}", flush=True)
    return png


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["arch", "mlm", "calm", "all"])
    parser.add_argument("--quick", action="store_true", help="a smoke run: capped data, a few steps, one seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="arch, mlm: seeds (default 0 1)")
    parser.add_argument("--gen-rows", type=int, default=None, help="test pairs generated (default 128)")
    parser.add_argument("--bench-steps", type=int, default=None, help="arch: timed batches (default 12)")
    parser.add_argument("--bench-warmup", type=int, default=3, help="arch: untimed batches first")
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="calm: LTT risk levels")
    parser.add_argument("--epsilon", type=float, default=0.1, help="calm: LTT failure probability")
    parser.add_argument("--repeats", type=int, default=200, help="calm: random calibration/test splits")
    parser.add_argument("--gen-grid", type=float, nargs="+", default=[1.01, 0.9, 0.7, 0.5, 0.3, 0.1])
    add_run_options(parser, threads=2)
    args = parser.parse_args(argv)
    quick = args.quick
    args.seeds = args.seeds or ([0] if quick else [0, 1])
    args.gen_rows = args.gen_rows or (4 if quick else 128)
    args.bench_steps = args.bench_steps or (2 if quick else 12)
    args.bench_warmup = 1 if quick else args.bench_warmup
    args.repeats = 20 if quick else args.repeats
    default_out = os.environ.get("XFAM_RUNS", str(ROOT / "runs"))
    if quick and args.out == default_out:
        args.out = str(Path(default_out) / "exp_seq2seq_quick")
    if quick and args.results == str(ROOT / "docs" / "results.md"):
        args.results = str(Path(args.out) / "results.md")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    started, results = time.perf_counter(), {}
    for which in ["arch", "mlm", "calm"] if args.which == "all" else [args.which]:
        begun = time.perf_counter()
        results[which] = {"arch": arch, "mlm": mlm, "calm": calm}[which](args)
        print(f"{which}: {(time.perf_counter() - begun) / 60:.1f} min", flush=True)
    print(f"total {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    return results


if __name__ == "__main__":
    main()
