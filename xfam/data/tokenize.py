"""Tokenizers of the text sources: raw bytes, a byte-level BPE trained locally on the train split, or a
pretrained Hugging Face tokenizer brought by the user.

Each maps text to ids below ``vocab_size`` and names one id, ``eos_id``, for the end-of-document token
that packing puts after every document. ``id_bytes()[i]`` is the byte string token ``i`` stands for
(empty for special tokens); ``token_bytes`` holds its length, which turns a loss in nats per token into
bits per byte, comparable across tokenizers. ``config`` is what enters the data fingerprint; ``state()``
is plain data that rebuilds the tokenizer without any file (kept in checkpoints).

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
* ``PretrainedTokenizer`` (``data.tokenizer=<path>``): a ``tokenizer.json`` (GPT-2's, Llama's ...) or a
  local Hugging Face tokenizer folder holding one, read with ``tokenizers``; xfam never downloads one
  (``tokenizer_problems`` says how to save it once). Documents are encoded without the post-processor's
  BOS/EOS (packing adds EOS itself) and with ``encode_special_tokens``, so a literal ``<|endoftext|>``
  in a document stays text; truncation and padding saved in the file are switched off.
  ``vocab_size`` is the largest id + 1 (ids may have gaps). Special tokens: ``eos``/``bos``/``pad``
  come from the folder's ``tokenizer_config.json`` (else ``special_tokens_map.json``); for a bare
  ``tokenizer.json``, or a key set in neither, the first well-known name among the tokenizer's special
  tokens (``EOS_NAMES``, ``BOS_NAMES``, ``PAD_NAMES``), else None. Bytes per token, read from the
  JSON's model, pre-tokenizer, normalizer and decoder:

  - byte-level BPE (a ``ByteLevel`` component: GPT-2, Llama 3, Qwen): each symbol maps back to its byte
    through ``bytes_to_unicode``; the sum over ``encode(text)`` is exactly ``len(text.encode())``.
  - SentencePiece style (``Metaspace``, or a normalizer replacing " " by "▁": Llama 2, Mistral, T5):
    "▁" counts as a space and a byte-fallback token ``<0xNN>`` as one byte; exact except for the
    dummy-prefix "▁" the tokenizer prepends (one byte too many per document, at most, unless the document
    holds non-special added tokens, each of which starts a new stretch of text).
  - WordPiece (BERT): a token's UTF-8 bytes without the "##" continuation prefix. Approximate: such
    tokenizers drop spaces (and may lowercase or strip accents) before tokenizing.
  - anything else: the UTF-8 bytes of ``decode([i])``.

  ``config`` is ``{"kind": "pretrained", "vocab_size", "sha256" (of the JSON text), "eos", "bos",
  "pad"}`` with no path in it: the same tokenizer at another path gives the same data.

One file over 400 lines: the three tokenizers share one interface, one state format (kept in checkpoints)
and one loader (``build_tokenizer``), and are read together.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xfam.core.errors import ConfigError, close_matches
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
            assert token is not None  # (every id below vocab_size has a token)
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


# ---------------------------------------------------------------- pretrained (Hugging Face) tokenizers

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]", "<|eot_id|>", "<|im_end|>", "<|end|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]", "<|startoftext|>")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
_WELL_KNOWN = {"eos": EOS_NAMES, "bos": BOS_NAMES, "pad": PAD_NAMES}
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_CHOICES = "Valid choices: 'byte', 'bpe', or a path to a tokenizer.json file or a local Hugging Face tokenizer folder."
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class PretrainedTokenizer:
    """A pretrained ``tokenizers`` tokenizer (``tokenizer.json``): see the module docstring.

    ``special`` names the eos/bos/pad tokens (a missing or None entry: the first well-known name among
    the special tokens, else None); a name that is not in the vocabulary is a ``ConfigError``. ``origin``
    only phrases messages (where the JSON and the names came from). ``special_tokens`` lists the
    tokenizer's special tokens (byte-fallback ``<0xNN>`` tokens left out), for the caller's messages.
    """

    def __init__(self, json_text: str, special: dict[str, str | None] | None = None, origin: str = "tokenizer"):
        self.json, self._tok = json_text, _parse_tokenizer(json_text, origin)
        self._tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a document stays text
        self._tok.no_truncation()  # a file saved with truncation/padding would cut or pad documents
        self._tok.no_padding()
        spec = json.loads(json_text)
        vocab = self._tok.get_vocab(with_added_tokens=True)  # token -> id
        self.vocab_size = max(vocab.values()) + 1  # get_vocab_size may undercount when ids have gaps
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        added = {a["id"]: a for a in spec.get("added_tokens") or []}
        specials = sorted(i for i, a in added.items() if a.get("special"))
        self.special_tokens = [added[i]["content"] for i in specials if not _is_byte_token(added[i]["content"])]
        self.special = _resolve_special(self._tok, self.special_tokens, special or {}, origin)
        self.eos_id, self.bos_id, self.pad_id = (
            None if self.special[k] is None else self._tok.token_to_id(self.special[k]) for k in ("eos", "bos", "pad")
        )
        self._drop = {i for i in specials if not (byte_fallback and _is_byte_token(added[i]["content"]))}
        self._drop |= {i for i in (self.eos_id, self.bos_id, self.pad_id) if i is not None}
        self._id_bytes = _pretrained_id_bytes(self._tok, spec, vocab, self.vocab_size, self._drop)
        self.token_bytes = [len(b) for b in self._id_bytes]
        digest = hashlib.sha256(json_text.encode()).hexdigest()[:16]
        self.config = {"kind": "pretrained", "vocab_size": self.vocab_size, "sha256": digest, **self.special}

    def state(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer without its files (kept in checkpoints)."""
        return {"kind": "pretrained", "json": self.json, "special": dict(self.special)}

    def id_bytes(self) -> list[bytes]:
        return list(self._id_bytes)

    def encode(self, text: str | bytes) -> list[int]:
        return self._tok.encode(_as_text(text), add_special_tokens=False).ids

    def encode_array(self, text: str | bytes) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=token_dtype(self.vocab_size))

    def encode_docs(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        encoded = self._tok.encode_batch_fast([_as_text(d) for d in docs], add_special_tokens=False)
        dtype = token_dtype(self.vocab_size)
        return [np.asarray(e.ids, dtype=dtype) for e in encoded]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens (eos, bos, pad and the tokenizer's others) are dropped."""
        return self._tok.decode([int(i) for i in ids if int(i) not in self._drop], skip_special_tokens=False)


def _is_byte_token(token: str) -> bool:
    return _BYTE_TOKEN.fullmatch(token) is not None


def _parse_tokenizer(json_text: str, origin: str) -> Any:
    """``tokenizers.Tokenizer`` of ``json_text``, or a ``ConfigError`` naming ``origin``."""
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_str(json_text)
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise ConfigError(
            f"{origin}: tokenizers {tokenizers.__version__} cannot read it as a tokenizer ({err}). {_CHOICES} "
            "Fix: point it at a tokenizer.json saved by Hugging Face tokenizers/transformers (re-save it with "
            "this tokenizers version if it came from a newer one)."
        ) from None


def _resolve_special(tok: Any, specials: list[str], named: dict[str, str | None], origin: str) -> dict[str, Any]:
    """eos/bos/pad token strings: as ``named`` when set (must be in the vocabulary), else well-known names."""
    out: dict[str, str | None] = {}
    for key, names in _WELL_KNOWN.items():
        name = named.get(key)
        if name is not None and tok.token_to_id(name) is None:
            raise ConfigError(
                f"{origin}: {key}_token {name!r} is not in the tokenizer's vocabulary. Its special tokens: "
                f"{_listing(specials)}. Fix: set {key}_token to one of them in tokenizer_config.json, or remove "
                f"it to let xfam pick a well-known name ({', '.join(names)})."
            )
        out[key] = name if name is not None else next((n for n in names if n in specials), None)
    return out


def _listing(tokens: list[str], most: int = 20) -> str:
    shown = ", ".join(repr(t) for t in tokens[:most]) or "(none)"
    return shown + (f" and {len(tokens) - most} more" if len(tokens) > most else "")


def _parts(node: Any, key: str) -> list[dict[str, Any]]:
    """The components of one pipeline stage of a tokenizer JSON, ``Sequence`` nodes flattened."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [p for child in node.get(key) or [] for p in _parts(child, key)]
    return [node]


def _bytes_scheme(spec: dict[str, Any]) -> tuple[str, str]:
    """How model-vocabulary tokens stand for bytes: ("byte_level", ""), ("metaspace", replacement char),
    ("wordpiece", "") or ("generic", ""), from the JSON's model, pre-tokenizer, normalizer and decoder."""
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    dec = _parts(spec.get("decoder"), "decoders")
    norm = _parts(spec.get("normalizer"), "normalizers")
    if any(p.get("type") == "ByteLevel" for p in pre + dec + norm):
        return "byte_level", ""
    for p in pre + dec:
        if p.get("type") == "Metaspace":
            return "metaspace", p.get("replacement", "▁")
    for p in norm:  # Llama 2 style: Prepend("▁") + Replace(" ", "▁")
        if p.get("type") == "Replace" and (p.get("pattern") or {}).get("String") == " " and p.get("content"):
            return "metaspace", p["content"]
    if (spec.get("model") or {}).get("type") == "WordPiece":
        return "wordpiece", ""
    return "generic", ""


def _pretrained_id_bytes(tok: Any, spec: dict[str, Any], vocab: dict[str, int], size: int, drop: set[int]) -> list:
    """Bytes each id stands for (see the module docstring); empty for ``drop`` (special) ids and id gaps.

    One pass over the vocabulary with C-level string operations (a 128k vocabulary: ~0.1 s)."""
    scheme, space = _bytes_scheme(spec)
    model = spec.get("model") or {}
    prefix, suffix = model.get("continuing_subword_prefix") or "", model.get("end_of_word_suffix") or ""
    byte_fallback = bool(model.get("byte_fallback"))
    added = {a["id"]: a["content"] for a in spec.get("added_tokens") or []}
    tokens: list[str | None] = [None] * size
    for piece, i in vocab.items():
        tokens[i] = piece
    generic: dict[int, bytes] = {}
    if scheme == "generic":
        ids = [i for i, t in enumerate(tokens) if t is not None and i not in drop and i not in added]
        texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
        generic = {i: t.encode("utf-8") for i, t in zip(ids, texts, strict=True)}
    unbyte = str.maketrans({c: chr(b) for b, c in bytes_to_unicode().items()})
    out = []
    for i, token in enumerate(tokens):
        if token is None or i in drop:
            out.append(b"")
        elif byte_fallback and _is_byte_token(token):
            out.append(bytes([int(token[3:5], 16)]))
        elif i in added:  # an added, non-special token matches text as it is written
            out.append(token.replace(space, " ").encode("utf-8") if space else token.encode("utf-8"))
        elif scheme == "generic":
            out.append(generic[i])
        else:
            if prefix and token.startswith(prefix):
                token = token[len(prefix) :]
            if suffix and token.endswith(suffix):
                token = token[: -len(suffix)]
            out.append(_model_token_bytes(token, scheme, space, unbyte))
    return out


def _model_token_bytes(token: str, scheme: str, space: str, unbyte: dict[int, str]) -> bytes:
    if scheme == "byte_level":
        try:
            return token.translate(unbyte).encode("latin-1")
        except UnicodeEncodeError:  # a symbol outside the byte alphabet: count it as text
            return token.encode("utf-8")
    if scheme == "metaspace":
        return token.replace(space, " ").encode("utf-8")
    return token.encode("utf-8")


def _tokenizer_file(value: str) -> Path:
    """The tokenizer.json that ``data.tokenizer=value`` names (a file, or a folder holding one), else a
    ``ConfigError`` saying what is wrong and the fix."""
    if not value.strip():
        raise _problem(value, "is empty", "set it to 'byte', 'bpe' or the path of a tokenizer")
    path = _expand(value)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
        raise _problem(value, f"folder {str(path.resolve())!r} holds no tokenizer.json", _folder_fix(path))
    if path.is_file():
        return path
    where = f"no file or folder {str(path.resolve())!r} exists"
    if near := close_matches(value.lower(), ["byte", "bpe"]):
        raise _problem(
            value,
            f"{where}, and it is not a tokenizer name",
            f"write {near[0]!r} if you meant it, else the path of an existing tokenizer",
        )
    if _HUB_ID.fullmatch(value) and not value.endswith(".json"):
        raise _problem(
            value,
            f"{where}, and xfam does not download tokenizers (this looks like a Hugging Face Hub id)",
            f"on a machine with network, save it once with `tokenizers.Tokenizer.from_pretrained({value!r})"
            f".save('tokenizer.json')` or `transformers.AutoTokenizer.from_pretrained({value!r})"
            f".save_pretrained('folder')`, copy the file or folder here and set data.tokenizer to its path",
        )
    raise _problem(
        value, where, "correct the path (a leading ~ is expanded; a relative path is from the working directory)"
    )


def _expand(value: str) -> Path:
    """``value`` as a path, a leading ``~`` expanded (kept as written when the home cannot be found)."""
    try:
        return Path(value).expanduser()
    except RuntimeError:  # "~nobody/...": no such user
        return Path(value)


def _folder_fix(path: Path) -> str:
    found = {n for n in ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model") if (path / n).exists()}
    base = "point data.tokenizer at a folder or file with a tokenizer.json (the 'fast' tokenizer format)"
    if found:
        return (
            f"{base}; this folder has {', '.join(sorted(found))} (a 'slow' tokenizer): convert it once with "
            f"`transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`, which writes tokenizer.json"
        )
    return base


def _problem(value: str, what: str, fix: str) -> ConfigError:
    """The error for ``data.tokenizer=value``: what is wrong, the valid choices, the fix."""
    return ConfigError(f"data.tokenizer={value!r}: {what}. {_CHOICES} Fix: {fix}.")


def _configured_special(folder: Path, value: str) -> dict[str, str | None]:
    """eos/bos/pad token strings set in ``tokenizer_config.json``, else ``special_tokens_map.json`` (a
    value may be a string or a dict with "content"); keys set in neither, or set to null, are absent (the
    caller then looks for a well-known name)."""
    out: dict[str, str | None] = {}
    for name in reversed(_CONFIG_FILES):  # tokenizer_config.json wins
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _problem(value, f"{str(file)!r} cannot be read as JSON ({err})", f"repair or delete {name}") from None
        for key in _WELL_KNOWN:
            token = data.get(f"{key}_token") if isinstance(data, dict) else None
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                out[key] = token
    return out


def _read_pretrained(value: str) -> tuple[str, dict[str, Any], dict[str, str | None], str]:
    """(JSON text, parsed JSON, configured special names, origin for messages) of ``data.tokenizer=value``."""
    file = _tokenizer_file(value)
    origin = f"data.tokenizer={value!r}"
    try:
        text = file.read_text(encoding="utf-8")
        spec = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _problem(
            value, f"{str(file)!r} is not a JSON file ({err})", "point it at a Hugging Face tokenizer.json"
        ) from None
    folder = _expand(value)
    if not isinstance(spec, dict) or "model" not in spec:
        raise _problem(value, f'{str(file)!r} is JSON but not a tokenizer (no "model")', "point it at a tokenizer.json")
    return text, spec, (_configured_special(folder, value) if folder.is_dir() else {}), origin


def load_pretrained(path: str) -> PretrainedTokenizer:
    """The pretrained tokenizer at ``path``: a tokenizer.json file, or a folder holding one (Hugging Face
    layout, whose tokenizer_config.json / special_tokens_map.json name the special tokens); ``~`` expanded.
    Raises ``ConfigError`` for anything ``tokenizer_problems`` reports. Loaded once per process while its files
    are unchanged (``_stamps``): a start validates the config several times, then builds the data."""
    return _load_cached(path, _stamps(path))


@functools.lru_cache(maxsize=8)
def _load_cached(value: str, stamps: tuple[tuple[str, int, int], ...]) -> PretrainedTokenizer:
    text, _, special, origin = _read_pretrained(value)
    return PretrainedTokenizer(text, special, origin)


def _stamps(value: str) -> tuple[tuple[str, int, int], ...]:
    """(path, mtime, size) of the files ``value`` may name: the cache key of ``load_pretrained``."""
    path = _expand(value)
    files = [path, *(path / n for n in ("tokenizer.json", *_CONFIG_FILES))] if path.is_dir() else [path]
    out = []
    for f in files:
        try:
            st = f.stat()
            out.append((str(f.resolve()), st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((str(f), -1, -1))
    return tuple(out)


def tokenizer_problems(value: str) -> list[str]:
    """Problems with ``data.tokenizer=value``, found before anything runs: "byte" and "bpe" are fine;
    anything else must be a path to a tokenizer.json, or to a folder holding one, that ``tokenizers``
    parses and whose configured special tokens are in its vocabulary. Each problem names the value, what
    is wrong, the valid choices and the fix. Cached by the files' (path, mtime, size)."""
    if value in ("byte", "bpe"):
        return []
    try:
        load_pretrained(value)
    except ConfigError as err:
        return list(err.problems)
    return []


def build_tokenizer(
    kind: str, bpe_vocab_size: int, corpus_fingerprint: str, train_texts: Iterable[str | bytes]
) -> ByteTokenizer | BPETokenizer | PretrainedTokenizer:
    """The byte tokenizer, the BPE of this train corpus (loaded from the cache, else trained), or, for any
    other ``kind``, the pretrained tokenizer at that path (``load_pretrained``)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":
        return load_pretrained(kind)
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


def tokenizer_from_state(state: dict[str, Any]) -> ByteTokenizer | BPETokenizer | PretrainedTokenizer:
    """The tokenizer described by ``state()`` (from a checkpoint): no data or file needed."""
    if state["kind"] == "byte":
        return ByteTokenizer()
    if state["kind"] == "pretrained":
        return PretrainedTokenizer(state["json"], state.get("special"), origin="the saved pretrained tokenizer")
    return BPETokenizer(state["json"])
