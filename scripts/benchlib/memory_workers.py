"""Worker side of ``scripts/bench_memory_models.py``: one memory model trained on a stream of segments, each
step's memory fed to the next, timed as ``benchlib.workers`` times the plain models. Imports torch.

Systems (the shape of ``benchlib.common``: vocab 256, width 256, 4 layers, 4 heads, batch 8 x segment 256, fp32):

* ``xfam_xl``           -- ``memory=xl mem_len=256``;
* ``xfam_compressive``  -- ``memory=compressive mem_len=256`` with its defaults (128 compressed slots, rate 3,
                           a learned convolution trained by the attention-reconstruction loss, added to the loss);
* ``xtransformers_xl``  -- ``TransformerWrapper(..., max_mem_len=256)`` called with ``return_mems=True`` and the
                           previous step's ``mems`` (detached by x-transformers).

Positions: relative score biases in both libraries, T5's bucketed bias (32 buckets, max distance 128):
xfam ``pos=t5``, x-transformers ``rel_pos_bias=True`` without absolute embeddings.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from benchlib.common import BETAS, DIM, EPS, HEADS, LAYERS, LR, SEQ, VOCAB, WEIGHT_DECAY
from benchlib.workers import DATA_INFO, _batches, _result, _rss_now_mb, profile_ops, timed, xfam_config

MEM_LEN = 256
SYSTEMS = ("xfam_xl", "xfam_compressive", "xtransformers_xl")
LABELS = {
    "xfam_xl": "xfam memory=xl",
    "xfam_compressive": "xfam memory=compressive",
    "xtransformers_xl": "x-transformers max_mem_len",
}


def memory_config(system: str) -> dict[str, Any]:
    """The run config of an xfam system: bench_train's plain config with T5 positions and the memory."""
    cfg = xfam_config("learned")
    cfg["pos"] = {"name": "t5", "num_buckets": 32, "max_distance": 128}
    cfg["memory"] = {"name": system.split("_", 1)[1], "mem_len": MEM_LEN}
    cfg["loader"]["streams"] = True
    return cfg


def build(system: str, total_steps: int):
    """``(model, optimizer, scheduler, step_call)``; ``step_call(ids, state) -> (logits, aux_loss, state)``."""
    import torch

    if system == "xtransformers_xl":
        from x_transformers import Decoder, TransformerWrapper

        model = TransformerWrapper(
            num_tokens=VOCAB,
            max_seq_len=SEQ,
            max_mem_len=MEM_LEN,
            use_abs_pos_emb=False,
            attn_layers=Decoder(dim=DIM, depth=LAYERS, heads=HEADS, rel_pos_bias=True),
        )
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

        def call(ids, mems):
            logits, mems = model(ids, mems=mems, return_mems=True)
            return logits, None, mems

        return model, opt, None, call

    from xfam.config.specs import OptimSpec
    from xfam.model.build import build_model
    from xfam.training.lit.optim import make_optimizer

    cfg = memory_config(system)
    model = build_model(cfg, DATA_INFO)
    opt = make_optimizer(model, OptimSpec(**cfg["optim"]), total_steps, fused=True)

    def call(ids, state):
        state = model.init_memory(ids.shape[0], ids.device) if state is None else state
        out = model(ids, memory=state)
        aux = sum(out.aux.values()) if out.aux else None
        return out.logits, aux, out.memory

    return model, opt["optimizer"], opt["lr_scheduler"]["scheduler"], call


def run(system: str, warmup: int, steps: int, profile: bool = False) -> dict[str, Any]:
    """``warmup + steps`` training steps over consecutive segments, the memory carried from step to step."""
    import statistics

    import torch.nn.functional as F

    n = warmup + steps
    batches = _batches(min(n, 8))
    rss_before = _rss_now_mb()
    model, opt, sched, call = build(system, n)
    model.train()
    losses, state = [], [None]

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        logits, aux, state[0] = call(batch["input_ids"], state[0])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        (loss if aux is None else loss + aux).backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())

    times, cpu, prof = timed(step, n, warmup, profile)
    if prof is not None:
        return {**profile_ops_top(prof), "step_s": statistics.median(times[warmup:]), **cpu}
    return {**_result(model, times, losses, rss_before, warmup), **cpu}


def profile_ops_top(ops: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """The ``top`` ops by self time of a ``profile_ops`` table."""
    ranked = sorted(ops["ops"].items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "ops": dict(ranked),
        "optimizer_ms": ops["optimizer_ms"],
        "ops_total_ms": sum(v[0] for v in ops["ops"].values()),
    }


def worker(system: str, warmup: int, steps: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if system == "matmul":
        from benchlib.workers import run_matmul

        res = run_matmul()
    else:
        import importlib

        importlib.import_module("x_transformers" if "xtransformers" in system else "xfam.model.build")
        profile = system.startswith("profile:")
        res = run(system.removeprefix("profile:"), warmup, steps, profile=profile)
    res.update({"system": system, "loadavg_start": os.getloadavg()[0], "torch": torch.__version__})
    sys.stdout.flush()
    print(json.dumps(res), flush=True)


__all__ = ["LABELS", "MEM_LEN", "SYSTEMS", "memory_config", "profile_ops", "run", "worker"]
