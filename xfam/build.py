"""Public construction API: a model or a data source from a plain config, without Hydra."""

from __future__ import annotations

from typing import Any

import xfam.attention
import xfam.exit
import xfam.memory
import xfam.pos  # noqa: F401  (registers every component)
from xfam.data.base import DATA, DataSource
from xfam.errors import ConfigError
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel


def data_info(source: DataSource) -> dict[str, Any]:
    """What the model and the trainer need from a prepared data source (stored in checkpoints)."""
    return {
        "name": source.registry_name,
        "task": source.task,
        "vocab_size": source.vocab_size,
        "num_classes": source.num_classes,
        "token_bytes": source.token_bytes,
        "pad_id": source.pad_id,
        "eos_id": source.eos_id,
        "fingerprint": source.fingerprint,
        "tokenizer": source.tokenizer_state(),
    }


def build_model(config: dict[str, Any], info: dict[str, Any]) -> XfamModel:
    """The model described by ``config`` (sections model/attention/pos/memory/exit) for the data
    described by ``info`` (see ``data_info``)."""
    spec = ModelSpec(**config["model"])
    vocab = spec.vocab_size or info["vocab_size"]
    if vocab < info["vocab_size"]:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the data's vocabulary ({info['vocab_size']} token ids): "
            f"some ids would be outside the embedding. Fix: model.vocab_size=null (take it from the data) or "
            f">= {info['vocab_size']}."
        )
    return XfamModel(
        spec,
        task=info["task"],
        vocab_size=vocab,
        num_classes=info.get("num_classes"),
        attention=config["attention"],
        pos=config["pos"],
        memory=config["memory"],
        exit=config["exit"],
    )


def build_data(config: dict[str, Any]) -> DataSource:
    """The data source of ``config['data']`` (not yet prepared)."""
    import xfam.data  # noqa: F401  (registers every source)

    return DATA.build(config["data"])
