#!/usr/bin/env python
"""Block-option benchmark: xfam against x-transformers with the same block options, three option sets, training.

Shape (every system): vocab 256, width 256, 4 layers, 4 heads (head dim 64), learned absolute positions
(x-transformers' default), untied head, no Linear biases, causal LM, batch 8 x 256 tokens, fp32, 2 torch threads;
the shape of ``scripts/bench_train.py``. One training step = zero_grad, forward, cross-entropy, backward, AdamW step.

Option sets (``SETS``; the report says how each flag of one maps onto the other's):

* ``geglu_rms_qknorm``      -- GEGLU FFN (hidden width 688 in both), RMSNorm, QK-norm with the fixed
                               temperature 10: xfam ``model.ffn=geglu model.norm=rmsnorm model.attn_qk_norm=l2
                               model.attn_qk_scale=10``; x-transformers ``ff_glu=True ff_mult=2.6875
                               use_rmsnorm=True attn_qk_norm=True``;
* ``sandwich_layerscale``   -- sandwich norm with LayerScale at 1e-6 (the shared stand-in for "sandwich norm +
                               ReZero", which neither library builds): xfam ``model.norm_position=sandwich
                               model.residual=layerscale model.layerscale_init=1e-6``; x-transformers
                               ``sandwich_norm=True use_layerscale=True layerscale_init_value=1e-6``;
* ``macaron_talking_heads`` -- macaron FFNs and talking heads: xfam ``model.macaron=true
                               model.attn_talking_heads=true``; x-transformers ``macaron=True
                               attn_pre_talking_heads=True attn_post_talking_heads=True`` (no attn_flash: it
                               refuses talking heads).

Systems per set: ``xfam_<set>`` (``build_model`` on a plain config, vanilla attention with ``backend=auto``,
xfam's own AdamW setup), ``xtransformers_<set>`` (``TransformerWrapper`` + ``Decoder``, default attention,
``ff_no_bias=True``) and, where x-transformers allows it, ``xtransformers_<set>_flash`` (``attn_flash=True``).
Targets per set: xfam >= 1.10x x-transformers default and >= 1.00x its attn_flash.

Protocol: that of ``scripts/bench_train.py`` (``benchlib.protocol``): every measurement a fresh process
(``--worker SYSTEM``), all systems alternating for ``--repeats`` rounds, medians after warm-up, a wait for a
quiet machine before each measurement and reruns of noisy ones, a 2048^3 matmul per round for the MFU column.
The report is a marked section of docs/benchmarks.md (kept when bench_train.py rewrites the file) and
docs/benchmarks_blocks.png.

    python scripts/bench_blocks.py --quick                  # a check that everything runs (~2 min)
    python scripts/bench_blocks.py --json blocks.json       # the full run (~15-20 min)
    python scripts/bench_blocks.py --sets macaron_talking_heads --repeats 8 --no-docs --json more.json
                                                            # a follow-up: more rounds of one set
    python scripts/bench_blocks.py --from-json blocks.json --append-json more.json \\
        --profile xfam_macaron_talking_heads xtransformers_macaron_talking_heads
                                                            # re-render with the follow-up and torch.profiler tables

One file over 400 lines, as scripts/bench_seq2seq.py: the workers, the orchestration and the report share the
option sets and the system names; the protocol itself is shared with bench_train.py in benchlib.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
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

START, END = "<!-- bench_blocks:start -->", "<!-- bench_blocks:end -->"
HEADING = "## Block options: xfam vs x-transformers with the same flags"
TARGET_DEFAULT, TARGET_FLASH = 1.10, 1.00


@dataclasses.dataclass(frozen=True)
class Shape:
    """The benchmark shape (bench_train.py's); ``TINY`` is for the test of the pipeline (``--tiny``)."""

    vocab: int = VOCAB
    dim: int = DIM
    layers: int = LAYERS
    heads: int = HEADS
    batch: int = BATCH
    seq: int = SEQ

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def glu_hidden(self) -> int:
        """xfam's GLU hidden width at ``ffn_mult=4`` (``ModelSpec.ffn_hidden``): 8 ceil(2/3 x 4 D / 8)."""
        return 8 * -(-int(2 * 4 * self.dim / 3) // 8)


FULL = Shape()
TINY = Shape(vocab=32, dim=32, layers=1, heads=2, batch=2, seq=8)


def _xt_geglu(s: Shape) -> dict[str, Any]:
    mult = s.glu_hidden / s.dim  # 688 / 256 = 2.6875, exact in binary
    assert int(s.dim * mult) == s.glu_hidden  # x-transformers' inner width: int(dim * ff_mult)
    return {"ff_glu": True, "ff_mult": mult, "use_rmsnorm": True, "attn_qk_norm": True}


@dataclasses.dataclass(frozen=True)
class BlockSet:
    """One option set: xfam's ``model.*`` overrides, x-transformers' ``Decoder`` kwargs at a shape (beyond the
    shape and ``ff_no_bias=True``), whether x-transformers allows ``attn_flash`` with them, what the FLOP count
    needs, and the report's words on how the two map."""

    xfam: dict[str, Any]
    xt: Callable[[Shape], dict[str, Any]]
    flash: bool
    ffns_per_layer: int  # FFN sublayers per block (macaron: 2)
    glu: bool
    mapping: str

    def ffn_hidden(self, s: Shape) -> int:
        return s.glu_hidden if self.glu else 4 * s.dim


SETS: dict[str, BlockSet] = {
    "geglu_rms_qknorm": BlockSet(
        xfam={"ffn": "geglu", "norm": "rmsnorm", "attn_qk_norm": "l2", "attn_qk_scale": 10.0},
        xt=_xt_geglu,
        flash=True,
        ffns_per_layer=1,
        glu=True,
        mapping=(
            "GEGLU FFN (Shazeer, 2020, arXiv:2002.05202), RMSNorm (Zhang & Sennrich, 2019, arXiv:1910.07467) and "
            "QK-norm as cosine-similarity attention with a fixed temperature (Henry et al., 2020, arXiv:2010.04245): "
            "scores 10 cos(q, k) in both (x-transformers' `attn_qk_norm=True` multiplies the l2-normalised q.k by "
            "its default `attn_qk_norm_scale=10`; xfam's `attn_qk_scale=10` fixes its temperature, which is "
            "otherwise learned). FFN hidden width {hidden} in both: xfam's GLU rule 8 ceil(2/3 x 4 x {dim} / 8) "
            "(`ModelSpec.ffn_hidden`), x-transformers' `ff_mult={mult}` (its inner width `int(dim * ff_mult)` = "
            "{hidden})."
        ),
    ),
    "sandwich_layerscale": BlockSet(
        xfam={"norm_position": "sandwich", "residual": "layerscale", "layerscale_init": 1e-6},
        xt=lambda s: {"sandwich_norm": True, "use_layerscale": True, "layerscale_init_value": 1e-6},
        flash=True,
        ffns_per_layer=1,
        glu=False,
        mapping=(
            "Sandwich norm (CogView, Ding et al., 2021, arXiv:2105.13290) with LayerScale (CaiT, Touvron et al., "
            "2021, arXiv:2103.17239), per-channel gains starting at 1e-6 in both. This is the shared stand-in for "
            '"sandwich norm + ReZero", which neither library builds: ReZero (Bachlechner et al., 2020, '
            "arXiv:2003.04887) is a scalar gain starting at 0 in blocks without norms, so xfam's `residual=rezero` "
            "takes only `norm_position=pre` (whose norms it drops), and x-transformers has no ReZero flag (its "
            "nearest, `use_layerscale` with `layerscale_init_value=0`, is per-channel and keeps every norm). "
            "xfam refuses `layerscale_init=0` (LayerScale's gain must be positive), so both start at 1e-6. The "
            "two order the gain differently: xfam x + lambda N'(f(N(x))) (the gain last, as CaiT), x-transformers "
            "x + N'(lambda f(N(x))) (its `LayerScale` wraps the sublayer, its sandwich norm the wrapped output, "
            "which then normalises most of the small gain away). The work is the same: per sublayer one extra "
            "norm and one per-channel multiply."
        ),
    ),
    "macaron_talking_heads": BlockSet(
        xfam={"macaron": True, "attn_talking_heads": True},
        xt=lambda s: {"macaron": True, "attn_pre_talking_heads": True, "attn_post_talking_heads": True},
        flash=False,
        ffns_per_layer=2,
        glu=False,
        mapping=(
            "Macaron FFNs (Lu et al., 2019, arXiv:1906.02762: FFN/2 - attention - FFN/2 in every block, both "
            "systems scaling each FFN branch by 1/2) and talking heads (Shazeer et al., 2020, arXiv:2003.02436: a "
            "learned H x H mixing of the heads' logits before the softmax and of their weights after it; xfam an "
            "einsum with an H x H matrix, x-transformers a 1 x 1 `Conv2d` over the heads, both without bias). "
            "Talking heads needs the explicit score matrix: x-transformers' `Attend` refuses `attn_flash` with it "
            "(so there is no flash system), and xfam's vanilla attention (`backend=auto`) takes its explicit-score "
            "einsum path instead of SDPA; x-transformers' default attention is an einsum path too."
        ),
    ),
}


def systems_of(name: str) -> tuple[str, ...]:
    """The systems of one option set, in round order."""
    out = (f"xfam_{name}", f"xtransformers_{name}")
    return out + ((f"xtransformers_{name}_flash",) if SETS[name].flash else ())


SYSTEMS = tuple(s for name in SETS for s in systems_of(name))


def parse_system(system: str) -> tuple[str, str, bool]:
    """``system -> (library, set, flash)``: ``xfam`` or ``xtransformers``, the option set, attn_flash."""
    lib, rest = system.split("_", 1)
    flash = rest.endswith("_flash")
    return lib, rest.removesuffix("_flash") if flash else rest, flash


def label(system: str) -> str:
    lib, _, flash = parse_system(system)
    return "xfam" if lib == "xfam" else "x-transformers (attn_flash)" if flash else "x-transformers (default)"


def ratio_specs(name: str) -> list[tuple[str, str, str, float]]:
    """``(a, b, label, target)`` per ratio of one set: xfam / x-transformers default (and attn_flash)."""
    xfam, default = f"xfam_{name}", f"xtransformers_{name}"
    out = [(xfam, default, "xfam / x-transformers default", TARGET_DEFAULT)]
    if SETS[name].flash:
        out.append((xfam, f"{default}_flash", "xfam / x-transformers attn_flash", TARGET_FLASH))
    return out


def param_gap(name: str, s: Shape) -> tuple[int, str]:
    """Parameters x-transformers has beyond xfam in a set, and what they are (both bias-free otherwise)."""
    if SETS[name].glu:
        h = s.glu_hidden
        n = s.layers * 2 * h
        return n, (
            f"x-transformers has {n:,} more, exactly the bias of its GLU input projection ({s.layers} blocks x "
            f"2 x {h}): its `GLU` builds `nn.Linear(dim, 2 * inner)` with a bias whatever `ff_no_bias` says"
        )
    return 0, "identical parameter counts"


def flops_per_step(name: str, s: Shape) -> dict[str, float]:
    """Model FLOPs of one training step of a set (forward + backward = 3x forward; a multiply-add = 2 FLOPs).

    Dense: 6 * N_matmul * tokens, N_matmul = L * (4 D^2 + FFNs) + D * V, an FFN 2 D H_ff (3 D H_ff for a GLU),
    macaron's two per block; attention 12 * L * S * D per token (full S x S squares); talking heads' mixing
    (2 x 2 S H^2 per token and layer), norms, softmax, embeddings and the optimiser are not counted."""
    bs, d = SETS[name], s.dim
    ffn = (3 if bs.glu else 2) * d * bs.ffn_hidden(s)
    n_matmul = s.layers * (4 * d * d + bs.ffns_per_layer * ffn) + d * s.vocab
    dense = 6 * n_matmul * s.tokens
    attention = 12 * s.layers * s.seq * d * s.tokens
    return {"n_matmul": n_matmul, "dense": dense, "attention": attention, "total": dense + attention}


# ---------------------------------------------------------------------------------------- worker side (torch)


def build_xfam(name: str, s: Shape):
    """xfam's decoder with the set's block options, from a plain config as ``train.py`` builds it."""
    from xfam.model.build import build_model

    model = {"name": f"bench_{name}", "dim": s.dim, "layers": s.layers, "heads": s.heads, "max_len": s.seq}
    cfg = {
        "model": model | SETS[name].xfam,
        "attention": {"name": "vanilla", "backend": "auto", "dropout": 0.0},
        "pos": {"name": "learned"},
        "memory": {"name": "none"},
        "exit": {"name": "none"},
    }
    info = {"task": "lm", "vocab_size": s.vocab, "num_classes": None, "token_bytes": None, "fingerprint": "b"}
    return build_model(cfg, info)


def build_xtransformers(name: str, s: Shape, flash: bool):
    """``TransformerWrapper`` + ``Decoder`` with the set's flags, bias-free FFNs, the head width given explicitly
    (its default, 64, at full shape); learned absolute positions are its default."""
    from x_transformers import Decoder, TransformerWrapper

    layers = Decoder(
        dim=s.dim,
        depth=s.layers,
        heads=s.heads,
        attn_dim_head=s.dim // s.heads,
        attn_flash=flash,
        ff_no_bias=True,
        **SETS[name].xt(s),
    )
    return TransformerWrapper(num_tokens=s.vocab, max_seq_len=s.seq, attn_layers=layers)


def _batches(s: Shape, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct random batches, ``input_ids`` / ``labels`` ``[B, S]`` (the next tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, s.vocab, (n * s.batch, s.seq + 1), generator=g)  # [N, S + 1]
    return [{"input_ids": r[:, :-1].contiguous(), "labels": r[:, 1:].contiguous()} for r in rows.split(s.batch)]


def run_train(system: str, s: Shape, warmup: int, steps: int, profile: bool = False) -> dict[str, Any]:
    """Build one system and time ``warmup + steps`` training steps (``profile``: op self-times per step instead)."""
    import torch
    import torch.nn.functional as F
    from benchlib.workers import _rss_now_mb, timed

    lib, name, flash = parse_system(system)
    n = warmup + steps
    batches = _batches(s, min(n, 8))
    rss_before = _rss_now_mb()
    if lib == "xfam":
        from xfam.config.specs import OptimSpec
        from xfam.training.lit.optim import make_optimizer

        model = build_xfam(name, s)
        made = make_optimizer(model, OptimSpec(lr=LR, betas=BETAS, eps=EPS), n, fused=True)  # as XfamLitModule
        opt, sched = made["optimizer"], made["lr_scheduler"]["scheduler"]
    else:
        model = build_xtransformers(name, s, flash)
        opt, sched = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY), None
    model.train()
    losses = []

    def step(i: int) -> None:
        b = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        out = model(b["input_ids"])
        logits = out.logits if lib == "xfam" else out  # [B, S, V]; XfamModel returns a ModelOutput
        loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())

    times, cpu, ops = timed(step, n, warmup, profile)
    med = statistics.median(times[warmup:])
    res = {"params": sum(p.numel() for p in model.parameters()), "step_s": med, "tokens_per_s": s.tokens / med}
    res["times"] = [round(t, 5) for t in times]
    if ops is not None:
        return {**res, **ops, **cpu}
    from benchlib.workers import _peak_rss_mb

    res |= {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)}
    res |= {"rss_before_mb": round(rss_before, 1), "peak_rss_mb": round(_peak_rss_mb(), 1)}
    return {**res, **cpu}


def worker(system: str, s: Shape, warmup: int, steps: int, threads: int) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import importlib

    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    name = system.split(":", 1)[-1]
    if name == "matmul":
        from benchlib.workers import run_matmul

        res = run_matmul()
    else:
        xfam = ("xfam.model.build", "xfam.training.lit.optim")
        for module in xfam if name.startswith("xfam") else ("x_transformers",):
            importlib.import_module(module)  # before the RSS baseline: it counts the model and its work only
        res = run_train(name, s, warmup, steps, profile=system.startswith("profile:"))
    res.update({"system": system, "loadavg_start": load, "threads": torch.get_num_threads()})
    print(json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------- parent side (no torch)


def spawn(system: str, args: argparse.Namespace, warmup: int, steps: int) -> dict[str, Any]:
    argv = [system, "--warmup", str(warmup), "--steps", str(steps)] + ["--tiny"] * args.tiny
    return protocol.spawn(Path(__file__).resolve(), argv, args, system)


def measure(system: str, args: argparse.Namespace, label_: str, rejected: list, steps: int) -> dict[str, Any]:
    def describe(res: dict[str, Any]) -> str:
        if system == "matmul":
            return f"{system:<40}{res['gflops']:8.1f} GFLOP/s ({MATMUL_N}^3 fp32)"
        return f"{system:<40}{res['tokens_per_s']:8.0f} tok/s  step {res['step_s'] * 1e3:7.1f} ms"

    return protocol.measure(lambda: spawn(system, args, args.warmup, steps), describe, label_, args, rejected)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeats`` rounds of: the matmul, then every system of every set."""
    runs: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    todo = ["matmul", *args.systems]
    started = time.perf_counter()
    for rep in range(args.repeats):
        for system in todo:
            head = (
                f"[{len(runs) + 1:3d}/{len(todo) * args.repeats} {time.perf_counter() - started:5.0f} s] rep {rep + 1}"
            )
            res = measure(system, args, head, rejected, args.steps)
            res["repeat"] = rep
            runs.append(res)
    return {"meta": meta(args), "runs": runs, "rejected": rejected}


def run_profiles(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One ``torch.profiler`` worker per system of ``--profile``."""
    out: list[dict[str, Any]] = []
    for system in args.profile:
        res = measure(f"profile:{system}", args, "[profile]", [], args.profile_steps)
        res.update({"system": system, "steps": args.profile_steps})
        out.append(res)
    return out


def meta(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **protocol.machine_meta(args),
        "shape": dataclasses.asdict(args.shape),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "steps": args.steps,
        "systems": list(args.systems),
    }


# ---------------------------------------------------------------------------------------- report (no torch)


def summarize(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system: median, min, max tokens/s over rounds, step time, parameters, memory, losses."""
    table: dict[str, dict[str, Any]] = {}
    for r in data["runs"]:
        if r["system"] != "matmul":
            table.setdefault(r["system"], {"runs": []})["runs"].append(r)
    for t in table.values():
        rs, tps = t["runs"], [r["tokens_per_s"] for r in t["runs"]]
        t.update({"tps": statistics.median(tps), "min": min(tps), "max": max(tps)})
        t["step_ms"] = statistics.median(r["step_s"] for r in rs) * 1e3
        t["params"] = rs[0]["params"]
        t["peak_mb"] = statistics.median(r["peak_rss_mb"] for r in rs)
        t["delta_mb"] = statistics.median(r["peak_rss_mb"] - r["rss_before_mb"] for r in rs)
        t["loss"] = (statistics.median(r["loss_first"] for r in rs), statistics.median(r["loss_last"] for r in rs))
    return table


def matmul_rate(data: dict[str, Any]) -> list[float]:
    return [r["gflops"] for r in data["runs"] if r["system"] == "matmul"]


def ratios(data: dict[str, Any], a: str, b: str) -> tuple[float, float, float, float] | None:
    """Ratio of the median tokens/s of ``a`` and ``b`` (the figure targets are judged on); min, max and median of
    the per-round ratios (``a`` and ``b`` measured in the same round: the estimator least moved by a machine whose
    speed drifts between rounds)."""
    get = lambda s: {r["repeat"]: r["tokens_per_s"] for r in data["runs"] if r["system"] == s}  # noqa: E731
    ra, rb = get(a), get(b)
    if not ra or not rb:
        return None
    per_round = [ra[k] / rb[k] for k in ra if k in rb]
    med = statistics.median(ra.values()) / statistics.median(rb.values())
    return med, min(per_round), max(per_round), statistics.median(per_round)


def sets_in(data: dict[str, Any]) -> list[str]:
    """The option sets with at least one system in the runs, in ``SETS`` order."""
    seen = {parse_system(r["system"])[1] for r in data["runs"] if r["system"] != "matmul"}
    return [name for name in SETS if name in seen]


def verdicts(data: dict[str, Any], bold: bool = True) -> list[str]:
    out = []
    for name in sets_in(data):
        for a, b, what, target in ratio_specs(name):
            if (r := ratios(data, a, b)) is not None:
                met = "met" if r[0] >= target else "not met"
                out.append(
                    f"* {name}: {what} = {r[0]:.3f} (per round {r[1]:.3f}-{r[2]:.3f}, median {r[3]:.3f}), target >= "
                    f"{target:.2f}: " + (f"**{met}**" if bold else met)
                )
    return out


def render_md(data: dict[str, Any], png: Path | None, md_path: Path) -> str:
    m, tab, s = data["meta"], summarize(data), Shape(**data["meta"]["shape"])
    rate = statistics.median(matmul_rate(data)) * 1e9 if matmul_rate(data) else float("nan")
    out = [
        f"Measured by `scripts/bench_blocks.py` on {m['date']} (`{m['command']}`)"
        + (f"; rendered by `{data['rendered_by']}`." if data.get("rendered_by") else "."),
        "",
        f"* Machine and versions: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, x-transformers "
        f"{m['x_transformers']}, xfam at commit {m['xfam_commit']}; {m['threads']} torch threads per worker.",
        f"* Shape, every system (bench_train.py's): vocab {s.vocab}, width {s.dim}, {s.layers} layers, {s.heads} "
        f"heads (head dim {s.dim // s.heads}), learned absolute positions (x-transformers' default), untied head, "
        f"causal LM, batch {s.batch} x {s.seq} tokens ({s.tokens:,} per step); fp32, CPU. No Linear biases: xfam's "
        "`bias=false` (its default), x-transformers' `ff_no_bias=True` (its attention has none by default).",
        "* xfam: `build_model` on a plain config (`model.dim/layers/heads`, `max_len` = the sequence, plus the set's "
        "overrides below; `attention=vanilla` with `backend=auto`, `pos=learned`), trained with "
        "`xfam.training.lit.optim.make_optimizer` (fused AdamW, decay on weight matrices only, warmup + cosine, as "
        "xfam's Lightning module at full precision).",
        f"* x-transformers: `TransformerWrapper(num_tokens={s.vocab}, max_seq_len={s.seq}, attn_layers=Decoder("
        f"dim={s.dim}, depth={s.layers}, heads={s.heads}, attn_dim_head={s.dim // s.heads}, ff_no_bias=True, "
        f"attn_flash=..., <set's flags>))`, PyTorch's default `AdamW(model.parameters(), weight_decay="
        f"{WEIGHT_DECAY})`; lr {LR}, betas {BETAS}, eps {EPS} for both. Its `norm_add_unit_offset` stays at its "
        "default (True: gains stored as gain - 1 and 1 added back in the forward): the same parameters and, at "
        "init, the same function; it costs one add on a width-D vector per norm call.",
        "* Training step: `zero_grad`, forward, cross-entropy (mean over tokens), backward, AdamW step.",
        f"* Protocol (bench_train.py's): each measurement a fresh process; per round the matmul, then every "
        f"system of every set; {m['repeats']} round(s); a run drops {m['warmup']} warm-up steps and takes the median "
        f"of {m['steps']}; figures are medians over rounds (min-max over rounds beside). Before each measurement "
        f"the parent waited (at most {m['max_wait']} s) for other processes to use < {m['quiet']} cores, and reran "
        f"a measurement during which they used > {m['noisy']} cores (at most {m['retries']} times; "
        f"{len(data.get('rejected', []))} reruns).",
        f"* MFU: model FLOPs per step of each set (`flops_per_step()`: matmuls of the blocks and the head, "
        f"attention's full squares; talking heads' mixing, norms and softmax not counted) / step time / the "
        f"{MATMUL_N}^3 fp32 matmul rate measured at the start of every round (median {rate / 1e9:.1f} GFLOP/s).",
        "",
        "Option sets (issue: GEGLU + RMSNorm + QK-norm; sandwich norm + ReZero; macaron + talking heads):",
        "",
    ]
    for name in sets_in(data):
        bs = SETS[name]
        xfam = " ".join(f"`model.{k}={v if isinstance(v, str) else json.dumps(v)}`" for k, v in bs.xfam.items())
        xt = ", ".join(f"`{k}={v!r}`" for k, v in bs.xt(s).items())
        mult = s.glu_hidden / s.dim
        words = bs.mapping.format(hidden=s.glu_hidden, dim=s.dim, mult=mult)
        out.append(f"* **{name}**: xfam {xfam}; x-transformers {xt}. {words}")
    out.append("")
    if png is not None:
        out += [f"![block options]({os.path.relpath(png, md_path.parent)})", ""]
    out += _table(data, tab, s, rate)
    out += _followups(data) + _profile_tables(data) + _raw(data)
    return "\n".join(out)


def _table(data: dict[str, Any], tab: dict, s: Shape, rate: float) -> list[str]:
    out = [
        "| set | system | tokens/s (median) | min-max | vs xfam | step (ms) | params | peak RSS (MB) "
        "| RSS increase (MB) | MFU | loss first -> last |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in sets_in(data):
        fl = flops_per_step(name, s)
        base = tab.get(f"xfam_{name}")
        for sy in systems_of(name):
            if (t := tab.get(sy)) is None:
                continue
            rel = f"{t['tps'] / base['tps']:.3f}" if base else "-"
            out.append(
                f"| {name} | {label(sy)} | {t['tps']:,.0f} | {t['min']:,.0f}-{t['max']:,.0f} | {rel} | "
                f"{t['step_ms']:.0f} | {t['params']:,} | {t['peak_mb']:.0f} | {t['delta_mb']:.0f} | "
                f"{fl['total'] / (t['step_ms'] / 1e3) / rate:.0%} | {t['loss'][0]:.3f} -> {t['loss'][1]:.3f} |"
            )
    out += ["", "Parameters:", ""]
    for name in sets_in(data):
        xf, xt = tab.get(f"xfam_{name}"), tab.get(f"xtransformers_{name}")
        gap, why = param_gap(name, s)
        if xf and xt:
            seen = xt["params"] - xf["params"]
            check = "" if seen == gap else f" (measured difference {seen:,}: not the expected {gap:,})"
            out.append(f"* {name}: xfam {xf['params']:,}, x-transformers {xt['params']:,}: {why}{check}.")
    out += [
        "",
        "Everything else is the same matrices (x-transformers' q, k, v are three Linears, xfam's one fused Linear; "
        "norm gains one width-D vector each in both).",
        "",
        "Ratios and targets (ratio of the medians; the per-round ratios' min-max and median beside):",
        "",
    ]
    return out + verdicts(data) + [""]


def _followups(data: dict[str, Any]) -> list[str]:
    """Targeted reruns (``--append-json``): more rounds of some systems, same protocol."""
    out: list[str] = []
    for f in data.get("followups", []):
        fm, ft = f["meta"], summarize(f)
        out += ["#### Follow-up run", ""] if not out else []
        out += [
            f"`{fm['command']}` ({fm['date']}): {fm['repeats']} rounds, {fm['warmup']} warm-up + {fm['steps']} timed "
            f"steps per process, same protocol ({len(f.get('rejected', []))} reruns).",
            "",
            "| set | system | tokens/s (median) | min-max |",
            "|---|---|---:|---:|",
        ]
        for sy in SYSTEMS:
            if (t := ft.get(sy)) is not None:
                out.append(
                    f"| {parse_system(sy)[1]} | {label(sy)} | {t['tps']:,.0f} | {t['min']:,.0f}-{t['max']:,.0f} |"
                )
        out += ["", *verdicts(f, bold=False), ""]
    return out


def _profile_tables(data: dict[str, Any], top: int = 16) -> list[str]:
    """Self CPU time per op and training step, one process per profiled system."""
    rows = data.get("profiles", [])
    if not rows:
        return []
    out = [
        "### Where the time goes (torch.profiler)",
        "",
        "Self CPU ms per training step (calls per step), one process per system after the warm-up; the profiler "
        "adds a little time to every op call.",
        "",
    ]
    names = sorted({k for p in rows for k in p["ops"]}, key=lambda k: -max(p["ops"].get(k, [0])[0] for p in rows))
    out += ["| op | " + " | ".join(f"{label(p['system'])}, {parse_system(p['system'])[1]}" for p in rows) + " |"]
    out.append("|---|" + "---:|" * len(rows))
    for k in names[:top]:
        cells = [f"{p['ops'][k][0]:.1f} ({p['ops'][k][1]:g})" if k in p["ops"] else "-" for p in rows]
        out.append(f"| `{k[:60]}` | " + " | ".join(cells) + " |")
    other = [sum(v[0] for kk, v in p["ops"].items() if kk not in names[:top]) for p in rows]
    out.append("| all other ops | " + " | ".join(f"{o:.1f}" for o in other) + " |")
    total = [sum(v[0] for v in p["ops"].values()) for p in rows]
    out.append("| **total self CPU** | " + " | ".join(f"**{t:.1f}**" for t in total) + " |")
    out.append(
        "| of which AdamW `step()` with its ops | " + " | ".join(f"{p['optimizer_ms']:.1f}" for p in rows) + " |"
    )
    return out + [""]


def _raw(data: dict[str, Any]) -> list[str]:
    out = ["<details><summary>Raw results: every kept run in round order (cores used by others)</summary>", ""]
    for sy in dict.fromkeys(r["system"] for r in data["runs"]):
        rs = [r for r in data["runs"] if r["system"] == sy]
        val = (lambda r: f"{r['gflops']:,.0f} GFLOP/s") if sy == "matmul" else (lambda r: f"{r['tokens_per_s']:,.0f}")
        out.append(f"* {sy}: " + ", ".join(f"{val(r)} ({r['foreign_cores']:.2f})" for r in rs))
    return out + ["", "</details>"]


def render_png(data: dict[str, Any], path: Path) -> None:
    """One panel per option set: tokens/s of xfam and x-transformers (default, attn_flash), min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tab, s, m, names = summarize(data), Shape(**data["meta"]["shape"]), data["meta"], sets_in(data)
    fig, axes = plt.subplots(1, max(len(names), 1), figsize=(4 * max(len(names), 1), 4.4), squeeze=False)
    top = max([t["max"] for t in tab.values()] or [1]) * 1.2
    for ax, name in zip(axes[0], names):
        keys = [sy for sy in systems_of(name) if sy in tab]
        ys = [tab[k]["tps"] for k in keys]
        err = [[tab[k]["tps"] - tab[k]["min"] for k in keys], [tab[k]["max"] - tab[k]["tps"] for k in keys]]
        colors = [
            {"xfam": "C3", "xtransformers": "C0"}[parse_system(k)[0]] if not k.endswith("_flash") else "C9"
            for k in keys
        ]
        bars = ax.bar(range(len(keys)), ys, yerr=err, capsize=3, color=colors)
        ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7, padding=3)
        ax.set_xticks(range(len(keys)), [label(k).replace(" (", "\n(") for k in keys], fontsize=7)
        rs = [(what.split(" / ")[1], ratios(data, a, b)) for a, b, what, _ in ratio_specs(name)]
        ax.set_title(name + "\nxfam / " + ", / ".join(f"{w}: {r[0]:.2f}" for w, r in rs if r), fontsize=8)
        ax.set_ylim(0, top)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("training tokens/s (median; bars: min-max)")
    fig.suptitle(
        f"Block options, width {s.dim}, {s.layers} layers, batch {s.batch} x {s.seq}, fp32, {m['threads']} CPU "
        f"threads ({m['repeats']} round(s))",
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
    for sy, t in summarize(data).items():
        print(f"  {sy:<40} {t['tps']:9,.0f} tokens/s [{t['min']:,.0f}-{t['max']:,.0f}] params {t['params']:,}")
    for line in verdicts(data, bold=False):
        print("  " + line[2:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="rounds of every system (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed training steps per process (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="discarded training steps per process (default 5)")
    p.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS), help="option sets (all systems)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None, help="systems, in round order (or --sets)")
    p.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks.md", help="markdown report (its own section)")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks_blocks.png", help="chart path")
    p.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="render the docs from saved raw results")
    p.add_argument("--no-docs", action="store_true", help="print the summary only; write no md/png")
    p.add_argument("--quick", action="store_true", help="1 round, 2 warm-up + 4 timed steps (a smoke run)")
    p.add_argument("--profile", nargs="+", choices=SYSTEMS, default=None, help="also profile these (torch.profiler)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per process (default 3)")
    p.add_argument("--append-json", type=Path, nargs="+", default=[], help="follow-up runs to report as well")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the tests' shape
    p.add_argument("--worker", metavar="SYSTEM", help=argparse.SUPPRESS)
    protocol.add_protocol_options(p)
    args = p.parse_args(argv)
    args.shape = TINY if args.tiny else FULL
    args.systems = args.systems or [sy for name in args.sets for sy in systems_of(name)]

    if args.worker:
        worker(args.worker, args.shape, args.warmup, args.steps, args.threads)
        return
    if args.quick:
        args.repeats, args.warmup, args.steps, args.max_wait, args.retries = 1, 2, 4, 0, 0
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        data["rendered_by"] = " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])])
        args.shape = Shape(**data["meta"]["shape"])
        args.tiny = args.shape == TINY
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
