"""``xfam export`` end to end: a trained run (a BPE tokenizer, tied embeddings) exported by the real command line;
``xfam eval`` and ``xfam generate`` (greedy) from the folder print exactly what they print from the checkpoint, the
model card holds the run's own metrics and command, and the refusals come as one error line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.helpers import TINY, compose_cfg, run_cli, text_data
from xfam.cli import main as xfam_main

CLEAN_EXIT = 2


@pytest.fixture(scope="module")
def run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trained run (in-process: its run directory has metrics.json and data_manifest.json)."""
    from xfam.training.runner import train

    run_dir = tmp_path_factory.mktemp("export-run")
    overrides = [
        *TINY,
        *text_data(corpus),
        "data.tokenizer=bpe",
        "data.bpe_vocab_size=300",
        "model.tie_embeddings=true",
    ]
    train(compose_cfg(overrides), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def folder(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exports") / "tiny-bpe"
    res = run_cli(["-m", "xfam.cli", "export", f"ckpt={run / 'checkpoints' / 'last.ckpt'}", f"out={out}"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert str(out) in res.stdout and "1 shared tensors stored once" in res.stdout
    return out


def xfam(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The output of ``xfam <argv>`` run in this process, the checkpoint's path left out."""
    xfam_main.main(argv)
    return capsys.readouterr().out


def test_eval_and_greedy_generate_from_the_folder_equal_the_checkpoints(
    run: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = run / "checkpoints" / "last.ckpt"
    outputs = {}
    for path in (ckpt, folder):
        evaluated = xfam(["eval", f"ckpt={path}", "split=test", "limit=4"], capsys).replace(str(path), "CKPT")
        generated = xfam(["generate", f"ckpt={path}", "prompt=the quick", "temperature=0", "max_new_tokens=20"], capsys)
        outputs[path] = (evaluated, generated)
    assert outputs[ckpt] == outputs[folder]
    evaluated, generated = outputs[folder]
    assert "test/loss" in evaluated and generated.startswith("the quick")


def test_the_folder_holds_the_tokenizer_and_a_card_of_the_run(run: Path, folder: Path) -> None:
    from tokenizers import Tokenizer

    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() == 300
    card = (folder / "README.md").read_text()
    metrics = json.loads((run / "metrics.json").read_text())
    assert f"From the run's `metrics.json`, step {metrics['step']}:" in card
    assert f"| test/loss | {metrics['test/loss']:.4f} |" in card
    assert "From the run's `data_manifest.json`" in card and "tokenizer `bpe`" in card
    assert "python train.py" in card and "data.tokenizer=bpe" in card and "model.tie_embeddings=true" in card
    assert "| attention | `vanilla` |" in card and "Vaswani et al., 2017" in card


def test_refusals_are_one_line_with_the_fix(run: Path, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = run / "checkpoints" / "last.ckpt"
    for argv, text in (
        (["export", f"ckpt={ckpt}", f"out={folder}"], "exists and is not empty"),
        (["export", f"ckpt={folder}", "out=elsewhere"], "is an exported model folder"),
        (["convert", f"ckpt={folder}", "out=elsewhere"], "is an exported model folder"),
        (["eval", f"ckpt={folder.parent}"], "neither a sharded checkpoint"),
    ):
        with pytest.raises(SystemExit) as stop:
            xfam_main.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == CLEAN_EXIT and err.count("xfam: error:") == 1 and text in err and "Fix:" in err, err
