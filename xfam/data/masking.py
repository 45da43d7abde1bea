"""Masked-language-model corruption: BERT's token masking and SpanBERT's span masking.

BERT (Devlin et al., 2019, arXiv:1810.04805, sec. 3.1 and appendix A.1): 15% of the real tokens of
each sequence are selected for prediction; a selected token is replaced by ``[MASK]`` with probability
0.8, by a random token with probability 0.1 and left unchanged with probability 0.1; the model is
trained to predict the original token at the selected positions only. As in BERT's released
``create_pretraining_data.py``, each row selects exactly ``max(1, round(rate * n))`` of its ``n``
real tokens (uniformly, without replacement), not a Bernoulli draw per token.

SpanBERT (Joshi et al., 2020, arXiv:1907.10529, sec. 3.1): whole spans are selected instead of single
tokens. A span's length is drawn from Geometric(p = 0.2) restricted to 1..10 (renormalised, as in the
authors' code: mean length 3.8, the value the paper states), its start uniformly among the real tokens
not selected yet; spans are added until the budget of ``round(rate * n)`` tokens is met (the last one
cut to the budget). The 80/10/10 decision is drawn once per span (per maximal run of selected tokens,
as the authors' code merges touching spans); a random replacement is drawn per token. Spans run over
the real tokens in order: special tokens and padding between them are skipped, never selected.

"Real" tokens are those neither padding (``key_padding`` False) nor one of ``special_ids``; random
replacements are drawn uniformly from the ids below ``vocab_size`` that are neither special nor
``mask_id``.

``MaskingCollate`` turns a language-model batch into an MLM batch. Its masks are a pure function of
``(seed, epoch, the batch's input ids)``: a run resumed exactly (same batches, same epoch) draws the
same masks in the main process or in any DataLoader worker, without any state to checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from xfam.core.errors import ConfigError

IGNORE = -100
#: SpanBERT's span-length distribution: Geometric(p) restricted to 1..SPAN_MAX.
SPAN_P, SPAN_MAX = 0.2, 10


def span_length_pmf(p: float = SPAN_P, max_len: int = SPAN_MAX) -> Tensor:
    """``[max_len]`` probabilities of span lengths 1..max_len: ``p (1 - p)^(l - 1)``, renormalised."""
    pmf = p * (1 - p) ** torch.arange(max_len, dtype=torch.float64)
    return pmf / pmf.sum()


def _check_fractions(rate: float, mask_frac: float, random_frac: float) -> None:
    problems = []
    if not 0 < rate <= 1:
        problems.append(f"masking rate={rate} must be in (0, 1]. Fix: use BERT's 0.15.")
    if mask_frac < 0 or random_frac < 0 or mask_frac + random_frac > 1:
        problems.append(
            f"masking mask_frac={mask_frac}, random_frac={random_frac}: each must be >= 0 and their sum <= 1 (the "
            "rest of the selected tokens stays unchanged). Fix: use BERT's mask_frac=0.8, random_frac=0.1."
        )
    if problems:
        raise ConfigError(problems)


def replacement_ids(vocab_size: int, mask_id: int, special_ids: Sequence[int]) -> Tensor:
    """The ids a random replacement is drawn from: below ``vocab_size``, neither special nor ``mask_id``."""
    keep = torch.ones(vocab_size, dtype=torch.bool)
    banned = [i for i in (*special_ids, mask_id) if 0 <= i < vocab_size]
    keep[torch.tensor(banned, dtype=torch.long)] = False
    return keep.nonzero().flatten()


def candidates(ids: Tensor, special_ids: Sequence[int], key_padding: Tensor | None = None) -> Tensor:
    """``[B, S]`` bool: the real tokens (not padding, not special), the only ones that may be selected."""
    real = ~torch.isin(ids, torch.tensor(list(special_ids), dtype=ids.dtype))
    return real if key_padding is None else real & key_padding.bool()


def _budget(real: Tensor, rate: float) -> Tensor:
    """``[B]`` tokens to select per row: ``max(1, round(rate * n))`` of ``n`` real tokens (0 when none)."""
    n = real.sum(dim=1)  # [B]
    return torch.where(n > 0, torch.round(n.double() * rate).long().clamp(min=1), 0)


def _select_tokens(real: Tensor, budget: Tensor, generator: torch.Generator | None) -> Tensor:
    """``[B, S]`` run ids: each selected token is its own run (``0..K-1``), -1 elsewhere."""
    scores = torch.rand(real.shape, generator=generator, dtype=torch.float64)  # [B, S]
    scores[~real] = 2.0  # after every real token
    rank = scores.argsort(dim=1).argsort(dim=1)  # [B, S] position of each token in its row's random order
    selected = rank < budget[:, None]
    run = torch.full(real.shape, -1, dtype=torch.long)
    run[selected] = torch.arange(int(selected.sum()))
    return run


def draw_spans(n: int, want: int, generator: torch.Generator | None = None) -> tuple[list[bool], list[int]]:
    """SpanBERT selection of ``want`` of ``n`` tokens in a row: ``(chosen [n], drawn lengths of the spans)``.

    Each span: a length from ``span_length_pmf``, a uniform start (redrawn when it is selected already,
    as in the authors' code), its tokens added in order until the budget is met (the last span cut).
    """
    pmf, chosen, spans, count = span_length_pmf(), [False] * n, [], 0
    while count < want:  # draws come in chunks (fewer generator calls); each accepted span adds >= 1 token
        chunk = want - count + 8
        lengths = (torch.multinomial(pmf, chunk, replacement=True, generator=generator) + 1).tolist()
        starts = torch.randint(n, (chunk,), generator=generator).tolist()
        for length, start in zip(lengths, starts):
            if count == want:
                break
            if chosen[start]:
                continue
            spans.append(length)
            for i in range(start, min(start + length, n)):
                if count == want:
                    break
                count += not chosen[i]
                chosen[i] = True
    return chosen, spans


def _select_spans(real: Tensor, budget: Tensor, generator: torch.Generator | None) -> Tensor:
    """``[B, S]`` run ids of SpanBERT span selection (maximal runs of selected real tokens), -1 elsewhere."""
    run = torch.full(real.shape, -1, dtype=torch.long)
    runs = 0
    for b in range(real.shape[0]):
        positions = real[b].nonzero().flatten().tolist()  # the real tokens of the row, in order
        chosen, _ = draw_spans(len(positions), int(budget[b]), generator)
        for i, c in enumerate(chosen):
            if c:
                runs += i == 0 or not chosen[i - 1]  # a new maximal run starts here
                run[b, positions[i]] = runs - 1
    return run


def mask_tokens(
    ids: Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
    key_padding: Tensor | None = None,
    rate: float = 0.15,
    mask_frac: float = 0.8,
    random_frac: float = 0.1,
    span: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """BERT (or, with ``span``, SpanBERT) corruption of ``ids`` ``[B, S]``; see the module docstring.

    Args:
        ids: ``[B, S]`` token ids.
        mask_id: the ``[MASK]`` id (it may lie at or beyond ``vocab_size``: a model then needs one more id).
        vocab_size: random replacements are drawn from the ids below it that are neither special nor mask.
        special_ids: ids never selected (padding, eos, cls, sep ...).
        key_padding: ``[B, S]`` bool, True on real tokens; False positions are never selected.
        rate: share of each row's real tokens selected for prediction.
        mask_frac / random_frac: share of the selected tokens (spans) replaced by ``mask_id`` / a random
            id; the rest stays unchanged.
        span: SpanBERT span selection instead of single tokens.
        generator: the source of randomness (None: torch's global generator).

    Returns:
        ``(inputs [B, S], labels [B, S])``: the corrupted ids, and the original ids at the selected
        positions with -100 elsewhere.
    """
    _check_fractions(rate, mask_frac, random_frac)
    ids = ids.long()
    pool = replacement_ids(vocab_size, mask_id, special_ids)
    if random_frac > 0 and len(pool) == 0:
        raise ConfigError(
            f"masking: no id below vocab_size={vocab_size} is left for random replacement once the special ids "
            f"{sorted(special_ids)} and mask_id={mask_id} are excluded. Fix: random_frac=0 or a larger vocab_size."
        )
    real = candidates(ids, special_ids, key_padding)  # [B, S]
    budget = _budget(real, rate)  # [B]
    run = (_select_spans if span else _select_tokens)(real, budget, generator)  # [B, S]
    selected = run >= 0
    decision = torch.rand(int(run.max()) + 1 if run.numel() else 0, generator=generator, dtype=torch.float64)  # [runs]
    u = torch.where(selected, decision[run.clamp(min=0)], 2.0)  # [B, S] one draw per run
    random_pick = torch.randint(max(len(pool), 1), ids.shape, generator=generator)  # [B, S]
    inputs = ids.clone()
    to_mask = u < mask_frac
    to_random = (u >= mask_frac) & (u < mask_frac + random_frac)
    inputs[to_mask] = mask_id
    if len(pool):
        inputs[to_random] = pool[random_pick[to_random]]
    labels = torch.where(selected, ids, IGNORE)
    return inputs, labels


def batch_seed(seed: int, epoch: int, ids: Tensor) -> int:
    """A 63-bit seed fixed by ``(seed, epoch, ids)``: the shape and every id enter the hash."""
    digest = hashlib.sha256(f"{seed}:{epoch}:{tuple(ids.shape)}:".encode())
    digest.update(ids.detach().cpu().long().contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


class MaskingCollate:
    """A collate function: a language-model batch from ``base_collate`` -> a masked-LM batch.

    ``input_ids`` is corrupted by ``mask_tokens``, ``labels`` becomes the original ids at the selected
    positions (-100 elsewhere; the lm's next-token labels are discarded), every other key (``key_padding``,
    ``segments`` ...) is kept as it is; ``key_padding``, when present, keeps padding from being selected.
    The masks depend only on ``(seed, epoch, the batch's input ids)``. Picklable when ``base_collate``
    is, so it runs in DataLoader workers; ``set_epoch`` must reach the copy that collates (a worker
    holds its own copy from the moment its iterator starts).
    """

    def __init__(
        self,
        base_collate: Callable[[list[Any]], dict[str, Tensor]],
        *,
        mask_id: int,
        vocab_size: int,
        special_ids: Sequence[int],
        rate: float = 0.15,
        mask_frac: float = 0.8,
        random_frac: float = 0.1,
        span: bool = False,
        seed: int = 0,
    ):
        _check_fractions(rate, mask_frac, random_frac)
        self.base_collate = base_collate
        self.mask_id, self.vocab_size, self.special_ids = mask_id, vocab_size, tuple(int(i) for i in special_ids)
        self.rate, self.mask_frac, self.random_frac, self.span = rate, mask_frac, random_frac, span
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Masks of epoch ``epoch`` from now on (the same batch gets other masks in another epoch)."""
        self.epoch = epoch

    def __call__(self, rows: list[Any]) -> dict[str, Tensor]:
        batch = dict(self.base_collate(rows))
        ids = batch["input_ids"]  # [B, S]
        generator = torch.Generator().manual_seed(batch_seed(self.seed, self.epoch, ids))
        batch["input_ids"], batch["labels"] = mask_tokens(
            ids,
            mask_id=self.mask_id,
            vocab_size=self.vocab_size,
            special_ids=self.special_ids,
            key_padding=batch.get("key_padding"),
            rate=self.rate,
            mask_frac=self.mask_frac,
            random_frac=self.random_frac,
            span=self.span,
            generator=generator,
        )
        return batch
