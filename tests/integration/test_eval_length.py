"""``xfam eval seq_len=N mem_len=M``: a checkpoint evaluated at another length (its data rebuilt with
``data.seq_len=N``, each memory keeping M states), equal to the same evaluation of a model and data composed
with those settings; lengths the model cannot take refused first, with the reason; the lengths used reported.
Also ``xfam generate`` from a memory checkpoint (the memory carried as in training: tests/unit/test_generate_memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.integration.helpers import TINY, compose_cfg, text_data
from xfam.cli.main import main
from xfam.core.errors import ConfigError
from xfam.eval import loop
from xfam.eval.carry import carried_inputs, next_carry
from xfam.eval.loop import MemoryLength, at_lengths, evaluate_split, memory_lengths, split_loader
from xfam.memory import MEMORY, Memory
from xfam.model.build import build_model
from xfam.model.checkpoint import load_model
from xfam.training.runner import train

CLEAN_EXIT = 2
SHORT = [*TINY, "trainer.max_steps=3"]  # a checkpoint; its quality does not matter here
XL = ["memory=xl", "pos=xl", "memory.mem_len=16", "data.doc_mask=true"]


def trained(corpus: Path, tmp: Path, extra: list[str]) -> Path:
    train(compose_cfg([*SHORT, *text_data(corpus), *extra]), tmp)
    return tmp / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def xl_ckpt(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Transformer-XL memory (mem_len 16) over documents marked in packed rows of 32 tokens."""
    return trained(corpus, tmp_path_factory.mktemp("xl-length"), XL)


@pytest.fixture(scope="module")
def learned_ckpt(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Learned positions: a table of model.max_len = 64 rows, trained at 32."""
    return trained(corpus, tmp_path_factory.mktemp("learned-length"), ["pos=learned"])


def reference_loss(ckpt: Path, corpus: Path, overrides: list[str], batches: int = 2) -> tuple[float, int]:
    """The test loss of the checkpoint's weights in a model and data composed by Hydra with ``overrides``
    (not through ``at_lengths``), its memory carried from batch to batch; and the row length."""
    cfg = compose_cfg([*SHORT, *text_data(corpus), *XL, *overrides])
    saved, meta = load_model(ckpt)
    model = build_model(cfg, meta["data_info"]).eval()
    model.load_state_dict(saved.state_dict())
    loader, _ = split_loader(cfg, meta["data_info"], "test", None, rebuilt=True)
    logits, labels, carry = [], [], None
    with torch.no_grad():
        for batch in list(loader)[:batches]:
            batch, layers, docs = carried_inputs(model, batch, carry, meta["data_info"]["eos_id"])
            out = model(batch["input_ids"], segments=batch["segments"], memory=layers)
            carry = next_carry(out.memory, docs)
            logits.append(out.logits.flatten(0, 1))
            labels.append(batch["labels"].flatten())
    loss = F.cross_entropy(torch.cat(logits), torch.cat(labels), ignore_index=-100)
    return float(loss), batch["input_ids"].shape[1]


def first_line(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """The report's first line, ``<ckpt> on <split> (...):``."""
    main(argv)
    return next(line for line in capsys.readouterr().out.splitlines() if " on test (" in line)


def test_the_trained_lengths_are_the_default_and_are_reported(xl_ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    line = first_line(capsys, ["eval", f"ckpt={xl_ckpt}", "limit=2"])
    assert "(2 batches of 4, seq_len=32, memory: xl eval_mem_len=16 in layers 0,1)" in line
    same = evaluate_split(str(xl_ckpt), "test", limit=2, seq_len=32, mem_len=16)
    assert same.metrics == evaluate_split(str(xl_ckpt), "test", limit=2).metrics


@pytest.mark.parametrize("mem_len", [0, 64])
def test_seq_len_and_mem_len_equal_a_run_composed_with_them(xl_ckpt: Path, corpus: Path, mem_len: int) -> None:
    got = evaluate_split(str(xl_ckpt), "test", limit=2, seq_len=64, mem_len=mem_len)
    want, width = reference_loss(xl_ckpt, corpus, ["data.seq_len=64", f"memory.eval_mem_len={mem_len}"])
    assert width == 64 and (got.seq_len, got.trained_seq_len) == (64, 32)
    assert got.memory == tuple(MemoryLength(i, "xl", "eval_mem_len", mem_len, 16) for i in range(2))
    assert got.metrics["test/loss"] == pytest.approx(want, rel=1e-5)


def test_the_memory_length_changes_the_result(xl_ckpt: Path) -> None:
    """What the test above would miss if mem_len were ignored: the carried memory matters. (An ignored
    mem_len gives the same loss to the bit; how much the memory helps a model trained for a few steps
    depends on the machine's arithmetic, 1e-4 relative on one CI machine.)"""
    losses = {m: evaluate_split(str(xl_ckpt), "test", limit=2, seq_len=64, mem_len=m).metrics for m in (0, 64)}
    assert losses[0]["test/loss"] != pytest.approx(losses[64]["test/loss"], rel=1e-6)


def test_learned_positions_past_the_table_are_refused_before_any_data(
    learned_ckpt: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "seq_len=64 (trained 32))" in first_line(capsys, ["eval", f"ckpt={learned_ckpt}", "seq_len=64", "limit=1"])

    def no_data(config: dict) -> None:
        raise AssertionError("the data was built before the length was refused")

    monkeypatch.setattr(loop, "build_data", no_data)
    with pytest.raises(SystemExit) as exit_:
        main(["eval", f"ckpt={learned_ckpt}", "seq_len=65"])
    err = capsys.readouterr().err
    assert exit_.value.code == CLEAN_EXIT and "Traceback" not in err
    assert "seq_len=65: pos=learned has one trained vector per position, a table of 64 rows" in err
    assert "Fix: a length of at most 64" in err and "pos in [" in err and "rope" in err


def test_mem_len_without_memory_is_refused(learned_ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["eval", f"ckpt={learned_ckpt}", "mem_len=8"])
    err = capsys.readouterr().err
    assert exit_.value.code == CLEAN_EXIT and "mem_len=8: this checkpoint has no memory (memory=none)" in err


def test_mem_len_sets_each_components_own_length_in_a_per_layer_schedule() -> None:
    """XL's evaluation length (its training mem_len kept) and the memorizing layer's local cache."""
    cfg = compose_cfg(["model.layers=3", *XL, "+memory.per_layer={-1: {name: memorizing}}"])
    changed = at_lengths(cfg, seq_len=48, mem_len=7)
    assert changed["data"]["seq_len"] == 48 and cfg["data"]["seq_len"] != 48  # the original is left alone
    model = build_model(changed, {"task": "lm", "vocab_size": 50})
    xl, memorizing = model.memories[0], model.memories[2]
    assert (xl.mem_len, xl.eval_mem_len, model.memories[1].eval_mem_len, memorizing.mem_len) == (16, 7, 7, 7)
    assert memory_lengths(changed, cfg) == (
        MemoryLength(0, "xl", "eval_mem_len", 7, 16),
        MemoryLength(1, "xl", "eval_mem_len", 7, 16),
        MemoryLength(2, "memorizing", "mem_len", 7, 0),
    )


def test_a_memory_without_a_length_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Everything(Memory):
        """A memory that keeps every state it sees: no length parameter."""

        def __init__(self) -> None:
            super().__init__()

    monkeypatch.setattr(Everything, "registry_name", "everything", raising=False)
    monkeypatch.setitem(MEMORY._classes, "everything", Everything)
    cfg = {"model": {"layers": 2}, "data": {"seq_len": 32}, "memory": {"name": "everything"}}
    with pytest.raises(ConfigError, match=r"mem_len=8: memory=everything keeps no fixed number of past states"):
        at_lengths(cfg, mem_len=8)
    assert at_lengths(cfg, seq_len=64)["data"] == {"seq_len": 64}


def test_generate_from_a_memory_checkpoint_carries_the_memory(xl_ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    """Past two segments of 32 tokens, the logits each token was drawn from equal the stream's recomputed
    segment by segment (check=true); the help says how each kind of model generates."""
    main(["generate", f"ckpt={xl_ckpt}", "prompt=the quick brown fox", "max_new_tokens=70", "check=true"])
    assert "generated vs recomputed logits" in capsys.readouterr().out  # (a mismatch exits with 1)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "causal LM with memory" in capsys.readouterr().out
