"""Generated outputs of a sequence-to-sequence model on evaluation batches, scored as text.

Both shapes that train on pairs generate here: an encoder-decoder decodes from its encoder's output
(``xfam.eval.translate``: greedy or beam search), a decoder-only model continues the prompt
``[source, BOS]`` (``xfam.eval.generate``). References are the batch's targets (``labels`` up to EOS), so
scoring needs nothing but the batch. Texts come from the data's tokenizer when it has one (byte or BPE
text); synthetic vocabularies are scored as their token ids joined by spaces, one word per token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from xfam.config.task import TaskSpec
from xfam.data.tokenize import tokenizer_from_state
from xfam.eval.generate import generate
from xfam.eval.translate import translate
from xfam.model.encoder_decoder import EncoderDecoder


def _until(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


def references(batch: dict[str, Tensor], eos_id: int) -> list[list[int]]:
    """Each row's target ids (``labels`` without -100, up to its EOS)."""
    return [_until([int(t) for t in row if t != -100], eos_id) for row in batch["labels"]]


@torch.no_grad()
def generate_outputs(
    model: Any,
    batch: dict[str, Tensor],
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
    beam_size: int = 1,
    length_penalty: float = 1.0,
) -> list[list[int]]:
    """Each row's generated target ids (up to, without, its EOS)."""
    if isinstance(model, EncoderDecoder):
        res = translate(
            model,
            batch["input_ids"],
            batch.get("key_padding"),
            bos_id=bos_id,
            eos_id=eos_id,
            max_new_tokens=max_new_tokens,
            beam_size=beam_size,
            length_penalty=length_penalty,
        )
        return [_until(row.tolist(), eos_id) for row in res.tokens]
    outs = []  # a decoder on [source, BOS, target]: the prompt ends at the first position with a target
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        start = int((labels != -100).nonzero()[0, 0])  # the BOS position (it predicts the first target token)
        new = generate(model, ids[None, : start + 1], max_new_tokens, temperature=0.0, stop_token=eos_id)
        outs.append(_until(new.tokens[0, start + 1 :].tolist(), eos_id))
    return outs


def as_text(ids: list[int], tokenizer: Any | None) -> str:
    """``ids`` as text with the data's tokenizer, or as space-separated ids (synthetic vocabularies)."""
    return tokenizer.decode(ids) if tokenizer is not None else " ".join(str(i) for i in ids)


class GeneratedTexts:
    """The generated and reference texts of one evaluation of a seq2seq model: the first
    ``spec.eval_generate_rows`` rows it is shown (``add``), decoded as ``spec`` says (greedy or beam search)."""

    def __init__(self, info: dict[str, Any], spec: TaskSpec, target_len: int | None = None):
        """``target_len``: the data's (BOS included), the longest output unless ``spec.max_new_tokens`` says."""
        self.info, self.spec = info, spec
        self.max_new_tokens = spec.max_new_tokens or target_len
        state = info.get("tokenizer")
        self.tokenizer = tokenizer_from_state(state) if state else None
        self.pairs: list[tuple[str, str]] = []  # (generated, reference)

    def add(self, model: Any, batch: dict[str, Tensor]) -> None:
        """Generate the outputs of ``batch``'s first rows while the budget lasts."""
        n = min(self.spec.eval_generate_rows - len(self.pairs), batch["labels"].shape[0])
        if n <= 0:
            return
        rows = {k: v[:n] for k, v in batch.items()}
        eos = self.info["eos_id"]
        hyps = generate_outputs(
            model,
            rows,
            bos_id=self.info["bos_id"],
            eos_id=eos,
            max_new_tokens=self.max_new_tokens or batch["labels"].shape[1],  # (never the references' own length)
            beam_size=self.spec.beam_size,
            length_penalty=self.spec.length_penalty,
        )
        text = lambda ids: as_text(ids, self.tokenizer)  # noqa: E731
        self.pairs += [(text(h), text(r)) for h, r in zip(hyps, references(rows, eos), strict=True)]
