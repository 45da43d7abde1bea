"""Tokenizers of the text sources: raw bytes, or a byte-level BPE trained locally on the train split.

Both map text to ids below ``vocab_size`` and reserve one id, ``eos_id``, for the end-of-document
token that packing puts after every document. ``id_bytes()[i]`` is the byte string token ``i``
stands for (empty for special tokens); ``token_bytes`` holds its length, which turns a loss in nats
per token into bits per byte. ``config`` is what enters the data fingerprint.

* ``ByteTokenizer``: ids 0..255 are the UTF-8 bytes, 256 is ``eos``; vocab 257. Encoding is one
  ``numpy.frombuffer`` per document.
* ``BPETokenizer``: a byte-level BPE (the GPT-2 scheme: Radford et al., 2019) trained with the
  ``tokenizers`` package, ``<eos>`` = id 0, the 256 byte symbols always in the vocabulary (no
  unknown token). Trained once per (train corpus fingerprint, vocab size) and cached as JSON
  under the ``datasets`` cache (a cached file that cannot be loaded is trained again, with a
  warning). It is trained on, and encodes, text: ``tokenizers`` takes ``str``, so invalid UTF-8 in
  a document (``_as_text``: ``errors="replace"``) reaches it as U+FFFD, and the model learns the
  replaced text; ``data=text`` warns about such documents (``xfam.data.text``). The byte tokenizer
  takes the bytes as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xfam.core.logs import log

EOS = "<eos>"


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id (uint8 / uint16 / uint32)."""
    return "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 65536 else "uint32"


def short_hash(*parts: Any) -> str:
    """A 16-hex-digit hash of JSON-able parts (stable across processes and machines)."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_root() -> Path:
    """Where xfam keeps files of its own (tokenizers, map outputs): ``<datasets cache>/xfam``.

    The ``datasets`` cache is ``HF_DATASETS_CACHE`` (default ``$HF_HOME/datasets``).
    """
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "xfam"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, ``eos`` = 256."""

    vocab_size = 257
    eos_id = 256

    def __init__(self) -> None:
        self.config: dict[str, Any] = {"kind": "byte", "vocab_size": 257}
        self.token_bytes = [1] * 256 + [0]

    def state(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer (kept in checkpoints)."""
        return {"kind": "byte"}

    def id_bytes(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)] + [b""]

    def encode(self, text: str | bytes) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(raw, dtype=np.uint8)

    def encode_docs(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode_array(d) for d in docs]

    def decode(self, ids: Iterable[int]) -> str:
        arr = np.asarray(list(ids), dtype=np.int64)
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters (byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    chars = {b: chr(b) for b in keep}
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return chars


class BPETokenizer:
    """A trained byte-level BPE (``tokenizers``); ``<eos>`` is id 0 and is never read from text."""

    def __init__(self, json_text: str):
        from tokenizers import Tokenizer

        self.json = json_text
        self._tok = Tokenizer.from_str(json_text)
        self._tok.encode_special_tokens = True  # a literal "<eos>" in a document stays text
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = self._tok.token_to_id(EOS)
        self.token_bytes = [len(b) for b in self.id_bytes()]
        digest = hashlib.sha256(json_text.encode()).hexdigest()[:16]
        self.config = {"kind": "bpe", "vocab_size": self.vocab_size, "sha256": digest}

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        return cls(path.read_text())

    def state(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer without the data (kept in checkpoints)."""
        return {"kind": "bpe", "json": self.json}

    def id_bytes(self) -> list[bytes]:
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        out = []
        for i in range(self.vocab_size):
            token = self._tok.id_to_token(i)
            out.append(b"" if i == self.eos_id else bytes(to_byte[c] for c in token))
        return out

    def encode(self, text: str | bytes) -> list[int]:
        return self._tok.encode(_as_text(text), add_special_tokens=False).ids

    def encode_docs(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        encoded = self._tok.encode_batch_fast([_as_text(d) for d in docs], add_special_tokens=False)
        dtype = token_dtype(self.vocab_size)
        return [np.asarray(e.ids, dtype=dtype) for e in encoded]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if i != self.eos_id], skip_special_tokens=False)


def _as_text(doc: str | bytes) -> str:
    return doc if isinstance(doc, str) else bytes(doc).decode("utf-8", errors="replace")


def train_bpe(texts: Iterator[str | bytes], vocab_size: int, path: Path) -> BPETokenizer:
    """Train a byte-level BPE on ``texts`` and save it (atomically) to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_as_text(t) for t in texts), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return BPETokenizer.load(path)


def build_tokenizer(
    kind: str, bpe_vocab_size: int, corpus_fingerprint: str, train_texts: Iterable[str | bytes]
) -> ByteTokenizer | BPETokenizer:
    """The byte tokenizer, or the BPE of this train corpus (loaded from the cache, else trained)."""
    if kind == "byte":
        return ByteTokenizer()
    path = cache_root() / "tokenizers" / f"bpe-{corpus_fingerprint}-{bpe_vocab_size}.json"
    if path.exists():
        try:
            tok = BPETokenizer.load(path)
            problem = None if tok.eos_id is not None else f"no {EOS} token"
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            problem = f"{type(err).__name__}: {err}"
        if problem is None:
            return tok
        log.warning("tokenizer cache %s cannot be read (%s); training it again", path, problem)
    return train_bpe(iter(train_texts), bpe_vocab_size, path)


def tokenizer_from_state(state: dict[str, Any]) -> ByteTokenizer | BPETokenizer:
    """The tokenizer described by ``state()`` (from a checkpoint): no data needed."""
    return ByteTokenizer() if state["kind"] == "byte" else BPETokenizer(state["json"])
