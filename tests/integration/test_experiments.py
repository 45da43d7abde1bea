"""The attention and length-extrapolation experiment sweeps (scripts/experiments.yaml,
configs/experiment/lra_listops.yaml, lsh_copy.yaml and extrapolation.yaml) compose and validate for every run,
and the driver (scripts/run_experiments.py) trains, evaluates and collects results on tiny runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.helpers import ROOT, compose_cfg, text_data
from xfam.attention import ATTENTION
from xfam.config import validate
from xfam.pos import POS

SWEEPS = yaml.safe_load((ROOT / "scripts" / "experiments.yaml").read_text())
RUNS = [(name, label, overrides) for name, s in SWEEPS.items() for label, overrides in s["runs"].items()]

#: A run of seconds: tiny model and data, a few steps (the backbone's structure is kept).
TINY = [
    "model.dim=16",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "optim.warmup_steps=1",
    "callbacks.progress_bar=none",
    "trainer.log_every_n_steps=1",
    "data.num_train=48",
    "data.num_val=16",
    "data.num_test=16",
    "data.batch_size=8",
]


def _driver():
    if "run_experiments" not in sys.modules:  # a script, not a package: load it once under its own name
        spec = importlib.util.spec_from_file_location("run_experiments", ROOT / "scripts" / "run_experiments.py")
        sys.modules["run_experiments"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["run_experiments"])
    return sys.modules["run_experiments"]


def _attention(overrides: list[str]) -> str:
    return _choice(overrides, "attention")


def _choice(overrides: list[str], slot: str) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(f"{slot}="))


@pytest.mark.parametrize(("name", "label", "overrides"), RUNS, ids=[f"{n}-{lbl}" for n, lbl, _ in RUNS])
def test_every_run_of_the_sweeps_composes_and_validates(name: str, label: str, overrides: list[str]) -> None:
    cfg = compose_cfg([f"experiment={SWEEPS[name]['experiment']}", *overrides])
    validate(cfg)
    slot = SWEEPS[name].get("slot", "attention")
    assert cfg[slot]["name"] == _choice(overrides, slot)


def test_the_runs_of_a_sweep_share_one_backbone_and_budget() -> None:
    for name, sweep in SWEEPS.items():
        slot, shared = sweep.get("slot", "attention"), []  # the one slot the runs of this sweep may change
        for overrides in sweep["runs"].values():
            assert all(o.startswith(slot) for o in overrides), f"a run of {name} may change its {slot} only"
            cfg = compose_cfg([f"experiment={sweep['experiment']}", *overrides])
            shared.append({k: v for k, v in cfg.items() if k != slot})
        assert all(s == shared[0] for s in shared)


def test_listops_sweep_has_every_bidirectional_mechanism_with_its_approximation_active() -> None:
    sweep = SWEEPS["lra_listops"]
    names = {_attention(o) for o in sweep["runs"].values()}
    bidirectional = {n for n, c in ATTENTION.items() if c.__module__.startswith("xfam.") and c.bidirectional}
    assert names == bidirectional
    cfg = compose_cfg([f"experiment={sweep['experiment']}"])
    assert cfg["data"]["name"] == "listops" and cfg["model"]["pool"] == "cls"
    assert cfg["data"]["seq_len"] <= cfg["model"]["max_len"] <= 512
    for overrides in sweep["runs"].values():
        params = compose_cfg([f"experiment={sweep['experiment']}", *overrides])["attention"]
        exact = ATTENTION.get(params["name"]).exact_params(cfg["model"]["max_len"])
        if exact:  # not the degenerate limit that equals dense attention
            assert any(params.get(k) != v for k, v in exact.items()), params


def test_copy_sweep_local_window_cannot_reach_the_first_copy() -> None:
    sweep = SWEEPS["lsh_copy"]
    for overrides in sweep["runs"].values():
        cfg = compose_cfg([f"experiment={sweep['experiment']}", *overrides])
        assert cfg["data"]["name"] == "duplication"
        if cfg["attention"]["name"] == "local":
            assert cfg["attention"]["window"] < cfg["data"]["seq_len"] // 2
    assert sweep["eval_hashes"] == [1, 2, 4, 8] and sweep["eval_hashes_runs"]


def test_extrapolation_sweep_has_every_pos_trained_at_64_and_learned_bounded_there() -> None:
    sweep = SWEEPS["extrapolation"]
    names = {_choice(o, "pos") for o in sweep["runs"].values()}
    assert names == {n for n, c in POS.items() if c.__module__.startswith("xfam.")}
    cfg = compose_cfg([f"experiment={sweep['experiment']}"])
    assert cfg["data"]["name"] == "text" and cfg["data"]["paths"] is None  # the embedded corpus
    assert cfg["data"]["seq_len"] == cfg["model"]["max_len"] == 64 == min(sweep["eval_lengths"])
    assert sweep["eval_lengths"] == [64, 128, 256, 512, 1024]
    assert set(sweep["eval_protocols"]) == {"nonoverlapping", "sliding"}
    # the settings docs/results.md reports (stride 32, the same 32,768 targets at every length)
    results = (Path(__file__).resolve().parents[2] / "docs" / "results.md").read_text()
    assert sweep["eval_stride"] == 32 and "moved by 32 tokens" in results
    assert sweep["eval_tokens"] == 32768 and "same 32,768" in results


def test_driver_collects_listops_results_on_a_tiny_run(tmp_path: Path) -> None:
    results = tmp_path / "results.md"
    results.write_text("# Results\n\nprose kept\n")
    argv = ["lra_listops", "--only", "vanilla,local", "--out", str(tmp_path / "runs"), "--results", str(results)]
    runs = _driver().main([*argv, *(f"--set={o}" for o in TINY)])
    assert [(r.label, r.status) for r in runs] == [("vanilla", "ok"), ("local", "ok")]
    text = results.read_text()
    assert "prose kept" in text and "<!-- experiments:lra_listops:start -->" in text
    assert "| `vanilla` |" in text and "| `local` |" in text and "majority class" in text
    assert (tmp_path / "results_lra_listops.png").stat().st_size > 0
    record = json.loads((tmp_path / "runs" / "lra_listops" / "results.json").read_text())
    labels = [int(y) for y in _test_labels(runs[0].run_dir)]
    top = max(labels.count(c) for c in set(labels))
    assert record["summary"]["majority_rate"] == pytest.approx(top / len(labels))
    assert 0 <= record["summary"]["root_rule_acc"] <= 1 and "root-operator rule" in text
    assert all(0 <= r["metrics"]["test/acc"] <= 1 for r in record["runs"])
    again = _driver().main([*argv, *(f"--set={o}" for o in TINY)])  # finished runs are reused, not retrained
    assert [r.status for r in again] == ["reused", "reused"]
    assert [r.metrics for r in again] == [r.metrics for r in runs]


def _test_labels(run_dir: str) -> list[int]:
    from xfam.model.build import build_data

    cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    source = build_data(cfg)
    source.prepare()
    return [int(y) for y in source.split("test")["label"]]


def test_driver_evaluates_lsh_with_every_number_of_hash_rounds(tmp_path: Path) -> None:
    results = tmp_path / "results.md"
    argv = ["lsh_copy", "--only", "lsh", "--out", str(tmp_path / "runs"), "--results", str(results)]
    (run,) = _driver().main([*argv, *(f"--set={o}" for o in TINY)])
    assert run.status == "ok"
    assert [e["eval_hashes"] for e in run.eval_hashes] == [1, 2, 4, 8]
    trained = next(e for e in run.eval_hashes if e["eval_hashes"] == e["trained_hashes"])
    assert trained["acc"] == pytest.approx(run.metrics["test/acc"], abs=1e-6)  # same weights, same split
    text = results.read_text()
    assert "| eval hash rounds |" in text and "chance 1/" in text
    assert (tmp_path / "results_lsh_copy.png").stat().st_size > 0


def test_driver_records_a_refused_run_and_goes_on(tmp_path: Path) -> None:
    sweeps = tmp_path / "sweeps.yaml"
    sweeps.write_text(
        yaml.safe_dump(
            {"bad": {"experiment": "lra_listops", "runs": {"too_wide": ["attention=local", "attention.window=100000"]}}}
        )
    )
    (run,) = _driver().main(["bad", "--sweeps", str(sweeps), "--out", str(tmp_path / "runs"), "--no-results"])
    assert run.status == "refused" and "window=100000" in run.reason


def test_driver_evaluates_every_length_and_protocol_on_a_tiny_lm(tmp_path: Path, corpus: Path) -> None:
    """Train at L=8 (learned positions: a table of 8) and rope, evaluate at 8 and 16 with both protocols;
    a rerun reuses the runs and their cached evaluations."""
    sweeps = tmp_path / "sweeps.yaml"
    runs = {"learned": ["pos=learned"], "rope": ["pos=rope"]}
    entry = {"experiment": "extrapolation", "slot": "pos", "runs": runs, "eval_lengths": [8, 16]}
    entry |= {"eval_protocols": ["nonoverlapping", "sliding"], "eval_stride": 4, "eval_tokens": 64}
    sweeps.write_text(yaml.safe_dump({"extrapolation": entry}))
    tiny = [
        *(o for o in TINY if not o.startswith("data.")),
        *(o for o in text_data(corpus) if not o.startswith("data.seq_len")),
        "data.seq_len=8",
        "model.max_len=8",
        "trainer.limit_test_batches=1",
    ]
    results = tmp_path / "results.md"
    argv = ["extrapolation", "--sweeps", str(sweeps), "--out", str(tmp_path / "runs"), "--results", str(results)]
    learned, rope = _driver().main([*argv, *(f"--set={o}" for o in tiny)])
    assert (learned.status, rope.status) == ("ok", "ok")
    got = {(e["protocol"], e["length"]): e for e in rope.lengths}
    assert set(got) == {(p, n) for p in ("nonoverlapping", "sliding") for n in (8, 16)}
    assert {e["tokens"] for e in got.values()} == {64}
    assert got["sliding", 8]["windows"] == 1 + (64 - 8) // 4 and got["nonoverlapping", 16]["windows"] == 4
    refused = {(e["protocol"], e["length"]): e.get("refused") for e in learned.lengths}
    assert refused["sliding", 8] is None and refused["nonoverlapping", 8] is None
    assert "past the learned table (8 positions)" in refused["sliding", 16]
    text = results.read_text()
    assert "<!-- experiments:extrapolation:start -->" in text and "**sliding** (stride 4)" in text
    assert "| `learned` |" in text and "refused" in text and "(1.00×)" in text
    assert (tmp_path / "results_extrapolation.png").stat().st_size > 0
    again = _driver().main([*argv, *(f"--set={o}" for o in tiny)])
    assert [r.status for r in again] == ["reused", "reused"]
    assert [r.lengths for r in again] == [learned.lengths, rope.lengths]  # from <run>/extrapolation.json
