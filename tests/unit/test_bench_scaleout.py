"""scripts/bench_scaleout.py: the per-rank byte count and the single-file timings in this process (fast), and the
whole ``--quick`` run -- DDP and FSDP over 2 spawned gloo ranks, sharded checkpoints, the report -- in a subprocess
(slow: two process spawns that import torch and Lightning, ~25 s on 2 shared cores)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_scaleout as bs  # noqa: E402

from tests.integration.helpers import run_cli  # noqa: E402

TINY = bs.Shape(vocab=64, dim=32, layers=1, heads=2, batch=2, seq=8)


def test_held_bytes_counts_every_tensor_once() -> None:
    """Unsharded: parameters and gradients 4 bytes per parameter (the tied matrix once), AdamW's two moments
    twice that, one fp32 ``step`` per parameter tensor."""
    model = bs.build(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=bs.LR)
    bs.train_step(model, opt, TINY)
    held = bs.held_bytes(model, opt)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert model.head.weight is model.embed.weight  # tied: counted once
    assert held["params"] == held["grads"] == 4 * n
    assert held["adam_moments"] == 8 * n
    assert held["adam_step"] == 4 * len(params)
    assert held["buffers"] == sum(b.numel() * b.element_size() for b in model.buffers())


def test_single_file_times_and_size(tmp_path: Path) -> None:
    res = bs.single_file(TINY, reps=2, warmup=1, tmp=tmp_path, started=0.0)
    assert res["size"] > 12 * res["n_params"]  # weights + two AdamW moments, fp32
    assert all(len(v) == 2 and min(v) >= 0 for v in res["times"].values())
    assert set(res["_weights"]) >= {"embed.weight", "head.weight"}


@pytest.mark.slow
def test_quick_run_writes_its_section_only(tmp_path: Path) -> None:
    md, png, raw = tmp_path / "benchmarks.md", tmp_path / "scaleout.png", tmp_path / "run.json"
    kept = "# Training throughput\n\nhand-written text\n"
    md.write_text(kept)
    args = ["scripts/bench_scaleout.py", "--quick", "--md", str(md), "--png", str(png), "--json", str(raw)]
    out = run_cli(args, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(raw.read_text())

    ratios = bs.memory_ratios(data)
    for kind in bs.SHARDED_KINDS:  # every tensor's dim-0 shard: half on each of the 2 ranks
        assert ratios[kind] == pytest.approx(0.5, abs=0.02), kind
    assert ratios["adam_step"] == 1.0
    assert all(r["n_params"] == data["memory"]["ddp"][0]["n_params"] for r in data["memory"]["fsdp"])
    ckpt = data["ckpt"]
    assert ckpt["full_state"]["max_abs_diff"] < 1e-5  # the sharded step equals the single-process one
    assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= set(ckpt["sharded"]["files"])
    assert len(ckpt["single"]["times"]["save"]) == data["meta"]["reps"] == 3

    text = md.read_text()
    assert text.startswith(kept) and text.count(bs.START) == text.count(bs.END) == 1
    assert bs.HEADING in text and "| **FSDP / DDP** |" in text and png.stat().st_size > 0
    rerun = run_cli(["scripts/bench_scaleout.py", "--from-json", str(raw), "--md", str(md), "--png", str(png)])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert md.read_text() == text  # the section replaced in place, the rest kept
