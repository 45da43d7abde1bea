"""Worker side of the benchmark: each runs in a fresh process, builds one system, times its
training steps and prints one JSON line. Imports torch (the parent never does)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchlib.common import BATCH, BETAS, DIM, EPS, HEADS, LAYERS, LR, MATMUL_N, SEQ, VOCAB, WEIGHT_DECAY, cpu_busy_s


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


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
            angle = torch.arange(SEQ).float()[:, None] * 10000.0 ** (-torch.arange(0, DIM, 2).float() / DIM)
            self.register_buffer("sinusoid", torch.stack((angle.sin(), angle.cos()), -1).flatten(1), persistent=False)
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
            elif pos == "sinusoidal":  # [S, D]: sin and cos interleaved
                x = x + self.sinusoid[:s]
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
    from xfam.config.specs import OptimSpec
    from xfam.model.build import build_model
    from xfam.training.lit.optim import make_optimizer

    cfg = xfam_config(pos)
    model = build_model(cfg, DATA_INFO)
    opt = make_optimizer(model, OptimSpec(**cfg["optim"]), total_steps, fused=True)  # as XfamLitModule at fp32
    return model, opt["optimizer"], opt["lr_scheduler"]["scheduler"]


def timed(call: Callable[[int], Any], n: int, warmup: int, profile: bool) -> tuple[list[float], dict, dict | None]:
    """Run ``call(i)`` for ``i < n`` and time each call. The CPU meter (and, with ``profile``, ``torch.profiler``)
    covers the calls after the first ``warmup``. Returns the times, the meter's reading and, when profiled, the
    op table of ``profile_ops``."""
    import torch

    times, meter, prof = [], CpuMeter(), None
    for i in range(n):
        if i == warmup:
            meter.start()
            if profile:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.__exit__(None, None, None)
    return times, meter.stop(), None if prof is None else profile_ops(prof, n - warmup)


def profile_ops(prof: Any, steps: int) -> dict[str, Any]:
    """Self CPU ms and calls per step of every op (``{op: [ms, calls]}``), and the optimiser step's total with
    its ops, from a finished ``torch.profiler`` run over ``steps`` steps."""
    ev = prof.key_averages()
    ops = {e.key: [round(e.self_cpu_time_total / 1e3 / steps, 3), e.count / steps] for e in ev if e.self_cpu_time_total}
    opt_ms = sum(e.cpu_time_total for e in ev if e.key.startswith("Optimizer.step")) / 1e3 / steps
    return {"ops": ops, "optimizer_ms": round(opt_ms, 3)}


def train_step(call: Any, opt: Any, sched: Any, batch: dict[str, Any], xfam: bool) -> float:
    """One training step of ``call`` on ``batch``: forward, cross-entropy, backward, optimizer (and scheduler) step;
    the loss. ``xfam``: ``call`` returns a ``ModelOutput`` (an ``XfamModel``), else the logits."""
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    out = call(batch["input_ids"])
    logits = out.logits if xfam else out
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    opt.step()
    if sched is not None:
        sched.step()
    return loss.item()


def run_plain(system: str, pos: str, warmup: int, steps: int, profile: bool = False) -> dict[str, Any]:
    """Build one system and time ``warmup + steps`` training steps in a plain loop.

    With ``profile``, the ``steps`` steps after the warm-up run under ``torch.profiler`` instead,
    and the result is each op's self CPU time per step.
    """

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
    losses = []

    def step(i: int) -> None:
        losses.append(train_step(model, opt, sched, batches[i % len(batches)], system == "xfam"))

    times, cpu, ops = timed(step, n, warmup, profile)
    if ops is None:
        return {**_result(model, times, losses, rss_before, warmup), **cpu}
    return {**ops, "step_s": statistics.median(times[warmup:]), **cpu}


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

    from xfam.training.lit.module import XfamLitModule

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
            importlib.import_module("xfam.model.build")
        if system.startswith("profile:"):
            res = run_plain(system.split(":", 1)[1], pos, warmup, steps, profile=True)
        elif system == "xfam_lightning":
            res = run_lightning(pos, warmup, steps)
        else:
            res = run_plain(system, pos, warmup, steps)
    res.update({"system": system, "pos": pos, "loadavg_start": load, "torch": torch.__version__})
    sys.stdout.flush()
    print(json.dumps(res), flush=True)
