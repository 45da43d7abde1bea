"""ETC's CPC pre-training objective (Ainslie et al., 2020, arXiv:2004.08483, sec. 3.4; Contrastive Predictive
Coding after Oord et al., 2018, arXiv:1807.03748), posed over the whole model as ETC poses it.

ETC replaces BERT's next-sentence prediction by CPC on its global sentence-summary tokens: all the tokens of a
subset of the input's sentences are masked (their summary tokens stay in the global input), and the final hidden
state of each masked sentence's summary token is trained, by a noise-contrastive (InfoNCE) loss, to predict the
final hidden state that a global summary token gets when it sees the unmasked sentence and nothing else; the other
masked sentences of the batch are the negatives. xfam's data marks no sentences, so a sentence is the fixed chunk
of ``segment`` long tokens that global token s summarises (``xfam.attention.etc``: tokens ``s * segment ..``).
Per call (``model`` is the ``XfamModel``, inputs ``[B, S]`` token ids or ``[B, S, F]`` vectors):

1. choose sentences: every sentence holding a real token is masked with probability ``mask_prob``, keeping at
   least one sentence of every row visible (training draws from torch's RNG, so exact resume replays it;
   evaluation uses a fixed seed, so its metric is comparable across evaluations);
2. prediction ``p_i``: the global states of a pass in which the masked sentences' tokens are hidden from every
   query (key padding: no row attends to them, positions unchanged), at the masked sentence's global token;
3. target ``t_i``: the global state of global token s in a pass over row b with every long token outside
   sentence s hidden: it sees its sentence, unmasked, and nothing else (the other global tokens it also sees
   hold nothing but what they read from the same sentence);
4. loss ``weight * InfoNCE(p, t)``: ``-mean_i log softmax_j(<p_i, t_j> / sqrt(D))[i]`` over the N masked
   sentences of the batch, gradients through both passes (one shared encoder, as in CPC); 0 when N < 2.

Hiding the tokens by key padding rather than replacing them with a ``[MASK]`` id gives the same information (the
model is told the positions are empty) for any task and input, including tasks without a mask token. Cost: one
extra pass over the batch and one full-length pass per masked sentence (about ``mask_prob * n_g`` per row).
Reported as ``attention/cpc`` (``train/attention/cpc``, ``val/aux/attention/cpc``). The mask rate is xfam's
choice (BERT's 15%); the paper's main text states none. ETC runs its MLM and CPC maskings in one pass; xfam runs
CPC's own passes beside the task's, so the objective composes with any encoder task (mlm, classify, tag).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.logs import log_once

#: Seed of the sentence choice in evaluation (training draws from torch's global RNG).
EVAL_SEED = 0


class GlobalModel(Protocol):
    """What the objective uses of the model (an ``XfamModel``, which a slot does not import)."""

    training: bool

    def global_states(
        self, tokens: Tensor, key_padding: Tensor | None = None, segments: Tensor | None = None
    ) -> Tensor: ...


@dataclasses.dataclass(frozen=True)
class SentenceCPC:
    """ETC's CPC over sentences of ``segment`` long tokens summarised by ``n_global`` global tokens."""

    weight: float
    mask_prob: float
    segment: int
    n_global: int
    name: str = "cpc"

    def __call__(
        self, model: GlobalModel, inputs: Tensor, key_padding: Tensor | None, segments: Tensor | None
    ) -> Tensor:
        log_once(
            f"attention=etc cpc_weight={self.weight}: ETC's CPC masks each sentence ({self.segment} long tokens) with "
            f"p={self.mask_prob}; one extra pass over the batch plus one per masked sentence"
        )
        chosen, sentence, real = self.choose(inputs, key_padding, model.training)  # [B, G], [S], [B, S]
        rows, which = chosen.nonzero(as_tuple=True)  # the N masked sentences: row b, global token s
        if len(rows) < 2:  # nothing to contrast
            return inputs.new_zeros((), dtype=torch.float32)
        visible = real & ~chosen[:, sentence]  # [B, S]: the masked sentences hidden
        pred = model.global_states(inputs, visible, segments)[chosen]  # [N, D]
        alone = real[rows] & (sentence[None] == which[:, None])  # [N, S]: sentence s of row b and nothing else
        docs = None if segments is None else segments[rows]
        target = model.global_states(inputs[rows], alone, docs)[torch.arange(len(rows)), which]  # [N, D]
        return self.weight * info_nce(pred, target)

    def choose(self, inputs: Tensor, key_padding: Tensor | None, training: bool) -> tuple[Tensor, Tensor, Tensor]:
        """The masked sentences ``[B, G]`` (bool), each long token's sentence ``[S]`` and the real tokens ``[B, S]``."""
        b, s, device = inputs.shape[0], inputs.shape[1], inputs.device
        real = key_padding if key_padding is not None else torch.ones(b, s, dtype=torch.bool, device=device)
        sentence = torch.div(torch.arange(s, device=device), self.segment, rounding_mode="floor")  # [S]
        owns = sentence[None] == torch.arange(self.n_global, device=device)[:, None]  # [G, S]
        present = (real[:, None, :] & owns[None]).any(-1)  # [B, G]: sentences with a real token
        gen = None if training else torch.Generator(device=device).manual_seed(EVAL_SEED)
        draw = torch.rand(b, self.n_global, generator=gen, device=device)  # [B, G]
        chosen = present & (draw < self.mask_prob)
        everything = (chosen == present).all(-1) & present.any(-1)  # rows with every sentence chosen
        keep = draw.masked_fill(~present, -1.0).argmax(-1)  # [B]: the one left visible there
        chosen[everything, keep[everything]] = False
        return chosen, sentence, real


def info_nce(pred: Tensor, target: Tensor) -> Tensor:
    """InfoNCE (Oord et al., 2018) of ``pred [N, E]`` against ``target [N, E]``: each prediction's own target
    is its positive, the other N - 1 targets its negatives; scores ``<p_i, t_j> / sqrt(E)``. Zero for N < 2."""
    if pred.shape[0] < 2:
        return pred.sum() * 0.0
    logits = pred @ target.T / math.sqrt(pred.shape[-1])  # [N, N]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (a half-precision run: in fp32)
    return F.cross_entropy(logits, torch.arange(pred.shape[0], device=pred.device))
