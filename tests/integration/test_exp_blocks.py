"""The block-options experiment (scripts/exp_blocks.py, docs/results.md ``## blocks``): every run of the measured
budget composes and validates on the main job's data; each arm changes only its block option, the two rates only
``optim.lr``, the repeat only the seed; the divergence rule follows its definition on made-up curves; and a
``--quick`` run (every arm trained a few steps, the high rate one that must blow up) renders the report."""

from __future__ import annotations

import copy
import functools
import math
import re
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import ROOT, compose_cfg
from xfam.config import validate

sys.path.insert(0, str(ROOT / "scripts"))
import exp_blocks as eb  # noqa: E402

OUT = ROOT / "runs" / "exp_blocks"


@functools.cache
def _composed(overrides: tuple[str, ...]) -> dict:
    return compose_cfg(list(overrides))


def config(run: eb.Run) -> dict:
    return copy.deepcopy(_composed(tuple(run.overrides)))


def without(cfg: dict, *keys: str) -> dict:
    """``cfg`` without the dotted ``keys``."""
    out = copy.deepcopy(cfg)
    for key in keys:
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node[part]
        node.pop(leaf, None)
    return out


def real_runs() -> list[eb.Run]:
    return eb.make_runs(eb.REAL, OUT, list(eb.LRS), 1, None)


def test_every_run_validates_and_each_comparison_changes_one_thing() -> None:
    runs = real_runs()
    assert len(runs) == len(eb.ARMS) * len(eb.LRS) + 1 and len({r.label for r in runs}) == len(runs)
    by = {(r.arm, r.lr, r.seed): r for r in runs}
    main_job = compose_cfg([])
    for run in runs:
        cfg = config(run)
        validate(cfg)
        # The main job's embedded corpus: its data section, only the row length and batch changed.
        assert without(cfg["data"], "seq_len", "batch_size") == without(main_job["data"], "seq_len", "batch_size")
        assert cfg["data"]["paths"] is None and cfg["optim"] == {**main_job["optim"], "lr": run.lr, "warmup_steps": 18}
        assert cfg["trainer"]["max_steps"] == eb.REAL.steps and cfg["test"] is False
    lo, hi, top = eb.LRS
    assert lo == main_job["optim"]["lr"] and hi == pytest.approx(10 * lo) and top == pytest.approx(100 * lo)
    for lr in eb.LRS:
        default, pre = config(by[("default", lr, 0)]), config(by[("deep_pre", lr, 0)])
        for arm in eb.ARMS:
            cfg = config(by[(arm.key, lr, 0)])
            reference = default if arm.group == "shallow" else pre
            keys = [f"model.{o.split('=')[0].removeprefix('model.')}" for o in arm.overrides]
            assert without(cfg, *keys) == without(reference, *keys), arm.key
            for o in arm.overrides:  # the option really is on, and the reference does not have it
                key, value = o.removeprefix("model.").split("=")
                assert str(cfg["model"][key]) == value and (arm.key == "deep_pre" or reference["model"][key] != value)
        deep = [config(by[(k, lr, 0)])["model"] for k in ("deep_post", "deep_deepnorm", "deep_pre")]
        assert [m["layers"] for m in deep] == [24] * 3 and len({m["dim"] for m in deep}) == 1
        assert [m["norm_position"] for m in deep] == ["post", "deepnorm", "pre"]
    for arm in eb.ARMS:  # the high rate changes the rate only
        assert without(config(by[(arm.key, hi, 0)]), "optim.lr") == without(config(by[(arm.key, lo, 0)]), "optim.lr")
    repeat = config(by[("default", lo, 1)])
    assert repeat["seed"] == 1 and without(repeat, "seed") == without(config(by[("default", lo, 0)]), "seed")


def test_divergence_rule_and_loss_rise() -> None:
    falling = [(s, 5.5 - 0.01 * s) for s in range(100)]
    assert eb.diverged(falling, 4.6) is None
    assert "final training loss" in eb.diverged([*falling, *[(100 + s, 6.0) for s in range(20)]], 4.6)
    assert "not finite at step 3" in eb.diverged([(0, 5.5), (1, 5.0), (2, 4.0), (3, math.nan)], None)
    assert "validation loss" in eb.diverged(falling, math.inf)
    assert eb.diverged([], None, "training stopped at step 7: NaN/Inf").startswith("non-finite guard: training stopped")
    # A loss that only falls has no rise; a spike of 1 nat above the best, held for the 10-step window, shows as
    # 1 / ln 2 bits, also after it recovered; one before the warmup's end does not count.
    assert eb.worst_rise(falling, after=10) == 0.0
    spiky = [(s, 3.0 + (1.0 if 50 <= s < 60 else 0.0)) for s in range(100)]
    assert eb.worst_rise(spiky, after=10) == pytest.approx(1 / math.log(2))
    assert eb.worst_rise(spiky, after=70) == 0.0


@pytest.mark.slow  # (~20 s: runs 16 tiny trainings; the other experiment scripts' --quick runs are slow too)
def test_quick_run_renders_the_report(tmp_path: Path) -> None:
    """Every arm trained a few steps; the "high" rate 1e30 must make every run diverge (the guard or the loss),
    the main rate none; the report goes between its markers (prose around kept), the plot next to it."""
    results = tmp_path / "results.md"
    results.write_text(
        "# Experiments\n\n## blocks\n\nprose kept\n\n<!-- experiments:blocks:start -->\nold\n"
        "<!-- experiments:blocks:end -->\n\nafter kept\n"
    )
    argv = ["--quick", "--out", str(tmp_path / "runs"), "--results", str(results), "--lrs", "1e-3", "1e30"]
    out = eb.main(argv)
    runs = out["runs"]
    assert len(runs) == 2 * len(eb.ARMS) + 1
    for r in runs:
        assert r["status"] in ("ok", "stopped"), (r["label"], r["reason"])
        if r["lr"] == 1e30:
            assert r["diverged"], r["label"]
        else:
            assert r["status"] == "ok" and r["diverged"] is None and 0 < r["metrics"]["val/bpb"] < 9, r["label"]
            assert len(r["curve"]) == eb.QUICK.steps and r["params"] > 0
    text = results.read_text()
    assert "prose kept" in text and "after kept" in text and "\nold\n" not in text and text.count("## blocks") == 1
    block = re.search(r"<!-- experiments:blocks:start -->(.*)<!-- experiments:blocks:end -->", text, re.S).group(1)
    for arm in eb.ARMS:
        row = next(line for line in block.splitlines() if line.startswith(f"| {arm.key} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert re.fullmatch(r"\d\.\d{3}", cells[4]) and "**diverged**" in cells[9], row
    first = next(r for r in runs if r["label"] == "default/lr0.001")
    assert first["command"] in block and "**Noise.**" in block and "Diverged runs: `" in block
    assert "![blocks](results_blocks.png)" in block and (tmp_path / "results_blocks.png").stat().st_size > 10_000
    # Run again: every run is reused from its folder (nothing trained), and the same table comes out.
    again = eb.main([*argv, "--only", "default", "--repeat-seed", "0", "--no-results"])
    assert [r["status"] for r in again["runs"]] in (["reused", "stopped"], ["reused", "reused"])
    assert again["runs"][0]["metrics"] == first["metrics"]
