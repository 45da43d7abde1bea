"""The experiment sweeps of issue 3 (scripts/experiments.yaml, configs/experiment/lra_listops.yaml and
lsh_copy.yaml) compose and validate for every run, and the driver (scripts/run_experiments.py)
trains, evaluates and collects results on tiny runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.helpers import ROOT, compose_cfg
from xfam.attention import ATTENTION
from xfam.config import validate

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
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("attention="))


@pytest.mark.parametrize(("name", "label", "overrides"), RUNS, ids=[f"{n}-{lbl}" for n, lbl, _ in RUNS])
def test_every_run_of_the_sweeps_composes_and_validates(name: str, label: str, overrides: list[str]) -> None:
    cfg = compose_cfg([f"experiment={SWEEPS[name]['experiment']}", *overrides])
    validate(cfg)
    assert cfg["attention"]["name"] == _attention(overrides)


def test_the_runs_of_a_sweep_share_one_backbone_and_budget() -> None:
    for sweep in SWEEPS.values():
        shared = []
        for overrides in sweep["runs"].values():
            assert all(o.startswith("attention") for o in overrides), "a run may change its attention only"
            cfg = compose_cfg([f"experiment={sweep['experiment']}", *overrides])
            shared.append({k: v for k, v in cfg.items() if k != "attention"})
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
    from xfam.build import build_data

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
