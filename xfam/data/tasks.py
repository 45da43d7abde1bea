"""The batches a task trains on, from its data source's rows (``xfam.config.task`` names the tasks).

Most tasks take the source's own ``collate``. Two render the rows differently: masked LM corrupts a text
source's language-model batches with BERT's masking (``xfam.data.masking``), and a decoder-only model on
source/target pairs (``model.arch=decoder``) reads each pair as one row, the source as a prefix of the target
(``xfam.data.seq2seq.collate_prefix_lm``). Training and ``xfam eval`` both build their loaders with it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from xfam.data.base import DataSource
from xfam.data.masking import MaskingCollate
from xfam.data.seq2seq import Seq2SeqSource, collate_prefix_lm


def task_collate(
    source: DataSource, info: Mapping[str, Any], *, arch: str, masking: Mapping[str, Any], seed: int
) -> Callable[[list[dict]], dict]:
    """The collate function of the task ``info["task"]`` (``xfam.model.build.data_info``) on the prepared
    ``source``, for a model of shape ``arch``; ``masking``: masked LM's ``rate, mask_frac, random_frac, span``."""
    if info["task"] == "mlm":
        specials = sorted({i for i in (source.pad_id, source.eos_id, getattr(source, "bos_id", None)) if i is not None})
        return MaskingCollate(
            source.collate,
            mask_id=info["mask_id"],
            vocab_size=source.vocab_size,
            special_ids=specials,
            rate=masking["rate"],
            mask_frac=masking["mask_frac"],
            random_frac=masking["random_frac"],
            span=masking["span"],
            seed=seed,
        )
    if info["task"] == "seq2seq" and arch == "decoder":
        assert isinstance(source, Seq2SeqSource)  # (a source of pairs)
        pad, bos, eos = source.pad_id, source.bos_id, source.eos_id
        assert pad is not None and bos is not None and eos is not None  # (prepare() gave the pairs their ids)
        return functools.partial(collate_prefix_lm, pad_id=pad, bos_id=bos, eos_id=eos)
    return source.collate
