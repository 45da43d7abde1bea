"""``xfam export``: a training checkpoint to a model folder without pickle, in Hugging Face's layout (the folder and
its reader: ``xfam.model.exported``; the model card: ``xfam.model.model_card``).

A training checkpoint is a pickle (``torch.load``, restricted to weights but a pickle still) holding the optimizer
and loop state too; the folder holds what using the model needs, as JSON and safetensors: anyone can load it
without running code from it, and the Hugging Face Hub shows it as a model with its card. The model is rebuilt
from the checkpoint and its ``state_dict`` written, so the folder loads exactly what ``xfam.load_model`` of the
checkpoint gives (the same modules, the same tensors bit for bit), and the written folder is read back and compared
before ``export`` returns.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from xfam.core.errors import ConfigError
from xfam.model import exported
from xfam.model.build import build_model
from xfam.model.checkpoint import disk_errors
from xfam.model.checkpoint_file import model_weights, read
from xfam.model.model_card import model_card


def export(ckpt: str | Path, out: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Write the model of training checkpoint ``ckpt`` (a ``.ckpt`` file or a sharded checkpoint's folder) into the
    folder ``out`` (``xfam.model.exported``'s layout) and return the written ``config.json``. ``out`` must be absent
    or empty unless ``force``, which replaces the files an export writes and leaves any other file (a hub clone's
    ``.git``) alone."""
    src, out = Path(ckpt), Path(out)
    check_out(src, out, force)
    saved = read(src)  # one ConfigError for a file that cannot be read, with its digests checked
    meta = saved["xfam"]
    model = build_model(meta["config"], meta["data_info"])
    model.load_state_dict(model_weights(src, saved))
    model.eval()
    state = model.state_dict()
    tensors, aliases = stored_tensors(state)
    config = folder_config(meta, saved, src, aliases)
    with disk_errors(out):  # a full disk: one line with the fix
        out.mkdir(parents=True, exist_ok=True)
        for name in exported.FILES:  # a forced export leaves no file of an earlier one behind (a stale tokenizer.json)
            (out / name).unlink(missing_ok=True)
        config["weights"]["sha256"] = write_weights(tensors, aliases, out / exported.WEIGHTS_FILE)
        config["data_info"]["tokenizer"] = write_tokenizer(meta["data_info"].get("tokenizer"), out)
        _write_text(out / exported.CARD_FILE, model_card(model, meta, config, src, out.resolve().name))
        _write_text(out / exported.CONFIG_FILE, json.dumps(config, indent=1) + "\n")  # last: the folder is whole
    check_written(out, meta, state)
    return config


def check_out(src: Path, out: Path, force: bool) -> None:
    """Refuse an ``out`` that is a file, the checkpoint itself, a training checkpoint's folder, or a folder holding
    files (unless ``force``)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"out={str(out)!r} is a file. Fix: out=<a new folder>, e.g. out={out.with_suffix('')}-export."
        )
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise ConfigError(f"out={str(out)!r} is the checkpoint {str(src)!r} or inside it. Fix: out=<another folder>.")
    if (out / "meta.pt").exists():
        raise ConfigError(
            f"out={str(out)!r} is a sharded training checkpoint (it has meta.pt); an export never writes into one, "
            f"even with force=true. Fix: out=<another folder>."
        )
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(
            f"out={str(out)!r} exists and is not empty. Fix: out=<a new or empty folder>, or force=true to replace the "
            f"files an export writes there ({', '.join(exported.FILES)}; other files stay)."
        )


def stored_tensors(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of ``state`` to write, each shared tensor once, and ``{alias: stored name}`` for the others.

    safetensors refuses tensors that share memory. A name whose tensor is the same view of the same storage as an
    earlier name's (tied embeddings, a block shared across layers) is an alias of it; any other tensor is written
    as a contiguous copy of its own when it is a view (non-contiguous, part of a larger storage, or overlapping a
    tensor already kept), so every entry owns exactly its bytes."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}  # (device, storage, offset, shape, stride, dtype) -> the name kept
    storages: set[tuple] = set()
    for name, t in state.items():
        t = t.detach()
        storage = (t.device, t.untyped_storage().data_ptr())
        view = (*storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and view in views:
            aliases[name] = views[view]
            continue
        whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        if not whole or (t.numel() and storage in storages):
            t = t.contiguous().clone()
        if t.numel():
            views[view] = name
            storages.add(storage)
        tensors[name] = t.cpu()
    return tensors, aliases


def write_weights(tensors: dict[str, torch.Tensor], aliases: dict[str, str], path: Path) -> str:
    """``model.safetensors`` (header metadata: ``format: pt`` as ``transformers`` writes it, and the aliases),
    written under a temporary name and renamed; returns its SHA-256."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt", exported.ALIASES_KEY: json.dumps(aliases)})
        os.chmod(tmp, 0o644)  # (safetensors creates it readable by its owner only; the folder is to be shared)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return exported.file_sha256(path)


def write_tokenizer(state: dict[str, Any] | None, out: Path) -> dict[str, Any] | None:
    """A BPE or pretrained tokenizer's JSON as ``tokenizer.json`` (its bytes as trained: the data fingerprint
    hashes them) with a ``tokenizer_config.json`` naming its special tokens, as ``transformers`` reads them;
    returns the ``data_info["tokenizer"]`` entry of ``config.json`` (the byte tokenizer has no file)."""
    if state is None or "json" not in state:
        return state
    _write_bytes(out / exported.TOKENIZER_FILE, state["json"].encode("utf-8"))
    special = state.get("special") or ({"eos": "<eos>"} if state["kind"] == "bpe" else {})
    hf = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    hf |= {f"{key}_token": name for key, name in special.items() if name is not None}
    _write_text(out / exported.TOKENIZER_CONFIG_FILE, json.dumps(hf, indent=1) + "\n")
    return {**{k: v for k, v in state.items() if k != "json"}, "file": exported.TOKENIZER_FILE}


def folder_config(meta: dict[str, Any], saved: dict[str, Any], src: Path, aliases: dict[str, str]) -> dict[str, Any]:
    """``config.json``: the layout, the checkpoint's metadata (``META_KEYS``) and where the export came from;
    refused when the metadata holds something JSON would not give back as it is (a tensor, a key that is not a
    string)."""
    for key in exported.META_KEYS:
        if problem := json_problem(meta.get(key), key):
            raise ConfigError(
                f"the checkpoint's metadata cannot be written as JSON: {problem}. Fix: export a checkpoint written by "
                f"this version of xfam (train, or resume it for a step, with this version)."
            )
    return {
        "format": exported.FORMAT,
        "format_version": exported.FORMAT_VERSION,
        "library_name": "xfam",
        "model_type": "xfam",
        **json.loads(json.dumps({key: meta[key] for key in exported.META_KEYS})),
        "step": saved.get("global_step"),
        "epoch": saved.get("epoch"),
        "source": src.name,
        "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "weights": {"file": exported.WEIGHTS_FILE, "sha256": None, "aliases": aliases},
    }


def json_problem(value: Any, where: str) -> str | None:
    """Where ``value`` holds what a JSON round trip would not give back (None: nothing): a key that is not a string,
    a tensor, a set. Tuples come back as lists (the model is built from either); a non-finite float is written as
    Python's JSON writes it (NaN, Infinity) and read back."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r} ({type(key).__name__}, not a string)"
            if problem := json_problem(item, f"{where}.{key}"):
                return problem
        return None
    if isinstance(value, (list, tuple)):
        return next((p for i, item in enumerate(value) if (p := json_problem(item, f"{where}[{i}]"))), None)
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    return f"{where} is a {type(value).__name__}"


def check_written(out: Path, meta: dict[str, Any], state: Mapping[str, torch.Tensor]) -> None:
    """Read the folder back as ``xfam.load_model`` will and compare: the same metadata, every tensor bit for bit."""
    back_meta, back = exported.read_folder(out)
    same_meta = _json(back_meta) == _json({key: meta[key] for key in exported.META_KEYS})
    differ = sorted(k for k in state if k not in back or not _same(back[k], state[k].detach().cpu()))
    differ += sorted(set(back) - set(state))
    if differ or not same_meta:
        what = f"tensors {', '.join(differ[:5])}" if differ else "the metadata"
        raise ConfigError(
            f"the folder {str(out)!r} was written but reads back with other {what} (a disk error). Fix: export again, "
            f"to another disk if it repeats."
        )


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals itself)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, text.encode("utf-8"))


def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` under a temporary name, then rename it: a file of the folder is whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
