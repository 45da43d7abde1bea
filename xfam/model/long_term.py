"""The long-term stores the model builder opens for memory components that need one
(``Memory.needs_store``; SPALM's kNN long-term memory): a kNN-LM datastore (``xfam knnlm build``) with
the frozen pretrained model that encodes its queries, verified to be the model that built it.
The component gets it as ``long_term=`` (an ``xfam.core.store.LongTermStore``) and imports none of this.
The encoder is a model of its own, rebuilt by the builder that asks (``build``: ``build_model``, which
opens stores in turn), so this module imports no builder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from xfam.core.errors import ConfigError
from xfam.core.store import StoreRequest
from xfam.knnlm.datastore import Datastore, Neighbours, checkpoint_identity, read_manifest
from xfam.knnlm.keys import KeyCapture, check_supported
from xfam.model.checkpoint_file import load_model_with


class EncodedDatastore:
    """A datastore (on the CPU) and the frozen model that encodes its queries: the input of that model's
    final FFN, as the store's keys are (kNN-LM). The encoder is a plain attribute of this object, so a
    model holding the store never registers it as a submodule (never trained, never saved)."""

    def __init__(self, datastore: Datastore, encoder: nn.Module):
        self.datastore, self.encoder = datastore, encoder

    @property
    def path(self) -> Path:
        return self.datastore.path

    @property
    def vocab_size(self) -> int | None:
        return self.datastore.manifest.get("vocab_size")

    @torch.no_grad()
    def encode(self, tokens: Tensor, key_padding: Tensor | None, segments: Tensor | None) -> Tensor:
        """Queries ``[B * S, D]`` (float32, on the tokens' device) of ``tokens [B, S]``."""
        encoder = self.encoder.to(tokens.device)
        with KeyCapture(encoder) as capture:
            encoder(tokens, key_padding=key_padding, segments=segments)
            return capture.take().flatten(0, 1).float()

    def search(self, queries: Tensor, k: int) -> Neighbours:
        return self.datastore.search(queries, k)


def open_long_term(
    request: StoreRequest, build: Callable[[dict[str, Any], dict[str, Any]], nn.Module]
) -> EncodedDatastore:
    """The datastore of ``request`` and its frozen query encoder: the pretrained model the store was built
    from (its manifest names the checkpoint), rebuilt by ``build(config, data_info)`` and verified by its
    weights' hash."""
    store = request.path
    manifest = read_manifest(Path(store))
    ckpt = manifest["checkpoint"]["path"]
    if not Path(ckpt).exists():
        raise ConfigError(
            f"memory.store {store} was built from {ckpt}, which no longer exists; SPALM encodes its queries with "
            "that model. Fix: restore the checkpoint, or rebuild the datastore from another one."
        )
    encoder, meta = load_model_with(ckpt, build, "cpu")
    check_supported(encoder)
    if encoder.uses_memory:
        raise ConfigError(
            f"SPALM's query encoder {ckpt} was trained with memory; it encodes each segment alone. "
            "Fix: a datastore built from a model trained with memory=none."
        )
    encoder.requires_grad_(False)
    opened = Datastore.open(store, index=request.index, checkpoint=checkpoint_identity(ckpt, encoder, meta["config"]))
    return EncodedDatastore(opened, encoder)
