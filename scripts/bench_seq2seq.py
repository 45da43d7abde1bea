#!/usr/bin/env python
"""Encoder-decoder benchmark: xfam's ``EncoderDecoder`` (Vaswani et al., 2017, arXiv:1706.03762) against
x-transformers' ``XTransformer`` at the same shape, training and decoding.

Shape (both systems): vocab 256, width 256, 4 encoder + 4 decoder layers, 4 heads (head dim 64), pre-LayerNorm,
FFN 4x GELU, learned absolute positions on both sides (XTransformer's default), batch 8, source 256 and target
256 tokens, fp32, 2 torch threads.

Training (one step = zero_grad, forward, cross-entropy, backward, AdamW step; tokens/s counts source + target
tokens, 8 x (256 + 256) = 4,096 per step):

* ``xfam_encdec``                -- ``build_model`` with ``model.arch=encoder_decoder``, xfam's own AdamW setup;
* ``xtransformers_encdec``       -- ``XTransformer`` with its default attention, trained through its own
                                    ``forward(src, tgt, mask)`` (its README's training call);
* ``xtransformers_encdec_flash`` -- the same with ``attn_flash=True`` on both stacks (SDPA).

Decoding (new tokens/s = batch x 64 / wall time of one decoding call, the encoder pass included; a beam search
counts each input's 64 output tokens, not its beams'), at batch 1 and 8 from a 256-token source:

* ``xfam_greedy``, ``xfam_beam`` (beam 4) -- ``xfam.eval.translate`` over the decode cache;
* ``xtransformers_greedy``               -- ``XTransformer.generate(temperature=0)`` with its key/value cache
                                           (x-transformers has no beam search).

Every output is forced to 64 tokens: xfam's EOS id (255) has its logit set to -inf by a hook on the output
layer, so a random-weight model never ends early; ``XTransformer.generate`` without ``eos_token`` never stops.

Protocol: that of ``scripts/bench_train.py`` (``benchlib.protocol``): every measurement a fresh process
(``--worker SYSTEM BATCH``), the systems alternating for ``--repeats`` rounds, medians after warm-up, a wait for
a quiet machine before each measurement and reruns of noisy ones, a 2048^3 matmul per round for the MFU column.
The report is a marked section of docs/benchmarks.md (kept when bench_train.py rewrites the file) and
docs/benchmarks_seq2seq.png.

    python scripts/bench_seq2seq.py --quick                # a check that everything runs (~2 min)
    python scripts/bench_seq2seq.py --json seq2seq.json    # the full run (~15-20 min)
    python scripts/bench_seq2seq.py --systems xfam_encdec xtransformers_encdec xtransformers_encdec_flash --repeats 8 \
        --no-docs --json more.json                          # a follow-up: more rounds of the training systems
    python scripts/bench_seq2seq.py --from-json seq2seq.json --append-json more.json --profile xfam_encdec xfam_beam
                                                            # re-render with the follow-up and torch.profiler tables

One file over 400 lines: the workers, the orchestration and the report share the shape and the system names, and the
decoding and training halves are short; the protocol itself is shared with bench_train.py in benchlib.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import common, protocol
from benchlib.common import (
    BATCH,
    BETAS,
    DIM,
    EPS,
    HEADS,
    LAYERS,
    LR,
    MATMUL_N,
    ROOT,
    SEQ,
    VOCAB,
    WEIGHT_DECAY,
)

TRAIN_SYSTEMS = ("xfam_encdec", "xtransformers_encdec", "xtransformers_encdec_flash")
DECODE_SYSTEMS = ("xfam_greedy", "xfam_beam", "xtransformers_greedy")
DECODE_BATCHES = (1, 8)
LABELS = {
    "xfam_encdec": "xfam EncoderDecoder",
    "xtransformers_encdec": "x-transformers XTransformer (default)",
    "xtransformers_encdec_flash": "x-transformers XTransformer (attn_flash)",
    "xfam_greedy": "xfam translate, greedy",
    "xfam_beam": "xfam translate, beam 4",
    "xtransformers_greedy": "x-transformers generate, greedy",
}
SHORT = {  # chart ticks
    "xfam_encdec": "xfam",
    "xtransformers_encdec": "x-transformers\ndefault",
    "xtransformers_encdec_flash": "x-transformers\nattn_flash",
    "xfam_greedy": "xfam\ngreedy",
    "xfam_beam": "xfam\nbeam 4",
    "xtransformers_greedy": "x-transf.\ngreedy",
}
RATIOS = (
    ("xfam_encdec", "xtransformers_encdec", "xfam / x-transformers default", 1.10),
    ("xfam_encdec", "xtransformers_encdec_flash", "xfam / x-transformers attn_flash", 1.00),
)
START, END = "<!-- bench_seq2seq:start -->", "<!-- bench_seq2seq:end -->"
HEADING = "## Encoder-decoder: xfam vs x-transformers' XTransformer"


@dataclasses.dataclass(frozen=True)
class Shape:
    """The benchmark shape; ``TINY`` is for the test of the pipeline (``--tiny``)."""

    vocab: int = VOCAB
    dim: int = DIM
    layers: int = LAYERS  # per stack
    heads: int = HEADS
    batch: int = BATCH
    src: int = SEQ
    tgt: int = SEQ
    new_tokens: int = 64
    beam: int = 4

    @property
    def train_tokens(self) -> int:
        """Tokens per training step: source + target."""
        return self.batch * (self.src + self.tgt)

    @property
    def eos(self) -> int:
        return self.vocab - 1


FULL = Shape()
TINY = Shape(vocab=32, dim=32, layers=1, heads=2, batch=2, src=8, tgt=8, new_tokens=4, beam=2)


def flops_per_step(s: Shape) -> dict[str, float]:
    """Model FLOPs of one training step (forward + backward = 3x forward; a multiply-add = 2 FLOPs).

    Matmul weights applied per source token: encoder L * 12 D^2 (q/k/v, output, FFN 4x) + the decoder's cross
    keys/values L * 2 D^2; per target token: decoder L * 14 D^2 (self q/k/v and output, cross q and output, FFN)
    + the head D * V. Attention scores and values, full squares (not halved for causality): encoder 4 * Ss * D,
    decoder self 4 * St * D and cross 4 * Ss * D per token and layer forward. Embeddings, norms, softmax and the
    optimiser are not counted.
    """
    d, n = s.dim, s.layers
    per_src, per_tgt = n * 14 * d * d, n * 14 * d * d + d * s.vocab
    dense = 6 * s.batch * (per_src * s.src + per_tgt * s.tgt)
    attention = 3 * s.batch * n * (4 * s.src * d * s.src + 4 * s.tgt * d * (s.tgt + s.src))
    return {"dense": dense, "attention": attention, "total": dense + attention}


# ---------------------------------------------------------------------------------------- worker side (torch)


def build_xfam(s: Shape):
    """xfam's encoder-decoder from a plain config, as ``train.py`` builds it for a seq2seq dataset."""
    from xfam.model.build import build_model

    cfg = {
        "model": {"name": "bench_seq2seq", "arch": "encoder_decoder", "dim": s.dim, "layers": s.layers}
        | {"heads": s.heads, "max_len": max(s.src, s.tgt, s.new_tokens + 1)},
        "attention": {"name": "vanilla", "backend": "auto", "dropout": 0.0},
        "pos": {"name": "learned"},
        "memory": {"name": "none"},
        "exit": {"name": "none"},
    }
    info = {"task": "seq2seq", "vocab_size": s.vocab, "num_classes": None, "token_bytes": None, "fingerprint": "b"}
    return build_model(cfg, info)


def build_xtransformers(s: Shape, flash: bool):
    """``XTransformer`` with its defaults; the head width is given explicitly (its default, 64, at full shape)."""
    from x_transformers import XTransformer

    return XTransformer(
        dim=s.dim,
        enc_num_tokens=s.vocab,
        enc_depth=s.layers,
        enc_heads=s.heads,
        enc_max_seq_len=s.src,
        enc_attn_dim_head=s.dim // s.heads,
        enc_attn_flash=flash,
        dec_num_tokens=s.vocab,
        dec_depth=s.layers,
        dec_heads=s.heads,
        dec_max_seq_len=max(s.tgt, s.new_tokens + 1),
        dec_attn_dim_head=s.dim // s.heads,
        dec_attn_flash=flash,
    )


def _pairs(s: Shape, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct random batches: ``source [B, Ss]``, ``target [B, St + 1]``, ``mask [B, Ss]`` (all real)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        src = torch.randint(0, s.vocab, (s.batch, s.src), generator=g)
        tgt = torch.randint(0, s.vocab, (s.batch, s.tgt + 1), generator=g)
        out.append({"source": src, "target": tgt, "mask": torch.ones(s.batch, s.src, dtype=torch.bool)})
    return out


def _train_step_fn(system: str, model):
    """``batch -> loss`` of one system: St decoder positions for both (xfam predicts St tokens, x-transformers'
    AutoregressiveWrapper St - 1: it feeds the whole target and drops the last position's logits)."""
    import torch.nn.functional as F

    if system == "xfam_encdec":

        def loss(b):
            out = model(b["source"], decoder_input_ids=b["target"][:, :-1], key_padding=b["mask"])
            return F.cross_entropy(out.logits.flatten(0, 1), b["target"][:, 1:].flatten())  # [B * St, V]

        return loss
    return lambda b: model(b["source"], b["target"][:, :-1], mask=b["mask"])


def run_train(system: str, s: Shape, warmup: int, steps: int, profile: bool = False) -> dict[str, Any]:
    """Build one system and time ``warmup + steps`` training steps (``profile``: op self-times per step instead)."""
    import torch
    from benchlib.workers import _rss_now_mb, timed

    n = warmup + steps
    batches = _pairs(s, min(n, 8))
    rss_before = _rss_now_mb()
    if system == "xfam_encdec":
        from xfam.config.specs import OptimSpec
        from xfam.training.lit.optim import make_optimizer

        model = build_xfam(s)
        made = make_optimizer(model, OptimSpec(lr=LR, betas=BETAS, eps=EPS), n, fused=True)  # as XfamLitModule
        opt, sched = made["optimizer"], made["lr_scheduler"]["scheduler"]
    else:
        model = build_xtransformers(s, flash=system.endswith("_flash"))
        opt, sched = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY), None
    loss_of = _train_step_fn(system, model)
    model.train()
    losses = []

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(batches[i % len(batches)])
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())

    times, cpu, ops = timed(step, n, warmup, profile)
    res = {"params": sum(p.numel() for p in model.parameters()), **_timing(times, warmup, s.train_tokens)}
    if ops is not None:
        return {**res, **ops, **cpu}
    res |= {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)}
    return {**res, **_memory(rss_before), **cpu}


def mask_token(model, token: int):
    """Set the logit of ``token`` to -inf in every output of xfam's decoder (a forward hook on its head), so
    decoding never emits it; returns the hook's handle."""

    import torch

    def hook(module, inputs, logits):  # logits [N, 1, V]
        return logits.index_fill(-1, torch.tensor([token], device=logits.device), float("-inf"))

    return model.decoder.head.register_forward_hook(hook)


def decode_call(system: str, model, s: Shape, batch: int):
    """``source -> tokens [batch, new_tokens]``: one decoding call of ``system`` (forced length, module docstring)."""
    import torch

    if system.startswith("xfam"):
        from xfam.eval.translate import translate

        mask_token(model, s.eos)
        beam = s.beam if system == "xfam_beam" else 1

        def call(src, mask):
            kw = dict(bos_id=0, eos_id=s.eos, max_new_tokens=s.new_tokens, beam_size=beam, length_penalty=1.0)
            return translate(model, src, mask, **kw).tokens

        return call
    model.eval()
    start = torch.zeros(batch, 1, dtype=torch.long)  # BOS
    return lambda src, mask: model.generate(src, start, s.new_tokens, mask=mask, temperature=0.0)


def run_decode(system: str, s: Shape, batch: int, warmup: int, reps: int, profile: bool = False) -> dict[str, Any]:
    """Time ``reps`` decoding calls after ``warmup`` of one system at ``batch`` (source ``s.src`` tokens)."""
    import torch
    from benchlib.workers import _rss_now_mb, timed

    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, s.vocab, (batch, s.src), generator=g)  # [b, Ss]
    mask = torch.ones(batch, s.src, dtype=torch.bool)
    rss_before = _rss_now_mb()
    model = build_xfam(s) if system.startswith("xfam") else build_xtransformers(s, flash=False)
    call = decode_call(system, model, s, batch)
    lengths = set()
    times, cpu, ops = timed(lambda i: lengths.add(tuple(call(src, mask).shape)), warmup + reps, warmup, profile)
    if lengths != {(batch, s.new_tokens)}:
        raise RuntimeError(f"{system} decoded {sorted(lengths)} tokens; expected ({batch}, {s.new_tokens})")
    res = {"params": sum(p.numel() for p in model.parameters()), **_timing(times, warmup, batch * s.new_tokens)}
    if ops is not None:
        return {**res, **ops, **cpu}
    return {**res, **_memory(rss_before), **cpu}


def _timing(times: list[float], warmup: int, tokens: int) -> dict[str, Any]:
    med = statistics.median(times[warmup:])
    return {"step_s": med, "tokens_per_s": tokens / med, "times": [round(t, 5) for t in times]}


def _memory(rss_before: float) -> dict[str, float]:
    from benchlib.workers import _peak_rss_mb

    return {"rss_before_mb": round(rss_before, 1), "peak_rss_mb": round(_peak_rss_mb(), 1)}


def worker(system: str, batch: int, s: Shape, warmup: int, steps: int, threads: int) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import importlib

    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    profile = system.startswith("profile:")
    name = system.split(":", 1)[-1]
    if name == "matmul":
        from benchlib.workers import run_matmul

        res = run_matmul()
    else:
        xfam = ("xfam.model.build", "xfam.eval.translate", "xfam.training.lit.optim")
        for module in xfam if name.startswith("xfam") else ("x_transformers",):
            importlib.import_module(module)  # before the RSS baseline: it counts the model and its work only
        if name in TRAIN_SYSTEMS:
            res = run_train(name, s, warmup, steps, profile)
        else:
            res = run_decode(name, s, batch, warmup, steps, profile)
    res.update({"system": system, "batch": batch, "loadavg_start": load, "threads": torch.get_num_threads()})
    print(json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------- parent side (no torch)


def spawn(system: str, batch: int, args: argparse.Namespace, warmup: int, steps: int) -> dict[str, Any]:
    argv = [system, str(batch), "--warmup", str(warmup), "--steps", str(steps)] + ["--tiny"] * args.tiny
    return protocol.spawn(Path(__file__).resolve(), argv, args, f"{system}/batch {batch}")


def measure(system: str, batch: int, args: argparse.Namespace, label: str, rejected: list) -> dict[str, Any]:
    train = system.split(":")[-1] in TRAIN_SYSTEMS
    warmup, steps = (args.warmup, args.steps) if train else (args.decode_warmup, args.decode_reps)

    def describe(res: dict[str, Any]) -> str:
        if system == "matmul":
            return f"{system:<28}{res['gflops']:8.1f} GFLOP/s ({MATMUL_N}^3 fp32)"
        unit = "tok/s" if train else f"new tok/s (batch {batch})"
        return f"{system:<28}{res['tokens_per_s']:8.0f} {unit}  call {res['step_s'] * 1e3:7.1f} ms"

    return protocol.measure(lambda: spawn(system, batch, args, warmup, steps), describe, label, args, rejected)


def plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """One round: the matmul, the training systems, then each decoding system at each batch."""
    train = [(s, args.shape.batch) for s in args.systems if s in TRAIN_SYSTEMS]
    decode = [(s, b) for b in args.batches for s in args.systems if s in DECODE_SYSTEMS]
    return [("matmul", 0), *train, *decode]


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    todo = plan(args)
    started = time.perf_counter()
    for rep in range(args.repeats):
        for system, batch in todo:
            label = (
                f"[{len(runs) + 1:3d}/{len(todo) * args.repeats} {time.perf_counter() - started:5.0f} s] rep {rep + 1}"
            )
            res = measure(system, batch, args, label, rejected)
            res["repeat"] = rep
            runs.append(res)
    return {"meta": meta(args), "runs": runs, "rejected": rejected}


def run_profiles(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One ``torch.profiler`` worker per system of ``--profile`` (decoding systems at the largest batch)."""
    out: list[dict[str, Any]] = []
    for system in args.profile:
        batch = args.shape.batch if system in TRAIN_SYSTEMS else max(args.batches)
        res = measure(f"profile:{system}", batch, args, "[profile]", [])
        res.update({"system": system, "steps": args.steps if system in TRAIN_SYSTEMS else args.decode_reps})
        out.append(res)
    return out


def meta(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **protocol.machine_meta(args),
        "shape": dataclasses.asdict(args.shape),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "steps": args.steps,
        "decode_warmup": args.decode_warmup,
        "decode_reps": args.decode_reps,
        "systems": list(args.systems),
        "batches": list(args.batches),
    }


# ---------------------------------------------------------------------------------------- report (no torch)


def summarize(data: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (system, batch): median, min, max tokens/s over rounds, call time, parameters, memory, losses."""
    table: dict[tuple[str, int], dict[str, Any]] = {}
    for r in data["runs"]:
        if r["system"] != "matmul":
            table.setdefault((r["system"], r["batch"]), {"runs": []})["runs"].append(r)
    for t in table.values():
        rs, tps = t["runs"], [r["tokens_per_s"] for r in t["runs"]]
        t.update({"tps": statistics.median(tps), "min": min(tps), "max": max(tps)})
        t["step_ms"] = statistics.median(r["step_s"] for r in rs) * 1e3
        t["params"] = rs[0]["params"]
        t["peak_mb"] = statistics.median(r["peak_rss_mb"] for r in rs)
        t["delta_mb"] = statistics.median(r["peak_rss_mb"] - r["rss_before_mb"] for r in rs)
        if "loss_first" in rs[0]:
            t["loss"] = (statistics.median(r["loss_first"] for r in rs), statistics.median(r["loss_last"] for r in rs))
    return table


def matmul_rate(data: dict[str, Any]) -> list[float]:
    return [r["gflops"] for r in data["runs"] if r["system"] == "matmul"]


def ratios(data: dict[str, Any], a: str, b: str, batch: int) -> tuple[float, float, float, float] | None:
    """Ratio of the median tokens/s of ``a`` and ``b`` (the figure targets are judged on); min, max and median of
    the per-round ratios (``a`` and ``b`` measured back to back: the estimator least moved by a machine whose speed
    drifts between rounds)."""
    get = lambda s: {r["repeat"]: r["tokens_per_s"] for r in data["runs"] if (r["system"], r["batch"]) == (s, batch)}  # noqa: E731
    ra, rb = get(a), get(b)
    if not ra or not rb:
        return None
    per_round = [ra[k] / rb[k] for k in ra if k in rb]
    med = statistics.median(ra.values()) / statistics.median(rb.values())
    return med, min(per_round), max(per_round), statistics.median(per_round)


def ff_biases(s: Shape) -> int:
    """Parameters x-transformers has beyond xfam (``bias=false``): the FFN biases, 4D + D per block, both stacks."""
    return 2 * s.layers * 5 * s.dim


def render_md(data: dict[str, Any], png: Path | None, md_path: Path) -> str:
    m, tab, s = data["meta"], summarize(data), Shape(**data["meta"]["shape"])
    rate = statistics.median(matmul_rate(data)) * 1e9 if matmul_rate(data) else float("nan")
    fl = flops_per_step(s)
    out = [
        f"Measured by `scripts/bench_seq2seq.py` on {m['date']} (`{m['command']}`)"
        + (f"; rendered by `{data['rendered_by']}`." if data.get("rendered_by") else "."),
        "",
        f"* Machine and versions: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, x-transformers "
        f"{m['x_transformers']}, xfam at commit {m['xfam_commit']}; {m['threads']} torch threads per worker.",
        f"* Shape, both systems: vocab {s.vocab}, width {s.dim}, {s.layers} encoder + {s.layers} decoder layers, "
        f"{s.heads} heads (head dim {s.dim // s.heads}), pre-LayerNorm, FFN 4x GELU, learned absolute positions on "
        f"both sides (XTransformer's default), untied embeddings; fp32, CPU.",
        "* xfam: `build_model` with `model.arch=encoder_decoder` (`xfam/model/encoder_decoder.py`), vanilla attention "
        "(`backend=auto`: SDPA), `pos=learned`; trained with `xfam.training.lit.optim.make_optimizer` (fused AdamW, "
        "decay on weight matrices only, warmup + cosine, as xfam's Lightning module at full precision).",
        f"* x-transformers: `XTransformer(dim={s.dim}, enc_/dec_num_tokens={s.vocab}, enc_/dec_depth={s.layers}, "
        f"enc_/dec_heads={s.heads}, enc_/dec_attn_dim_head={s.dim // s.heads}, enc_/dec_attn_flash=...)`, trained "
        f"through its own `forward(src, tgt, mask=src_mask)` (its AutoregressiveWrapper's loss), PyTorch's default "
        f"`AdamW(model.parameters(), weight_decay={WEIGHT_DECAY})`; lr {LR}, betas {BETAS}, eps {EPS} for both.",
        f"* Training step: batch {s.batch}, source {s.src} and target {s.tgt} tokens (a source mask of all-real "
        f"tokens given to both, as in XTransformer's README); `zero_grad`, forward, cross-entropy, backward, AdamW "
        f"step. **Tokens/s counts source + target tokens**: {s.train_tokens:,} per step. Both decoders run "
        f"{s.tgt} positions (x-transformers' wrapper scores {s.tgt - 1} of them, xfam {s.tgt}).",
        f"* Decoding: source {s.src} tokens, {s.new_tokens} new tokens per input, at batch "
        f"{' and '.join(map(str, m['batches']))}; new tokens/s = batch x {s.new_tokens} / wall time of one decoding "
        f"call (the encoder pass included); beam search counts each input's {s.new_tokens} output tokens (not "
        f"{s.beam} beams' worth). Every output has exactly {s.new_tokens} tokens (checked): xfam's EOS (id "
        f"{s.eos}) has its logit set to -inf by a forward hook on the output layer, and x-transformers' `generate` "
        f"is called without `eos_token`. x-transformers has no beam search; its greedy `generate` is the reference.",
        f"* Protocol (as above for bench_train.py): each measurement a fresh process; per round the matmul, the "
        f"training systems, then the decoding systems; {m['repeats']} round(s); a training run drops {m['warmup']} "
        f"warm-up steps and takes the median of {m['steps']}, a decoding run drops {m['decode_warmup']} call(s) and "
        f"takes the median of {m['decode_reps']}; figures are medians over rounds (min-max over rounds beside). "
        f"Before each measurement the parent waited (at most {m['max_wait']} s) for other processes to use < "
        f"{m['quiet']} cores, and reran a measurement during which they used > {m['noisy']} cores (at most "
        f"{m['retries']} times; {len(data.get('rejected', []))} reruns).",
        f"* MFU: model FLOPs per step (`flops_per_step()`: {fl['dense'] / 1e9:.1f} GFLOP dense + "
        f"{fl['attention'] / 1e9:.1f} GFLOP attention) / step time / the {MATMUL_N}^3 fp32 matmul rate measured at "
        f"the start of every round (median {rate / 1e9:.1f} GFLOP/s).",
        "",
    ]
    if png is not None:
        out += [f"![encoder-decoder]({os.path.relpath(png, md_path.parent)})", ""]
    out += _train_table(data, tab, s, fl, rate) + _followups(data, s) + _decode_table(data, tab, s)
    out += _profile_tables(data)
    out += _raw(data)
    return "\n".join(out)


def _train_table(data: dict[str, Any], tab: dict, s: Shape, fl: dict, rate: float) -> list[str]:
    out = [
        "### Training",
        "",
        "| system | tokens/s (src + tgt, median) | min-max | step (ms) | params | peak RSS (MB) | RSS increase (MB) "
        "| MFU | loss first -> last |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for sy in TRAIN_SYSTEMS:
        if (t := tab.get((sy, s.batch))) is None:
            continue
        loss = f"{t['loss'][0]:.3f} -> {t['loss'][1]:.3f}" if "loss" in t else "-"
        out.append(
            f"| {LABELS[sy]} | {t['tps']:,.0f} | {t['min']:,.0f}-{t['max']:,.0f} | {t['step_ms']:.0f} | "
            f"{t['params']:,} | {t['peak_mb']:.0f} | {t['delta_mb']:.0f} | "
            f"{fl['total'] / (t['step_ms'] / 1e3) / rate:.0%} | {loss} |"
        )
    out += [
        "",
        f"Parameters: x-transformers has {ff_biases(s):,} more than xfam, exactly its FFN biases "
        f"(2 stacks x {s.layers} blocks x (4 x {s.dim} + {s.dim})); everything else is the same matrices (its "
        "q, k, v are separate Linears, xfam's one fused Linear; its LayerNorm has no bias, as xfam's with "
        "`bias=false`).",
        "",
    ]
    for a, b, label, target in RATIOS:
        if (r := ratios(data, a, b, s.batch)) is not None:
            verdict = "**met**" if r[0] >= target else "**not met**"
            out.append(
                f"* {label} = {r[0]:.3f} (per round {r[1]:.3f}-{r[2]:.3f}, median {r[3]:.3f}), target >= "
                f"{target:.2f}: {verdict}"
            )
    return out + [""]


def _followups(data: dict[str, Any], s: Shape) -> list[str]:
    """Targeted reruns (``--append-json``): more rounds of the training systems, same protocol."""
    out: list[str] = []
    for f in data.get("followups", []):
        fm, ft = f["meta"], summarize(f)
        out += ["#### Follow-up run", ""] if not out else []
        out += [
            f"`{fm['command']}` ({fm['date']}): {fm['repeats']} rounds, {fm['warmup']} warm-up + {fm['steps']} timed "
            f"steps per process, same protocol ({len(f.get('rejected', []))} reruns).",
            "",
            "| system | tokens/s (median) | min-max |",
            "|---|---:|---:|",
        ]
        for sy in TRAIN_SYSTEMS:
            if (t := ft.get((sy, s.batch))) is not None:
                out.append(f"| {LABELS[sy]} | {t['tps']:,.0f} | {t['min']:,.0f}-{t['max']:,.0f} |")
        out.append("")
        for a, b, label, target in RATIOS:
            if (r := ratios(f, a, b, s.batch)) is not None:
                verdict = "met" if r[0] >= target else "not met"
                out.append(
                    f"* {label} = {r[0]:.3f} (per round {r[1]:.3f}-{r[2]:.3f}, median {r[3]:.3f}), target >= "
                    f"{target:.2f}: {verdict}"
                )
        out.append("")
    return out


def _decode_table(data: dict[str, Any], tab: dict, s: Shape) -> list[str]:
    out = [
        "### Decoding",
        "",
        "| batch | system | new tokens/s (median) | min-max | call (ms) | ms per new token | vs xfam greedy "
        "| vs x-transformers greedy |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b in data["meta"]["batches"]:
        for sy in DECODE_SYSTEMS:
            if (t := tab.get((sy, b))) is None:
                continue
            rel = []
            for base in ("xfam_greedy", "xtransformers_greedy"):
                r = ratios(data, sy, base, b)
                rel.append(f"{r[0]:.2f} [{r[1]:.2f}-{r[2]:.2f}]" if r else "-")
            out.append(
                f"| {b} | {LABELS[sy]} | {t['tps']:,.0f} | {t['min']:,.0f}-{t['max']:,.0f} | {t['step_ms']:.0f} | "
                f"{t['step_ms'] / s.new_tokens:.2f} | {rel[0]} | {rel[1]} |"
            )
    return out + ["", "Ratio cells: ratio of the medians [min-max of the per-round ratios].", ""]


def _profile_tables(data: dict[str, Any], top: int = 16) -> list[str]:
    """Self CPU time per op and step (training) or decoding call, one process per profiled system."""
    profs = data.get("profiles", [])
    if not profs:
        return []
    out = [
        "### Where the time goes (torch.profiler)",
        "",
        "Self CPU ms per training step or decoding call (calls per step), one process per system after the warm-up; "
        "the profiler adds a little time to every op call.",
        "",
    ]
    for kind in (TRAIN_SYSTEMS, DECODE_SYSTEMS):
        rows = [p for p in profs if p["system"] in kind]
        if not rows:
            continue
        names = sorted({k for p in rows for k in p["ops"]}, key=lambda k: -max(p["ops"].get(k, [0])[0] for p in rows))
        out += ["| op | " + " | ".join(f"{LABELS[p['system']]} (batch {p['batch']})" for p in rows) + " |"]
        out.append("|---|" + "---:|" * len(rows))
        for k in names[:top]:
            cells = [f"{p['ops'][k][0]:.1f} ({p['ops'][k][1]:g})" if k in p["ops"] else "-" for p in rows]
            out.append(f"| `{k[:60]}` | " + " | ".join(cells) + " |")
        other = [sum(v[0] for kk, v in p["ops"].items() if kk not in names[:top]) for p in rows]
        out.append("| all other ops | " + " | ".join(f"{o:.1f}" for o in other) + " |")
        out.append(
            "| **total self CPU** | "
            + " | ".join(f"**{sum(v[0] for v in p['ops'].values()):.1f}**" for p in rows)
            + " |"
        )
        if kind is TRAIN_SYSTEMS:
            out.append(
                "| of which AdamW `step()` with its ops | "
                + " | ".join(f"{p['optimizer_ms']:.1f}" for p in rows)
                + " |"
            )
        out.append("")
    return out


def _raw(data: dict[str, Any]) -> list[str]:
    out = ["<details><summary>Raw results: every kept run in round order (cores used by others)</summary>", ""]
    keys = dict.fromkeys((r["system"], r["batch"]) for r in data["runs"])
    for sy, b in keys:
        rs = [r for r in data["runs"] if (r["system"], r["batch"]) == (sy, b)]
        val = (lambda r: f"{r['gflops']:,.0f} GFLOP/s") if sy == "matmul" else (lambda r: f"{r['tokens_per_s']:,.0f}")
        name = sy if sy == "matmul" else f"{sy} (batch {b})"
        out.append(f"* {name}: " + ", ".join(f"{val(r)} ({r['foreign_cores']:.2f})" for r in rs))
    return out + ["", "</details>"]


def render_png(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tab, s, m = summarize(data), Shape(**data["meta"]["shape"]), data["meta"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.6]})
    groups = [([(sy, s.batch) for sy in TRAIN_SYSTEMS], ax1, "training tokens/s (source + target)")]
    groups.append(([(sy, b) for b in m["batches"] for sy in DECODE_SYSTEMS], ax2, f"new tokens/s ({s.new_tokens} new)"))
    for keys, ax, ylabel in groups:
        keys = [k for k in keys if k in tab]
        ys = [tab[k]["tps"] for k in keys]
        err = [[tab[k]["tps"] - tab[k]["min"] for k in keys], [tab[k]["max"] - tab[k]["tps"] for k in keys]]
        colors = [f"C{(TRAIN_SYSTEMS + DECODE_SYSTEMS).index(k[0]) % 10}" for k in keys]
        bars = ax.bar(range(len(keys)), ys, yerr=err, capsize=3, color=colors)
        ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7, padding=3)
        names = [SHORT[k[0]] for k in keys]
        ax.set_xticks(
            range(len(keys)), [n if k[0] in TRAIN_SYSTEMS else f"{n}\nbatch {k[1]}" for n, k in zip(names, keys)]
        )
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylabel(ylabel + " (median; bars: min-max)")
        ax.set_ylim(0, max([tab[k]["max"] for k in keys] or [1]) * 1.2)
        ax.grid(axis="y", alpha=0.3)
    ax1.set_title(f"Training, batch {s.batch}, {s.src} + {s.tgt} tokens", fontsize=9)
    ax2.set_title(f"Decoding from {s.src} source tokens (x-transformers: no beam search)", fontsize=9)
    fig.suptitle(
        f"Encoder-decoder, width {s.dim}, {s.layers}+{s.layers} layers, fp32, {m['threads']} CPU threads "
        f"({m['repeats']} round(s))",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(data: dict[str, Any], md: Path, png: Path) -> None:
    """The chart and this benchmark's section of ``md`` (``benchlib.common.write_report``)."""
    chart = lambda path: render_png(data, path)  # noqa: E731
    common.write_report(md, png, (START, END), HEADING, chart, render_md(data, png, md))


def print_summary(data: dict[str, Any]) -> None:
    tab, s = summarize(data), Shape(**data["meta"]["shape"])
    for (sy, b), t in tab.items():
        print(
            f"  {sy:<28} batch {b}: {t['tps']:9,.0f} tokens/s [{t['min']:,.0f}-{t['max']:,.0f}] params {t['params']:,}"
        )
    for a, b, label, target in RATIOS:
        if (r := ratios(data, a, b, s.batch)) is not None:
            print(f"  {label}: {r[0]:.3f} [{r[1]:.3f}-{r[2]:.3f}, median per round {r[3]:.3f}] target >= {target}")


def main(argv: list[str] | None = None) -> None:
    systems = TRAIN_SYSTEMS + DECODE_SYSTEMS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="rounds of every system (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed training steps per process (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="discarded training steps per process (default 5)")
    p.add_argument("--decode-reps", type=int, default=5, help="timed decoding calls per process (default 5)")
    p.add_argument("--decode-warmup", type=int, default=1, help="discarded decoding calls per process (default 1)")
    p.add_argument("--systems", nargs="+", choices=systems, default=list(systems), help="systems, in round order")
    p.add_argument("--batches", nargs="+", type=int, default=list(DECODE_BATCHES), help="decoding batch sizes")
    p.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks.md", help="markdown report (its own section)")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks_seq2seq.png", help="chart path")
    p.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="render the docs from saved raw results")
    p.add_argument("--no-docs", action="store_true", help="print the summary only; write no md/png")
    p.add_argument("--quick", action="store_true", help="1 round, 2 + 4 training steps, 1 + 1 decoding calls")
    p.add_argument("--profile", nargs="+", choices=systems, default=None, help="also profile these (torch.profiler)")
    p.add_argument("--append-json", type=Path, nargs="+", default=[], help="follow-up runs to report as well")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the tests' shape
    p.add_argument("--worker", nargs=2, metavar=("SYSTEM", "BATCH"), help=argparse.SUPPRESS)
    protocol.add_protocol_options(p)
    args = p.parse_args(argv)
    args.shape = TINY if args.tiny else FULL

    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.shape, args.warmup, args.steps, args.threads)
        return
    if args.quick:
        args.repeats, args.warmup, args.steps, args.max_wait, args.retries = 1, 2, 4, 0, 0
        args.decode_warmup, args.decode_reps = 1, 1
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        data["rendered_by"] = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
        args.batches = data["meta"]["batches"]
    else:
        data = run_all(args)
    if args.profile:
        data["profiles"] = run_profiles(args)
    if args.append_json:
        data["followups"] = [json.loads(f.read_text()) for f in args.append_json]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
    if not args.no_docs:
        write_report(data, args.md, args.png)
        print(f"wrote {args.md} (section {START}) and {args.png}")
    print_summary(data)


if __name__ == "__main__":
    main()
