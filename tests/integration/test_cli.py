"""The real command lines: train.py (help, refusal, resume), xfam list/eval/generate. Bad input through
train.py: test_fuzz_cli."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.helpers import TINY, run_cli, text_data

CLEAN_EXIT = 2  # every configuration or input problem


def snapshot(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")} if root.exists() else {}


@pytest.fixture(scope="module")
def trained(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict]:
    """One tiny run through train.py: its run directory, its overrides and the environment."""
    runs = tmp_path_factory.mktemp("cli-runs")
    env = {"XFAM_RUNS": str(runs)}
    args = ["name=cli", *TINY, *text_data(corpus)]
    res = run_cli(["train.py", *args], env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run_dir,) = [p.parent for p in (runs / "cli").glob("*/metrics.json")]
    assert str(run_dir) in res.stdout  # the run says where its outputs are
    return run_dir, args, env


def test_train_help_lists_groups_and_examples() -> None:
    res = run_cli(["train.py", "--help"])
    assert res.returncode == 0
    for text in (
        "Config groups",
        "Examples:",
        "ckpt_path=auto",
        "xfam list",
    ):
        assert text in res.stdout, text
    first = {}
    for line in res.stdout.splitlines():
        name, _, options = line.partition(": ")
        first.setdefault(name, options)
    assert "vanilla" in first["attention"].split(", ") and "listops" in first["data"].split(", ")


def test_xfam_help() -> None:
    for args in (["--help"], ["eval", "--help"], ["generate", "--help"], ["list", "--help"]):
        res = run_cli(["-m", "xfam.cli", *args])
        assert res.returncode == 0 and "usage: xfam" in res.stdout, args


def test_existing_run_is_refused_then_continued_with_auto(trained: tuple[Path, list[str], dict]) -> None:
    run_dir, args, env = trained
    before = snapshot(run_dir)
    res = run_cli(["train.py", *args], env=env)
    assert res.returncode == CLEAN_EXIT and "already holds a run" in res.stderr and "ckpt_path=auto" in res.stderr
    assert snapshot(run_dir) == before  # nothing in the existing run changed
    res = run_cli(["train.py", *args, "ckpt_path=auto", "trainer.max_steps=9"], env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 9  # same directory, continued


def test_eval_and_generate_from_a_checkpoint(trained: tuple[Path, list[str], dict]) -> None:
    run_dir, _, env = trained
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    res = run_cli(["-m", "xfam.cli", "eval", f"ckpt={ckpt}", "split=test"], env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "test/loss" in res.stdout and "test/bpb" in res.stdout
    res = run_cli(
        [
            "-m",
            "xfam.cli",
            "generate",
            f"ckpt={ckpt}",
            "prompt=the quick",
            "max_new_tokens=24",
            "top_k=20",
            "top_p=0.9",
            "num_samples=2",
            "check=true",
        ],
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("the quick") == 2 and "cached vs recomputed logits" in res.stdout and "OK" in res.stdout
    greedy = ["-m", "xfam.cli", "generate", f"ckpt={ckpt}", "prompt=the quick", "max_new_tokens=24", "temperature=0"]
    static = run_cli([*greedy, "decoder=static", "check=true"], env=env)  # the fixed-shape step, not compiled
    assert static.returncode == 0, static.stderr[-2000:]
    assert "OK" in static.stdout
    eager = run_cli([*greedy, "decoder=eager"], env=env)
    assert eager.returncode == 0 and eager.stdout.splitlines()[0] == static.stdout.splitlines()[0]


def test_generate_refuses_bad_checkpoints(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    res = run_cli(["-m", "xfam.cli", "generate", f"ckpt={bad}"])
    assert res.returncode == CLEAN_EXIT and "cannot be read" in res.stderr and "Traceback" not in res.stderr


def test_list_shows_every_slot_and_the_matrix() -> None:
    res = run_cli(["-m", "xfam.cli", "list"])
    assert res.returncode == 0
    for text in ("== attention", "== pos", "== memory", "== exit", "== data", "attention x pos", "vanilla", "alibi"):
        assert text in res.stdout, text
    res = run_cli(["-m", "xfam.cli", "list", "--markdown"])
    assert res.stdout.startswith("| slot | component |")
