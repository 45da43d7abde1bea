"""Checkpoint integrity: a digest written with every checkpoint and checked on every read, clear
refusals of files that are not checkpoints, a full disk in one line, and ``ckpt_path=auto`` passing
over what it cannot use (a folder or a dangling link, a corrupted file, another architecture)."""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import flip_a_tensor_bit
from xfam.core.errors import ConfigError
from xfam.model import checkpoint
from xfam.model.checkpoint import DIGEST_KEY, DiskFullError, digest
from xfam.training.lit.checkpoint import AtomicCheckpointIO
from xfam.training.resume import newest_readable
from xfam.training.runner import check_room, write_record


def xfam_ckpt(dim: int = 32, step: int = 0) -> dict:
    """A small checkpoint the way xfam writes one: metadata, weights and optimizer state."""
    return {
        "xfam": {"config_version": checkpoint.CONFIG_VERSION, "config": {"model": {"dim": dim}}},
        "global_step": step,
        "state_dict": {"model.w": torch.full((256,), 1.25), "model.b": torch.arange(4)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
    }


def test_a_bit_flip_in_a_tensor_is_refused_by_every_read(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(xfam_ckpt(), path)
    assert torch.load(path, weights_only=True)[DIGEST_KEY] == digest(xfam_ckpt())
    loaded = checkpoint.read(path)
    assert DIGEST_KEY not in loaded and torch.equal(loaded["state_dict"]["model.w"], torch.full((256,), 1.25))
    flip_a_tensor_bit(path)
    assert not torch.equal(torch.load(path, weights_only=True)["state_dict"]["model.w"], torch.full((256,), 1.25))
    for read in (checkpoint.read, io.load_checkpoint):  # xfam's reads, and Lightning's (trainer.fit(ckpt_path=))
        with pytest.raises(ConfigError, match="do not match the digest written with it.*Fix: use another checkpoint"):
            read(path)


def test_the_digest_covers_every_value_and_the_structure_and_survives_a_round_trip(tmp_path: Path) -> None:
    ckpt = xfam_ckpt()
    torch.save(ckpt, tmp_path / "a.ckpt")
    assert digest(torch.load(tmp_path / "a.ckpt", weights_only=True)) == digest(ckpt)
    assert digest({**ckpt, DIGEST_KEY: "anything"}) == digest(ckpt)  # the digest is not part of itself
    changed = [
        {**ckpt, "global_step": 1},
        {**ckpt, "state_dict": {"model.b": torch.arange(4), "model.w": torch.full((256,), 1.25)}},  # order
        {**ckpt, "state_dict": {"model.w": torch.full((256,), 1.25), "model.c": torch.arange(4)}},  # a name
        {**ckpt, "state_dict": {"model.w": torch.full((256,), 1.25), "model.b": torch.arange(4).int()}},  # dtype
        {**ckpt, "state_dict": {"model.w": torch.full((16, 16), 1.25), "model.b": torch.arange(4)}},  # shape
        {**ckpt, "xfam": {**ckpt["xfam"], "config": {"model": {"dim": "32"}}}},  # a type
    ]
    assert len({digest(c) for c in changed} | {digest(ckpt)}) == len(changed) + 1


def test_a_checkpoint_written_before_digests_loads_with_one_note(tmp_path: Path, caplog) -> None:
    path = tmp_path / "old.ckpt"
    torch.save(xfam_ckpt(), path)  # no digest: an older xfam wrote it
    with caplog.at_level(logging.INFO, logger="xfam"):
        for _ in range(3):
            assert checkpoint.read(path)["global_step"] == 0
    notes = [r for r in caplog.records if "before xfam stored digests" in r.getMessage()]
    assert len(notes) == 1 and str(path) in notes[0].getMessage()


class Hostile:
    """Unpickling this runs code (here: it would create a file)."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


def test_an_unreadable_file_says_what_it_is_not_and_never_advises_unsafe_loading(tmp_path: Path) -> None:
    hostile, target = tmp_path / "hostile.ckpt", tmp_path / "ran"
    torch.save({"xfam": Hostile(target)}, hostile)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all")
    truncated = tmp_path / "truncated.ckpt"
    AtomicCheckpointIO().save_checkpoint(xfam_ckpt(), truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    for path in (hostile, garbage, truncated):
        with pytest.raises(ConfigError) as err:
            checkpoint.read(path)
        msg = str(err.value)
        assert "not a checkpoint xfam can read safely (truncated, corrupted or not a torch checkpoint" in msg, msg
        assert "\n" not in msg and len(msg) < 400, msg
        for advice in ("weights_only", "trust", "safe_globals", "allowlist"):
            assert advice not in msg.lower(), msg
    assert not target.exists()  # the hostile file's code never ran


def test_a_folder_or_a_dangling_link_is_named_for_what_it_is(tmp_path: Path) -> None:
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(ConfigError, match="is a folder but not a sharded checkpoint"):
        checkpoint.read(tmp_path / "dir.ckpt")
    (tmp_path / "link.ckpt").symlink_to(tmp_path / "gone.ckpt")
    with pytest.raises(ConfigError, match="is a link to .*gone.ckpt.*, which does not exist"):
        checkpoint.read(tmp_path / "link.ckpt")


def run_with(tmp_path: Path, last: str, *steps: tuple[int, int]) -> Path:
    """A run directory whose last.ckpt is ``last`` (dir, dangling, dim=N) and step checkpoints (step, dim)."""
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    io = AtomicCheckpointIO()
    for step, dim in steps:
        io.save_checkpoint(xfam_ckpt(dim, step), ckpts / f"step-{step:07d}.ckpt")
    if last == "dir":
        (ckpts / "last.ckpt").mkdir()
    elif last == "dangling":
        (ckpts / "last.ckpt").symlink_to(ckpts / "step-0000099.ckpt")
    else:
        io.save_checkpoint(xfam_ckpt(int(last), 9), ckpts / "last.ckpt")
    return tmp_path / "run"


@pytest.mark.parametrize("last", ["dir", "dangling", "64"])
def test_auto_passes_over_a_last_ckpt_it_cannot_use_with_a_warning(tmp_path: Path, last: str, caplog) -> None:
    run = run_with(tmp_path, last, (3, 32), (6, 32))
    cfg = {"model": {"dim": 32}}
    with caplog.at_level(logging.WARNING, logger="xfam"):
        assert newest_readable(run, cfg) == str(run / "checkpoints" / "step-0000006.ckpt")
    warned = " ".join(r.getMessage() for r in caplog.records)
    why = {"dir": "is a folder", "dangling": "which does not exist", "64": "another architecture (model.dim: 64 -> 32)"}
    assert "skipping last.ckpt" in warned and why[last] in warned, warned


def test_auto_with_no_checkpoint_of_this_architecture_stops_with_one_message(tmp_path: Path) -> None:
    run = run_with(tmp_path, "64", (3, 64))
    with pytest.raises(ConfigError, match=r"last.ckpt has a different architecture .*\n  model.dim: 64 -> 32\nFix:"):
        newest_readable(run, {"model": {"dim": 32}})


def full_disk(monkeypatch: pytest.MonkeyPatch, free: int = 3 * 2**20) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100 * 2**30, 100 * 2**30, free))


def test_a_full_disk_in_the_checkpoint_writer_is_one_line_and_leaves_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(xfam_ckpt(step=1), path)

    def no_space(obj, f, *args, **kwargs):
        f.write(b"the first bytes of a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    full_disk(monkeypatch)
    with pytest.raises(DiskFullError) as err:
        io.save_checkpoint(xfam_ckpt(step=2), path)
    monkeypatch.undo()
    msg = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in msg
    assert str(path) in msg and "3.0 MB free" in msg and "XFAM_RUNS=" in msg and "Fix: free space" in msg
    assert checkpoint.read(path)["global_step"] == 1  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left


def test_a_disk_without_room_for_two_checkpoints_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Linear(1000, 1000)  # 1M parameters: 12 MB a checkpoint with AdamW's moments
    need = 2 * 4 * 3 * sum(p.numel() for p in model.parameters()) + checkpoint.DISK_MARGIN
    full_disk(monkeypatch, free=need + 1)
    check_room(tmp_path / "runs" / "new", model)  # a folder not created yet: its disk is measured
    full_disk(monkeypatch, free=need - 1)
    with pytest.raises(DiskFullError, match=r"needs about \d+ MB\. Nothing half-written was left\. Fix: free space"):
        check_room(tmp_path / "runs" / "new", model)
    assert not (tmp_path / "runs").exists()


def test_a_full_disk_when_writing_the_run_record_is_one_line_and_keeps_the_old_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"  # a run being resumed: its config.yaml is rewritten
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    real_write = Path.write_text

    def no_space(self, text, *args, **kwargs):
        real_write(self, text[:3])  # what fitted
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", no_space)
    with pytest.raises(DiskFullError, match="not enough space on the disk of .*run.*XFAM_RUNS"):
        write_record(run, {"seed": 1}, type("Source", (), {"manifest": {}})())
    monkeypatch.undo()
    assert [p.name for p in run.iterdir()] == ["config.yaml"] and (run / "config.yaml").read_text() == "seed: 0\n"
