#!/usr/bin/env python
"""Scale-out benchmark: per-rank memory of DDP against FSDP2, and single-file against sharded checkpoints.

Two measurements, side by side in one run, on CPU processes (gloo), 1 torch thread per process:

1. **Per-rank training state, DDP vs FSDP** (``--mem-dim``/``--mem-layers``; default width 512, 8 layers, vocab
   50304, tied embeddings): 2 ranks spawned with ``torch.multiprocessing`` (``MASTER_ADDR=127.0.0.1``, a free
   port) build the same xfam causal LM (``xfam.build_model``), wrap it in ``DistributedDataParallel`` or shard it
   with ``xfam.training.lit.fsdp.shard_model`` (FSDP2 ``fully_shard`` per block, then the root) over a 1-D mesh
   ``("data_parallel",)``, and run one training step (forward, cross-entropy, backward, ``torch.optim.AdamW``).
   Each rank then counts the bytes it holds: parameters, gradients (a DTensor: its ``to_local()`` shard), AdamW's
   ``exp_avg``/``exp_avg_sq`` and ``step``, and the buffers; its peak RSS (``getrusage``, Python and torch
   included) is reported beside.
2. **Checkpoint write/read, single file vs sharded folder** (``--ckpt-dim``/``--ckpt-layers``; default the GPT-2
   small shape, width 768, 12 layers, vocab 50304, tied: 124M parameters) after one AdamW step:

   * single file, in this process: ``{"state_dict", "optimizer_states", "xfam"}`` written by xfam's
     ``AtomicCheckpointIO.save_checkpoint`` (``torch.save`` to ``<path>.tmp``, its digest, fsync, rename; the
     digest is part of xfam's cost and is timed on its own too), read by ``torch.load(weights_only=True)`` (and
     xfam's digest check, ``verify``, timed on its own);
   * sharded, 2 FSDP ranks: ``get_model_state_dict``/``get_optimizer_state_dict`` and ``torch.distributed
     checkpoint.save`` into ``<path>.tmp``, each rank's digests of the shard files it wrote, then rank 0's
     ``xfam.model.checkpoint.seal`` (the digests into ``meta.pt``, fsync, rename) -- what ``trainer=fsdp``
     does per checkpoint without ``callbacks.async_save`` (not measured here); read by
     ``torch.distributed.checkpoint.load`` into the sharded state (in place), with rank 0's digest check
     (``xfam.model.checkpoint.read``) timed on its own;
   * assembling the full weights of the sharded folder in one process with no process group,
     ``xfam.model.sharded.full_state(folder, {"state_dict"})`` (what ``xfam convert`` and ``xfam eval`` do).

   Times are medians of ``--reps`` repetitions after ``--warmup``; each write goes to a new path under a temp
   folder in /tmp (removed at the end). Reads follow the write, so the bytes come from the page cache.

The report is a marked section of docs/benchmarks.md (kept when bench_train.py rewrites the file) and
docs/benchmarks_scaleout.png. On a shared 2-core machine the times are indicative.

    python scripts/bench_scaleout.py --quick                # tiny shapes, a check that everything runs (~30 s)
    python scripts/bench_scaleout.py --json scaleout.json   # the full run (~5 min); docs/benchmarks{.md,_scaleout.png}

One file over 400 lines: both measurements, their worker processes and the report are one protocol, read as a
whole, and docs/benchmarks.md cites this one command.

References: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``; Zhao et al., "PyTorch FSDP", VLDB 2023, and
ZeRO-3, Rajbhandari et al., SC 2020: parameters, gradients and optimizer state sharded over the data-parallel
ranks); PyTorch distributed checkpoint (``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import common
from benchlib.common import ROOT

START, END = "<!-- bench:scaleout:start -->", "<!-- bench:scaleout:end -->"
HEADING = "## Scale-out: DDP vs FSDP memory, checkpoint formats"
WORLD = 2  # ranks of the distributed parts
LR = 1e-3
MB = 2**20
#: Per-rank tensor categories, in table order; ``SHARDED_KINDS`` are the ones FSDP splits over the ranks.
KINDS = ("params", "grads", "adam_moments", "adam_step", "buffers")
SHARDED_KINDS = ("params", "grads", "adam_moments")
KIND_LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "adam_moments": "AdamW exp_avg + exp_avg_sq",
    "adam_step": "AdamW step",
    "buffers": "buffers",
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A GPT-like causal LM (pre-LayerNorm, GELU FFN 4x, learned positions, no biases) and its training batch
    per rank (``batch`` x ``seq`` tokens)."""

    vocab: int
    dim: int
    layers: int
    heads: int
    batch: int = 2
    seq: int = 128
    tie: bool = True


QUICK_MEM = Shape(vocab=1024, dim=64, layers=2, heads=2, batch=2, seq=32)
QUICK_CKPT = Shape(vocab=1024, dim=96, layers=2, heads=2, batch=2, seq=32)


def log(msg: str, started: float | None = None) -> None:
    prefix = f"[{time.perf_counter() - started:5.0f} s] " if started is not None else ""
    print(prefix + msg, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------- model, step, counting


def build(s: Shape):
    """xfam's decoder from a plain config, as ``train.py`` builds it (seeded: every rank and the single-file
    process start from the same weights)."""
    import torch

    from xfam.model.build import build_model

    model = {
        "name": "bench_scaleout",
        "dim": s.dim,
        "layers": s.layers,
        "heads": s.heads,
        "max_len": s.seq,
        "dropout": 0.0,
        "tie_embeddings": s.tie,
    }
    cfg = {
        "model": model,
        "attention": {"name": "vanilla", "backend": "auto", "dropout": 0.0},
        "pos": {"name": "learned"},
        "memory": {"name": "none"},
        "exit": {"name": "none"},
    }
    info = {"task": "lm", "vocab_size": s.vocab, "num_classes": None, "token_bytes": None, "fingerprint": "b"}
    torch.manual_seed(0)
    return build_model(cfg, info)


def train_step(model: Any, opt: Any, s: Shape) -> float:
    """One step on a fixed random batch (the same on every rank, so a sharded step equals the single-process one):
    forward, cross-entropy, backward, AdamW step; the gradients are kept (as before the next ``zero_grad``)."""
    import torch
    import torch.nn.functional as F

    rows = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=torch.Generator().manual_seed(0))  # [B, S + 1]
    logits = model(rows[:, :-1]).logits  # [B, S, V]
    loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()
    opt.step()
    return loss.item()


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(tensors: Any) -> int:
    """Bytes this process holds of ``tensors`` (a DTensor: its local shard)."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def held_bytes(model: Any, opt: Any) -> dict[str, int]:
    """Per category (``KINDS``), the bytes of training state this rank holds; tied parameters counted once."""
    import torch

    params = list(model.parameters())  # deduplicated: a tied matrix once
    states = list(opt.state.values())
    return {
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params if p.grad is not None),
        "adam_moments": nbytes(st[k] for st in states for k in ("exp_avg", "exp_avg_sq") if k in st),
        "adam_step": nbytes(st["step"] for st in states if isinstance(st.get("step"), torch.Tensor)),
        "buffers": nbytes(model.buffers()),
    }


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------- ranks (spawned)


def _rank(rank: int, mode: str, mem: Shape, ckpt: Shape | None, reps: int, warmup: int, tmp: str) -> None:
    """One of ``WORLD`` spawned processes: the memory measurement of ``mode`` (ddp | fsdp), then (fsdp, when
    ``ckpt``) the sharded-checkpoint timings; writes ``<tmp>/<mode>-<rank>.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import xfam.model.build  # noqa: F401  (before the RSS baseline: the model and its step only)
        import xfam.training.lit.fsdp  # noqa: F401

        res: dict[str, Any] = {"rank": rank, "rss_baseline_mb": round(_rss_now_mb(), 1)}
        res |= _memory(rank, mode, mem)
        if ckpt is not None:
            res["ckpt"] = _sharded_checkpoints(rank, ckpt, reps, warmup, Path(tmp))
        Path(tmp, f"{mode}-{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",))


def _memory(rank: int, mode: str, s: Shape) -> dict[str, Any]:
    """Build, wrap (DDP) or shard (FSDP), one step; the bytes held per category and the peak RSS."""
    import gc

    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from xfam.training.lit.fsdp import shard_model

    model = build(s)
    n_params = sum(p.numel() for p in model.parameters())
    units: list[str] = []
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)  # Lightning's defaults (no bucket views)
    else:
        units = shard_model(model, _mesh(), MixedPrecisionPolicy())
        wrapped = model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    t0 = time.perf_counter()
    loss = train_step(wrapped, opt, s)
    step_s = time.perf_counter() - t0
    res = {
        "mode": mode,
        "n_params": n_params,
        "units": len(units),
        "loss": round(loss, 4),
        "step_s": round(step_s, 3),
        "bytes": held_bytes(model, opt),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "rss_after_mb": round(_rss_now_mb(), 1),
    }
    if rank == 0:
        total = sum(res["bytes"].values()) / MB
        log(
            f"  {mode} rank 0: {n_params:,} params, tensors held {total:,.1f} MB, peak RSS {res['peak_rss_mb']:,.0f} MB"
        )
    del wrapped, model, opt
    gc.collect()
    return res


def _sharded_checkpoints(rank: int, s: Shape, reps: int, warmup: int, tmp: Path) -> dict[str, Any]:
    """FSDP model and AdamW after one step; ``warmup + reps`` sharded saves (DCP + xfam's ``seal``) and loads
    (xfam's digest check on rank 0, then DCP in place). Keeps the last folder, ``<tmp>/sharded/last.ckpt``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from xfam.model.checkpoint import CONFIG_VERSION, read, seal
    from xfam.model.sharded import rank_digests
    from xfam.training.lit.fsdp import shard_model

    model = build(s)
    n_params = sum(p.numel() for p in model.parameters())
    shard_model(model, _mesh(), MixedPrecisionPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train_step(model, opt, s)

    def state() -> dict[str, Any]:  # ShardedStrategy's layout (Lightning's keys)
        return {"state_dict": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, opt)}

    root = tmp / "sharded"
    t: dict[str, list[float]] = {"dcp_save": [], "seal": [], "digest_check": [], "dcp_load": []}
    for i in range(warmup + reps):
        path = root / ("last.ckpt" if i == warmup + reps - 1 else f"step-{i}.ckpt")
        part = path.with_name(path.name + ".tmp")
        if rank == 0:
            part.mkdir(parents=True)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state(), checkpoint_id=str(part))
        dist.barrier()
        t1 = time.perf_counter()
        # ShardedStrategy._seal: every rank hashes its own shards, rank 0 gathers them, writes meta.pt, renames
        digests: list = [None] * dist.get_world_size()
        dist.all_gather_object(digests, rank_digests(part, rank))
        if rank == 0:
            seal(
                part, path, {"xfam": {"config_version": CONFIG_VERSION}}, {k: v for d in digests for k, v in d.items()}
            )
        dist.barrier()
        t2 = time.perf_counter()
        if rank == 0:  # ShardedStrategy.load_checkpoint: rank 0 checks meta.pt's and every shard's digest first
            read(path)
        dist.barrier()
        t3 = time.perf_counter()
        loaded = state()
        dcp.load(loaded, checkpoint_id=str(path))  # into the sharded parameters and AdamW state, in place
        dist.barrier()
        t4 = time.perf_counter()
        if i >= warmup:
            for key, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                t[key].append(dt)
        if rank == 0:
            log(
                f"  sharded rep {i + 1}/{warmup + reps}{' (warm-up)' if i < warmup else ''}: "
                f"write {t2 - t0:.2f} s (of which digests {t2 - t1:.2f} s), read {t4 - t3:.2f} s "
                f"(+ digest check {t3 - t2:.2f} s)"
            )
            if path.name != "last.ckpt":
                shutil.rmtree(path)
        dist.barrier()
    files = {p.name: p.stat().st_size for p in (root / "last.ckpt").iterdir()} if rank == 0 else {}
    return {"n_params": n_params, "times": t, "files": files}


# ---------------------------------------------------------------------------------------- parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(mode: str, mem: Shape, ckpt: Shape | None, reps: int, warmup: int, tmp: Path) -> list[dict[str, Any]]:
    """``WORLD`` ranks of ``_rank`` (torch.multiprocessing, spawn); their JSON results."""
    import torch.multiprocessing as mp

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    mp.spawn(_rank, args=(mode, mem, ckpt, reps, warmup, str(tmp)), nprocs=WORLD, join=True)
    return [json.loads((tmp / f"{mode}-{r}.json").read_text()) for r in range(WORLD)]


def single_file(s: Shape, reps: int, warmup: int, tmp: Path, started: float) -> dict[str, Any]:
    """One process, the full model and AdamW after one step: xfam's atomic single-file write and its reads."""
    import torch

    from xfam.model.checkpoint import CONFIG_VERSION, digest, verify
    from xfam.training.lit.checkpoint import AtomicCheckpointIO

    model = build(s)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train_step(model, opt, s)
    io = AtomicCheckpointIO()
    t: dict[str, list[float]] = {"save": [], "digest": [], "load": [], "verify": []}
    path = tmp / "single" / "last.ckpt"
    size = 0
    for i in range(warmup + reps):
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        ckpt = {  # Lightning's keys for the weights and optimizer, and xfam's metadata
            "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()],
            "xfam": {"config_version": CONFIG_VERSION},
        }
        io.save_checkpoint(ckpt, path)  # torch.save + digest + fsync + rename
        t1 = time.perf_counter()
        digest(ckpt)  # the digest alone, again: the share of xfam's integrity check in the write
        t2 = time.perf_counter()
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        t3 = time.perf_counter()
        verify(loaded, path)  # xfam's check on every read: the digest of what was loaded
        t4 = time.perf_counter()
        size = path.stat().st_size
        del loaded
        if i >= warmup:
            for key, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                t[key].append(dt)
        log(
            f"single-file rep {i + 1}/{warmup + reps}{' (warm-up)' if i < warmup else ''}: write {t1 - t0:.2f} s "
            f"(of which digest ~{t2 - t1:.2f} s), read {t3 - t2:.2f} s (+ digest check {t4 - t3:.2f} s)",
            started,
        )
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"n_params": n_params, "times": t, "size": size, "_weights": weights}


def assemble(folder: Path, reps: int, warmup: int, reference: dict[str, Any], started: float) -> dict[str, Any]:
    """``full_state(folder, {"state_dict"})`` timed; the largest difference to the single-process weights."""
    from xfam.model.sharded import full_state

    times, full = [], {}
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        full = full_state(folder, {"state_dict"})["state_dict"]
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    diff = max(float((full[k] - v).abs().max()) for k, v in reference.items())
    log(
        f"full_state (full weights from the sharded folder): {median(times):.2f} s; max |sharded step - single "
        f"step| {diff:.2e}",
        started,
    )
    return {"times": times, "max_abs_diff": diff, "keys": len(full)}


def meta(args: argparse.Namespace) -> dict[str, Any]:
    from benchlib import protocol

    ns = argparse.Namespace(threads=1, quiet=None, max_wait=None, noisy=None, retries=None)
    m = protocol.machine_meta(ns)
    for key in ("quiet", "max_wait", "noisy", "retries", "x_transformers"):
        m.pop(key, None)
    return m | {"reps": args.reps, "warmup": args.warmup, "world": WORLD}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    data: dict[str, Any] = {"meta": meta(args), "mem_shape": dataclasses.asdict(args.mem)}
    load_start = os.getloadavg()[0]  # the machine is shared: how busy it was, beside the times
    data["ckpt_shape"] = dataclasses.asdict(args.ckpt)
    tmp = Path(tempfile.mkdtemp(prefix="xfam_bench_scaleout_", dir="/tmp"))
    try:
        log(
            f"DDP, {WORLD} ranks: per-rank memory after one step (width {args.mem.dim}, {args.mem.layers} layers)",
            started,
        )
        ddp = spawn("ddp", args.mem, None, args.reps, args.warmup, tmp)
        log(
            f"FSDP, {WORLD} ranks: per-rank memory, then sharded checkpoints (width {args.ckpt.dim}, "
            f"{args.ckpt.layers} layers)",
            started,
        )
        fsdp = spawn("fsdp", args.mem, args.ckpt, args.reps, args.warmup, tmp)
        data["memory"] = {"ddp": ddp, "fsdp": [{k: v for k, v in r.items() if k != "ckpt"} for r in fsdp]}
        sharded = fsdp[0]["ckpt"]
        sharded["rank_times"] = [r["ckpt"]["times"] for r in fsdp]
        sharded["size"] = sum(sharded["files"].values())
        log("single file, 1 process: write and read", started)
        single = single_file(args.ckpt, args.reps, args.warmup, tmp, started)
        reference = single.pop("_weights")
        full = assemble(tmp / "sharded" / "last.ckpt", args.reps, args.warmup, reference, started)
        data["ckpt"] = {"single": single, "sharded": sharded, "full_state": full}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    data["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    data["meta"]["loadavg"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    return data


# ---------------------------------------------------------------------------------------- report


def memory_rows(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{mode.upper()} rank {r['rank']}", r) for mode in ("ddp", "fsdp") for r in data["memory"][mode]]


def memory_ratios(data: dict[str, Any]) -> dict[str, float]:
    """FSDP / DDP per category (and the tensor total), bytes summed over the ranks."""
    m = data["memory"]
    tot = lambda mode, k: sum(r["bytes"][k] for r in m[mode])  # noqa: E731
    out = {k: tot("fsdp", k) / tot("ddp", k) if tot("ddp", k) else float("nan") for k in KINDS}
    out["total"] = sum(tot("fsdp", k) for k in KINDS) / sum(tot("ddp", k) for k in KINDS)
    out["peak_rss"] = sum(r["peak_rss_mb"] for r in m["fsdp"]) / sum(r["peak_rss_mb"] for r in m["ddp"])
    return out


def ckpt_samples(data: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Seconds per phase of every timed repetition, both formats and ``full_state``."""
    c = data["ckpt"]
    si, sh = c["single"]["times"], c["sharded"]["times"]
    return {
        "single": {"write": si["save"], "digest": si["digest"], "read": si["load"], "check": si["verify"]},
        "sharded": {
            "write": [a + b for a, b in zip(sh["dcp_save"], sh["seal"])],
            "digest": sh["seal"],
            "read": sh["dcp_load"],
            "check": sh["digest_check"],
        },
        "full_state": {"read": c["full_state"]["times"]},
    }


def ckpt_summary(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Median seconds per phase and size (MB) of both formats."""
    out = {fmt: {k: median(v) for k, v in phases.items()} for fmt, phases in ckpt_samples(data).items()}
    for fmt in ("single", "sharded"):
        out[fmt]["size_mb"] = data["ckpt"][fmt]["size"] / MB
    return out


def _cell(xs: list[float]) -> str:
    """Median (min-max) seconds."""
    return f"{median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"


def _size(n: int) -> str:
    return f"{n / MB:,.1f} MB" if n >= MB / 10 else f"{n / 1024:,.1f} KB"


def _shape_words(s: dict[str, Any], n: int) -> str:
    tie = "tied" if s["tie"] else "untied"
    return (
        f"width {s['dim']}, {s['layers']} layers, {s['heads']} heads, vocab {s['vocab']:,}, {tie} embeddings: "
        f"**{n:,} parameters**"
    )


def render_md(data: dict[str, Any], png: Path | None, md_path: Path) -> str:
    m, mem, cs, cx = data["meta"], data["memory"], ckpt_summary(data), ckpt_samples(data)
    c = data["ckpt"]
    ddp0, fsdp0 = mem["ddp"][0], mem["fsdp"][0]
    ms, ck = data["mem_shape"], data["ckpt_shape"]
    tied_mb = ck["vocab"] * ck["dim"] * 4 / MB  # fp32
    out = [
        f"Measured by `scripts/bench_scaleout.py` on {m['date']} (`{m['command']}`, {m['wall_s']:.0f} s).",
        "",
        f"* Machine and versions: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB; torch {m['torch']}, lightning "
        f"{m['lightning']}, xfam at commit {m['xfam_commit']}; 1 torch thread per process, CPU, gloo, {WORLD} ranks "
        "spawned by `torch.multiprocessing` (MASTER_ADDR=127.0.0.1, a free port). A shared machine: times are "
        "indicative"
        + (
            f" (1-minute load average {m['loadavg'][0]:.1f} at the start, {m['loadavg'][1]:.1f} at the end)."
            if "loadavg" in m
            else "."
        ),
        "* Model: xfam's decoder from a plain config (`xfam.build_model`: pre-LayerNorm, GELU FFN 4x, learned "
        "positions, no biases, dropout 0), fp32. One training step before measuring: forward on a fixed random "
        f"batch ({ms['batch']} x {ms['seq']} tokens per rank; the same batch on every rank), cross-entropy, "
        f"backward, `torch.optim.AdamW(lr={LR})` step; gradients kept.",
        "",
        "### Per-rank training state: DDP vs FSDP",
        "",
        f"Model: {_shape_words(ms, ddp0['n_params'])}. DDP: `DistributedDataParallel(model)` with its defaults. "
        f"FSDP: `xfam.training.lit.fsdp.shard_model(model, init_device_mesh('cpu', ({WORLD},), "
        f"mesh_dim_names=('data_parallel',)), MixedPrecisionPolicy())` ({fsdp0['units']} per-block units + the "
        "root). Bytes each rank holds after the step (a DTensor: its `to_local()` shard; a tied matrix once):",
        "",
    ]
    if png is not None:
        out += [f"![scale-out]({os.path.relpath(png, md_path.parent)})", ""]
    head = [KIND_LABELS[k] + " (MB)" for k in KINDS]
    out += [
        "| rank | " + " | ".join(head) + " | **tensors total (MB)** | peak RSS (MB, incl. Python/torch) |",
        "|---|" + "---:|" * (len(KINDS) + 2),
    ]
    for label, r in memory_rows(data):
        vals = [r["bytes"][k] / MB for k in KINDS]
        base = f" (after imports {r['rss_baseline_mb']:,.0f})"
        out.append(
            f"| {label} | " + " | ".join(f"{v:,.2f}" for v in vals) + f" | **{sum(vals):,.1f}** | "
            f"{r['peak_rss_mb']:,.0f}{base} |"
        )
    ra = memory_ratios(data)
    out.append(
        "| **FSDP / DDP** | "
        + " | ".join("-" if ra[k] != ra[k] else f"{ra[k]:.3f}" for k in KINDS)  # nan: none held under DDP
        + f" | **{ra['total']:.3f}** | "
        f"{ra['peak_rss']:.3f} |"
    )
    out += [
        "",
        f"* Sharded by FSDP ({' '.join('`' + KIND_LABELS[k] + '`' for k in SHARDED_KINDS)}): each rank holds 1/{WORLD} "
        f"of every parameter (dim-0 shards, the last padded), its gradient and AdamW's two moments; ratio "
        f"{ra['params']:.3f} / {ra['grads']:.3f} / {ra['adam_moments']:.3f}.",
        "* **Not sharded**: the buffers (every rank holds them whole, under DDP and FSDP alike; "
        + (f"{fsdp0['bytes']['buffers'] / MB:,.2f} MB here" if fsdp0["bytes"]["buffers"] else "none in this model")
        + ") and AdamW's `step` (a scalar tensor per parameter tensor, "
        "on every rank: FSDP keeps the same number of parameter tensors, so the ratio is 1; "
        f"{fsdp0['bytes']['adam_step']:,} bytes here).",
        "* Not in the tensor count: DDP's gradient buckets (with its default `gradient_as_bucket_view=False` the "
        "reducer keeps flat buckets beside `p.grad`, about one more copy of the gradients, for the all-reduce), "
        "FSDP's all-gather buffers of a unit during its forward and backward (freed after; the root unit holds the "
        "embedding and the head, the largest), and the activations. They show in the peak RSS, which also counts "
        "the Python interpreter, torch and xfam (the RSS after the imports is in brackets), so its ratio is not the "
        "tensors' ratio.",
        f"* Step time of that one step (rank 0, 1 thread; includes the first-call set-up): DDP "
        f"{ddp0['step_s']:.2f} s, FSDP {fsdp0['step_s']:.2f} s; loss {ddp0['loss']} / {fsdp0['loss']}.",
        "",
        "### Checkpoints: single file vs sharded folder",
        "",
        f"Model: {_shape_words(ck, c['single']['n_params'])}, with AdamW's state after one step. Medians of "
        f"{m['reps']} repetitions after {m['warmup']} warm-up (min-max in brackets); each write to a new path "
        "under /tmp (removed after).",
        "",
        "| format | size on disk (MB) | write (s) | of which xfam's digests (s) | read (s) | xfam's digest check "
        "before the read (s) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| single file (`AtomicCheckpointIO`, 1 process) | {cs['single']['size_mb']:,.1f} | "
        + " | ".join(_cell(cx["single"][k]) for k in ("write", "digest", "read", "check"))
        + " |",
        f"| sharded folder (DCP, {WORLD} FSDP ranks) | {cs['sharded']['size_mb']:,.1f} | "
        + " | ".join(_cell(cx["sharded"][k]) for k in ("write", "digest", "read", "check"))
        + " |",
        "| full weights from the sharded folder, 1 process (`full_state(folder, {'state_dict'})`) | - | - | - | "
        f"{_cell(cx['full_state']['read'])} | - |",
        "",
        "* Single file: the write is `AtomicCheckpointIO().save_checkpoint({'state_dict', 'optimizer_states', "
        "'xfam'}, path)`: `torch.save` to `<path>.tmp` with xfam's digest (blake2b over every tensor's bytes), "
        "fsync, rename; *of which* is one more `digest()` of the same dict timed alone. Read: `torch.load(path, "
        "weights_only=True)`; the check is xfam's `verify` (the digest again), which every xfam read runs.",
        "* Sharded: the write is `get_model_state_dict` + `get_optimizer_state_dict` + `torch.distributed."
        f"checkpoint.save` into `<path>.tmp` (each of the {WORLD} ranks writes its shards, fsynced by DCP), then "
        "each rank hashes (blake2b) the shard files it wrote, rank 0 gathers the digests and seals "
        "(`xfam.model.checkpoint.seal`: the digests into `meta.pt`, fsync, rename), as "
        "`ShardedStrategy.save_checkpoint` does without `callbacks.async_save` (not measured here) -- *of "
        "which* is that hashing and sealing. Read: "
        "`torch.distributed.checkpoint.load` into the sharded state dicts, which share storage with the "
        "parameters and AdamW's moments (loaded in place, no copy after); "
        "the check is rank 0's `xfam.model.checkpoint.read(path)` before it (meta.pt's digest and every shard's).",
        "* Files: single "
        + f"{_size(c['single']['size'])}; sharded "
        + ", ".join(f"`{k}` {_size(v)}" for k, v in sorted(c["sharded"]["files"].items()))
        + "."
        + (
            f" `torch.save` stores a tied matrix once (shared storage); DCP saves the weights by name, so the tied "
            f"embedding/output matrix is written twice (`embed.weight` and `head.weight`, {tied_mb:,.1f} MB more; "
            "AdamW's state has it once)."
            if ck["tie"]
            else ""
        ),
        f"* `full_state` assembles full tensors of the weights only ({c['full_state']['keys']} tensors) with no "
        "process group, what `xfam convert` and `xfam eval` do; they match the weights of the same step taken in "
        f"one process to {c['full_state']['max_abs_diff']:.1e} (max abs difference).",
        "* Reads follow the write of the same file, so they come from the page cache, not the disk; the write "
        "times include fsync to this machine's disk.",
    ]
    return "\n".join(out)


def render_png(data: dict[str, Any], path: Path) -> None:
    """Left: per-rank MB by category, DDP vs FSDP (peak RSS as a marker); right: checkpoint seconds by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.4))
    rows = memory_rows(data)
    bottom = [0.0] * len(rows)
    for i, k in enumerate(KINDS):
        vals = [r["bytes"][k] / MB for _, r in rows]
        a.bar(range(len(rows)), vals, bottom=bottom, color=f"C{i}", label=KIND_LABELS[k])
        bottom = [x + v for x, v in zip(bottom, vals)]
    a.scatter(
        range(len(rows)),
        [r["peak_rss_mb"] for _, r in rows],
        marker="_",
        s=400,
        color="k",
        zorder=3,
        label="peak RSS (incl. Python/torch)",
    )
    for x, y in enumerate(bottom):
        a.text(x, y, f"{y:,.0f}", ha="center", va="bottom", fontsize=8)
    a.set_xticks(range(len(rows)), [label.replace(" rank", "\nrank") for label, _ in rows], fontsize=8)
    a.set_ylabel("MB held per rank after one step")
    ms = data["mem_shape"]
    a.set_title(
        f"DDP vs FSDP, {WORLD} ranks: {data['memory']['ddp'][0]['n_params'] / 1e6:.1f}M params "
        f"(width {ms['dim']}, {ms['layers']} layers)",
        fontsize=9,
    )
    a.set_ylim(0, max(max(bottom), max(r["peak_rss_mb"] for _, r in rows)) * 1.45)
    a.legend(fontsize=7, loc="upper left", ncol=2)
    a.grid(axis="y", alpha=0.3)

    cs = ckpt_summary(data)
    labels = ["single file", f"sharded ({WORLD} ranks)", "full_state\n(1 process)"]
    write = [cs["single"]["write"], cs["sharded"]["write"], 0.0]
    digests = [cs["single"]["digest"], cs["sharded"]["digest"], 0.0]
    read = [cs["single"]["read"], cs["sharded"]["read"], cs["full_state"]["read"]]
    x = range(len(labels))
    b.bar([i - 0.2 for i in x], [w - d for w, d in zip(write, digests)], 0.4, color="C0", label="write")
    b.bar(
        [i - 0.2 for i in x],
        digests,
        0.4,
        bottom=[w - d for w, d in zip(write, digests)],
        color="C9",
        label="of which xfam's digests",
    )
    b.bar([i + 0.2 for i in x], read, 0.4, color="C3", label="read")
    for i, (w, r) in enumerate(zip(write, read)):
        if w:
            b.text(i - 0.2, w, f"{w:.2f}", ha="center", va="bottom", fontsize=8)
        b.text(i + 0.2, r, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    sizes = [cs["single"]["size_mb"], cs["sharded"]["size_mb"]]
    b.set_xticks(list(x), [f"{lab}\n{s:,.0f} MB" for lab, s in zip(labels, sizes)] + [labels[2]], fontsize=8)
    b.set_ylabel(f"seconds (median of {data['meta']['reps']})")
    b.set_title(f"Checkpoints: {data['ckpt']['single']['n_params'] / 1e6:.1f}M params + AdamW state", fontsize=9)
    b.legend(fontsize=7)
    b.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(data: dict[str, Any], md: Path, png: Path) -> None:
    """The chart and this benchmark's section of ``md`` (``benchlib.common.write_report``)."""
    chart = lambda path: render_png(data, path)  # noqa: E731
    common.write_report(md, png, (START, END), HEADING, chart, render_md(data, png, md))


def print_summary(data: dict[str, Any]) -> None:
    ra, cs = memory_ratios(data), ckpt_summary(data)
    for label, r in memory_rows(data):
        parts = "  ".join(f"{k} {r['bytes'][k] / MB:,.2f}" for k in KINDS)
        print(f"  {label:<12} {parts}  (MB)  peak RSS {r['peak_rss_mb']:,.0f} MB")
    print("  FSDP/DDP: " + "  ".join(f"{k} {ra[k]:.3f}" for k in (*KINDS, "total", "peak_rss")))
    for fmt in ("single", "sharded"):
        s = cs[fmt]
        print(
            f"  {fmt:<8} {s['size_mb']:,.1f} MB  write {s['write']:.2f} s (digests {s['digest']:.2f})  "
            f"read {s['read']:.2f} s (+ check {s['check']:.2f})"
        )
    print(f"  full_state {cs['full_state']['read']:.2f} s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary of both models (default 50304, GPT-2's)")
    p.add_argument("--mem-dim", type=int, default=512, help="width of the DDP/FSDP memory model (default 512)")
    p.add_argument("--mem-layers", type=int, default=8, help="layers of the memory model (default 8)")
    p.add_argument("--ckpt-dim", type=int, default=768, help="width of the checkpoint model (default 768)")
    p.add_argument("--ckpt-layers", type=int, default=12, help="layers of the checkpoint model (default 12)")
    p.add_argument("--untied", action="store_true", help="separate output layer (default: tied to the embedding)")
    p.add_argument("--reps", type=int, default=5, help="timed checkpoint repetitions (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="discarded checkpoint repetitions first (default 1)")
    p.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks.md", help="markdown report (its own section)")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks_scaleout.png", help="chart path")
    p.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="render the docs from saved raw results")
    p.add_argument("--no-docs", action="store_true", help="print the summary only; write no md/png")
    p.add_argument("--quick", action="store_true", help="tiny models (a check that everything runs, ~30 s)")
    args = p.parse_args(argv)
    tie = not args.untied
    heads = lambda d: max(1, d // 64)  # noqa: E731  (head dim 64)
    args.mem = Shape(args.vocab, args.mem_dim, args.mem_layers, heads(args.mem_dim), tie=tie)
    args.ckpt = Shape(args.vocab, args.ckpt_dim, args.ckpt_layers, heads(args.ckpt_dim), tie=tie)
    if args.quick:
        args.mem, args.ckpt = (dataclasses.replace(s, tie=tie) for s in (QUICK_MEM, QUICK_CKPT))
        args.reps, args.warmup = 3, 1

    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        data = run_all(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
    if not args.no_docs:
        write_report(data, args.md, args.png)
        print(f"wrote {args.md} (section {START}) and {args.png}")
    print_summary(data)


if __name__ == "__main__":
    main()
