"""The memory experiments (scripts/memory_experiments.py): every run composes and validates, a run changes
nothing but its memory (and pos for the RoPE pair), the reach claims of the recall runs hold, and one run
of the recall experiment trains end to end with the script's local/far evaluation."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import ROOT, compose_cfg
from xfam.config import resolve_streams, validate
from xfam.data.far_recall import FarRecall

sys.path.insert(0, str(ROOT / "scripts"))
import memory_experiments as mx  # noqa: E402

EXPERIMENTS = mx.experiments(argparse.Namespace(rope=True))
RUNS = [(name, label) for name, exp in EXPERIMENTS.items() for label in exp.runs]


def cfg_of(name: str, label: str, extra: list[str] | None = None) -> dict:
    exp = EXPERIMENTS[name]
    return compose_cfg([f"experiment={exp.experiment}", *exp.runs[label], *(extra or [])])


@pytest.mark.parametrize(("name", "label"), RUNS, ids=[f"{n}-{lb}" for n, lb in RUNS])
def test_every_run_composes_validates_and_uses_streams(name: str, label: str) -> None:
    cfg = cfg_of(name, label)
    validate(cfg)
    assert resolve_streams(cfg)[0], "every run of a comparison uses the same stream layout"


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_runs_differ_only_in_their_memory(name: str) -> None:
    def rest(cfg: dict) -> dict:
        out = copy.deepcopy(cfg)
        for key in ("memory", "pos"):
            out.pop(key)
        return out

    configs = {label: cfg_of(name, label) for label in EXPERIMENTS[name].runs}
    first = next(iter(configs.values()))
    for label, cfg in configs.items():
        assert rest(cfg) == rest(first), label
        if "rope" not in label:
            assert cfg["pos"] == first["pos"], label


def test_copy_memory_covers_one_segment() -> None:
    cfg = cfg_of("copy", "xl")
    assert cfg["memory"]["mem_len"] >= cfg["data"]["seq_len"] - 1  # a copy target is seq_len - 1 back
    assert cfg_of("copy", "none")["memory"]["name"] == "none"


def test_recall_runs_reach_what_the_table_says() -> None:
    cfg = cfg_of("recall", "none")
    d, layers = cfg["data"], cfg["model"]["layers"]
    src = FarRecall(**{k: v for k, v in d.items() if k != "name"})
    distance = src.min_distance()
    short, covering = cfg_of("recall", "xl-mem32")["memory"], cfg_of("recall", "xl-mem96")["memory"]
    assert layers * short["mem_len"] < distance, "XL's stacked reach must fall short of every pair"
    # the query row's first query (t = 0) sees t + mem_len back: the whole pairs row at mem_len >= (G+1)*S
    assert covering["mem_len"] >= (d["gap_rows"] + 1) * d["seq_len"]
    store = cfg_of("recall", "memorizing")["memory"]["per_layer"][-1]
    assert store["name"] == "memorizing" and store["store_size"] >= (d["gap_rows"] + 1) * d["seq_len"]


def test_recall_run_trains_and_the_local_far_split_adds_up(tmp_path: Path) -> None:
    small = [
        "model.dim=32",
        "model.heads=2",
        "data.num_train=64",
        "data.num_val=32",
        "data.num_test=32",
        "data.batch_size=4",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=4",
        "trainer.limit_test_batches=8",
        "optim.warmup_steps=1",
        "callbacks.progress_bar=none",
    ]
    run = mx.Run("memory_recall", "memorizing", [*EXPERIMENTS["recall"].runs["memorizing"], *small])
    cfg, reusable = mx.prepare_run(run, tmp_path)
    assert cfg is not None and not reusable, run.reason
    mx.train_run(run, cfg, reusable)
    assert run.status == "ok", run.reason
    result = mx.recall_eval(run)
    # the script's pass over the test streams is the module's own test pass, split by episode row
    assert result["all/acc"] == pytest.approx(run.metrics["test/acc"], abs=1e-6)
    assert result["all/loss"] == pytest.approx(run.metrics["test/loss"], rel=1e-5)
    distance = (cfg["data"]["gap_rows"] + 1) * cfg["data"]["seq_len"] - 2 * cfg["data"]["num_pairs"] + 1
    assert set(result["by_distance"]) and min(map(int, result["by_distance"])) >= distance


def test_script_help_and_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        mx.main(["--help"])
    assert done.value.code == 0 and "{copy,text,recall,all}" in capsys.readouterr().out
    mx.main(["all", "--dry-run", "--rope", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("python train.py experiment=memory_") == len(RUNS)
    assert "refused" not in out and not any(tmp_path.iterdir()), "a dry run trains and writes nothing"
