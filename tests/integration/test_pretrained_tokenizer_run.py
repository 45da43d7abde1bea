"""A pretrained tokenizer end to end: ``data.tokenizer=<tokenizer.json>`` trains with the tokenizer's vocabulary
and end-of-document token, the checkpoint carries it (``xfam generate`` decodes with it, with no data and no
tokenizer file), and a vocabulary larger than ``model.vocab_size`` is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, run_cli, text_data
from xfam.config.validation import validate
from xfam.core.errors import ConfigError
from xfam.training.runner import train


@pytest.fixture(scope="module")
def gpt2_like(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2-style byte-level BPE with <|endoftext|>, trained here on the test corpus and saved as a file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((p.read_text() for p in sorted(corpus.glob("*.txt"))), trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def ids(path: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def test_a_run_trains_and_generates_with_a_pretrained_tokenizer(gpt2_like: Path, corpus: Path, tmp_path: Path) -> None:
    overrides = [*TINY, *text_data(corpus), f"data.tokenizer={gpt2_like}", "trainer.max_steps=3"]
    train(compose_cfg(overrides), tmp_path)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    info = ckpt["xfam"]["data_info"]
    assert info["vocab_size"] == ids(gpt2_like) > 300 and info["tokenizer"]["kind"] == "pretrained"
    assert info["tokenizer"]["json"] == gpt2_like.read_text()
    assert sum(info["token_bytes"]) > info["vocab_size"]  # merges stand for several bytes each
    manifest = json.loads((tmp_path / "data_manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == "pretrained" and manifest["token_dtype"] == "uint16"
    assert manifest["splits"]["train"]["shards"] and manifest["splits"]["train"]["text_bytes"] > 0
    ckpt_path = tmp_path / "checkpoints" / "last.ckpt"
    gpt2_like.rename(gpt2_like.with_suffix(".moved"))  # decoding needs only the checkpoint
    try:
        args = ["-m", "xfam.cli", "generate", f"ckpt={ckpt_path}", "prompt=the quick", "max_new_tokens=8", "check=true"]
        out = run_cli(args)
    finally:
        gpt2_like.with_suffix(".moved").rename(gpt2_like)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "the quick" in out.stdout and "OK" in out.stdout
    res = run_cli(["-m", "xfam.cli", "eval", f"ckpt={ckpt_path}", "split=test"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "test/bpb" in res.stdout


def test_a_vocabulary_larger_than_the_model_is_refused_before_any_work(gpt2_like: Path, corpus: Path) -> None:
    cfg = compose_cfg([*TINY, *text_data(corpus), f"data.tokenizer={gpt2_like}", "model.vocab_size=300"])
    n = ids(gpt2_like)
    with pytest.raises(
        ConfigError, match=rf"{n} token ids, more than model.vocab_size=300.*Fix: model.vocab_size=null"
    ):
        validate(cfg)


def test_a_missing_tokenizer_file_is_refused_before_any_work(corpus: Path, tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, *text_data(corpus), f"data.tokenizer={tmp_path / 'nope' / 'tokenizer.json'}"])
    with pytest.raises(ConfigError, match="data.tokenizer="):
        validate(cfg)
    assert not list(tmp_path.iterdir())


def test_token_bytes_count_every_byte_of_the_text_once(gpt2_like: Path, corpus: Path, tmp_path: Path) -> None:
    """Bits per byte are comparable across tokenizers: the bytes the targets stand for are the text's bytes."""
    import datasets

    from xfam.data.text import TextSource

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
        sources = {}
        for tokenizer in ("byte", str(gpt2_like)):
            src = TextSource(paths=[str(corpus)], extensions=[".txt"], tokenizer=tokenizer, seq_len=16)
            src.prepare()
            sources[tokenizer] = src
    for src in sources.values():
        for name in ("train", "validation", "test"):
            stream = np.concatenate(list(src.split(name).stream.pieces())).astype(np.int64)
            assert int(np.asarray(src.token_bytes)[stream].sum()) == src.manifest["splits"][name]["text_bytes"]
    byte, bpe = sources.values()
    assert len(bpe.split("train").stream) < len(byte.split("train").stream) / 2  # fewer tokens, the same bytes
