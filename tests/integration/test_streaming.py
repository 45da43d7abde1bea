"""``data=hf data.streaming=true`` end to end: a streamed corpus trains, and a run stopped and resumed with
``ckpt_path=auto`` reproduces an uninterrupted one's per-step losses (the units' positions are in the
checkpoint), with the loader's own process and with 2 workers (a resume whose next batch is worker 1's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg
from tests.integration.test_distributed import killed_then_resumed, run
from tests.integration.test_train import step_losses, stop_at
from tests.unit.test_data_cache import WORDS
from xfam.core.errors import ConfigError
from xfam.training.runner import train


def _doc(i: int) -> str:
    g = torch.Generator().manual_seed(i)
    n = int(torch.randint(20, 200, (1,), generator=g))
    return f"doc {i}: " + " ".join(WORDS[int(k)] for k in torch.randint(len(WORDS), (n,), generator=g))


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of 4 JSON-lines files (4 shards), 150 documents each: streamed by file type."""
    folder = tmp_path_factory.mktemp("jsonl")
    for k in range(4):
        lines = [json.dumps({"text": _doc(k * 1000 + i)}) for i in range(150)]
        (folder / f"train-{k}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def streaming(folder: Path, workers: int = 0) -> list[str]:
    return [
        "data=hf",
        f"data.path={folder}",
        "data.config_name=null",
        "data.validation_split=null",
        "data.test_split=null",
        "data.join=eos",
        "data.streaming=true",
        "data.eval_rows=8",
        "data.seq_len=32",
        "data.batch_size=4",
        f"loader.num_workers={workers}",
    ]


RUN = ["trainer.max_steps=12", "callbacks.every_n_steps=3", "trainer.val_check_interval=3", "model.dropout=0.1"]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_stopped_and_resumed_stream_equals_the_uninterrupted_one(workers: int, jsonl: Path, tmp_path: Path) -> None:
    overrides = [*TINY, *streaming(jsonl, workers), *RUN]
    whole = train(compose_cfg(overrides), tmp_path / "whole")
    stop_at(8, compose_cfg(overrides), tmp_path / "split")  # last checkpoint: step 6 (odd batches per worker: 3)
    ckpt = torch.load(tmp_path / "split" / "checkpoints" / "step-0000006.ckpt", weights_only=True)
    (rank,) = ckpt["xfam_resume"]["ranks"]
    assert rank["stream"]["batches"] == 6 and rank["stream"]["units"] == max(1, workers)
    resumed = train(compose_cfg([*overrides, "ckpt_path=auto"]), tmp_path / "split")
    assert len(step_losses(tmp_path / "whole")) == 12
    assert step_losses(tmp_path / "split") == step_losses(tmp_path / "whole")
    assert resumed["val/loss"] == whole["val/loss"]


def test_a_resume_on_other_loader_workers_is_refused_before_launch(jsonl: Path, tmp_path: Path) -> None:
    overrides = [*TINY, *streaming(jsonl), *RUN]
    stop_at(4, compose_cfg(overrides), tmp_path)
    with pytest.raises(ConfigError, match=r"in 1 unit.*would read 2.*loader.num_workers=0"):
        train(compose_cfg([*overrides, "loader.num_workers=2", "ckpt_path=auto"]), tmp_path)


@pytest.mark.slow  # three 2-process runs: ~1.5 min
def test_a_stream_under_ddp_resumes_exactly_after_a_kill(jsonl: Path, tmp_path: Path) -> None:
    """2 ranks x 2 loader workers: 4 units, each rank its own; killed after a checkpoint, the resumed run's
    per-step losses equal the uninterrupted one's."""
    args = [*TINY, *streaming(jsonl, 2), *RUN, "trainer=ddp_cpu"]
    whole = run(args, tmp_path / "whole")
    resumed, killed_at = killed_then_resumed(args, tmp_path / "split", 6)
    assert killed_at < 11, "killed mid-run"
    assert step_losses(resumed) == step_losses(whole) and len(step_losses(whole)) == 12
    ckpt = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    ranks = ckpt["xfam_resume"]["ranks"]
    assert [r["stream"]["units"] for r in ranks] == [4, 4]
    assert set(ranks[0]["stream"]["positions"]) == {0, 1} and set(ranks[1]["stream"]["positions"]) == {2, 3}
