"""The sequence-to-sequence data contract: sources of (source, target) pairs, their fitting, their batches.

The layout is the encoder-decoder Transformer's (Vaswani et al., 2017, arXiv:1706.03762): an encoder
reads the source, a causal decoder reads the target shifted right behind a begin-of-sequence token
and predicts it followed by an end-of-sequence token (teacher forcing). The same pairs can also
train a decoder-only model with the source as a prefix (the prefix LM of Raffel et al., 2020, T5,
arXiv:1910.10683, sec. 3.2.1, here with a causal mask over the prefix too): ``collate_prefix_lm``.

Rows (columns of each split, torch-formatted): ``source`` int ``[m]`` and ``target`` int ``[n]``, the
ids of the two texts without BOS or EOS, ``1 <= n``, ``m <= source_len`` and ``n + 1 <= target_len``
after ``fit_pairs``. Batches:

* encoder-decoder (``collate_seq2seq``): ``input_ids`` ``[B, Ss]`` the sources right-padded with
  ``pad_id``; ``key_padding`` ``[B, Ss]`` bool, True on real tokens (only when some row is padded);
  ``decoder_input_ids`` ``[B, St]`` = ``[BOS, t1 .. tn]`` right-padded with ``pad_id``;
  ``labels`` ``[B, St]`` = ``[t1 .. tn, EOS]``, -100 on padding. ``Ss``/``St`` are the longest row of
  the batch, at most ``source_len`` / ``target_len``.
* prefix LM (``collate_prefix_lm``): ``input_ids`` ``[B, S]`` = ``[s1 .. sm, BOS, t1 .. tn]``
  right-padded; ``labels`` ``[B, S]``: -100 on the source, then ``t1 .. tn, EOS`` at the positions of
  ``BOS, t1 .. tn`` (each position predicts the next token), -100 on padding; ``key_padding`` as above.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.core.logs import log
from xfam.data.base import DataSource, Task
from xfam.data.cache import cached_map, rows_check
from xfam.data.packing import FORMAT, get_split
from xfam.data.tokenize import short_hash

IGNORE = -100
COLUMNS = ("source", "target")


class Seq2SeqSource(DataSource):
    """Base of every source of (source, target) pairs (``task = "seq2seq"``).

    From the parameters: ``source_len`` (most source ids), ``target_len`` (most decoder positions:
    BOS and the target ids), ``truncate``, ``batch_size``, ``seed`` (``keep_lengths`` sets them and
    ``seq_len``, the longer of the two sides). Set by ``prepare()``: ``vocab_size`` (special ids
    included), ``pad_id``, ``bos_id``, ``eos_id``, ``token_bytes`` (or None), ``fingerprint``,
    ``manifest``, and ``truncated`` (per split, the counts ``fit_pairs`` returned).
    """

    task: ClassVar[Task] = "seq2seq"
    bos_id: int | None = None
    source_len: int
    target_len: int
    truncate: bool

    def keep_lengths(self, *, source_len: int, target_len: int, truncate: bool, batch_size: int, seed: int) -> None:
        """Store the parameters every pair source shares; ``seq_len`` = the longest side a model reads."""
        self.source_len, self.target_len, self.truncate = source_len, target_len, truncate
        self.batch_size, self.seed, self.seq_len = batch_size, seed, max(source_len, target_len)

    def fit(self, name: str, ds: Any) -> Any:
        """``fit_pairs`` of one split with this source's lengths, counts kept in ``self.truncated[name]``."""
        ds, counts = fit_pairs(
            ds,
            source_len=self.source_len,
            target_len=self.target_len,
            truncate=self.truncate,
            split=name,
            owner=self.registry_name,
        )
        self.truncated = {**getattr(self, "truncated", {}), name: counts}
        return ds

    def split(self, name: str) -> Any:
        return get_split(getattr(self, "_splits", {}), name, self.registry_name)

    def collate(self, rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """Rows to an encoder-decoder batch (``collate_seq2seq``)."""
        return collate_seq2seq(rows, self._special("pad_id"), self._special("bos_id"), self._special("eos_id"))

    def _special(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise RuntimeError(f"data={self.registry_name}: {name} is unset; call prepare() before collate()")
        return value

    def encode(self, text: str) -> list[int]:
        """Text to ids (no BOS/EOS)."""
        raise NotImplementedError  # abstract

    def decode(self, ids: Any) -> str:
        """Ids to text; special ids (pad, bos, eos) are dropped."""
        raise NotImplementedError  # abstract


def pair_lengths(ds: Any) -> tuple[Any, Any]:
    """Lengths ``[N]`` of the ``source`` and ``target`` lists of ``ds`` (numpy int64), from the list offsets."""
    table = ds.with_format("arrow")
    return tuple(pc.list_value_length(table[c]).to_numpy(zero_copy_only=False).astype("int64") for c in COLUMNS)


def fit_pairs(
    ds: Any, *, source_len: int, target_len: int, truncate: bool, split: str, owner: str
) -> tuple[Any, dict[str, int]]:
    """Refuse empty targets, then truncate (or refuse) pairs longer than the model reads.

    ``ds`` has int-list columns ``source`` and ``target`` (no BOS/EOS). The decoder reads BOS and the
    target, so a target fits when ``len(target) + 1 <= target_len``; a source when
    ``len(source) <= source_len``. With ``truncate`` the long ones are cut to ``source_len`` /
    ``target_len - 1`` ids (the cut is cached in the ``datasets`` cache, keyed by ``ds``'s fingerprint)
    and counted in the log; without it they are refused. Returns the dataset (the input's format)
    and ``{"source_truncated": n, "target_truncated": m}``.
    """
    src, tgt = pair_lengths(ds)
    empty = (tgt == 0).nonzero()[0]
    if len(empty):
        raise ConfigError(
            f"data={owner}: {len(empty)} of the {len(tgt)} pairs of the {split} split have an empty target (the "
            f"first is row {int(empty[0])}); a decoder must predict at least one token before EOS. Fix: remove "
            "those pairs from the data (e.g. Dataset.filter on the target column) or fill their targets."
        )
    long_src, long_tgt = int((src > source_len).sum()), int((tgt + 1 > target_len).sum())
    counts = {"source_truncated": long_src, "target_truncated": long_tgt}
    if not (long_src or long_tgt):
        return ds, counts
    what = (
        f"{long_src} sources longer than source_len={source_len} (longest {int(src.max())}) and {long_tgt} targets "
        f"longer than target_len - 1 = {target_len - 1} (longest {int(tgt.max())}; the decoder also reads BOS) "
        f"among the {len(tgt)} pairs of the {split} split"
    )
    if not truncate:
        raise ConfigError(
            f"data={owner}: {what}. Fix: data.truncate=true or larger data.source_len/target_len "
            f"(source_len >= {int(src.max())}, target_len >= {int(tgt.max()) + 1} keep every pair whole)."
        )
    log.info("data=%s: truncating %s", owner, what)  # asked for (truncate=true): info, not a warning
    key = f"fit-{short_hash(FORMAT, ds._fingerprint, source_len, target_len)}"
    check = rows_check(len(ds), "target")
    fitted = cached_map(ds, _Cut(source_len, target_len - 1), key, 1024, check, f"xfam {owner}: truncate {split}")
    fmt = ds.format
    fitted = fitted.with_format(
        fmt["type"], columns=fmt["columns"], output_all_columns=fmt["output_all_columns"], **fmt["format_kwargs"]
    )
    return fitted, counts


class _Cut:
    """``datasets.map`` function: a table -> the same table with ``source``/``target`` cut to their limits."""

    def __init__(self, source_max: int, target_max: int):
        self.limits = {"source": source_max, "target": target_max}

    def __call__(self, table: pa.Table) -> pa.Table:
        for name, limit in self.limits.items():
            i = table.schema.get_field_index(name)
            table = table.set_column(i, name, pc.list_slice(table.column(name), 0, limit))
        return table


def _ids(rows: list[dict[str, Any]], column: str) -> list[Tensor]:
    return [torch.as_tensor(r[column]).long().reshape(-1) for r in rows]


def _pad(seqs: list[Tensor], value: int) -> Tensor:
    """Right-pad 1-d sequences to the longest: ``[B, L]``."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def _key_padding(lengths: list[int], width: int) -> Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # [B, L], True on real tokens


def collate_seq2seq(rows: list[dict[str, Any]], pad_id: int, bos_id: int, eos_id: int) -> dict[str, Tensor]:
    """Pairs to an encoder-decoder batch (see the module docstring)."""
    sources, targets = _ids(rows, "source"), _ids(rows, "target")
    bos, eos = torch.tensor([bos_id]), torch.tensor([eos_id])
    input_ids = _pad(sources, pad_id)  # [B, Ss]
    decoder_input_ids = _pad([torch.cat([bos, t]) for t in targets], pad_id)  # [B, St]
    labels = _pad([torch.cat([t, eos]) for t in targets], IGNORE)  # [B, St]
    batch = {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids, "labels": labels}
    lengths = [len(s) for s in sources]
    if min(lengths) < input_ids.shape[1]:
        batch["key_padding"] = _key_padding(lengths, input_ids.shape[1])
    return batch


def collate_prefix_lm(rows: list[dict[str, Any]], pad_id: int, bos_id: int, eos_id: int) -> dict[str, Tensor]:
    """Pairs to a decoder-only batch, the source as a prefix (see the module docstring)."""
    sources, targets = _ids(rows, "source"), _ids(rows, "target")
    bos, eos = torch.tensor([bos_id]), torch.tensor([eos_id])
    input_ids = _pad([torch.cat([s, bos, t]) for s, t in zip(sources, targets)], pad_id)  # [B, S]
    ignore = [torch.full((len(s),), IGNORE) for s in sources]
    labels = _pad([torch.cat([i, t, eos]) for i, t in zip(ignore, targets)], IGNORE)  # [B, S]
    batch = {"input_ids": input_ids, "labels": labels}
    lengths = [len(s) + 1 + len(t) for s, t in zip(sources, targets)]
    if min(lengths) < input_ids.shape[1]:
        batch["key_padding"] = _key_padding(lengths, input_ids.shape[1])
    return batch
