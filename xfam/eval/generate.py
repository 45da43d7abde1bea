"""Autoregressive sampling, with temperature, top-k and nucleus (top-p, Holtzman et al., 2020,
arXiv:1904.09751) filtering, from a causal language model with or without segment memory.

* Without memory each new token runs in one incremental call with the model's decode state (a KV
  cache, or whatever each mechanism keeps).
* With memory (``memory=xl``, ``compressive``, ``memorizing``, ``spalm``: the segment recurrence of
  Dai et al., 2019, "Transformer-XL", arXiv:1901.02860, sec. 3.2, and the memories built on it) the
  memory is carried as in training: the stream (prompt and generated tokens) is cut into segments of
  the training length (``data.seq_len``); each completed segment is run once with the memory of the
  segments before it, and the memory it writes is kept. Inside the current, incomplete segment the tokens
  decode incrementally: the segment's first call reads the memory into a decode cache (its keys and
  values in front of the segment's), each later call runs one token against that cache
  (``CachedSegments``). Where a memory cannot be read that way (documents marked, a memory that takes part
  in attention or mixes into the output: ``memorizing``, ``spalm``), the current segment is recomputed at
  every step instead (``SegmentStream``). Either way a token's logits are exactly those of the model run
  over the whole stream segment by segment (``stream_logits``, the definition). When the training data
  marked documents (``data.doc_mask``), a boundary token closes its document, as in training: attention
  and memory stay inside documents. SPALM's long-term memory retrieves for every recomputed position, as
  in training.

Shapes: B samples, T tokens so far, S segment length, V vocabulary.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.attention import AttentionMechanism
from xfam.core.errors import ConfigError
from xfam.core.logs import log_once
from xfam.eval import fast_decode
from xfam.eval.fast_decode import StaticStream, capacity_for
from xfam.model.plan import DecodeCache
from xfam.model.transformer import ModelOutput, XfamModel

if TYPE_CHECKING:
    from xfam.knnlm.interpolate import KnnMixer


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set of mass >= top_p."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class Generation(NamedTuple):
    """``tokens [B, T + n]``, the logits each new token was drawn from ``[B, n, V]``, and the layers the
    model used for each of them ``[B, n]`` (None unless the exit policy reports depth)."""

    tokens: Tensor
    logits: Tensor
    depth: Tensor | None


def generation_problems(model: XfamModel, segment_len: int | None = None) -> list[str]:
    """Why ``model`` cannot generate (empty when it can); ``segment_len``: a memory model's training
    ``data.seq_len``, the length of the segments its memory is written in."""
    if model.task != "lm" or not model.causal:
        what = "a bidirectional language model" if model.task == "lm" else f"a model of task {model.task!r}"
        return [
            f"generate continues text with a causal language model; this checkpoint is {what}, whose outputs "
            f"are not next-token predictions from a prefix. Fix: evaluate it with `xfam eval`."
        ]
    return prefix_problems(model, segment_len, "tokens")


def prefix_problems(model: XfamModel, segment_len: int | None, unit: str) -> list[str]:
    """Why a causal ``model`` cannot run growing prefixes, one call per new ``unit`` (tokens, or a regress model's
    steps): a mechanism of fixed length, or a memory model without its training segment length."""
    problems = []
    fixed = sorted({m.registry_name for m in model.modules() if isinstance(m, AttentionMechanism) and m.fixed_length})
    if fixed:
        problems.append(
            f"attention={', '.join(fixed)} needs every sequence to have exactly model.max_len {unit}, and "
            f"generation runs growing prefixes. Fix: generate from a model trained with another attention."
        )
    if model.uses_memory and (segment_len is None or segment_len < 1):
        problems.append(
            f"a model with memory generates segment by segment, as it was trained, and needs its training "
            f"segment length (segment_len={segment_len}). Fix: pass segment_len=<the checkpoint's data.seq_len> "
            f"(meta['config']['data']['seq_len'] of xfam.load_model)."
        )
    return problems


def document_ids(tokens: Tensor, boundary: int | None) -> Tensor | None:
    """``[B, T]`` document ids of a stream whose documents end with the ``boundary`` token (None: no
    documents). A boundary closes its own document (``xfam.data.base.collate_lm``'s rule)."""
    if boundary is None:
        return None
    return F.pad((tokens == boundary).long(), (1, 0))[:, :-1].cumsum(dim=1)  # [B, T]


class SegmentStream:
    """A memory model over a growing stream, segment by segment with the memory carried (see the module
    docstring): ``stream(tokens)`` returns the model's output for the stream's last, possibly incomplete,
    segment, after writing every completed segment before it into the memory."""

    def __init__(self, model: XfamModel, segment_len: int, boundary: int | None = None):
        self.model, self.segment_len, self.boundary = model, segment_len, boundary
        self.memory: list | None = None
        self.done = 0  # tokens whose segment is complete and written into self.memory

    def __call__(self, tokens: Tensor) -> ModelOutput:
        """``tokens [B, T]``: the whole stream so far (it only grows between calls)."""
        if self.memory is None:
            self.memory = self.model.init_memory(tokens.shape[0], tokens.device)
        docs = document_ids(tokens, self.boundary)  # [B, T]
        while tokens.shape[1] - self.done > self.segment_len:  # complete segments first (a long prompt)
            self._run(tokens, docs, self.done + self.segment_len)
        return self._run(tokens, docs, tokens.shape[1])

    def _run(self, tokens: Tensor, docs: Tensor | None, end: int) -> ModelOutput:
        """Tokens ``done .. end`` with the memory of the segments before them; kept when they complete one."""
        part = slice(self.done, end)
        out = self.model(tokens[:, part], segments=None if docs is None else docs[:, part], memory=self.memory)
        if end - self.done == self.segment_len:
            self.memory, self.done = out.memory, end
        return out


class CachedSegments:
    """A memory model over a growing stream with a decode cache inside each segment: the same logits as
    ``SegmentStream`` (the segments of training, the memory carried), without recomputing the current segment
    at every step. Each completed segment runs once with the memory of the segments before it and writes the
    memory; the current segment's first call reads that memory, whose keys and values enter its decode cache
    in front of the segment's (``DecodeCache.front``), and each later call runs the new tokens against that
    cache. For memories read as states in front of the keys (``cached_segment_problems``), without documents."""

    def __init__(self, model: XfamModel, segment_len: int):
        self.model, self.segment_len = model, segment_len
        self.memory: list | None = None
        self.cache: DecodeCache | None = None
        self.done = self.seen = 0  # tokens in completed segments; tokens run so far

    def __call__(self, tokens: Tensor) -> ModelOutput:
        """``tokens [B, T]``: the whole stream so far (it only grows between calls)."""
        if self.memory is None:
            self.memory = self.model.init_memory(tokens.shape[0], tokens.device)
        while tokens.shape[1] - self.done > self.segment_len:  # a completed segment writes the memory
            segment = tokens[:, self.done : self.done + self.segment_len]
            self.memory = self.model(segment, memory=self.memory).memory
            self.done, self.cache = self.done + self.segment_len, None
        if self.cache is None:  # the segment's first call reads the memory
            out = self.model(tokens[:, self.done :], memory=self.memory, cache=self.model.empty_cache())
        else:
            out = self.model(tokens[:, self.seen :], cache=self.cache)
        self.cache, self.seen = out.cache, tokens.shape[1]
        return out


def cached_segment_problems(model: XfamModel, boundary: int | None) -> list[str]:
    """Why a memory model generates by recomputing its current segment (``SegmentStream``) rather than with a
    decode cache inside the segment (``CachedSegments``); empty: it need not."""
    out = ["documents are marked (data.doc_mask)"] if boundary is not None else []
    for m in model.memories:
        out += [f"memory={m.registry_name} takes part in its layer's attention"] if m.augments_attention else []
        out += [f"memory={m.registry_name} mixes into the output"] if m.mixes_output else []
    return out


class CachedStream:
    """A model without memory over a growing stream (token ids or vectors): each call runs the rows after the
    decode cache."""

    def __init__(self, model: XfamModel):
        self.model, self.cache, self.seen = model, model.empty_cache(), 0  # (the cache also counts aux rows)

    def __call__(self, tokens: Tensor) -> ModelOutput:
        out = self.model(tokens[:, self.seen :], cache=self.cache)
        self.cache, self.seen = out.cache, tokens.shape[1]
        return out


@torch.no_grad()
def stream_logits(model: XfamModel, tokens: Tensor, segment_len: int, boundary: int | None = None) -> Tensor:
    """Logits ``[B, T, V]`` of every position of ``tokens [B, T]`` for a memory model run over the stream
    in segments of ``segment_len`` with the memory carried from each to the next (the definition that
    generation with memory follows); ``boundary``: the token that ends a document, when documents are marked."""
    model.eval()
    memory, docs, out = model.init_memory(tokens.shape[0], tokens.device), document_ids(tokens, boundary), []
    for a in range(0, tokens.shape[1], segment_len):
        part = slice(a, a + segment_len)
        res = model(tokens[:, part], segments=None if docs is None else docs[:, part], memory=memory)
        memory = res.memory
        out.append(res.logits)
    return torch.cat(out, dim=1)


@torch.no_grad()
def generate(
    model: XfamModel,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_token: int | None = None,
    knn: KnnMixer | None = None,
    segment_len: int | None = None,
    boundary: int | None = None,
    decoder: str = "auto",
    compile_mode: str | None = None,
) -> Generation:
    """Continue ``prompt [B, T]``. Without memory the prompt is processed in one call, then each new token
    in one incremental call (an early-exit policy decides each token's depth in that call): through the
    fixed-shape step, compiled where it pays, or the eager growing cache (``decoder``: ``auto``,
    ``compiled``, ``static``, ``eager``; ``compile_mode``: ``torch.compile``'s mode, e.g. ``max-autotune``
    (on a CPU the weights frozen into the step: fastest per token, slowest to compile) or ``reduce-overhead``
    (CUDA graphs); ``xfam.eval.fast_decode``). With memory
    the stream is run in segments of ``segment_len`` (the training ``data.seq_len``) with the memory
    carried, the current segment recomputed at each step (module docstring); ``boundary``: the token that
    ends a document when the training data marked documents (``data.doc_mask``), else None. With ``knn``
    (``xfam.knnlm.KnnMixer``) tokens are drawn from kNN-LM's interpolated distribution, whose
    log-probabilities are then the returned logits."""
    if problems := generation_problems(model, segment_len):
        raise ConfigError(problems)
    if prompt.shape[1] == 0:
        raise ConfigError("generate needs a prompt of at least one token. Fix: pass prompt=<text>.")
    bad = [f"max_new_tokens={max_new_tokens} (valid: >= 1)"] if max_new_tokens < 1 else []
    bad += [f"temperature={temperature} (valid: >= 0, 0 = greedy)"] if not temperature >= 0 else []
    bad += [f"top_k={top_k} (valid: >= 0, 0 = off)"] if top_k < 0 else []
    bad += [f"top_p={top_p} (valid: 0 < top_p <= 1, 1 = off)"] if not 0 < top_p <= 1 else []
    if bad:  # (top_p <= 0 kept no token: NaN probabilities, and sampling failed inside torch)
        raise ConfigError(f"generate: {'; '.join(bad)}. Fix: a value in the valid range.")
    model.eval()
    batch, length = prompt.shape
    how = fast_decode.choose(model, batch, length, max_new_tokens, decoder, knn=knn is not None, mode=compile_mode)
    step: SegmentStream | CachedSegments | CachedStream | StaticStream
    if model.uses_memory:
        assert segment_len is not None  # (generation_problems refused a memory model without it)
        if problems := cached_segment_problems(model, boundary):
            log_once(f"recomputing the current segment at every step: {'; '.join(problems)}")
            step = SegmentStream(model, segment_len, boundary)
        else:
            step = CachedSegments(model, segment_len)
    elif how == "eager":
        step = CachedStream(model)
    else:
        step = StaticStream(model, capacity_for(model, length + max_new_tokens), how == "compiled", compile_mode)
    with knn if knn is not None else contextlib.nullcontext():
        out = step(prompt)
        tokens, used, depths = prompt, [], []
        logits = out.logits[:, -1] if knn is None else knn(out.logits[:, -1])  # [B, V]
        for _ in range(max_new_tokens):
            used.append(logits)
            depths.append(out.depth[:, -1] if out.depth is not None else None)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)  # [B, 1]
            tokens = torch.cat((tokens, nxt), dim=1)
            if len(used) == max_new_tokens or (stop_token is not None and bool((nxt == stop_token).all())):
                break  # (no call for logits no token is drawn from)
            out = step(tokens)
            logits = out.logits[:, -1] if knn is None else knn(out.logits[:, -1])
    # (every step's depth, or none)
    depth = torch.stack(cast("list[Tensor]", depths), dim=1) if depths and depths[0] is not None else None
    return Generation(tokens, torch.stack(used, dim=1), depth)
