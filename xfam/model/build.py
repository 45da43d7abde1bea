"""Public construction API: a model or a data source from a plain config, without Hydra."""

from __future__ import annotations

import dataclasses
from typing import Any

import xfam.attention
import xfam.exit
import xfam.memory
import xfam.pos  # noqa: F401  (registers every component)
from xfam.core import plugins
from xfam.core.errors import ConfigError
from xfam.core.registry import RESERVED, STRUCTURAL, check_params
from xfam.core.schedule import per_layer
from xfam.core.store import LongTermStore, StoreRequest
from xfam.data.base import DATA, DataSource
from xfam.memory._base import MEMORY
from xfam.model.checkpoint_file import read
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.inputs import inputs_of
from xfam.model.long_term import open_long_term
from xfam.model.spec import ModelSpec
from xfam.model.transformer import Task, XfamModel


def data_info(source: DataSource, task: str | None = None) -> dict[str, Any]:
    """What the model and the trainer need from a prepared data source (stored in checkpoints). ``task``: what
    is trained, when not the source's own (``task=mlm`` on a text source: one more token id, [MASK]).
    ``inputs``: what a row's model input is (``xfam.model.inputs``: token ids, vectors or images);
    ``target_dim``: the width of a ``regress`` source's target vectors."""
    vocab, extra = source.vocab_size, {}
    if task == "mlm":
        vocab, extra = vocab + 1, {"mask_id": vocab}
    return {
        "name": source.registry_name,
        "task": task or source.task,
        **extra,
        "bos_id": getattr(source, "bos_id", None),
        "vocab_size": vocab,
        "num_classes": source.num_classes,
        "token_bytes": source.token_bytes,
        "pad_id": source.pad_id,
        "eos_id": source.eos_id,
        "fingerprint": source.fingerprint,
        "tokenizer": source.tokenizer_state(),
        "inputs": source.inputs,
        "target_dim": source.target_dim,
        "decision": getattr(source, "decision", None),  # trajectories: the environment, return scale, references
    }


def model_io(config: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """What sizes the model's input and output layers: the task, the vocabulary (``model.vocab_size``,
    else the data's), the number of classes, the inputs (token ids unless the data says otherwise) and the
    width of regression targets."""
    vocab = config["model"].get("vocab_size") or info["vocab_size"]
    io = {"task": info["task"], "vocab_size": vocab, "num_classes": info.get("num_classes")}
    return io | {"inputs": inputs_of(info), "target_dim": info.get("target_dim")}


def check_checkpoint_data(
    ckpt: str, config: dict[str, Any], info: dict[str, Any], meta: dict[str, Any] | None = None
) -> None:
    """Refuse to resume ``ckpt`` on data its model cannot take (token ids outside its vocabulary,
    another vocabulary size, task or class count): its embedding or head has other shapes. Refuse
    other data it could take too (another data fingerprint: e.g. another corpus in a run directory
    named like this one's) unless ``allow_data_change=true`` asks for it: continuing a run on other
    data by mistake would mix two experiments silently. Runs once the data is prepared and before
    anything is written, so a refused resume changes nothing. ``meta``: the checkpoint's ``xfam`` metadata,
    when the caller has read it already."""
    from xfam.core.logs import log

    meta = read(ckpt)["xfam"] if meta is None else meta
    saved, now = model_io(meta["config"], meta["data_info"]), model_io(config, info)
    if saved == now:
        was, is_now = meta["data_info"].get("fingerprint"), info.get("fingerprint")
        if was is None or was == is_now:
            return
        if config.get("allow_data_change", False):
            log.warning("allow_data_change=true: resuming %s on other data (fingerprint %s -> %s)", ckpt, was, is_now)
            return
        raise ConfigError(
            f"checkpoint {ckpt} was trained on other data (data fingerprint {was} -> {is_now}). Nothing was "
            f"changed. Fix: resume with the data settings of the checkpoint's run (its config.yaml), start a "
            f"fresh run (ckpt_path=null, another name), or add allow_data_change=true to continue this "
            f"checkpoint on this data on purpose."
        )
    diff = [f"{key}: {saved[key]!r} -> {now[key]!r}" for key in saved if saved[key] != now[key]]
    why = "its model cannot take this data"
    if saved["task"] == now["task"] and now["vocab_size"] > saved["vocab_size"]:
        why = f"this data has token ids up to {now['vocab_size'] - 1}, outside the checkpoint's vocabulary"
    raise ConfigError(
        f"checkpoint {ckpt} was trained on other data: {why} ({'; '.join(diff)}; data fingerprint "
        f"{meta['data_info'].get('fingerprint')} -> {info.get('fingerprint')}). Nothing was changed. Fix: resume "
        f"with the data settings of the checkpoint's run (its config.yaml), or start a fresh run (ckpt_path=null, "
        f"another name)."
    )


def build_model(config: Any, info: dict[str, Any]) -> XfamModel | EncoderDecoder:
    """The model described by ``config`` for the data described by ``info`` (see ``data_info``).

    ``config``: a plain config mapping (sections model/attention/pos/memory/exit), or the ``RunConfig``
    that ``xfam.validate`` returns, whose spec and per-layer slot configs are used as validated. A run
    configuration is recognised by its ``spec`` (a ``ModelSpec``): this layer sits below ``xfam.config``
    and does not import it."""
    if isinstance(getattr(config, "spec", None), ModelSpec):  # (validated: its plugins are loaded)
        spec = config.spec
        # Each layer's config as its own item of a per_layer list (xfam.core.schedule's list form, one item
        # per layer): the model builds every layer from exactly the config validation derived for it.
        slots = {
            "attention": {"per_layer": list(config.attention)},
            "pos": config.pos,
            "memory": {"per_layer": list(config.memory)},
            "exit": config.exit,
        }
        enc = config.encoder
        encoder = None if enc is None else (enc.spec, {"per_layer": list(enc.attention)}, enc.pos)
        cross = {"per_layer": list(config.cross)} if config.cross else None
    else:
        plugins.load(config.get(plugins.KEY, []))  # a checkpoint's config: the components its run imported
        spec = ModelSpec(**config["model"])
        slots = {slot: config[slot] for slot in ("attention", "pos", "memory", "exit")}
        encoder, cross = _encoder_of(config, spec, info["task"])
    vocab = spec.vocab_size or info["vocab_size"]  # (model_io's rule)
    if vocab < info["vocab_size"]:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the data's vocabulary ({info['vocab_size']} token ids): "
            f"some ids would be outside the embedding. Fix: model.vocab_size=null (take it from the data) or "
            f">= {info['vocab_size']}."
        )
    if encoder is not None:
        enc_spec, enc_attention, enc_pos = encoder
        none = {"name": "none"}
        enc = XfamModel(
            enc_spec,
            task="encode",
            vocab_size=vocab,
            attention=enc_attention,
            pos=enc_pos,
            memory=none,
            exit=none,
            partner_layers=spec.layers,
        )
        dec = XfamModel(spec, task="lm", vocab_size=vocab, **slots, cross=cross, partner_layers=enc_spec.layers)
        return EncoderDecoder(enc, dec, tie_embeddings=spec.tie_embeddings)
    task: Task = "lm" if info["task"] == "seq2seq" else info["task"]  # (a decoder on pairs: the source as a prefix)
    return XfamModel(
        spec,
        task=task,
        vocab_size=vocab,
        num_classes=info.get("num_classes"),
        **slots,
        stores=open_stores(slots["memory"], spec.layers),
        inputs=inputs_of(info),
        target_dim=info.get("target_dim"),
    )


def _encoder_of(config: dict[str, Any], spec: ModelSpec, task: str) -> tuple[tuple | None, dict | None]:
    """From a plain config: the encoder ``(spec, attention, pos)`` and the cross-attention config of an
    encoder-decoder, or ``(None, None)`` (a checkpoint written before encoder-decoders has neither section)."""
    if spec.arch_for(task) != "encoder_decoder":
        return None, None
    enc = config.get("encoder") or {}
    enc_spec = dataclasses.replace(spec, layers=enc.get("layers") or spec.layers, causal=False)
    encoder = (enc_spec, enc.get("attention") or config["attention"], enc.get("pos") or config["pos"])
    return encoder, config.get("cross_attention") or {"name": "vanilla"}


def open_stores(memory: dict[str, Any], layers: int) -> dict[int, LongTermStore]:
    """The long-term stores the memory components ask for (``Memory.needs_store``), by layer, opened here
    (components never open their own): a store asked for by several layers is opened once. A layer config
    that does not validate is left to the memory's own build, which reports it."""
    stores: dict[int, LongTermStore] = {}
    opened: dict[StoreRequest, LongTermStore] = {}
    for i, cfg in enumerate(per_layer(memory, layers, "memory")):
        cls = MEMORY.get(cfg["name"]) if cfg.get("name") in MEMORY else None
        params = {k: v for k, v in cfg.items() if k not in RESERVED}
        if cls is None or not cls.needs_store or check_params(cls, params, "memory", dict.fromkeys(STRUCTURAL)):
            continue
        if (request := cls.store_request(params, layer=i, num_layers=layers)) is not None:
            stores[i] = opened[request] = opened.get(request) or open_long_term(request, build_model)
    return stores


def build_data(config: dict[str, Any]) -> DataSource:
    """The data source of ``config['data']`` (not yet prepared)."""
    import xfam.data  # noqa: F401  (registers every source)

    return DATA.build(config["data"])
