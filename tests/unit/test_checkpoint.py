"""Checkpoint writing is atomic; reading refuses what is not a whole xfam checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xfam.core.errors import ConfigError
from xfam.model import checkpoint
from xfam.model.checkpoint import architecture_diff
from xfam.training.lit.checkpoint import AtomicCheckpointIO


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"partial bytes of a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left


def test_read_refuses_truncated_and_foreign_files(tmp_path: Path) -> None:
    good = tmp_path / "good.ckpt"
    torch.save({"xfam": {"config_version": checkpoint.CONFIG_VERSION}, "state_dict": {}}, good)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:40])
    with pytest.raises(ConfigError, match="cannot be read"):
        checkpoint.read(truncated)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ConfigError, match="not an xfam checkpoint"):
        checkpoint.read(foreign)
    newer = tmp_path / "newer.ckpt"
    torch.save({"xfam": {"config_version": checkpoint.CONFIG_VERSION + 1}}, newer)
    with pytest.raises(ConfigError, match="newer xfam"):
        checkpoint.read(newer)
    with pytest.raises(ConfigError, match="does not exist"):
        checkpoint.read(tmp_path / "missing.ckpt")
    assert checkpoint.read(good)["state_dict"] == {}


def test_architecture_diff_names_the_changed_keys() -> None:
    a = {"model": {"dim": 32, "heads": 2}, "pos": {"name": "rope"}, "optim": {"lr": 1.0}}
    b = {"model": {"dim": 64, "heads": 2}, "pos": {"name": "alibi"}, "optim": {"lr": 2.0}}
    assert architecture_diff(a, b) == ["model.dim: 32 -> 64", "pos.name: 'rope' -> 'alibi'"]
    assert architecture_diff(a, a) == []


def test_a_model_option_newer_than_the_checkpoint_compares_as_its_default() -> None:
    old = {"model": {"dim": 32}}  # written before model.num_mem_kv existed
    assert architecture_diff(old, {"model": {"dim": 32, "num_mem_kv": 0}}) == []
    assert architecture_diff(old, {"model": {"dim": 32, "num_mem_kv": 4}}) == ["model.num_mem_kv: 0 -> 4"]


def test_a_checkpoint_resumes_only_on_data_its_model_can_take(tmp_path: Path) -> None:
    from xfam.model.build import check_checkpoint_data

    def info(task: str = "lm", vocab: int = 257, classes: int | None = None) -> dict:
        return {"task": task, "vocab_size": vocab, "num_classes": classes, "fingerprint": f"{task}{vocab}{classes}"}

    config = {"model": {"vocab_size": None}}
    path = tmp_path / "run.ckpt"
    meta = {"config_version": checkpoint.CONFIG_VERSION, "config": config, "data_info": info()}
    torch.save({"xfam": meta}, path)
    check_checkpoint_data(str(path), config, info())
    check_checkpoint_data(str(path), {**config, "allow_data_change": True}, {**info(), "fingerprint": "other text"})
    with pytest.raises(ConfigError, match=r"ids up to 299, outside the checkpoint.s vocabulary \(vocab_size: 257"):
        check_checkpoint_data(str(path), config, info(vocab=300))
    with pytest.raises(ConfigError, match="vocab_size: 257 -> 17; num_classes: None -> 10"):
        check_checkpoint_data(str(path), config, info("classify", 17, 10))
    with pytest.raises(ConfigError, match="vocab_size: 257 -> 100"):
        check_checkpoint_data(str(path), config, info(vocab=100))  # a smaller embedding: other shapes too
    fixed = {"model": {"vocab_size": 512}}  # an explicit model.vocab_size: the embedding does not follow the data
    torch.save({"xfam": {**meta, "config": fixed}}, path)
    check_checkpoint_data(str(path), {**fixed, "allow_data_change": True}, info(vocab=300))


def test_a_checkpoint_resumes_on_other_data_only_when_asked(tmp_path: Path) -> None:
    """Same vocabulary, other text (e.g. a run directory shared by two corpora): the model could take it,
    but continuing another run's training silently is refused; ``allow_data_change=true`` allows it."""
    from xfam.model.build import check_checkpoint_data

    info = {"task": "lm", "vocab_size": 257, "num_classes": None, "fingerprint": "aaaa1111"}
    config = {"model": {"vocab_size": None}}
    path = tmp_path / "run.ckpt"
    torch.save({"xfam": {"config_version": checkpoint.CONFIG_VERSION, "config": config, "data_info": info}}, path)
    with pytest.raises(ConfigError) as err:
        check_checkpoint_data(str(path), config, {**info, "fingerprint": "bbbb2222"})
    assert "aaaa1111 -> bbbb2222" in str(err.value) and "allow_data_change=true" in str(err.value)
    assert "Fix:" in str(err.value) and "\n" not in str(err.value)
    check_checkpoint_data(str(path), {**config, "allow_data_change": True}, {**info, "fingerprint": "bbbb2222"})
