"""Run directory names and the multirun summary table."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from xfam.core.errors import ConfigError
from xfam.training.hydra_callbacks import summarize, write_tables
from xfam.training.resume import holds_run, resolve_checkpoint
from xfam.training.run_names import dirname
from xfam.training.runner import undo_on_failure


def test_dirname_is_deterministic_readable_and_usable_unquoted_in_an_override() -> None:
    assert dirname("") == "default"
    name = dirname("data.paths=[/some/long/path/to/a/corpus/folder]+model=small+pos=alibi")
    assert name == dirname("data.paths=[/some/long/path/to/a/corpus/folder]+model=small+pos=alibi")
    assert name.startswith("data.paths:h") and name.endswith("+model:small+pos:alibi")
    assert dirname("data.paths=[/x]") != dirname("data.paths=[/y]")
    (ov,) = OverridesParser.create().parse_overrides([f"ckpt_path=runs/default/{name}/checkpoints/last.ckpt"])
    assert ov.value() == f"runs/default/{name}/checkpoints/last.ckpt"
    assert len(dirname("+".join(f"k{i}={i}" for i in range(100)))) <= 160


def test_dirname_keeps_the_names_of_existing_runs() -> None:
    """Overrides that need no change keep the name they always had, so ``ckpt_path=auto`` finds their runs."""
    assert dirname("model=small+pos=alibi") == "model:small+pos:alibi"
    assert dirname("+model.extra=1+pos=alibi") == "+model.extra:1+pos:alibi"
    assert dirname("optim.lr=1e-3+trainer.precision=bf16-mixed") == "optim.lr:1e-3+trainer.precision:bf16-mixed"
    long = "[/some/long/path/to/a/corpus/folder]"
    assert dirname(f"data.paths={long}") == "data.paths:h" + hashlib.sha1(long.encode()).hexdigest()[:8]


# Hydra's override_dirname of two command lines that the old names merged (sanitising, "=" vs ":", "+"
# inside a value, truncation), and a few more that must stay apart.
TRICKY = [
    ("data.paths=[x/ab]", "data.paths=[x_ab]"),
    ("data.paths=[x/ab]", "data.paths=[x ab]"),
    ("data.paths=[a,b]", "data.paths=[a_b]"),
    ("data.name='a:b'", "data.name='a=b'"),
    ("data.name=a:b", "data.name=a_b"),
    ("data.paths=[c++/src]", "data.paths=[c__/src]"),
    ("a=1++b=2", "a=1+b=2"),
    ("~model.dropout", "_model.dropout"),
    ("model.name=x+pos=rope", "model.name=x_pos_rope"),
    ("+".join(f"k{i}={i}" for i in range(60)), "+".join(f"k{i}={i}" for i in range(59)) + "+k59=X"),
    ("data.paths=[" + "x" * 30 + "]", "data.paths=[" + "y" * 30 + "]"),
]


@pytest.mark.parametrize(("a", "b"), TRICKY)
def test_dirname_gives_different_overrides_different_directories(a: str, b: str) -> None:
    assert dirname(a) != dirname(b), (a, b)
    assert dirname(a) == dirname(a)


def test_no_two_tricky_overrides_share_a_directory() -> None:
    overrides = {o for pair in TRICKY for o in pair}
    assert len({dirname(o) for o in overrides}) == len(overrides)


def test_a_run_is_a_checkpoint_or_a_trained_step_not_what_a_failed_launch_left(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs" / "version_0").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    for leftover in ("config.yaml", "data_manifest.json", "train.log", "logs/version_0/metrics.csv"):
        (run / leftover).write_text("step,train/loss\n" if leftover.endswith(".csv") else "x")
    (run / "checkpoints" / "nonfinite-step-0000001.ckpt").write_bytes(b"debug")
    (run / "checkpoints" / "step-0000003.ckpt.tmp").write_bytes(b"unfinished")
    assert not holds_run(run)
    assert resolve_checkpoint(None, run) is None  # the corrected command runs
    for made in ("checkpoints/step-0000003.ckpt", "metrics.json", "logs/version_0/metrics.csv"):
        (run / made).write_text("step,train/loss\n0,5.5\n")
        assert holds_run(run), made
        with pytest.raises(ConfigError, match="already holds a run"):
            resolve_checkpoint(None, run)
        (run / made).unlink()


class Failed(Exception):
    pass


def attempt(run: Path, *, checkpoint: str | None = None) -> None:
    """A launch that writes its record and logs (and maybe a checkpoint), then fails."""
    with pytest.raises(Failed), undo_on_failure(run):
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.yaml").write_text("new")
        (run / "logs" / "version_0").mkdir(parents=True, exist_ok=True)
        (run / "logs" / "version_0" / "metrics.csv").write_text("step\n")
        if checkpoint:
            (run / "checkpoints").mkdir(exist_ok=True)
            (run / "checkpoints" / checkpoint).write_bytes(b"ckpt")
        raise Failed


def test_a_launch_failing_before_its_first_checkpoint_leaves_no_folder(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    (runs / "other" / "pos:none").mkdir(parents=True)
    attempt(runs / "exp" / "pos:alibi")
    assert sorted(p.name for p in runs.iterdir()) == ["other"]  # runs/exp/ went too, runs/ stays
    attempt(runs / "other" / "pos:rope")
    assert [p.name for p in (runs / "other").iterdir()] == ["pos:none"]  # runs/other/ holds another run: kept


def test_a_failed_launch_never_removes_what_was_there_before_or_a_run(tmp_path: Path) -> None:
    leftovers = tmp_path / "leftovers"  # an older launch's record: not a run, but not this launch's
    leftovers.mkdir()
    (leftovers / "config.yaml").write_text("old")
    (leftovers / "notes.txt").write_text("mine")
    attempt(leftovers)
    assert sorted(p.name for p in leftovers.iterdir()) == ["config.yaml", "notes.txt"]
    run = tmp_path / "run"  # a run: nothing is removed, not even what the failed launch added
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    attempt(run)
    assert (run / "logs").is_dir() and (run / "checkpoints" / "last.ckpt").exists()
    for name in ("step-0000003.ckpt", "nonfinite-step-0000002.ckpt"):  # written by the failed launch: kept
        attempt(tmp_path / name, checkpoint=name)
        assert (tmp_path / name / "checkpoints" / name).exists() and (tmp_path / name / "config.yaml").exists()


def test_summary_has_one_row_per_job_with_its_status(tmp_path: Path) -> None:
    for name, loss in (("pos:rope", 1.5), ("pos:alibi", 1.25)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"step": 10, "val/loss": loss}))
    (tmp_path / "pos:killed").mkdir()  # a job killed from outside wrote nothing: no row
    (tmp_path / "pos:xl").mkdir()  # a job that failed in training records why
    (tmp_path / "pos:xl" / "status.json").write_text(json.dumps({"status": "failed", "reason": "Boom: a|b\nc"}))
    rows = summarize(tmp_path)
    assert [(r["run"], r["status"]) for r in rows] == [("pos:alibi", "ok"), ("pos:rope", "ok"), ("pos:xl", "failed")]
    csv_path, md_path = write_tables(rows, tmp_path)
    assert csv_path.read_text().splitlines()[0] == "run,status,step,val/loss,reason"
    table = md_path.read_text()
    assert "| pos:alibi | ok | 10 | 1.25 |  |" in table and "| pos:xl | failed |  |  | Boom: a/b c |" in table


def test_summary_md_names_jobs_by_the_overrides_that_tell_them_apart(tmp_path: Path) -> None:
    common = [f"data.paths=[/a/long/path/to/corpus/{i}]" for i in range(8)] + ["model=small"]
    jobs = {"optim.lr=0.001": "ok", "optim.lr=0.002": "skipped", "+attention.per_layer={-1: {dropout: 0.1}}": "ok"}
    for i, (last, status) in enumerate(jobs.items()):
        job = tmp_path / f"{i}{dirname('+'.join([*common, last]))}"  # cut: alike but for a hash
        job.mkdir()
        (job / "status.json").write_text(json.dumps({"status": status, "overrides": [*common, last]}))
    (tmp_path / "old").mkdir()  # a status.json of before: the overrides as one string
    (tmp_path / "old" / "status.json").write_text(json.dumps({"status": "ok", "overrides": " ".join(common)}))
    rows = summarize(tmp_path)
    csv_path, md_path = write_tables(rows, tmp_path)
    with open(csv_path) as f:
        written = list(csv.DictReader(f))
    assert [r["run"] for r in written] == [r["run"] for r in rows]  # the directories, in full
    assert written[0]["overrides"] == " ".join([*common, "optim.lr=0.001"])  # every override
    table = md_path.read_text().splitlines()
    assert table[2].startswith("| optim.lr=0.001 | ok |") and table[3].startswith("| optim.lr=0.002 | skipped |")
    assert table[4].startswith("| +attention.per_layer={-1: {dropout: 0.1}} | ok |")
    assert table[5].startswith("| old | ok |")  # nothing tells it apart but its directory
