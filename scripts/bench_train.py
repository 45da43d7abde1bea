#!/usr/bin/env python
"""Training-throughput benchmark: xfam against x-transformers and a minimal plain-PyTorch GPT.

Shape: vocab 256, width 256, 4 layers, 4 heads (head dim 64), batch 8 x 256 tokens, causal LM,
fp32, 2 torch threads. One training step = forward + cross-entropy + backward + AdamW step.

Systems (each measurement is a fresh worker process, ``--worker SYSTEM POS``, printing one JSON line):

* ``minimal``             -- a minimal GPT on ``F.scaled_dot_product_attention`` written below
                             (the yardstick: framework overhead should be ~0 relative to it);
* ``xtransformers``       -- ``x_transformers.TransformerWrapper`` + ``Decoder``, default attention;
* ``xtransformers_flash`` -- the same with ``attn_flash=True`` (SDPA);
* ``xfam``                -- ``XfamModel`` with xfam's own AdamW setup, in a plain loop;
* ``xfam_lightning``      -- ``XfamLitModule`` trained by ``lightning.Trainer`` (timed by a callback).

Protocol: for each positional encoding the systems alternate (A B C D E A B C D E ...) for
``--repeats`` rounds; each process times every step with ``time.perf_counter``, drops ``--warmup``
steps and takes the median of the next ``--steps``; the figure per system is the median over
rounds with the min-max spread. A matmul worker (2048^3 fp32, same thread count) runs at the start
of each round, for the model-FLOP-utilisation column. The parent process only orchestrates: it
never imports torch.

On a shared machine two threads on two cores are badly slowed by any other busy process, so the
parent waits for a quiet machine before each measurement (``--quiet``, ``--max-wait``) and reruns a
measurement during which other processes used more than ``--noisy`` cores (``--retries``).

    python scripts/bench_train.py --quick                 # a check that everything runs (~2 min)
    python scripts/bench_train.py --json run.json         # the full run (~20 min); docs/benchmarks.{md,png}
    python scripts/bench_train.py --systems minimal xfam --pos alibi --repeats 10 --no-docs --json ab.json
                                                          # a targeted follow-up (more rounds, fewer systems)
    python scripts/bench_train.py --from-json run.json --append-json ab.json --profile minimal xfam
                                                          # re-render with follow-ups and torch.profiler tables
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SYSTEMS = ("minimal", "xtransformers", "xtransformers_flash", "xfam", "xfam_lightning")
POS = ("learned", "rope", "alibi")
LABELS = {
    "minimal": "minimal (plain PyTorch)",
    "xtransformers": "x-transformers (default)",
    "xtransformers_flash": "x-transformers (attn_flash)",
    "xfam": "xfam (plain loop)",
    "xfam_lightning": "xfam (Lightning)",
}

# The benchmark shape and the optimiser settings shared by every system.
VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH = 256, 256, 4, 4, 256, 8
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1
MATMUL_N = 2048
#: Everything after this line of the markdown report is hand-written and kept when it is rewritten.
NOTES_MARKER = "<!-- hand-written notes: everything below this line is kept when bench_train.py rewrites the file -->"
ROOT = Path(__file__).resolve().parent.parent


def flops_per_step() -> dict[str, float]:
    """Model FLOPs of one training step (forward + backward = 3x forward; a multiply-add = 2 FLOPs).

    Dense: 6 * N_matmul * tokens, N_matmul = L * 12 D^2 (q/k/v, output, FFN 4x) + D * V (head);
    embedding lookups, norms, softmax and the optimizer are not counted. Attention: scores q k^T
    and probs @ v, 2 * 2 * S * D per token and layer forward, counted over the full S x S square
    (not halved for the causal mask), times 3 for training: 12 * L * S * D per token.
    """
    tokens = BATCH * SEQ
    n_matmul = LAYERS * 12 * DIM * DIM + DIM * VOCAB
    dense = 6 * n_matmul * tokens
    attention = 12 * LAYERS * SEQ * DIM * tokens
    return {"n_matmul": n_matmul, "dense": dense, "attention": attention, "total": dense + attention}


# =================================================================================================
# Worker side (runs in a fresh process; imports torch)
# =================================================================================================


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cpu_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, summed over cores (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = v[3] + v[4]  # idle + iowait
    return (sum(v[:8]) - idle) / hz, sum(v[:8]) / hz


class CpuMeter:
    """Cores used by *other* processes while this one runs: machine busy time minus our own."""

    def start(self) -> None:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.t0, self.own0, self.busy0 = time.perf_counter(), ru.ru_utime + ru.ru_stime, cpu_busy_s()[0]

    def stop(self) -> dict[str, float]:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.perf_counter() - self.t0
        own = ru.ru_utime + ru.ru_stime - self.own0
        busy = cpu_busy_s()[0] - self.busy0
        return {"own_cores": round(own / wall, 2), "foreign_cores": round(max(0.0, busy - own) / wall, 2)}


def _random_tokens(n_rows: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n_rows, SEQ + 1), generator=g)  # [N, S + 1]


def _batches(n: int) -> list[dict[str, Any]]:
    rows = _random_tokens(n * BATCH)
    return [
        {"input_ids": r[:, :-1].contiguous(), "labels": r[:, 1:].contiguous()} for r in rows.split(BATCH)
    ]  # xfam's batch format: input_ids / labels [B, S]


def build_minimal(pos: str):
    """A minimal pre-LayerNorm GPT on SDPA: the yardstick for framework overhead."""
    import math

    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(DIM, bias=False), nn.LayerNorm(DIM, bias=False)
            self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
            self.proj = nn.Linear(DIM, DIM, bias=False)
            self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)

        def forward(self, x, rope, mask):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(DIM, -1))
            if rope is not None:
                cos, sin = rope
                q = q * cos + torch.cat((-q[..., 32:], q[..., :32]), -1) * sin
                k = k * cos + torch.cat((-k[..., 32:], k[..., :32]), -1) * sin
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            x = x + self.proj(o.transpose(1, 2).reshape(b, s, DIM))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class MinimalGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, DIM)
            self.pos = nn.Embedding(SEQ, DIM) if pos == "learned" else None
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = nn.LayerNorm(DIM, bias=False)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            dh = DIM // HEADS
            self.register_buffer("inv_freq", 10000.0 ** (-torch.arange(0, dh, 2).float() / dh), persistent=False)
            start = 2.0 ** (-8.0 / HEADS)
            self.register_buffer("slopes", torch.tensor([start ** (i + 1) for i in range(HEADS)]), persistent=False)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
            for b in self.blocks:  # GPT-2 scaled residual init
                nn.init.normal_(b.proj.weight, std=0.02 / math.sqrt(2 * LAYERS))
                nn.init.normal_(b.fc2.weight, std=0.02 / math.sqrt(2 * LAYERS))

        def forward(self, idx):
            s = idx.shape[1]
            x = self.tok(idx)
            rope = mask = None
            if pos == "learned":
                x = x + self.pos.weight[:s]
            elif pos == "rope":
                f = torch.arange(s, dtype=torch.float32)[:, None] * self.inv_freq[None]  # [S, Dh/2]
                f = torch.cat((f, f), -1)
                rope = f.cos(), f.sin()
            elif pos == "alibi":
                i = torch.arange(s)
                dist = (i[:, None] - i[None, :]).float()  # [S, S], > 0 in the past
                mask = (-self.slopes[:, None, None] * dist).masked_fill(dist < 0, float("-inf"))[None]  # [1, H, S, S]
            for blk in self.blocks:
                x = blk(x, rope, mask)
            return self.head(self.norm(x))

    model = MinimalGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return model, opt, None


def build_xtransformers(pos: str, flash: bool):
    import torch
    from x_transformers import Decoder, TransformerWrapper

    layer_kw: dict[str, Any] = {"attn_flash": flash}
    wrap_kw: dict[str, Any] = {}
    if pos == "rope":
        layer_kw["rotary_pos_emb"] = True
        wrap_kw["use_abs_pos_emb"] = False
    elif pos == "alibi":
        layer_kw["alibi_pos_bias"] = True
        wrap_kw["use_abs_pos_emb"] = False
    model = TransformerWrapper(
        num_tokens=VOCAB,
        max_seq_len=SEQ,
        attn_layers=Decoder(dim=DIM, depth=LAYERS, heads=HEADS, **layer_kw),
        **wrap_kw,
    )
    # x-transformers has no optimiser of its own; its README trains with a plain torch optimiser.
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return model, opt, None


def xfam_config(pos: str) -> dict[str, Any]:
    """A plain resolved config as ``XfamLitModule`` takes it (the sections of configs/*.yaml)."""
    pos_cfg = {"learned": {"name": "learned"}, "rope": {"name": "rope", "base": 10000.0}}.get(
        pos, {"name": "alibi", "num_heads": None}
    )
    return {
        "model": {"name": "bench", "dim": DIM, "layers": LAYERS, "heads": HEADS, "max_len": SEQ},
        "attention": {"name": "vanilla", "backend": "auto", "dropout": 0.0},
        "pos": pos_cfg,
        "memory": {"name": "none"},
        "exit": {"name": "none"},
        "optim": {"lr": LR, "betas": list(BETAS), "eps": EPS},  # everything else: OptimSpec defaults
        "loader": {"streams": False, "num_workers": 0},
        "trainer": {"accelerator": "cpu", "devices": 1},
    }


DATA_INFO = {"task": "lm", "vocab_size": VOCAB, "num_classes": None, "token_bytes": None, "fingerprint": "bench"}


def build_xfam(pos: str, total_steps: int):
    from xfam.build import build_model
    from xfam.lit.optim import make_optimizer
    from xfam.specs import OptimSpec

    cfg = xfam_config(pos)
    model = build_model(cfg, DATA_INFO)
    opt = make_optimizer(model, OptimSpec(**cfg["optim"]), total_steps)
    return model, opt["optimizer"], opt["lr_scheduler"]["scheduler"]


def run_plain(system: str, pos: str, warmup: int, steps: int, profile: bool = False) -> dict[str, Any]:
    """Build one system and time ``warmup + steps`` training steps in a plain loop.

    With ``profile``, the ``steps`` steps after the warm-up run under ``torch.profiler`` instead,
    and the result is each op's self CPU time per step.
    """
    import contextlib

    import torch
    import torch.nn.functional as F

    n = warmup + steps
    batches = _batches(min(n, 8))  # a few distinct batches, cycled (same data for every system)
    rss_before = _rss_now_mb()
    if system == "minimal":
        model, opt, sched = build_minimal(pos)
    elif system.startswith("xtransformers"):
        model, opt, sched = build_xtransformers(pos, flash=system == "xtransformers_flash")
    else:
        model, opt, sched = build_xfam(pos, n)
    model.train()
    times, losses = [], []
    meter = CpuMeter()
    prof = contextlib.nullcontext()
    for i in range(n):
        if i == warmup:
            meter.start()
            if profile:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(batch["input_ids"])
        logits = out.logits if system == "xfam" else out  # XfamModel returns a ModelOutput
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if not profile:
        return {**_result(model, times, losses, rss_before, warmup), **meter.stop()}
    prof.__exit__(None, None, None)
    ops = {
        e.key: [round(e.self_cpu_time_total / 1e3 / steps, 3), e.count / steps]
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    }  # op -> [self CPU ms per step, calls per step]
    opt_ms = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("Optimizer.step")) / 1e3 / steps
    return {"ops": ops, "optimizer_ms": round(opt_ms, 3), "step_s": statistics.median(times[warmup:]), **meter.stop()}


def run_lightning(pos: str, warmup: int, steps: int) -> dict[str, Any]:
    """``XfamLitModule`` under ``lightning.Trainer``; a callback times the batches.

    A step is timed from one ``on_train_batch_start`` to the next (the loop's whole cycle: data
    fetch, training_step, backward, optimizer and scheduler step, logging); one extra step is run
    so the last timed step has an end. ``on_train_batch_start`` -> ``on_train_batch_end`` alone
    is recorded too (``inner_s``).
    """
    import logging
    import warnings

    import lightning as L
    import torch

    from xfam.lit.module import XfamLitModule

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    n = warmup + steps + 1
    rows = _random_tokens(n * BATCH)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            r = rows[i]
            return {"input_ids": r[:-1], "labels": r[1:]}

    class Timer(L.Callback):
        def __init__(self):
            self.starts, self.ends, self.losses = [], [], []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warmup:
                meter.start()
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())
            self.losses.append(float(outputs["loss"]))

    loader = torch.utils.data.DataLoader(Rows(), batch_size=BATCH, shuffle=False, num_workers=0)
    rss_before = _rss_now_mb()
    module = XfamLitModule(xfam_config(pos), DATA_INFO)
    timer, meter = Timer(), CpuMeter()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=n,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(module, train_dataloaders=loader)
    cycle = [b - a for a, b in zip(timer.starts, timer.starts[1:])]
    inner = [e - s for s, e in zip(timer.starts, timer.ends)][warmup : warmup + steps]
    res = _result(module.model, cycle, timer.losses[:-1], rss_before, warmup)
    res["inner_s"] = statistics.median(inner)
    return {**res, **meter.stop()}


def _result(model, times: list[float], losses: list[float], rss_before: float, warmup: int) -> dict[str, Any]:
    import resource

    import torch

    kept = times[warmup:]
    med = statistics.median(kept)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": med,
        "tokens_per_s": BATCH * SEQ / med,
        "times": [round(t, 5) for t in times],
        "rss_before_mb": round(rss_before, 1),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "threads": torch.get_num_threads(),
        "nivcsw": ru.ru_nivcsw,
        "minflt": ru.ru_minflt,
        "loadavg_end": os.getloadavg()[0],
    }


def run_matmul(repeats: int = 10) -> dict[str, Any]:
    import torch

    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    for _ in range(3):
        a @ b
    times = []
    meter = CpuMeter()
    meter.start()
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {
        "gflops": 2 * MATMUL_N**3 / med / 1e9,
        "times": [round(t, 5) for t in times],
        "threads": torch.get_num_threads(),
        **meter.stop(),
    }


def worker(system: str, pos: str, warmup: int, steps: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    if system == "matmul":
        res = run_matmul()
    else:
        import importlib

        # Import everything the system needs before the RSS baseline, so it counts only the model,
        # its gradients, optimizer state and activations.
        importlib.import_module("x_transformers" if "xtransformers" in system else "torch.nn")
        if "xfam" in system:
            importlib.import_module("xfam.build")
        if system.startswith("profile:"):
            res = run_plain(system.split(":", 1)[1], pos, warmup, steps, profile=True)
        elif system == "xfam_lightning":
            res = run_lightning(pos, warmup, steps)
        else:
            res = run_plain(system, pos, warmup, steps)
    res.update({"system": system, "pos": pos, "loadavg_start": load, "torch": torch.__version__})
    sys.stdout.flush()
    print(json.dumps(res), flush=True)


# =================================================================================================
# Parent side (orchestration and reporting; no torch)
# =================================================================================================


def foreign_load(interval: float = 1.0) -> float:
    """Cores busy over ``interval`` seconds; the parent is idle meanwhile, so it is all other work."""
    b0, t0 = cpu_busy_s()[0], time.perf_counter()
    time.sleep(interval)
    return (cpu_busy_s()[0] - b0) / (time.perf_counter() - t0)


def wait_for_quiet(args: argparse.Namespace) -> tuple[float, float]:
    """Wait (at most ``--max-wait`` s) until other processes use under ``--quiet`` cores for 2 s."""
    t0, calm = time.perf_counter(), 0
    load = foreign_load()
    while time.perf_counter() - t0 < args.max_wait:
        calm = calm + 1 if load < args.quiet else 0
        if calm >= 2:
            break
        load = foreign_load()
    return round(time.perf_counter() - t0, 1), round(load, 2)


def spawn(system: str, pos: str, args: argparse.Namespace, warmup: int, steps: int) -> dict[str, Any]:
    waited, load = wait_for_quiet(args) if args.max_wait > 0 else (0.0, float("nan"))
    env = dict(os.environ)
    t = str(args.threads)
    env.update({"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system, pos]
    cmd += ["--warmup", str(warmup), "--steps", str(steps), "--threads", t]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {system}/{pos} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1])
    res.update({"wall_s": round(time.perf_counter() - t0, 1), "waited_s": waited, "load_before": load})
    return res


def measure(
    system: str, pos: str, args: argparse.Namespace, label: str, rejected: list, warmup: int, steps: int
) -> dict[str, Any]:
    """One measurement in a fresh process; rerun (at most ``--retries`` times) while it was noisy."""
    for attempt in range(args.retries + 1):
        res = spawn(system, pos, args, warmup, steps)
        res["attempt"] = attempt
        noisy = res["foreign_cores"] > args.noisy and attempt < args.retries
        if system == "matmul":
            body = f"{res['gflops']:8.1f} GFLOP/s (2048^3 fp32)"
        else:
            body = f"{BATCH * SEQ / res['step_s']:8.0f} tok/s  step {res['step_s'] * 1e3:6.1f} ms"
            if "peak_rss_mb" in res:
                body += f"  peak RSS {res['peak_rss_mb']:5.0f} MB"
        tail = f"  others {res['foreign_cores']:.2f} cores (waited {res['waited_s']:.0f} s)  [{res['wall_s']:.0f} s]"
        print(f"{label} {system:<20}" + body + tail + ("  -> noisy, rerun" if noisy else ""), flush=True)
        if not noisy:
            return res
        rejected.append(res)
    return res


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    total = len(args.pos) * args.repeats * (len(args.systems) + 1)
    started = time.perf_counter()
    for pos in args.pos:
        for rep in range(args.repeats):
            for system in ("matmul", *args.systems):
                elapsed = time.perf_counter() - started
                label = f"[{len(runs) + 1:3d}/{total} {elapsed:5.0f} s] pos={pos:<7} rep {rep + 1}/{args.repeats}"
                res = measure(system, pos, args, label, rejected, args.warmup, args.steps)
                res["repeat"] = rep
                runs.append(res)
    return {"meta": meta(args), "runs": runs, "rejected": rejected}


def run_profiles(args: argparse.Namespace, poses: list[str]) -> list[dict[str, Any]]:
    """One ``torch.profiler`` worker per (pos, system) of ``--profile``: op self-times per step."""
    out, rejected = [], []
    for pos in poses:
        for system in args.profile:
            label = f"[profile] pos={pos:<7}"
            res = measure(f"profile:{system}", pos, args, label, rejected, args.warmup, args.profile_steps)
            res.update({"system": system, "pos": pos, "steps": args.profile_steps})
            out.append(res)
    return out


def meta(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import version

    def ver(name: str) -> str:
        try:
            return version(name)
        except Exception:
            return "?"

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "xfam"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    )
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": ver("torch"),
        "lightning": ver("lightning"),
        "x_transformers": ver("x-transformers"),
        "xfam_commit": commit + (" (xfam/ has uncommitted changes)" if dirty else ""),
        "threads": args.threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "steps": args.steps,
        "quiet": args.quiet,
        "max_wait": args.max_wait,
        "noisy": args.noisy,
        "retries": args.retries,
        "systems": list(args.systems),
        "pos": list(args.pos),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


# -- reporting ------------------------------------------------------------------------------------


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per (pos, system): median / min / max tokens/s over repeats, memory, params; per-round ratios."""
    runs, m = data["runs"], data["meta"]
    matmul = [r["gflops"] for r in runs if r["system"] == "matmul"]
    rate = statistics.median(matmul) * 1e9 if matmul else float("nan")
    fl = flops_per_step()
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for pos in m["pos"]:
        for s in m["systems"]:
            rs = [r for r in runs if r["system"] == s and r["pos"] == pos]
            if not rs:
                continue
            tps = [r["tokens_per_s"] for r in rs]
            med = statistics.median(tps)
            step = BATCH * SEQ / med
            table[pos, s] = {
                "tps": med,
                "min": min(tps),
                "max": max(tps),
                "all": tps,
                "step_ms": step * 1e3,
                "params": rs[0]["params"],
                "peak_mb": statistics.median(r["peak_rss_mb"] for r in rs),
                "delta_mb": statistics.median(r["peak_rss_mb"] - r["rss_before_mb"] for r in rs),
                "mfu": fl["total"] / step / rate,
                "inner_ms": statistics.median(r["inner_s"] for r in rs) * 1e3 if "inner_s" in rs[0] else None,
            }
    return {"table": table, "matmul": matmul, "rate": rate, "flops": fl}


RATIOS = (
    ("xfam", "xtransformers", "xfam / x-transformers default", 1.10),
    ("xfam", "xtransformers_flash", "xfam / x-transformers attn_flash", 1.00),
    ("xfam", "minimal", "xfam / minimal", 0.97),
    ("xfam_lightning", "xfam", "xfam Lightning / xfam plain loop", None),
)


def ratios(data: dict[str, Any], pos: str, a: str, b: str) -> tuple[float, float, float, float] | None:
    """Ratio of the medians, min and max of the per-round ratios (a and b measured in the same
    round), and the ratio of the best runs (max tokens/s) of each."""
    runs = data["runs"]
    get = lambda s: {r["repeat"]: r["tokens_per_s"] for r in runs if r["system"] == s and r["pos"] == pos}  # noqa: E731
    ra, rb = get(a), get(b)
    if not ra or not rb:
        return None
    per_round = [ra[k] / rb[k] for k in ra if k in rb]
    med = statistics.median(ra.values()) / statistics.median(rb.values())
    return med, min(per_round), max(per_round), max(ra.values()) / max(rb.values())


def render_md(data: dict[str, Any], summary: dict[str, Any], png: Path | None, md_path: Path) -> str:
    m, tab, fl = data["meta"], summary["table"], summary["flops"]
    out = ["# Training throughput: xfam vs x-transformers vs a minimal PyTorch GPT", ""]
    out += [
        f"Measured by `scripts/bench_train.py` on {m['date']} (`{m['command']}`)"
        + (f"; rendered by `{data['rendered_by']}`." if data.get("rendered_by") else "."),
        "",
        "## Setup",
        "",
        f"* Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB RAM; {m['os']}.",
        f"* Versions: Python {m['python']}, torch {m['torch']}, lightning {m['lightning']}, "
        f"x-transformers {m['x_transformers']}, xfam at commit {m['xfam_commit']}.",
        f"* Threads: `torch.set_num_threads({m['threads']})` in every worker, and "
        f"`OMP_NUM_THREADS={m['threads']} MKL_NUM_THREADS={m['threads']}` in its environment.",
        f"* Model: vocab {VOCAB}, width {DIM}, {LAYERS} layers, {HEADS} heads (head dim {DIM // HEADS}), FFN 4x GELU, "
        f"pre-LayerNorm, causal LM; batch {BATCH} x {SEQ} tokens ({BATCH * SEQ} tokens per step), fp32, CPU.",
        f"* One step: `zero_grad`, forward, cross-entropy (mean over tokens), backward, AdamW step "
        f"(lr {LR}, betas {BETAS}, eps {EPS}). Weight decay as each system does it: minimal and "
        f"x-transformers `AdamW(model.parameters(), weight_decay={WEIGHT_DECAY})` (x-transformers has no "
        f"optimiser of its own); xfam `xfam.lit.optim.make_optimizer` with `OptimSpec()` defaults "
        f"(decay {WEIGHT_DECAY} on weight matrices only, warmup + cosine `LambdaLR` stepped every step).",
        "* Systems:",
        "  * **minimal**: the ~60-line plain-PyTorch GPT inside the script: fused q/k/v Linear (no bias), "
        "`F.scaled_dot_product_attention` (`is_causal=True`; ALiBi as one additive float mask "
        "`[1, H, S, S]` with the causal -inf folded in, built once per forward; RoPE as a rotate-half "
        "rotation of q and k with cos/sin built once per forward), GELU FFN (no bias), final LayerNorm, "
        "untied head. The yardstick.",
        "  * **x-transformers (default)**: `TransformerWrapper(num_tokens=256, max_seq_len=256, "
        "attn_layers=Decoder(dim=256, depth=4, heads=4, ...))`; learned = its default absolute "
        "embedding, rope = `rotary_pos_emb=True, use_abs_pos_emb=False`, alibi = `alibi_pos_bias=True, "
        "use_abs_pos_emb=False`. Default attention: explicit einsum scores. Note that its RoPE rotates "
        "only half of each head's channels by default (`rotary_emb_dim = dim_head // 2` = 32, partial "
        "rotary as in GPT-J), where xfam and minimal rotate all 64.",
        "  * **x-transformers (attn_flash)**: the same with `attn_flash=True` (SDPA).",
        "  * **xfam (plain loop)**: `XfamModel(ModelSpec(dim=256, layers=4, heads=4, max_len=256), task='lm', "
        "attention={name: vanilla, backend: auto}, pos={name: POS, defaults}, memory=none, exit=none)` "
        "with xfam's own optimiser setup, trained in the same plain loop as the others.",
        "  * **xfam (Lightning)**: `XfamLitModule(config, data_info)` under `lightning.Trainer(accelerator='cpu', "
        "devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, "
        "enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)` on an in-memory "
        "DataLoader (batch size 8, default collate) of random-token rows in xfam's batch format. A callback "
        "times a step from one `on_train_batch_start` to the next: the loop's whole cycle (data fetch, "
        "`training_step` with xfam's metrics, backward, optimizer and scheduler step, `self.log`).",
        "",
        "## Protocol",
        "",
        f"* Every measurement is a fresh process (`python scripts/bench_train.py --worker SYSTEM POS`, one "
        f"JSON line out). For each positional encoding the systems alternate (A B C D E A B C D E ...) "
        f"for {m['repeats']} rounds.",
        f"* In a process every step is timed with `time.perf_counter`; the first {m['warmup']} steps are "
        f"discarded and the median of the next {m['steps']} is that run's step time. The figure per "
        f"system is the median over rounds; the spread is the min-max over rounds.",
        "* Ratios are ratios of those medians; their spread is the min-max of the per-round ratios "
        "(two systems measured back to back in the same round).",
        "* Memory: peak RSS of the worker (`resource.getrusage(RUSAGE_SELF).ru_maxrss`), and its increase "
        "over the RSS measured just before the model was built (all libraries already imported, the "
        "batches already made): parameters, gradients, AdamW state, activations, allocator slack. The "
        "increase is only comparable between plain-loop workers: the Lightning worker imports more before "
        "its baseline and reuses heap memory those imports freed.",
        f"* Matmul rate: a {MATMUL_N}^3 fp32 `a @ b` with the same thread count, median of 10 after 3 "
        f"warm-up calls, in a fresh process at the start of every round: median "
        f"{summary['rate'] / 1e9:.1f} GFLOP/s (min {min(summary['matmul']):.1f}, max {max(summary['matmul']):.1f}).",
        f"* Model FLOPs per step (`flops_per_step()` in the script): dense 6 * N_matmul * tokens with "
        f"N_matmul = L * 12 D^2 + D * V = {fl['n_matmul']:,} (q/k/v, output, FFN, head; embeddings, "
        f"norms, softmax, optimiser not counted) -> {fl['dense'] / 1e9:.2f} GFLOP; attention scores and "
        f"values 2 * 2 * S * D per token and layer forward, full S x S (not halved for causality), "
        f"x3 for forward + backward = 12 * L * S * D * tokens -> {fl['attention'] / 1e9:.2f} GFLOP; "
        f"total {fl['total'] / 1e9:.2f} GFLOP per step. MFU = model FLOPs per step / step time / matmul rate.",
        f"* The machine was shared with other jobs (tests of other engineers). Two threads on two cores "
        f"are badly hurt by any other busy process (a step went from ~0.3 s to 1.5-2 s), so before each "
        f"measurement the parent waited (at most {m.get('max_wait', '?')} s) until other processes used "
        f"< {m.get('quiet', '?')} cores for 2 s, and each worker measured the cores used by other "
        f"processes during its timed steps (machine busy time from /proc/stat minus its own CPU time); a "
        f"measurement with > {m.get('noisy', '?')} such cores was rerun, at most {m.get('retries', '?')} "
        f"times. {len(data.get('rejected', []))} measurements were rerun; the raw results list the others' "
        f"load of every kept run.",
        "",
    ]
    # -- main table
    out += ["## Results", ""]
    if png is not None:
        out += [f"![throughput]({os.path.relpath(png, md_path.parent)})", ""]
    out += [
        "| pos | system | tokens/s (median) | min-max | vs minimal | step (ms) | params | peak RSS (MB) "
        "| RSS increase (MB) | MFU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for pos in m["pos"]:
        base = tab.get((pos, "minimal"))
        for s in m["systems"]:
            if (pos, s) not in tab:
                continue
            t = tab[pos, s]
            rel = f"{t['tps'] / base['tps']:.3f}" if base else "-"
            out.append(
                f"| {pos} | {LABELS[s]} | {t['tps']:,.0f} | {t['min']:,.0f}-{t['max']:,.0f} | {rel} | "
                f"{t['step_ms']:.0f} | {t['params']:,} | {t['peak_mb']:.0f} | {t['delta_mb']:.0f} | {t['mfu']:.0%} |"
            )
    out.append("")
    # -- ratios and targets
    out += [
        "## Ratios and targets",
        "",
        "Targets: xfam >= 1.10x x-transformers default, >= 1.00x x-transformers attn_flash, and within 3% of "
        "the minimal model with the same pos (>= 0.97x). Each cell: ratio of the medians (the figure the "
        "targets are judged on), [min-max of the per-round ratios], and the ratio of the two systems' best "
        "runs (a second estimator, less sensitive to a slow process).",
        "",
        "| pos | " + " | ".join(label for _, _, label, _ in RATIOS) + " |",
        "|---|" + "---:|" * len(RATIOS),
    ]
    verdicts = []
    for pos in m["pos"]:
        cells = []
        for a, b, label, target in RATIOS:
            r = ratios(data, pos, a, b)
            if r is None:
                cells.append("-")
                continue
            cell = f"{r[0]:.3f} [{r[1]:.3f}-{r[2]:.3f}], best {r[3]:.3f}"
            if target is not None:
                ok = r[0] >= target
                cell += "; met" if ok else "; **not met**"
                verdicts.append((pos, label, target, r, ok))
            cells.append(cell)
        out.append(f"| {pos} | " + " | ".join(cells) + " |")
    out.append("")
    if verdicts:
        n_ok = sum(v[-1] for v in verdicts)
        out.append(f"{n_ok} of {len(verdicts)} targets met:")
        out.append("")
        for pos, label, target, r, ok in verdicts:
            out.append(
                f"* pos={pos}, {label} = {r[0]:.3f} (per round {r[1]:.3f}-{r[2]:.3f}), target >= {target:.2f}: "
                + ("**met**" if ok else "**not met**")
            )
        out.append("")
    # -- noise
    spreads = sorted((t["max"] - t["min"]) / t["tps"] for t in tab.values())
    if spreads and m["repeats"] > 1:
        out += [
            f"Run-to-run noise: the min-max spread of one system over its {m['repeats']} rounds is "
            f"{statistics.median(spreads):.1%} of its median (median over all pos x system; largest "
            f"{spreads[-1]:.1%}), even with no other process busy: this virtual machine shows a fast and a "
            f"slow mode per process (~0.30 s and ~0.32 s per step for the same model). A difference of a few "
            f"percent between two systems is therefore not resolved by one such run; see the follow-up runs "
            f"and the profiles below.",
            "",
        ]
    out += render_followups(data)
    out += render_profiles(data)
    # -- parameters
    out += ["## Parameter counts", ""]
    out += ["| pos | " + " | ".join(LABELS[s] for s in m["systems"]) + " |", "|---|" + "---:|" * len(m["systems"])]
    for pos in m["pos"]:
        out.append(
            f"| {pos} | "
            + " | ".join(f"{tab[pos, s]['params']:,}" if (pos, s) in tab else "-" for s in m["systems"])
            + " |"
        )
    out += [
        "",
        "minimal and xfam have identical parameters (no Linear biases, LayerNorm gains without bias, untied "
        "head). x-transformers has the same matrices (its q, k, v are three separate Linears rather than one "
        "fused one; its LayerNorm is a bias-free norm times a learned gain) plus biases in its FFN Linears: "
        "4 layers * (1024 + 256) = 5,120 more. Its absolute position table (pos=learned) is 256 x 256 like "
        "the others' (65,536). RoPE and ALiBi have no parameters.",
        "",
    ]
    if any(t["inner_ms"] is not None for t in tab.values()):
        out += ["## Lightning step breakdown", ""]
        for pos in m["pos"]:
            t = tab.get((pos, "xfam_lightning"))
            if t and t["inner_ms"] is not None:
                out.append(
                    f"* pos={pos}: whole cycle {t['step_ms']:.1f} ms, of which `on_train_batch_start` -> "
                    f"`on_train_batch_end` {t['inner_ms']:.1f} ms."
                )
        out.append("")
    # -- raw
    out += [
        "## Raw results",
        "",
        "tokens/s of every kept run in round order (cores used by other processes during its timed steps):",
        "",
    ]
    for pos in m["pos"]:
        for s in ("matmul", *m["systems"]):
            rs = [r for r in data["runs"] if r["system"] == s and r["pos"] == pos]
            if not rs:
                continue
            key = "gflops" if s == "matmul" else "tokens_per_s"
            unit = " GFLOP/s" if s == "matmul" else ""
            vals = ", ".join(f"{r[key]:,.0f}{unit} ({r['foreign_cores']:.2f})" for r in rs)
            out.append(f"* {pos} / {s}: {vals}")
    out.append("")
    return "\n".join(out)


def render_followups(data: dict[str, Any]) -> list[str]:
    """Targeted reruns (``--append-json``): more rounds of a few systems, same protocol."""
    out = []
    for f in data.get("followups", []):
        fm, ft = f["meta"], summarize(f)["table"]
        if not out:
            out += ["## Follow-up runs", ""]
        out += [
            f"`{fm['command']}` ({fm['date']}): {fm['repeats']} rounds of {', '.join(fm['systems'])}; "
            f"{fm['warmup']} warm-up + {fm['steps']} timed steps per process, same protocol.",
            "",
            "| pos | system | tokens/s (median) | min-max |",
            "|---|---|---:|---:|",
        ]
        for pos in fm["pos"]:
            for sy in fm["systems"]:
                if (pos, sy) in ft:
                    t = ft[pos, sy]
                    out.append(f"| {pos} | {LABELS[sy]} | {t['tps']:,.0f} | {t['min']:,.0f}-{t['max']:,.0f} |")
        out.append("")
        for pos in fm["pos"]:
            for a, b, label, target in RATIOS:
                r = ratios(f, pos, a, b)
                if r:
                    ok = "met" if target is not None and r[0] >= target else "not met"
                    verdict = "" if target is None else f" (target >= {target:.2f}: {ok})"
                    out.append(
                        f"* pos={pos}, {label} = {r[0]:.3f} (per round {r[1]:.3f}-{r[2]:.3f}, best runs "
                        f"{r[3]:.3f}){verdict}"
                    )
        out.append("")
    return out


def render_profiles(data: dict[str, Any], top: int = 14) -> list[str]:
    """Self CPU time per op and step (``torch.profiler``), one process per system and pos."""
    profs = data.get("profiles", [])
    if not profs:
        return []
    out = [
        "## Where the time goes (torch.profiler)",
        "",
        f"One process per system and pos, {profs[0].get('steps', '?')} profiled steps after "
        f"{data['meta']['warmup']} warm-up steps; self CPU time per step in ms (calls per step). The "
        "profiler adds a little time to every op call.",
        "",
    ]
    for pos in dict.fromkeys(p["pos"] for p in profs):
        rows = [p for p in profs if p["pos"] == pos]
        names = sorted(
            {k for p in rows for k in p["ops"]}, key=lambda k: -max(p["ops"].get(k, [0, 0])[0] for p in rows)
        )
        out += [f"pos={pos}:", "", "| op | " + " | ".join(LABELS[p["system"]] for p in rows) + " |"]
        out.append("|---|" + "---:|" * len(rows))
        for k in names[:top]:
            cells = [f"{p['ops'][k][0]:.1f} ({p['ops'][k][1]:g})" if k in p["ops"] else "-" for p in rows]
            out.append(f"| `{k[:60]}` | " + " | ".join(cells) + " |")
        other = [sum(v[0] for kk, v in p["ops"].items() if kk not in names[:top]) for p in rows]
        out.append("| all other ops | " + " | ".join(f"{o:.1f}" for o in other) + " |")
        total = [sum(v[0] for v in p["ops"].values()) for p in rows]
        out.append("| **total self CPU** | " + " | ".join(f"**{t:.1f}**" for t in total) + " |")
        out.append(
            "| of which AdamW `step()` with all its ops | "
            + " | ".join(f"{p['optimizer_ms']:.1f}" if "optimizer_ms" in p else "-" for p in rows)
            + " |"
        )
        out.append("")
    return out


def render_png(data: dict[str, Any], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, tab = data["meta"], summary["table"]
    systems, poses = m["systems"], m["pos"]
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(10, 5))
    for j, s in enumerate(systems):
        xs, ys, lo, hi = [], [], [], []
        for i, pos in enumerate(poses):
            if (pos, s) in tab:
                t = tab[pos, s]
                xs.append(i + (j - (len(systems) - 1) / 2) * width)
                ys.append(t["tps"])
                lo.append(t["tps"] - t["min"])
                hi.append(t["max"] - t["tps"])
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=LABELS[s])
        ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7, rotation=90, padding=4)
    ax.set_xticks(range(len(poses)), [f"pos={p}" for p in poses])
    ax.set_ylabel("tokens / s (median; bars: min-max over rounds)")
    ax.set_title(
        f"Training throughput, width {DIM}, {LAYERS} layers, batch {BATCH}x{SEQ}, fp32, "
        f"{m['threads']} CPU threads ({m['repeats']} rounds)"
    )
    top = max(t["max"] for t in tab.values())
    ax.set_ylim(0, top * 1.25)
    ax.legend(loc="upper center", ncol=3, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="rounds of A B C D E per pos (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per process (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="discarded steps per process (default 5)")
    p.add_argument("--pos", nargs="+", choices=POS, default=list(POS), help="positional encodings")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems, in round order")
    p.add_argument("--threads", type=int, default=2, help="torch/OMP/MKL threads per worker (default 2)")
    p.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks.md", help="markdown report path")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks.png", help="chart path")
    p.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="render the docs from saved raw results")
    p.add_argument("--no-docs", action="store_true", help="print the summary only; write no md/png")
    p.add_argument("--quick", action="store_true", help="1 round, 2 warm-up + 4 timed steps (a smoke run)")
    p.add_argument(
        "--quiet", type=float, default=0.25, help="before each run, wait until other processes use < this many cores"
    )
    p.add_argument("--max-wait", type=float, default=600, help="longest wait for --quiet, seconds (0: never wait)")
    p.add_argument(
        "--noisy", type=float, default=0.3, help="rerun a measurement if other processes used > this many cores"
    )
    p.add_argument("--retries", type=int, default=5, help="reruns of a noisy measurement (default 5)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per worker process")
    p.add_argument(
        "--profile",
        nargs="*",
        choices=[x for x in SYSTEMS if x != "xfam_lightning"],
        default=None,
        help="also profile these systems (torch.profiler, one process per pos; bare --profile: minimal xfam)",
    )
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per process (default 3)")
    p.add_argument(
        "--append-json", type=Path, nargs="+", default=[], help="saved results of follow-up runs to report as well"
    )
    p.add_argument("--worker", nargs=2, metavar=("SYSTEM", "POS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        worker(args.worker[0], args.worker[1], args.warmup, args.steps, args.threads)
        return
    if args.quick:
        args.repeats, args.warmup, args.steps, args.max_wait, args.retries = 1, 2, 4, 0, 0
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        data["rendered_by"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    else:
        data = run_all(args)
    if args.profile is not None:
        args.profile = args.profile or ["minimal", "xfam"]
        data["profiles"] = run_profiles(args, data["meta"]["pos"])
    if args.append_json:
        data["followups"] = [json.loads(f.read_text()) for f in args.append_json]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
    summary = summarize(data)
    if not args.no_docs:
        png = args.png
        for path in (args.md, png):
            path.parent.mkdir(parents=True, exist_ok=True)
        render_png(data, summary, png)
        text = render_md(data, summary, png, args.md)
        if args.md.exists() and NOTES_MARKER in args.md.read_text():  # keep hand-written notes
            text += "\n" + NOTES_MARKER + args.md.read_text().split(NOTES_MARKER, 1)[1]
        args.md.write_text(text)
        print(f"wrote {args.md} and {png}")
    for pos in data["meta"]["pos"]:
        line = [f"pos={pos:<7}"] + [
            f"{s}={summary['table'][pos, s]['tps']:,.0f}"
            for s in data["meta"]["systems"]
            if (pos, s) in summary["table"]
        ]
        print("  ".join(line))
        for a, b, label, target in RATIOS:
            r = ratios(data, pos, a, b)
            if r:
                print(f"    {label}: {r[0]:.3f} [{r[1]:.3f}-{r[2]:.3f}]" + (f" target >= {target}" if target else ""))


if __name__ == "__main__":
    main()
