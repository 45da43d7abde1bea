"""Sharded training (``trainer=fsdp_cpu``: FSDP2 over 2 CPU processes, gloo) as real command lines: the same
training as one process with the same global batch, each rank holding half of every parameter and reading its
own rows, sharded checkpoints that load, evaluate and convert in one process, exact resume after a SIGKILL
(of one rank, of both) during a sharded write, and resume on another number of processes.

The stateful components ride along, as in the DDP test: XL memory (one stream per batch row and rank, saved
per rank) and Performer's random features (redrawn every 3 steps, the same draw on every rank)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.helpers import ROOT, compose_cfg, run_cli
from tests.integration.test_crash_safety import same_losses
from tests.integration.test_distributed import RTOL, STATEFUL, data, trains_as_one_process, val_losses
from tests.integration.test_train import step_losses
from xfam.core.errors import ConfigError
from xfam.model import sharded
from xfam.model.checkpoint import load_model, read

FSDP = ["trainer=fsdp_cpu"]
PLAIN = STATEFUL[:-6]  # TINY, 9 steps, validation every 3: no memory, vanilla attention


def run(args: list[str], runs: Path, name: str = "f") -> Path:
    res = run_cli(["train.py", f"name={name}", *args], env={"XFAM_RUNS": str(runs)}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = runs.glob(f"{name}/*")
    return run_dir


@pytest.fixture(scope="module")
def fsdp_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-process FSDP run, 4 rows per rank, checkpoints at steps 3, 6, 9."""
    return run([*STATEFUL, *data(corpus, 4), *FSDP], tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def one_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same training in one process (no sharding), 8 rows: the same rows per step."""
    return run([*STATEFUL, *data(corpus, 8)], tmp_path_factory.mktemp("one"))


def test_fsdp_trains_as_one_process_with_the_same_global_batch(fsdp_run: Path, one_run: Path) -> None:
    last = fsdp_run / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "step-0000009.ckpt" and sharded.is_sharded(last)
    saved = trains_as_one_process(fsdp_run, one_run)  # every rank read its own rows: its memory streams differ
    # only rank 0 writes the run's files: the same ones as a one-process run's, checkpoints aside
    files = lambda d: {p.relative_to(d) for p in d.rglob("*") if "checkpoints" not in p.parts}  # noqa: E731
    assert files(fsdp_run) == files(one_run)
    # what the spawned ranks chose is in the run's log, as a one-process run's is
    assert "optimizer: fused AdamW" in (fsdp_run / "train.log").read_text()
    assert "units: one unit per block (2)" in (fsdp_run / "train.log").read_text()
    assert all(r["memory"]["layers"][0]["h"].shape == (4, 24, 32) for r in saved["xfam_resume"]["ranks"])


def test_each_rank_holds_half_of_every_parameter_and_its_optimizer_state(fsdp_run: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    folder = fsdp_run / "checkpoints" / "step-0000009.ckpt"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    md = FileSystemReader(str(folder)).read_metadata()
    tensors = [(i, info) for i, info in md.storage_data.items() if i.offset is not None]  # (not the strings)
    files = {(i.fqn, tuple(i.offset)): info.relative_path for i, info in tensors}
    model, _ = load_model(folder)
    params = [f"model.{n}" for n, _ in model.named_parameters()]
    checked = 0
    for name in params:
        for key in (f"state_dict.{name}", f"optimizer_0.state.{name}.exp_avg", f"optimizer_0.state.{name}.exp_avg_sq"):
            tensor = md.state_dict_metadata[key]
            rows = tensor.size[0]
            chunks = [c for c in tensor.chunks if c.sizes.numel() > 0]
            owners = {files[(key, tuple(c.offsets))] for c in chunks}
            assert sum(c.sizes[0] for c in chunks) == rows, key  # the shards tile dim 0
            assert all(c.sizes[0] <= -(-rows // 2) for c in chunks), key  # none holds more than half
            if rows >= 2:  # (a 1-row tensor has one non-empty shard)
                assert owners == {"__0_0.distcp", "__1_0.distcp"}, key
                checked += 1
    assert checked >= 2 * len(params)


def test_a_sharded_checkpoint_evaluates_converts_and_loads_in_one_process(fsdp_run: Path, tmp_path: Path) -> None:
    folder = fsdp_run / "checkpoints" / "last.ckpt"
    model, meta = load_model(folder)
    tokens = torch.arange(32).view(2, 16) % 200
    with torch.no_grad():
        reference = model(tokens, memory=model.init_memory(2, torch.device("cpu"))).logits
    # sharded -> one file -> sharded: the same tensors, optimizer state included
    res = run_cli(["-m", "xfam.cli", "convert", f"ckpt={folder}", f"out={tmp_path / 'one.ckpt'}"])
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli(["-m", "xfam.cli", "convert", f"ckpt={tmp_path / 'one.ckpt'}", f"out={tmp_path / 'again'}"])
    assert res.returncode == 0, res.stderr[-2000:]
    one = read(tmp_path / "one.ckpt")
    assert one["global_step"] == 9 and one["xfam"]["config"] == meta["config"]
    assert len(one["optimizer_states"][0]["state"]) == sum(
        len(g["params"]) for g in one["optimizer_states"][0]["param_groups"]
    )
    original, again = sharded.full_state(folder), sharded.full_state(tmp_path / "again")
    flat = lambda s: {f"{k}.{n}": v for k, d in s.items() for n, v in _leaves(d)}  # noqa: E731
    assert flat(original).keys() == flat(again).keys()
    for key, value in flat(original).items():
        assert torch.equal(value, flat(again)[key]) if isinstance(value, torch.Tensor) else value == flat(again)[key]
    for path in (tmp_path / "one.ckpt", tmp_path / "again"):
        other, _ = load_model(path)
        with torch.no_grad():
            assert torch.equal(other(tokens, memory=other.init_memory(2, torch.device("cpu"))).logits, reference)
    res = run_cli(["-m", "xfam.cli", "eval", f"ckpt={folder}", "limit=1"])
    assert res.returncode == 0 and "test/loss" in res.stdout, res.stderr[-2000:]
    # fine-tuning starts from a folder too (init_from=<folder>): every tensor loaded, the same outputs
    from xfam.model.build import build_model
    from xfam.model.init_from import FinetuneSpec, finetune_problems, init_from

    fresh = build_model(meta["config"], meta["data_info"]).eval()
    assert not finetune_problems({**meta["config"], "init_from": str(folder), "ckpt_path": None})
    report = init_from(fresh, folder, FinetuneSpec(), meta["data_info"])
    assert report.step == 9 and not report.new and not report.mismatched
    with torch.no_grad():
        assert torch.equal(fresh(tokens, memory=fresh.init_memory(2, torch.device("cpu"))).logits, reference)


def _leaves(d, prefix: str = ""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), d


def test_a_changed_shard_is_refused_and_auto_passes_over_it(fsdp_run: Path, tmp_path: Path) -> None:
    from tests.integration.helpers import flip_a_tensor_bit  # noqa: F401  (the single-file version of this test)
    from xfam.training.resume import newest_readable

    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_run, run_dir, symlinks=True)
    shard = run_dir / "checkpoints" / "step-0000009.ckpt" / "__1_0.distcp"
    data_ = bytearray(shard.read_bytes())
    data_[len(data_) // 2] ^= 1
    shard.write_bytes(bytes(data_))
    with pytest.raises(ConfigError, match="__1_0.distcp does not match the digest"):
        read(run_dir / "checkpoints" / "last.ckpt")
    assert newest_readable(run_dir) == str(run_dir / "checkpoints" / "step-0000006.ckpt")
    (run_dir / "checkpoints" / "step-0000006.ckpt" / "__0_0.distcp").unlink()
    with pytest.raises(ConfigError, match="shard files missing: __0_0.distcp"):
        read(run_dir / "checkpoints" / "step-0000006.ckpt")


def test_resuming_on_other_processes_is_refused_before_launch_where_streams_cannot_continue(
    fsdp_run: Path, corpus: Path, tmp_path: Path
) -> None:
    from xfam.training.runner import train

    ckpt = fsdp_run / "checkpoints" / "step-0000006.ckpt"
    args = [*STATEFUL, *data(corpus, 4), *FSDP, "trainer.devices=1", f"ckpt_path={ckpt}"]
    with pytest.raises(ConfigError, match=r"8 memory streams .* Fix: data.batch_size=8"):
        train(compose_cfg(args), tmp_path / "run")
    with pytest.raises(ConfigError, match="is a sharded checkpoint .* Fix: xfam convert"):
        train(compose_cfg([*STATEFUL, *data(corpus, 8), f"ckpt_path={ckpt}"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was written


# -- slow: kills, other process counts, sweeps, components ------------------------------------------------------

SLOW_SEAL = textwrap.dedent(
    """
    import os, pathlib, time
    if os.environ.get("XFAM_TEST_SLOW_SEAL_STEP"):
        import xfam.training.lit.fsdp as fsdp
        seal = fsdp.seal
        def slow(tmp, path, meta, *args):
            if meta.get("global_step") == int(os.environ["XFAM_TEST_SLOW_SEAL_STEP"]):
                pathlib.Path(os.environ["XFAM_TEST_SEALING"]).write_text(str(os.getpid()))
                time.sleep(600)
            return seal(tmp, path, meta, *args)
        fsdp.seal = slow
    """
)


def _killed_during_a_sharded_write(corpus: Path, tmp_path: Path, which: str) -> Path:
    """Start the FSDP run, wait until rank 0 is sealing step 6's checkpoint (its shards written, ``meta.pt`` not),
    SIGKILL ``which`` (``rank1``: the other rank alone; ``all``: the whole process tree), return the run folder."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_SEAL)  # imported by every process, spawned ranks included
    sealing = tmp_path / "sealing"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XFAM_RUNS": str(tmp_path / "runs"), "PYTHONUNBUFFERED": "1"}
    env |= {"PYTHONPATH": f"{hooks}:{ROOT}", "XFAM_TEST_SLOW_SEAL_STEP": "6", "XFAM_TEST_SEALING": str(sealing)}
    env.pop("XFAM_DEBUG", None)
    args = [sys.executable, "train.py", "name=k", *STATEFUL, *data(corpus, 4), *FSDP]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while not sealing.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sealing.exists(), proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "no write in 300 s"
    rank0 = int(sealing.read_text())
    ranks = [
        int(p) for p in subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    ]
    if which == "rank1":  # the spawned rank that is not sealing (waiting at the barrier after its shards)
        workers = [p for p in ranks if p not in (proc.pid, rank0) and _is_spawned(p)]
        assert workers, ranks
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=120) != 0  # the launcher notices and ends the run
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    subprocess.run(["pkill", "-9", "-s", str(proc.pid)])  # nothing of it may live on
    (run_dir,) = (tmp_path / "runs" / "k").iterdir()
    assert (run_dir / "checkpoints" / "step-0000006.ckpt.tmp").is_dir()  # it died mid-write
    assert not (run_dir / "checkpoints" / "step-0000006.ckpt").exists()
    return run_dir


def _is_spawned(pid: int) -> bool:
    try:
        return "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()  # (not multiprocessing's resource tracker)
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("which", ["rank1", "all"])
def test_killed_during_a_sharded_write_then_auto_resumes_exactly(
    which: str, fsdp_run: Path, corpus: Path, tmp_path: Path
) -> None:
    run_dir = _killed_during_a_sharded_write(corpus, tmp_path, which)
    env = {"XFAM_RUNS": str(tmp_path / "runs")}
    res = run_cli(["train.py", "name=k", *STATEFUL, *data(corpus, 4), *FSDP, "ckpt_path=auto"], env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"resuming from \S+/checkpoints/(last|step-0000003)\.ckpt at step 3\b", res.stdout + res.stderr)
    same_losses(step_losses(run_dir), step_losses(fsdp_run))
    same_losses(val_losses(run_dir), val_losses(fsdp_run))
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # the step-6 write was redone and sealed


@pytest.mark.slow
def test_two_processes_resume_on_one_and_one_on_two(
    fsdp_run: Path, one_run: Path, corpus: Path, tmp_path: Path
) -> None:
    """2 -> 1: the 2-process checkpoint of step 6 continues in one FSDP process reading 8 rows (the same global
    batch), with the memory streams regrouped; 1 -> 2: a one-process FSDP run's checkpoint continues on 2. Both
    end where the uninterrupted runs end."""
    step6 = fsdp_run / "checkpoints" / "step-0000006.ckpt"
    two_to_one = run([*STATEFUL, *data(corpus, 8), *FSDP, "trainer.devices=1", f"ckpt_path={step6}"], tmp_path / "a")
    assert val_losses(two_to_one)[8] == pytest.approx(val_losses(fsdp_run)[8], rel=RTOL)
    single = run([*STATEFUL, *data(corpus, 8), *FSDP, "trainer.devices=1"], tmp_path / "b")  # (9 steps: the schedule)
    assert val_losses(single)[8] == pytest.approx(val_losses(one_run)[8], rel=RTOL)
    ckpt = single / "checkpoints" / "step-0000006.ckpt"
    assert len(read(ckpt)["xfam_resume"]["ranks"]) == 1
    one_to_two = run([*STATEFUL, *data(corpus, 4), *FSDP, f"ckpt_path={ckpt}"], tmp_path / "c")
    assert val_losses(one_to_two)[8] == pytest.approx(val_losses(single)[8], rel=RTOL)
    # a converted checkpoint continues without sharding too
    res = run_cli(["-m", "xfam.cli", "convert", f"ckpt={step6}", f"out={tmp_path / 'step6.ckpt'}"])
    assert res.returncode == 0, res.stderr[-2000:]
    plain = run([*STATEFUL, *data(corpus, 8), f"ckpt_path={tmp_path / 'step6.ckpt'}"], tmp_path / "d")
    assert val_losses(plain)[8] == pytest.approx(val_losses(fsdp_run)[8], rel=RTOL)


@pytest.mark.slow
def test_fsdp_cpu_runs_inside_a_multirun(corpus: Path, tmp_path: Path) -> None:
    """The ranks are spawned, not started by re-running the command line (which inside -m would re-run the
    whole sweep): every job of the sweep trains once."""
    args = ["-m", "name=m", "pos=rope,alibi", *PLAIN, "trainer.max_steps=3", *data(corpus, 4), *FSDP]
    res = run_cli(["train.py", *args], env={"XFAM_RUNS": str(tmp_path)}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted(p.parent for p in (tmp_path / "m").rglob("metrics.json"))
    assert len(jobs) == 2, res.stderr[-2000:]
    assert [json.loads((j / "metrics.json").read_text())["step"] for j in jobs] == [3, 3]
    assert sorted(yaml.safe_load((j / "config.yaml").read_text())["pos"]["name"] for j in jobs) == ["alibi", "rope"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "component",
    [
        ["exit=act"],
        ["exit=calm"],
        ["model.reversible=true"],
        ["model.share_layers=true"],
        ["model.tie_embeddings=true"],
    ],
    ids=lambda c: c[0],
)
def test_components_under_fsdp_train_as_in_one_process(component: list[str], corpus: Path, tmp_path: Path) -> None:
    """Auxiliary losses (ACT's ponder cost, CALM's per-layer classifiers), reversible layers (their own backward),
    a block run at every depth and tied embeddings: the same validation losses as one process."""
    base = [*PLAIN, "trainer.max_steps=4", "trainer.val_check_interval=2", *component]
    fsdp = run([*base, *data(corpus, 4), *FSDP], tmp_path / "f")
    one = run([*base, *data(corpus, 8)], tmp_path / "o")
    for step, loss in val_losses(one).items():
        assert val_losses(fsdp)[step] == pytest.approx(loss, rel=RTOL), step


@pytest.mark.slow
def test_checkpoints_written_in_the_background_are_the_same_and_sealed(
    fsdp_run: Path, corpus: Path, tmp_path: Path
) -> None:
    """``callbacks.async_save=true``: training goes on while a background thread writes the shards; the run's
    losses and every sealed checkpoint equal the synchronous run's, and nothing is left half-written."""
    background = run([*STATEFUL, *data(corpus, 4), *FSDP, "callbacks.async_save=true"], tmp_path)
    same_losses(step_losses(background), step_losses(fsdp_run))
    names = sorted(p.name for p in (background / "checkpoints").iterdir())
    assert names == sorted(p.name for p in (fsdp_run / "checkpoints").iterdir()), names
    for step in (6, 9):  # (step 3's was pruned: callbacks.keep_last=2)
        a = sharded.full_state(background / "checkpoints" / f"step-{step:07d}.ckpt")
        b = sharded.full_state(fsdp_run / "checkpoints" / f"step-{step:07d}.ckpt")
        for (name, x), (_, y) in zip(_leaves(a), _leaves(b), strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (step, name)
        assert read(background / "checkpoints" / f"step-{step:07d}.ckpt")["global_step"] == step


@pytest.mark.slow
def test_etc_cpc_trains_under_fsdp(tmp_path: Path) -> None:
    """ETC's CPC re-runs the stack on each rank's masked sentences (none when fewer than two are masked), so the
    blocks stay in the root unit and the ranks' collectives still pair: the run finishes and logs the CPC loss."""
    args = ["experiment=lra_listops", "attention=etc", "attention.cpc_weight=0.1", "model.dim=32", "model.layers=2"]
    args += ["data.batch_size=4", "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=2"]
    run_dir = run([*args, "trainer.limit_test_batches=2", "callbacks.progress_bar=none", *FSDP], tmp_path, "etc")
    rows = val_losses(run_dir)
    assert sorted(rows) == [1, 3] and all(loss == loss for loss in rows.values())
    assert "val/attention/cpc" in (run_dir / "logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
