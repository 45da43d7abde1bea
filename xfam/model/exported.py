"""Reading an exported model folder (``xfam export``, written by ``xfam.model.export``) without pickle: JSON and
safetensors only, so a folder from anyone can be loaded without running its code.

The folder follows the Hugging Face layout:

* ``config.json``: ``format`` (``FORMAT``) and ``format_version`` (refused when unknown or newer), the checkpoint's
  ``xfam`` metadata (``META_KEYS``: the resolved run config, ``data_info``, versions, the data fingerprint) and
  where it came from (``step``, ``exported``, ``source``); ``weights`` names the weights file, its SHA-256 (checked
  on every load, as a checkpoint's digest is) and the aliases of shared tensors;
* ``model.safetensors``: the model's ``state_dict`` (no optimizer), each shared tensor stored once: a tied output
  layer or a block shared across layers is one entry, and ``weights["aliases"]`` maps each other name to it (the
  same map is in the file's own header metadata, ``xfam_aliases``);
* ``tokenizer.json`` (and ``tokenizer_config.json``): a BPE or pretrained tokenizer's JSON, as ``tokenizers``
  and ``transformers`` read it; ``data_info["tokenizer"]`` then says ``"file": "tokenizer.json"`` instead of
  holding the text;
* ``README.md``: the model card (``xfam.model.model_card``), read by people, not here.

``read_folder`` returns exactly the ``(metadata, state_dict)`` a checkpoint gives, so ``xfam.load_model`` and every
command that takes ``ckpt=`` treat both alike. Nothing here imports torch or safetensors before a folder is read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from xfam.core.errors import ConfigError

#: ``config.json``'s ``format``: a reader refuses any other.
FORMAT = "xfam-model"
#: The layout's version; bumped when a reader of this one could not read the new one.
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CARD_FILE = "README.md"
#: Every file an export writes (a forced export into a folder replaces these and leaves others alone).
FILES = (WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CARD_FILE, CONFIG_FILE)
#: The keys of a checkpoint's ``xfam`` metadata that ``config.json`` holds and ``read_folder`` returns.
META_KEYS = ("xfam_version", "config_version", "git_commit", "packages", "data_fingerprint", "config", "data_info")
#: Key in the safetensors header metadata of the aliases of shared tensors (JSON: ``{alias: stored name}``).
ALIASES_KEY = "xfam_aliases"


def is_exported(path: str | Path) -> bool:
    """Whether ``path`` looks like an exported model folder: a folder with ``config.json`` and no ``meta.pt`` (a
    sharded training checkpoint's). Whose ``config.json`` it is, ``read_folder`` checks."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file() and not (path / "meta.pt").exists()


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (what ``sha256sum`` prints and the Hugging Face Hub shows for a large file)."""
    from xfam.model.sharded import file_digest  # (imports torch: only once a folder is read)

    return file_digest(path, hashlib.sha256())


def read_config(folder: str | Path) -> dict[str, Any]:
    """``config.json`` of an exported folder, refused unless ``format`` is this layout at a version this reader
    knows."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    fix = (
        f"Fix: pass a folder written by `xfam export`, or export the checkpoint again "
        f"(xfam export ckpt=<.ckpt> out={folder})."
    )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{str(path)!r} cannot be read as JSON ({type(err).__name__}: {err}). {fix}") from err
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else None
        raise ConfigError(
            f"{str(folder)!r} is not an xfam model folder: its {CONFIG_FILE} has format {found!r}, not {FORMAT!r} "
            f"(a folder of another library, or not written by `xfam export`). {fix}"
        )
    version = config.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise ConfigError(
            f"{str(folder)!r} has format_version {version!r}; this xfam reads {FORMAT} versions 1 to {FORMAT_VERSION}. "
            f"Fix: upgrade xfam (a newer xfam wrote the folder), or export the checkpoint again with this one."
        )
    missing = [k for k in (*META_KEYS, "weights") if k not in config]
    if missing:
        raise ConfigError(f"{str(path)!r} lacks {', '.join(missing)}: it is incomplete. {fix}")
    return config


def read_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint metadata (``META_KEYS``, the tokenizer's JSON put back in ``data_info``) and the model's
    ``state_dict`` (aliases restored) of an exported folder, read with ``json`` and ``safetensors`` only; a
    missing file, a weights file that changed since the export, or an unknown layout is a ``ConfigError``."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    config = read_config(folder)
    weights = config["weights"]
    path = folder / weights.get("file", WEIGHTS_FILE)
    if not path.is_file():
        raise ConfigError(
            f"{str(folder)!r} has no {path.name}, the model's weights. Fix: copy the whole folder again from its "
            f"source (every file `xfam export` wrote: {', '.join(FILES)})."
        )
    if weights.get("sha256") and file_sha256(path) != weights["sha256"]:
        raise ConfigError(
            f"{str(path)!r} does not match the SHA-256 recorded in {CONFIG_FILE} (the file changed after it was "
            f"exported: a disk or copy error, or an edit). Fix: copy the folder again from its source, or export the "
            f"checkpoint again."
        )
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  (safe_open has no __iter__)
    except (SafetensorError, OSError) as err:
        raise ConfigError(
            f"{str(path)!r} cannot be read as safetensors ({type(err).__name__}: {err}). Fix: copy the folder again "
            f"from its source, or export the checkpoint again."
        ) from err
    for alias, name in weights.get("aliases", {}).items():
        state[alias] = state[name]  # one tensor under both names, as the model's own state_dict has it
    meta = {key: config[key] for key in META_KEYS}
    meta["data_info"] = {**meta["data_info"], "tokenizer": tokenizer_state(folder, meta["data_info"].get("tokenizer"))}
    return meta, state


def tokenizer_state(folder: Path, saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """The tokenizer state of a checkpoint (``xfam.data.tokenize``'s ``state()``) from ``config.json``'s entry:
    the JSON text read back from the file the entry names."""
    if saved is None or "file" not in saved:
        return saved
    path = folder / saved["file"]
    if not path.is_file():
        raise ConfigError(
            f"{str(folder)!r} has no {saved['file']}, the model's tokenizer. Fix: copy the whole folder again from "
            f"its source."
        )
    text = path.read_bytes().decode("utf-8")  # bytes as written: the text's hash is in the data fingerprint
    return {**{k: v for k, v in saved.items() if k != "file"}, "json": text}
