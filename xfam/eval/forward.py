"""One batch through a model, whatever its shape (the batch layouts of ``xfam.data.base``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from xfam.model.transformer import ModelOutput


def forward_batch(model: Any, batch: dict[str, Tensor], *, memory: Any = None, targets: Any = None) -> ModelOutput:
    """``model`` on ``batch``: source pairs (``decoder_input_ids``) through an encoder-decoder, anything else
    through one stack with its padding, documents and ``memory``; ``targets`` for exit policies that train
    per-layer classifiers."""
    if "decoder_input_ids" in batch:
        return model(
            batch["input_ids"],
            decoder_input_ids=batch["decoder_input_ids"],
            key_padding=batch.get("key_padding"),
            targets=targets,
        )
    return model(
        batch["input_ids"],
        key_padding=batch.get("key_padding"),
        segments=batch.get("segments"),
        memory=memory,
        targets=targets,
    )
