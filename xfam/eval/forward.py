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
        model_inputs(batch),
        key_padding=batch.get("key_padding"),
        segments=batch.get("segments"),
        memory=memory,
        targets=targets,
    )


def model_inputs(batch: dict[str, Tensor]) -> Tensor:
    """What the model reads of ``batch``: token ids ``input_ids``, or the float ``inputs`` of a source whose rows
    are not token ids (vectors ``[B, S, F]``, images ``[B, C, H, W]``; ``xfam.data.base``)."""
    return batch["input_ids"] if "input_ids" in batch else batch["inputs"]


def input_positions(batch: dict[str, Tensor]) -> int:
    """The input positions of ``batch`` (what throughput counts): token ids and vectors one per row step,
    images one per pixel."""
    if "input_ids" in batch:
        return batch["input_ids"].numel()
    x = batch["inputs"]
    return x.shape[0] * x.shape[-2] * x.shape[-1] if x.dim() == 4 else x.shape[0] * x.shape[1]
