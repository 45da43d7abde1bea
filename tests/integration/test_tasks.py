"""Every task and model shape trains end to end through ``xfam.train``, reports its metrics, and its checkpoint
loads and evaluates without Lightning: encoder-decoder and decoder-only seq2seq, masked LM, tagging."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import xfam
from tests.integration.helpers import TINY, compose_cfg, run_cli, text_data
from xfam.eval.loop import evaluate_split
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.training.runner import train

TOY = ["data=seq2seq_toy", "data.num_train=64", "data.num_val=8", "data.num_test=8", "data.batch_size=4"]
TOY += ["data.max_digits=5", "data.source_len=8", "data.target_len=8", "task.eval_generate_rows=4"]
CASES = {
    "encoder_decoder": (TOY + ["encoder.layers=1"], ["val/bleu", "val/chrf", "val/exact_match", "test/bleu"]),
    "decoder_prefix": (TOY + ["model.arch=decoder"], ["val/bleu", "val/exact_match"]),
    "calm_decoder": (TOY + ["exit=calm"], ["val/agreement", "val/bleu"]),
    "mlm": (["task=mlm"], ["val/ppl", "val/acc"]),
    "tag": (
        ["data=pytokens", "data.max_files=6", "data.seq_len=32", "data.batch_size=4", "data.val_fraction=0.34"],
        ["val/acc"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_task_trains_and_its_checkpoint_loads(case: str, corpus: Path, tmp_path: Path) -> None:
    overrides, expected = CASES[case]
    data = text_data(corpus) if case == "mlm" else []
    metrics = train(compose_cfg([*TINY, *data, *overrides]), tmp_path)
    assert set(expected) <= set(metrics), sorted(metrics)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if v is not None and k != "step")
    model, meta = xfam.load_model(tmp_path / "checkpoints" / "last.ckpt")
    assert isinstance(model, EncoderDecoder) == (case in ("encoder_decoder", "calm_decoder"))
    if case == "calm_decoder":  # inference options of the decoder's exit policy, as on a decoder LM
        res = evaluate_split(
            str(tmp_path / "checkpoints" / "last.ckpt"), "test", None, 1, "cpu", ["exit.threshold=0.5"]
        )
        assert "test/agreement" in res.metrics and "test/bleu" in res.metrics
    assert meta["data_info"]["task"] == (
        "seq2seq" if case in ("encoder_decoder", "decoder_prefix", "calm_decoder") else case
    )


def test_an_encoder_decoder_on_text_generates_and_evaluates(tmp_path: Path) -> None:
    """``xfam generate`` decodes a docstring-task checkpoint from source text or a file (greedy, beam search; cached
    logits checked against a recompute), and ``xfam eval`` scores generated outputs; a prompt alone is refused."""
    docs = ["data=docstrings", "data.max_files=40", "data.source_len=64", "data.target_len=16", "data.batch_size=4"]
    docs += ["task.eval_generate_rows=2"]
    train(compose_cfg([*TINY, *docs]), tmp_path)
    ckpt = f"ckpt={tmp_path / 'checkpoints' / 'last.ckpt'}"
    src = tmp_path / "f.py"
    src.write_text("def add(a, b):\n    return a + b\n")
    greedy = run_cli(
        ["-m", "xfam.cli", "generate", ckpt, "source='def f(x): return x'", "max_new_tokens=8", "check=true"]
    )
    assert greedy.returncode == 0 and "cached vs recomputed logits" in greedy.stdout and "OK" in greedy.stdout, greedy
    beam = run_cli(["-m", "xfam.cli", "generate", ckpt, f"source_file={src}", "max_new_tokens=8", "beam_size=3"])
    assert beam.returncode == 0, beam.stderr
    refused = run_cli(["-m", "xfam.cli", "generate", ckpt, "prompt=def", "max_new_tokens=4"])
    assert refused.returncode != 0 and "source=<text>" in refused.stderr
    ev = run_cli(["-m", "xfam.cli", "eval", ckpt, "limit=1"])
    assert ev.returncode == 0 and "test/bleu" in ev.stdout and "test/chrf" in ev.stdout, ev.stderr
