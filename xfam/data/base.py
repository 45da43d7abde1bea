"""Contract of the data slot: a source prepares Hugging Face ``datasets`` splits and collates rows.

Every source is registered in ``DATA`` under its YAML name (``configs/data/<name>.yaml``), takes
keyword-only annotated parameters like every component, and after ``prepare()`` exposes what the
model builder and the trainer need. Nothing is fetched from a hub unless the user configures a hub
dataset; ``prepare`` does the (cached) work, ``check`` only cheap validation (paths exist ...).

Rows (columns of each split, torch-formatted):

* language modelling (``task = "lm"``): ``tokens`` int ``[S + 1]`` (inputs are ``tokens[:-1]``,
  targets ``tokens[1:]``) and optionally ``target_mask`` bool ``[S]`` (False: the target does not
  count, e.g. the prompt half of a copy task). With ``contiguous = True`` row k+1 continues row k
  (so the sampler can lay out contiguous streams for the memory slot).
* classification (``task = "classify"``): ``input_ids`` int ``[n <= S]`` and ``label`` int.
* tagging (``task = "tag"``): ``input_ids`` int ``[n <= S]`` and ``labels`` int ``[n]``, a class per token.
* sequence to sequence (``task = "seq2seq"``, ``xfam.data.seq2seq``): ``source`` and ``target`` int lists.
* continuous sequences (``task = "regress"``, ``xfam.data.timeseries``): ``series`` float ``[S + 1, F]``
  (inputs are ``series[:-1]``, targets ``series[1:]``).
* images (``task = "classify"``, ``xfam.data.digits``): ``image`` float ``[C, H, W]`` and ``label`` int.
* trajectories (``task = "decision"``, ``xfam.data.trajectories``): one window of K timesteps per row,
  ``returns`` float ``[K]`` (scaled returns-to-go), ``states`` ``[K, S]`` (``[K]`` ids), ``actions`` ``[K]``
  ids or ``[K, A]`` floats, ``timesteps`` int ``[K]`` and ``step_mask`` bool ``[K]`` (left padding False).

Inputs other than token ids (``inputs``, below; ``xfam.model.inputs`` embeds them) are one float
tensor under the batch key ``inputs``, in place of ``input_ids``.

Batches (what ``collate`` returns and the Lightning module consumes):

* ``input_ids`` long ``[B, S]`` (seq2seq: the source), or for a source whose ``inputs`` are not token ids
  ``inputs`` float: vectors ``[B, S, F]`` (regress) or images ``[B, C, H, W]`` (classify)
* ``targets`` float ``[B, S, F]``: regress, the next vector of every position; decision, the continuous
  actions ``[B, K, A]`` (normalised to [-1, 1], zeros on padding)
* decision (``xfam.model.inputs``): ``inputs`` float ``[B, K, F]`` packed timesteps (``StepLayout.pack``),
  ``labels`` long ``[B, K]`` for discrete actions (-100 on padding), ``step_mask`` bool ``[B, K]`` and, when
  a step is padded, ``key_padding`` bool ``[B, n K]`` per token
* ``labels`` long ``[B, S]`` with -100 where no target counts (lm, tag, seq2seq: the target) / ``label``
  long ``[B]`` (classify)
* ``decoder_input_ids`` long ``[B, St]``: seq2seq, the target shifted right behind BOS
* ``key_padding`` bool ``[B, S]``, True on real tokens (only when rows are padded)
* ``segments`` long ``[B, S]`` document ids (only when ``doc_mask`` asks attention to stay
  inside documents of packed rows)
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from xfam.core.registry import Component, Registry

Split = Literal["train", "validation", "test"]
Task = Literal["lm", "classify", "tag", "seq2seq", "regress", "decision"]


class DataSource(Component):
    """Base of every ``data`` component.

    Class attributes:
        task: ``lm``, ``classify``, ``tag``, ``seq2seq`` or ``regress`` (continuous vectors, the next one predicted).
        contiguous: lm rows are consecutive chunks of one token stream (streams mode possible).
        stream_hint: the setting that makes a source's rows contiguous, where one does (for a refusal's fix).
        byte_text: the tokens are text with ``token_bytes`` (bits per byte is reported).

    Set by ``prepare()``:
        vocab_size: number of token ids (all ids in the data are below it).
        num_classes: classes of a classification task (None for lm).
        token_bytes: ``[V]`` bytes each token id stands for (0 for special tokens), for
            bits-per-byte; None where bytes are meaningless (synthetic tasks).
        pad_id / eos_id: padding and document-boundary token ids (None when unused).
        fingerprint: short hash of everything that determines the data (files and their
            contents, tokenizer, generator parameters, seed).
        manifest: a JSON-able description (files with sizes and hashes, generator settings).
        inputs: what a row's model input is (``inputs_for``), known from the parameters.
        target_dim: regress: the width F of the target vectors (None for other tasks).
    """

    task: ClassVar[Task] = "lm"
    contiguous: ClassVar[bool] = False
    stream_hint: ClassVar[str | None] = None
    byte_text: ClassVar[bool] = False

    vocab_size: int
    num_classes: int | None = None
    token_bytes: list[int] | None = None
    pad_id: int | None = None
    eos_id: int | None = None
    fingerprint: str = ""
    manifest: dict[str, Any]
    seq_len: int
    batch_size: int
    doc_mask: bool = False
    target_dim: int | None = None

    @classmethod
    def task_for(cls, params: dict[str, Any]) -> Task:
        """The task of a source configured with ``params`` (validation reads it before building anything);
        a source whose task depends on its settings (``data=hf`` with ``source_column``: pairs) overrides it."""
        return cls.task

    @classmethod
    def inputs_for(cls, params: dict[str, Any]) -> dict[str, Any]:
        """What a row's model input is, for a source configured with ``params`` (validation reads it before
        anything is built): ``{"kind": "tokens"}`` (ids, the default), ``{"kind": "vectors", "dim": F}``
        (``[S, F]`` floats per row) or ``{"kind": "image", "channels": C, "height": H, "width": W}``."""
        return {"kind": "tokens"}

    @classmethod
    def contiguous_for(cls, params: dict[str, Any]) -> bool:
        """Whether rows configured with ``params`` are consecutive chunks of streams (``contiguous``; a source
        whose layout is a setting overrides it)."""
        return cls.contiguous

    @classmethod
    def documents_for(cls, params: dict[str, Any]) -> bool:
        """Whether batches of a source configured with ``params`` mark documents (``segments``): ``doc_mask``."""
        return bool(params.get("doc_mask", False))

    @property
    def inputs(self) -> dict[str, Any]:
        return self.inputs_for(getattr(self, "params", {}))

    def prepare(self) -> None:
        """Build or load (from the ``datasets`` cache) every split; validate token ids."""
        raise NotImplementedError  # abstract

    def split(self, name: Split) -> Any:
        """The prepared ``datasets.Dataset`` of one split, torch-formatted."""
        raise NotImplementedError  # abstract

    def tokenizer_state(self) -> dict[str, Any] | None:
        """The text tokenizer as plain data (``xfam.data.tokenize.tokenizer_from_state`` rebuilds
        it), stored in checkpoints so ``xfam generate`` needs no data; None for synthetic tasks."""
        return None

    def collate(self, rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """Rows of one split to a batch (see the module docstring)."""
        if self.task == "classify":
            return collate_classify(rows, self.pad_id or 0)
        return collate_lm(rows, self.eos_id if self.doc_mask else None)


def collate_lm(rows: list[dict[str, Tensor]], boundary: int | None = None) -> dict[str, Tensor]:
    tokens = torch.stack([r["tokens"] for r in rows]).long()  # [B, S + 1]
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    if "target_mask" in rows[0]:
        keep = torch.stack([r["target_mask"] for r in rows]).bool()  # [B, S]
        labels[~keep] = -100
    batch = {"input_ids": inputs.contiguous(), "labels": labels}
    if boundary is not None:
        # Document k starts after the k-th boundary token: a boundary closes its own document.
        starts = torch.nn.functional.pad((inputs == boundary).long(), (1, 0))[:, :-1]
        batch["segments"] = starts.cumsum(dim=1)  # [B, S]
    return batch


def collate_classify(rows: list[dict[str, Tensor]], pad_id: int) -> dict[str, Tensor]:
    lengths = [len(r["input_ids"]) for r in rows]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : lengths[i]] = r["input_ids"]
    batch = {"input_ids": ids, "label": torch.stack([torch.as_tensor(r["label"]) for r in rows]).long()}
    if min(lengths) < width:
        batch["key_padding"] = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # [B, S]
    return batch


DATA: Registry[DataSource] = Registry("data", DataSource)
