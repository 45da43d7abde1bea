"""Worker side of ``scripts/bench_scaling.py``: one training run of xfam or the minimal PyTorch model at a given
width and row length. The models are ``benchlib.workers``' own, built at another shape by setting that module's
shape constants before building (the builders read them when called). Imports torch."""

from __future__ import annotations

import json
import os
import sys

from benchlib import workers

LAYERS = 4


def shape(width: int, rows: int) -> dict[str, int]:
    """The shape at ``width`` and ``rows``: heads of 64, 4 layers, ~2048 tokens per step (batch 2048 / rows, >= 1)."""
    return {"DIM": width, "HEADS": width // 64, "SEQ": rows, "BATCH": max(1, 2048 // rows), "LAYERS": LAYERS}


def flops(width: int, rows: int, vocab: int = 256) -> float:
    """Model FLOPs of one training step, counted as ``benchlib.common.flops_per_step`` counts them."""
    s = shape(width, rows)
    tokens = s["BATCH"] * rows
    dense = 6 * (LAYERS * 12 * width * width + width * vocab) * tokens
    return dense + 12 * LAYERS * rows * width * tokens


def worker(system: str, width: int, rows: int, warmup: int, steps: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if system == "matmul":
        res = workers.run_matmul()
    else:
        import importlib

        importlib.import_module("xfam.model.build" if system == "xfam" else "torch.nn")
        for name, value in shape(width, rows).items():
            setattr(workers, name, value)  # read by the builders, the batches and the result when called
        res = workers.run_plain(system, "learned", warmup, steps)
        res.pop("times", None)
    res.update({"system": system, "width": width, "rows": rows, **shape(width, rows)})
    sys.stdout.flush()
    print(json.dumps({**res, "loadavg_start": os.getloadavg()[0]}), flush=True)


__all__ = ["flops", "shape", "worker"]
