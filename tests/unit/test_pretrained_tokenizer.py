"""Pretrained Hugging Face tokenizers (``data.tokenizer=<path>``): loading, special tokens, bytes per token,
fingerprints, checkpoint state and the checks run before anything starts.

Every tokenizer here is trained inside the test on a few hundred lines with ``tokenizers`` (the GPT-2,
SentencePiece and BERT schemes in miniature); nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from xfam.core.errors import ConfigError
from xfam.data.tokenize import (
    PretrainedTokenizer,
    build_tokenizer,
    load_pretrained,
    tokenizer_from_state,
    tokenizer_problems,
)

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "naïve",
    "café",
    "owners",
    "déjà",
    "vu",
    "played",
    "Ünïcödé",
    "中文",
    "字符",
    "tests",
    "—",
    "quickly",
]
TEXTS = [
    "Hello, wörld! naïve café — 中文 字符 😀 emoji",
    "def f(x):\n\treturn x ** 2  # two  spaces\r\n",
    "Ünïcödé ñ ß 𝄞 ✓ and plain ascii 12345",
    "a",
]


def corpus(n: int = 300) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def gpt2_like() -> Tokenizer:
    """Byte-level BPE with <|endoftext|> and <pad> specials and one added ordinary token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens(["<|custom|>"])  # an added, non-special token: stands for its own text
    return tok


def sentencepiece_like(legacy: bool, bytes_in_added: bool) -> str:
    """A Llama-2-style BPE: byte fallback, <unk> <s> </s>, <0x00>..<0xFF> in the vocabulary. ``legacy``: the
    space handling is a normalizer (Prepend + Replace) instead of a Metaspace pre-tokenizer. Returns JSON."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    spec = json.loads(tok.to_str())
    if not bytes_in_added:  # as in Llama 2's tokenizer.json: byte tokens only in the model vocabulary
        spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] not in byte_tokens]
    return json.dumps(spec)


def wordpiece_like() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpt2") / "tokenizer.json"
    gpt2_like().save(str(path))
    return path


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory, gpt2_file) -> Path:
    folder = tmp_path_factory.mktemp("gpt2_folder")
    shutil.copy(gpt2_file, folder / "tokenizer.json")
    eos = {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False, "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "model_max_length": 1024}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    return folder


# ---------------------------------------------------------------- byte-level BPE (GPT-2 style)


def test_byte_level_by_file_path(gpt2_file):
    tok = load_pretrained(str(gpt2_file))
    assert isinstance(tok, PretrainedTokenizer)
    assert tok.vocab_size == len(tok._tok.get_vocab(with_added_tokens=True)) > 300
    assert tok._tok.token_to_id("<|custom|>") == tok.vocab_size - 1
    assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
    assert tok.bos_id is None  # a bare tokenizer.json: GPT-2 has no well-known BOS name
    assert tok.pad_id == tok._tok.token_to_id("<pad>")
    assert tok.special_tokens == ["<|endoftext|>", "<pad>"]
    assert tok.config["eos"] == "<|endoftext|>" and tok.config["kind"] == "pretrained"
    for text in [*TEXTS, "x <|custom|> y"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert sum(tok.token_bytes[i] for i in ids) == utf8_len(text)  # exact for byte-level BPE
    arrays = tok.encode_docs([*TEXTS, TEXTS[0].encode("utf-8")])
    assert all(a.dtype == np.uint16 for a in arrays)
    assert arrays[0].tolist() == arrays[-1].tolist() == tok.encode(TEXTS[0])  # bytes documents are text
    assert tok.encode_array(TEXTS[1]).dtype == np.uint16
    assert tok.token_bytes[tok.eos_id] == tok.token_bytes[tok.pad_id] == 0
    assert tok.id_bytes()[tok._tok.token_to_id("<|custom|>")] == b"<|custom|>"


def test_byte_level_by_folder_reads_the_special_tokens(gpt2_folder):
    tok = load_pretrained(str(gpt2_folder))
    assert tok.config["eos"] == "<|endoftext|>"  # from tokenizer_config.json, a {"content": ...} dict
    assert tok.bos_id == tok.eos_id  # from special_tokens_map.json
    assert tok.config["pad"] == "<pad>"  # set in neither file: the well-known name
    assert tok.decode([tok.bos_id, *tok.encode("hi"), tok.eos_id, tok.pad_id]) == "hi"


def test_a_literal_special_token_in_a_document_stays_text(gpt2_file):
    tok = load_pretrained(str(gpt2_file))
    text = "end of one <|endoftext|> not a boundary <pad>"
    ids = tok.encode(text)
    assert tok.eos_id not in ids and tok.pad_id not in ids
    assert tok.decode(ids) == text
    assert sum(tok.token_bytes[i] for i in ids) == utf8_len(text)
    assert tok.eos_id not in tok.encode_docs([text])[0].tolist()


def test_truncation_and_padding_saved_in_the_file_are_ignored(tmp_path):
    raw = gpt2_like()
    raw.enable_truncation(4)
    raw.enable_padding(length=64)
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_pretrained(str(tmp_path / "tokenizer.json"))
    text = " ".join(WORDS)
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode_docs([text, "a"])[1]) == 1


def test_home_is_expanded(gpt2_file, monkeypatch):
    monkeypatch.setenv("HOME", str(gpt2_file.parent.parent))
    tok = load_pretrained(f"~/{gpt2_file.parent.name}/tokenizer.json")
    assert tok.config == load_pretrained(str(gpt2_file)).config


def test_build_tokenizer_takes_a_path(gpt2_folder):
    tok = build_tokenizer(str(gpt2_folder), 300, "unused", iter(()))
    assert isinstance(tok, PretrainedTokenizer) and tok.config == load_pretrained(str(gpt2_folder)).config


# ---------------------------------------------------------------- SentencePiece style (Llama 2)


@pytest.mark.parametrize("legacy", [False, True], ids=["metaspace", "normalizer"])
@pytest.mark.parametrize("bytes_in_added", [False, True], ids=["bytes_in_model", "bytes_added"])
def test_sentencepiece_like(tmp_path, legacy, bytes_in_added):
    (tmp_path / "tokenizer.json").write_text(sentencepiece_like(legacy, bytes_in_added))
    tok = load_pretrained(str(tmp_path))
    assert tok.config["eos"] == "</s>" and tok.config["bos"] == "<s>" and tok.pad_id is None
    assert tok.special_tokens == ["<unk>", "<s>", "</s>"]  # the byte tokens are not special tokens here
    assert tok.id_bytes()[tok._tok.token_to_id("<0x41>")] == b"A"
    for text in TEXTS[:3]:
        ids = tok.encode(text)
        assert sum(tok.token_bytes[i] for i in ids) - utf8_len(text) in (0, 1)  # the dummy-prefix space
        assert tok.decode(ids) == text
    emoji = tok.encode("😀")  # not in the corpus: four byte-fallback tokens
    assert sum(tok.token_bytes[i] for i in emoji) - 4 in (0, 1)


# ---------------------------------------------------------------- WordPiece (BERT)


def test_wordpiece(tmp_path):
    wordpiece_like().save(str(tmp_path / "tokenizer.json"))
    tok = load_pretrained(str(tmp_path / "tokenizer.json"))
    assert tok.config["eos"] == "[SEP]" and tok.config["bos"] == "[CLS]" and tok.config["pad"] == "[PAD]"
    normal = [i for i in range(tok.vocab_size) if i not in tok._drop]
    assert normal and all(tok.token_bytes[i] > 0 for i in normal)
    pieces = [t for t in tok._tok.get_vocab() if t.startswith("##") and len(t) > 2]
    assert pieces and tok.id_bytes()[tok._tok.token_to_id(pieces[0])] == pieces[0][2:].encode("utf-8")
    assert tok.decode(tok.encode("the cat sat")) == "the cat sat"


# ---------------------------------------------------------------- vocabulary size, fingerprint, state


def test_a_vocabulary_over_65536_ids_gets_uint32(tmp_path):
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_pretrained(str(tmp_path / "tokenizer.json"))
    assert tok.vocab_size == 70_001
    (ids,) = tok.encode_docs(["w0 w69999"])
    assert ids.dtype == np.uint32 and ids.tolist() == [1, 70_000]
    assert tok.id_bytes()[70_000] == b"w69999"


def test_vocab_size_counts_ids_with_gaps(tmp_path):
    raw = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "b": 5}, unk_token="<unk>"))
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_pretrained(str(tmp_path / "tokenizer.json"))
    assert tok.vocab_size == 6 and len(tok.token_bytes) == 6
    assert tok.token_bytes[5] == 1 and tok.token_bytes[1:5] == [0, 0, 0, 0]


def test_fingerprint_follows_the_content_not_the_path(tmp_path, gpt2_file):
    before = load_pretrained(str(gpt2_file)).config
    copy = tmp_path / "elsewhere" / "my-tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(gpt2_file, copy)
    assert load_pretrained(str(copy)).config == before
    assert str(gpt2_file) not in json.dumps(before) and str(copy) not in json.dumps(before)
    raw = Tokenizer.from_file(str(copy))
    raw.add_tokens(["newtoken"])
    raw.save(str(copy))
    after = load_pretrained(str(copy)).config
    assert after["sha256"] != before["sha256"] and len(after["sha256"]) == 16


def test_state_rebuilds_the_tokenizer_without_the_file(tmp_path, gpt2_folder):
    folder = tmp_path / "t"
    shutil.copytree(gpt2_folder, folder)
    tok = load_pretrained(str(folder))
    state = json.loads(json.dumps(tok.state()))  # plain data, as kept in a checkpoint
    shutil.rmtree(folder)
    again = tokenizer_from_state(state)
    assert isinstance(again, PretrainedTokenizer)
    assert again.config == tok.config and again.id_bytes() == tok.id_bytes()
    assert (again.eos_id, again.bos_id, again.pad_id) == (tok.eos_id, tok.bos_id, tok.pad_id)
    assert [a.tolist() for a in again.encode_docs(TEXTS)] == [a.tolist() for a in tok.encode_docs(TEXTS)]


def test_a_configured_eos_missing_from_the_vocabulary_is_a_config_error(tmp_path, gpt2_file):
    shutil.copy(gpt2_file, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ConfigError, match=r"<\|im_end\|>") as err:
        load_pretrained(str(tmp_path))
    assert "<|endoftext|>" in str(err.value) and "Fix:" in str(err.value)  # lists the special tokens it has
    (problem,) = tokenizer_problems(str(tmp_path))
    assert "<|im_end|>" in problem


# ---------------------------------------------------------------- validation before anything runs


def test_valid_values_have_no_problems(gpt2_file, gpt2_folder):
    for value in ("byte", "bpe", str(gpt2_file), str(gpt2_folder)):
        assert tokenizer_problems(value) == []


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing.json", "exists"),
        ("empty_folder", "holds no tokenizer.json"),
        ("slow_folder", "vocab.json"),
        ("not_json.json", "not a JSON file"),
        ("other.json", "not a tokenizer"),
        ("bad_model.json", "cannot read it"),
    ],
)
def test_each_bad_path_is_one_problem_naming_it_and_the_fix(tmp_path, case, expect):
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "slow_folder").mkdir()
    (tmp_path / "slow_folder" / "vocab.json").write_text("{}")
    (tmp_path / "not_json.json").write_text("not json {")
    (tmp_path / "other.json").write_text(json.dumps({"name": "a config, not a tokenizer"}))
    (tmp_path / "bad_model.json").write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    value = str(tmp_path / case)
    (problem,) = tokenizer_problems(value)
    assert repr(value) in problem and expect in problem
    assert "'byte', 'bpe'" in problem and "Fix:" in problem
    with pytest.raises(ConfigError):
        load_pretrained(value)


@pytest.mark.parametrize("value", ["gpt2", "meta-llama/Llama-2-7b-hf"])
def test_a_hub_id_says_xfam_does_not_download(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    (problem,) = tokenizer_problems(value)
    assert repr(value) in problem and "does not download" in problem
    assert "from_pretrained" in problem and ".save(" in problem and "Fix:" in problem
    with pytest.raises(ConfigError, match="does not download"):
        build_tokenizer(value, 300, "unused", iter(()))


def test_problems_follow_the_file_when_it_changes(tmp_path, gpt2_file):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    assert len(tokenizer_problems(str(path))) == 1
    shutil.copy(gpt2_file, path)  # a new size and mtime: checked again
    assert tokenizer_problems(str(path)) == []


def test_a_typo_of_byte_or_bpe_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (problem,) = tokenizer_problems("BPE")
    assert "'BPE'" in problem and "write 'bpe'" in problem and "download" not in problem


def test_pairs_take_the_tokenizers_own_special_ids_and_add_only_the_missing_ones():
    from types import SimpleNamespace

    from xfam.data.hf_pairs import special_ids
    from xfam.data.tokenize import ByteTokenizer

    assert special_ids(ByteTokenizer()) == (256, 257, 258, 259)  # as before: bos and pad after the vocabulary
    llama2_like = SimpleNamespace(vocab_size=100, eos_id=2, bos_id=1, pad_id=None)
    assert special_ids(llama2_like) == (2, 1, 100, 101)
    pad_is_eos = SimpleNamespace(vocab_size=100, eos_id=2, bos_id=None, pad_id=2)  # (Llama 3 configs often do this)
    assert special_ids(pad_is_eos) == (2, 100, 101, 102)  # padding never a real token
    no_eos = SimpleNamespace(vocab_size=50, eos_id=None, bos_id=None, pad_id=0)
    assert special_ids(no_eos) == (50, 51, 0, 52)
