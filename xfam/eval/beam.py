"""Beam search, greedy search and sampling over an abstract incremental decoder (sequence-to-sequence decoding).

Nothing here knows the model. The caller supplies

* ``step(last_tokens [N] long, state) -> (logits [N, V], state)``: one decoder step for N rows, given the token
  each row fed last (``bos_id`` on the first call) and the decoder state (encoder output, decode caches);
* ``reorder(state, index [N'] long) -> state`` (beam search only): the state's rows gathered by ``index``
  (``index_select`` along the row dimension of every tensor in it). Beam search calls it once at the start to
  expand the ``batch_size`` input rows to ``N = batch_size * beam_size`` beam rows (``index = arange(B)``
  repeated ``beam_size`` times each: row ``b * beam_size + k`` is beam k of input b), then after every step
  that is followed by another, with the beam each surviving hypothesis came from.

Greedy search and sampling keep one row per input and never reorder.

**Score.** A finished hypothesis Y (the generated tokens, without BOS, with its EOS; or ``max_len`` tokens
without EOS when it ran out of length) scores ``log P(Y) / lp(|Y|)`` with GNMT's length penalty (Wu et al.,
"Google's Neural Machine Translation System", 2016, arXiv:1609.08144, sec. 7):
``lp(n) = ((5 + n) / 6) ** alpha``, ``alpha = length_penalty``; ``alpha = 0`` is plain log-probability and
alpha > 0 favours longer outputs. (GNMT's coverage penalty needs the attention weights and is not applied.)
The alternative normalisation of Hugging Face ``transformers`` divides by ``|Y| ** alpha``; both are 1 at
alpha = 0 and grow with |Y|, GNMT's more slowly (lp(1) = 1 for every alpha). xfam uses GNMT's.

**Search.** As in fairseq and Hugging Face: every step scores the ``2 * beam_size`` best one-token extensions of
the live beams (at most ``beam_size`` of them end in EOS, so at least ``beam_size`` do not); an EOS extension
among the ``beam_size`` best becomes a finished hypothesis (a row keeps its ``beam_size`` best finished ones),
and the ``beam_size`` best non-EOS extensions are the next live beams, so a finished hypothesis is never
extended. On the first step only beam 0 of each row is live (the others score -inf), so the beams are
distinct. When ``max_len`` tokens have been generated the live beams are finished as they are.

**Early stopping.** With ``early_stopping=True`` a row stops once it holds ``beam_size`` finished hypotheses
and no live beam can beat the worst of them. The bound is exact: a live beam with log-probability s <= 0
after n tokens ends at some length m in ``[n + 1, max_len]`` with a log-probability s' <= s, so its final
score is at most ``max(s / lp(m)) = max(s / lp(n + 1), s / lp(max_len))`` (lp is monotone in m, so the
maximum is at an end: ``max_len`` for alpha > 0, ``n + 1`` for alpha < 0). The search therefore returns
exactly what running to ``max_len`` returns, only sooner. (Hugging Face's default, ``early_stopping=False``
there, bounds by ``s / lp(n)`` instead, a heuristic that can stop too soon when alpha > 0, since a longer
continuation divides by a larger lp; its ``early_stopping=True`` stops at the first ``beam_size`` finished
hypotheses; its ``"never"`` is the exact bound.) ``early_stopping=False`` here runs every row to ``max_len``.

Shapes: B inputs, K beams, N = B * K rows, V vocabulary, L = ``max_len``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.eval.generate import filter_logits

Step = Callable[[Tensor, Any], tuple[Tensor, Any]]
Reorder = Callable[[Any, Tensor], Any]


class BeamResult(NamedTuple):
    """``tokens [B, T]``: each input's best hypothesis (without BOS, ending at its EOS or at ``max_len``),
    right-padded with the pad id to the longest one; ``scores [B]``: its score, ``log P / lp(length)`` (plain
    ``log P`` for greedy search and sampling, the model's unfiltered log-probability)."""

    tokens: Tensor
    scores: Tensor


def gnmt_length_penalty(length: Tensor | float, alpha: float) -> Tensor | float:
    """GNMT's length penalty ``((5 + length) / 6) ** alpha`` (Wu et al., 2016, arXiv:1609.08144)."""
    return ((5 + length) / 6) ** alpha


def _check(where: str, batch_size: int, max_len: int, bad: list[str]) -> None:
    """One ConfigError naming every out-of-range option of ``where``."""
    bad = [f"batch_size={batch_size} (valid: >= 1)"] * (batch_size < 1) + bad
    bad += [f"max_len={max_len} (valid: >= 1)"] * (max_len < 1)
    if bad:
        raise ConfigError(f"{where}: {'; '.join(bad)}. Fix: a value in the valid range.")


def _log_probs(logits: Tensor, rows: int, eos_id: int) -> Tensor:
    """``log_softmax`` of ``logits [rows, V]`` in at least float32; refuses an ``eos_id`` outside the vocabulary."""
    if logits.dim() != 2 or logits.shape[0] != rows:
        raise ConfigError(
            f"decoding: step returned logits of shape {tuple(logits.shape)}; expected [{rows}, V] (one row per "
            "decoded row). Fix: return the last position's logits, [N, V]."
        )
    if not 0 <= eos_id < logits.shape[1]:
        raise ConfigError(
            f"decoding: eos_id={eos_id} is outside the vocabulary (valid: 0..{logits.shape[1] - 1}). "
            "Fix: pass the tokenizer's end-of-sequence id."
        )
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


# ---------------------------------------------------------------------------------------------- beam search


class _Finished(NamedTuple):
    """Each row's best finished hypotheses, best first: ``scores [B, K]`` (-inf = empty slot), ``tokens
    [B, K, L]`` (right-padded), ``lengths [B, K]``."""

    scores: Tensor
    tokens: Tensor
    lengths: Tensor


def _merge(pool: _Finished, new: _Finished) -> _Finished:
    """The K best of ``pool`` and ``new`` (``new`` may hold any number of candidates per row)."""
    k = pool.scores.shape[1]
    scores = torch.cat((pool.scores, new.scores), dim=1)  # [B, K + C]
    top = scores.topk(k, dim=1)  # sorted, best first
    tokens = torch.cat((pool.tokens, new.tokens), dim=1)  # [B, K + C, L]
    lengths = torch.cat((pool.lengths, new.lengths), dim=1)
    pick = top.indices[..., None].expand(-1, -1, tokens.shape[-1])
    return _Finished(top.values, tokens.gather(1, pick), lengths.gather(1, top.indices))


def _extend(seqs: Tensor, beam: Tensor, token: Tensor) -> Tensor:
    """``seqs [B, K, n]`` of the beams ``beam [B, C]`` with ``token [B, C]`` appended: ``[B, C, n + 1]``."""
    parents = seqs.gather(1, beam[..., None].expand(-1, -1, seqs.shape[-1]))  # [B, C, n]
    return torch.cat((parents, token[..., None]), dim=-1)


def _as_finished(seqs: Tensor, scores: Tensor, max_len: int, pad: int) -> _Finished:
    """Hypotheses ``seqs [B, C, n]`` with ``scores [B, C]`` as a pool entry padded to ``max_len``."""
    n = seqs.shape[-1]
    return _Finished(scores, F.pad(seqs, (0, max_len - n), value=pad), torch.full_like(scores, n, dtype=torch.long))


def _best_possible(live: Tensor, n: int, max_len: int, alpha: float) -> Tensor:
    """Exact upper bound on the final score of a live beam with log-probability ``live [B]`` after ``n``
    tokens: ``max(s / lp(n + 1), s / lp(max_len))`` (module docstring)."""
    first = min(n + 1, max_len)
    return torch.maximum(live / gnmt_length_penalty(first, alpha), live / gnmt_length_penalty(max_len, alpha))


@torch.no_grad()
def beam_search(
    step: Step,
    state: Any,
    *,
    batch_size: int,
    bos_id: int,
    eos_id: int,
    beam_size: int,
    max_len: int,
    length_penalty: float = 1.0,
    early_stopping: bool = True,
    reorder: Reorder,
    pad_id: int | None = None,
    device: torch.device | str | None = None,
) -> BeamResult:
    """Each input's best hypothesis under ``log P / lp`` (module docstring). ``state`` holds the decoder state
    of the ``batch_size`` inputs; ``pad_id`` (default ``eos_id``) pads the returned tokens; ``device`` is where
    the token tensors live (that of the state's tensors; default CPU)."""
    bad = [f"beam_size={beam_size} (valid: >= 1)"] * (beam_size < 1)
    _check("beam_search", batch_size, max_len, bad)
    b, k, pad = batch_size, beam_size, eos_id if pad_id is None else pad_id
    rows = torch.arange(b, device=device)[:, None] * k  # [B, 1] first row of each input
    state = reorder(state, torch.arange(b, device=device).repeat_interleave(k))  # B rows -> N = B * K rows
    live = torch.full((b, k), float("-inf"), device=device)
    live[:, 0] = 0.0  # [B, K] log P of the live beams; only beam 0 at first, so the beams are distinct
    seqs = torch.empty(b, k, 0, dtype=torch.long, device=device)  # [B, K, n] live beams' tokens
    empty = torch.full((b, k), float("-inf"), device=device)
    pool = _as_finished(seqs, empty, max_len, pad)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    last = torch.full((b * k,), bos_id, dtype=torch.long, device=device)
    for n in range(1, max_len + 1):  # n: tokens generated after this step
        logits, state = step(last, state)
        logp = _log_probs(logits, b * k, eos_id).view(b, k, -1)  # [B, K, V]
        live = live.to(logp.dtype)
        cand = (live[..., None] + logp).flatten(1).topk(min(2 * k, logp.shape[1] * logp.shape[2]), dim=1)
        cand_beam, cand_tok = cand.indices // logp.shape[2], cand.indices % logp.shape[2]  # [B, 2K]
        is_eos = cand_tok == eos_id
        rank = torch.arange(cand_tok.shape[1], device=device)
        ends = is_eos & (rank < k) & torch.isfinite(cand.values) & ~done[:, None]  # [B, 2K]
        scores = torch.where(ends, cand.values / gnmt_length_penalty(n, length_penalty), float("-inf"))
        pool = _merge(pool, _as_finished(_extend(seqs, cand_beam, cand_tok), scores, max_len, pad))
        keep = cand.values.masked_fill(is_eos, float("-inf")).topk(k, dim=1).indices  # [B, K] of the 2K
        beam, last = cand_beam.gather(1, keep), cand_tok.gather(1, keep)
        live, seqs = cand.values.gather(1, keep), _extend(seqs, beam, last)
        if early_stopping:
            full = torch.isfinite(pool.scores).all(dim=1)
            beaten = _best_possible(live.max(dim=1).values, n, max_len, length_penalty) <= pool.scores[:, -1]
            done |= full & beaten
        if n == max_len or bool(done.all()):
            break
        state = reorder(state, (rows + beam).flatten())
        last = last.flatten()
    if n == max_len:  # rows still searching finish their live beams as they are
        out_of_length = torch.where(done[:, None], float("-inf"), live / gnmt_length_penalty(n, length_penalty))
        pool = _merge(pool, _as_finished(seqs, out_of_length, max_len, pad))
    longest = int(pool.lengths[:, 0].max())
    return BeamResult(pool.tokens[:, 0, :longest], pool.scores[:, 0])


# ---------------------------------------------------------------------------------------- greedy and sampling


def _one_path(
    step: Step, state: Any, choose: Callable[[Tensor], Tensor], b: int, eos: int, max_len: int, last: Tensor, pad: int
) -> BeamResult:
    """Decode one token per row with ``choose(logits [B, V]) -> [B]``, starting from ``last [B]`` (BOS), until
    every row has emitted EOS or ``max_len`` tokens; a finished row is fed EOS and its later tokens are ``pad``."""
    finished = torch.zeros(b, dtype=torch.bool, device=last.device)
    score, out = torch.zeros(b, device=last.device), []
    for _ in range(max_len):
        logits, state = step(last, state)
        logp = _log_probs(logits, b, eos)  # [B, V]
        token = choose(logits).masked_fill(finished, eos)  # [B]
        score = score + logp.gather(1, token[:, None])[:, 0].masked_fill(finished, 0.0)
        out.append(token.masked_fill(finished, pad))
        finished = finished | (token == eos)
        last = token
        if bool(finished.all()):
            break
    return BeamResult(torch.stack(out, dim=1), score)


@torch.no_grad()
def greedy_search(
    step: Step,
    state: Any,
    *,
    batch_size: int,
    bos_id: int,
    eos_id: int,
    max_len: int,
    pad_id: int | None = None,
    device: torch.device | str | None = None,
) -> BeamResult:
    """The most probable token at every step; ``state`` holds ``batch_size`` rows and is never reordered.
    Scores are ``log P`` (equal to ``beam_search``'s with ``beam_size=1, length_penalty=0``); ``pad_id`` and
    ``device`` as in ``beam_search``."""
    _check("greedy_search", batch_size, max_len, [])
    pad = eos_id if pad_id is None else pad_id
    bos = torch.full((batch_size,), bos_id, dtype=torch.long, device=device)
    return _one_path(step, state, lambda logits: logits.argmax(-1), batch_size, eos_id, max_len, bos, pad)


@torch.no_grad()
def sample_search(
    step: Step,
    state: Any,
    *,
    batch_size: int,
    bos_id: int,
    eos_id: int,
    max_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    pad_id: int | None = None,
    device: torch.device | str | None = None,
) -> BeamResult:
    """Ancestral sampling from ``softmax(logits / temperature)`` filtered to the top-k tokens and the nucleus
    of mass ``top_p`` (``xfam.eval.generate.filter_logits``; Holtzman et al., 2020, arXiv:1904.09751);
    ``temperature=0`` is greedy search. Scores are the model's unfiltered ``log P`` of the sample."""
    bad = [f"temperature={temperature} (valid: >= 0, 0 = greedy)"] * (not temperature >= 0)
    bad += [f"top_k={top_k} (valid: >= 0, 0 = off)"] * (top_k < 0)
    bad += [f"top_p={top_p} (valid: 0 < top_p <= 1, 1 = off)"] * (not 0 < top_p <= 1)
    _check("sample_search", batch_size, max_len, bad)
    if temperature == 0:
        return greedy_search(
            step,
            state,
            batch_size=batch_size,
            bos_id=bos_id,
            eos_id=eos_id,
            max_len=max_len,
            pad_id=pad_id,
            device=device,
        )

    def draw(logits: Tensor) -> Tensor:
        scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        probs = torch.softmax(filter_logits(scaled, top_k, top_p), dim=-1)  # [B, V]
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    pad = eos_id if pad_id is None else pad_id
    bos = torch.full((batch_size,), bos_id, dtype=torch.long, device=device)
    return _one_path(step, state, draw, batch_size, eos_id, max_len, bos, pad)
