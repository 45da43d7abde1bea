"""Memory carried from one batch of contiguous streams to the next (training, validation and test in
the Lightning module, ``xfam eval``, kNN-LM's datastore and scoring loops).

Row r of every batch continues stream r of the previous batch (``loader.streams``), so the model gets
the memory the previous batch wrote. When the data marks documents, each row's document ids are
shifted to continue the stream's numbering, so a memory never shows a query another document's
entries (the memory is reset at document boundaries, to the token). A row's last document ends with it when
its last token is the boundary token (text), or where the batch says so (``doc_end``: trajectory chunks).

A carry is ``{"layers": per-layer memory states, "docs": [B] each row's next document id, or None}``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from xfam.eval.forward import model_inputs
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.transformer import XfamModel

Carry = dict[str, Any]


def carried_inputs(
    model: XfamModel | EncoderDecoder, batch: dict[str, Tensor], carry: Carry | None, eos_id: int | None
) -> tuple[dict[str, Tensor], list[Any], Tensor | None]:
    """``(batch with continued document ids, the layers' memory to pass, each row's next document id)``.

    ``carry``: the previous batch's (None at the start of the streams: empty memory)."""
    if carry is None:
        assert isinstance(model, XfamModel)  # (memory: compat refuses it for an encoder-decoder)
        rows = model_inputs(batch)
        carry = {"layers": model.init_memory(rows.shape[0], rows.device), "docs": None}
    docs = None
    if "segments" in batch:
        first = carry["docs"] if carry["docs"] is not None else torch.zeros_like(batch["segments"][:, 0])
        segments = batch["segments"] + first[:, None]  # [B, S], continuing the row's stream
        # the row's last document ends with it: a boundary token closes its document (text), or the data says so
        if "doc_end" in batch:
            boundary = batch["doc_end"]
        else:
            assert eos_id is not None  # (a source that marks no ends closes its documents with its eos)
            boundary = batch["input_ids"][:, -1] == eos_id
        docs = segments[:, -1] + boundary.long()  # [B]
        batch = {**batch, "segments": segments}
    return batch, carry["layers"], docs


def next_carry(memory: list[Any], docs: Tensor | None) -> Carry:
    """The carry after a forward pass that returned ``memory`` (detached by each memory's ``write``)."""
    return {"layers": memory, "docs": docs}
