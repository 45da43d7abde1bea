"""The fast decoding path of ``generate``: a fixed-shape decode cache and a compiled single-token step (the
approach of PyTorch's gpt-fast: ``torch.compile`` of the step with a preallocated cache; CUDA graphs on
top with ``compile_mode="reduce-overhead"``).

The prompt runs in one eager call; its decode state then moves into a ``StaticCache`` sized for the whole
generation (``xfam.model.static_cache``), and every new token runs the same step, whose shapes never
change, so it is traced and compiled once per model and size, then reused by every later call in the
process. Decoders (``generate(decoder=...)``):

* ``compiled`` -- the fixed-shape step under ``torch.compile``;
* ``static``   -- the same step, not compiled (what ``compiled`` traces; for checks and debugging);
* ``eager``    -- the incremental call with a growing cache (``CachedStream``), which every model supports;
* ``auto``     -- ``compiled`` where the model supports it and compiling pays: the step is already compiled
  in this process, or the generation makes at least ``COMPILE_FROM`` new tokens (batch x new tokens;
  compiling takes seconds, repaid at roughly this many tokens on a CPU); ``static`` for an early-exit
  model (its depth varies per token, which one compiled graph cannot follow; the fixed-shape cache still
  spares the growing cache's copies, and a skipped layer writes its keys and values in place); else
  ``eager``. Logged once with the reason.

Compile modes (``compile_mode``, ``torch.compile``'s): the default compiles in seconds. On a CPU,
``max-autotune`` also freezes the weights into the compiled step (inductor's ``freezing``: constants,
folded and packed for its C++ GEMM micro-kernels, chosen by benchmarking) -- about 3x faster per token at
batch 1, after some 20 s of compiling, for decoding that runs long; the step is recompiled when the
model's weights change (an optimizer step, ``load_state_dict``). On CUDA, ``reduce-overhead`` adds CUDA
graphs. Each (model, batch, cache size, mode) gets its own compiled step (``CompiledStep``): one graph,
never shared with another model, never evicted by dynamo's limit of graphs per function.
"""

from __future__ import annotations

import itertools
import time
import types
import weakref
from typing import Any

import torch
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.core.logs import log, log_once
from xfam.model.plan import DecodeCache, StaticCache
from xfam.model.static_cache import NoStaticStep, static_problems, to_static
from xfam.model.transformer import ModelOutput, XfamModel

DECODERS = ("auto", "compiled", "static", "eager")
#: batch x new tokens from which ``auto`` compiles a step not yet compiled in this process.
COMPILE_FROM = 2048
#: The cache is sized in multiples of this many tokens, so nearby lengths share one compiled step.
ROUND = 256

#: ``compile_mode``s that freeze the weights into the step on a CPU (see the module docstring)
FROZEN_MODES = ("max-autotune", "max-autotune-no-cudagraphs")


def _step(model: XfamModel, tokens: Tensor, cache: StaticCache) -> Tensor:
    """One token per row ``tokens [B, 1]`` at ``cache.pos``: the next-token logits ``[B, V]``."""
    return model(tokens, cache=cache).logits[:, -1]


def _weights(model: XfamModel) -> tuple[tuple[int, int], ...]:
    """Where every parameter and buffer lives and how often it was written in place: what a step with frozen
    weights must see unchanged (an optimizer step and ``load_state_dict`` write in place, ``.to`` moves)."""
    return tuple((t.data_ptr(), t._version) for t in itertools.chain(model.parameters(), model.buffers()))


class CompiledStep:
    """``_step`` compiled for one model, batch size, cache size and mode. It compiles a copy of ``_step`` with a
    code object of its own: dynamo keeps its graphs per code object, at most ``recompile_limit`` of them (then it
    runs eagerly), and a frozen graph holds one model's weights, so a step shared between models could be
    evicted or, frozen, compute with another model's weights. On a CPU inductor's C++ wrapper calls the kernels
    without Python in between (0.72 vs 0.87 ms per token for a 4-layer width-256 model, 2-core AMD EPYC)."""

    def __init__(self, model: XfamModel, mode: str | None, device: str):
        fresh = types.FunctionType(_step.__code__.replace(), _step.__globals__, _step.__name__)
        self.frozen = device == "cpu" and mode in FROZEN_MODES
        cpu_mode = "max-autotune-no-cudagraphs" if self.frozen else mode  # (no CUDA graphs to make on a CPU)
        self.fn = torch.compile(fresh, dynamic=False, mode=cpu_mode if device == "cpu" else mode)
        self.settings: dict[str, Any] = {"cpp_wrapper": True, "freezing": self.frozen} if device == "cpu" else {}
        if self.frozen:  # (inductor prints each GEMM's timing table otherwise; xfam logs the compile time)
            self.settings.update(autotune_num_choices_displayed=0, max_autotune_report_choices_stats=False)
        self.weights = _weights(model) if self.frozen else ()
        self.ready = False

    def current(self, model: XfamModel) -> bool:
        """Whether the step still computes with ``model``'s weights (always, unless frozen)."""
        return not self.frozen or self.weights == _weights(model)

    def __call__(self, model: XfamModel, tokens: Tensor, cache: StaticCache) -> Tensor:
        if self.ready:
            return self.fn(model, tokens, cache)
        how = "weights frozen, GEMMs autotuned: tens of seconds" if self.frozen else "seconds"
        log.info("compiling the decode step (%s; once per model, batch and cache size in this process)", how)
        start = time.perf_counter()
        with torch._inductor.config.patch(self.settings):  # (read while compiling, on the first call)
            logits = self.fn(model, tokens, cache)
        self.ready = True
        log.info("decode step compiled in %.1f s", time.perf_counter() - start)
        return logits


#: model -> {(batch, capacity, mode): its compiled step}; a model's steps go with it
_steps: weakref.WeakKeyDictionary[XfamModel, dict[tuple[int, int, str | None], CompiledStep]]
_steps = weakref.WeakKeyDictionary()


def compiled_step(
    model: XfamModel, batch: int, capacity: int, mode: str | None, make: bool = True
) -> CompiledStep | None:
    """The model's compiled step for ``batch`` rows and a cache of ``capacity`` tokens, made if missing (and
    ``make``) or when its frozen weights are no longer the model's; None when missing and not ``make``."""
    steps = _steps.setdefault(model, {}) if make else _steps.get(model, {})
    step = steps.get((batch, capacity, mode))
    if step is not None and not step.current(model):
        step = None
        if make:
            log.info("the model's weights changed since its decode step was compiled with them frozen: recompiling")
    if step is None and make:
        step = steps[batch, capacity, mode] = CompiledStep(model, mode, next(model.parameters()).device.type)
    return step


def capacity_for(model: XfamModel, tokens: int) -> int:
    """The cache size for ``tokens`` in all: rounded up to ``ROUND`` (within a learned table's length)."""
    size = -(-tokens // ROUND) * ROUND
    return min(size, model.spec.max_len) if model.pos.bounded and tokens <= model.spec.max_len else size


def choose(
    model: XfamModel, batch: int, prompt: int, new: int, decoder: str, *, knn: bool = False, mode: str | None = None
) -> str:
    """The decoder ``generate`` runs (see the module docstring), logged with the reason; a ``compiled`` or
    ``static`` request the model cannot honour is refused."""
    if decoder not in DECODERS:
        raise ConfigError(f"decoder={decoder!r}: valid: {', '.join(DECODERS)}. Fix: decoder=auto.")
    if decoder == "eager":
        return "eager"
    capacity = capacity_for(model, prompt + new)
    extra = ["kNN-LM reads every step's hidden states"] if knn else []
    problems = {c: static_problems(model, capacity, compiled=c) + extra for c in (True, False)}
    if decoder != "auto" and (mine := problems[decoder == "compiled"]):
        raise ConfigError(
            f"decoder={decoder}: this model has no {'compiled ' if decoder == 'compiled' else ''}fixed-shape decode "
            f"step: {'; '.join(mine)}. Fix: decoder=auto (it decodes such models as they allow) or decoder=eager."
        )
    if decoder != "auto":
        return decoder
    if problems[True] and not problems[False]:  # (an early-exit policy)
        log_once(f"decoding with the fixed-shape step, not compiled: {'; '.join(problems[True])}")
        return "static"
    if problems[True]:
        log_once(f"decoding without the fixed-shape step: {'; '.join(problems[True])}")
        return "eager"
    if compiled_step(model, batch, capacity, mode, make=False) or batch * new >= COMPILE_FROM:
        cpu = next(model.parameters()).device.type == "cpu"
        hint = "; compile_mode=max-autotune decodes about 2x faster after ~20 s of compiling" if cpu else ""
        log_once(f"decoding with a compiled fixed-shape step (a cache of {capacity} tokens){'' if mode else hint}")
        return "compiled"
    log_once(
        f"decoding eagerly: fewer than {COMPILE_FROM} new tokens (batch x max_new_tokens) do not repay compiling "
        f"the fixed-shape step (decoder=compiled compiles anyway)"
    )
    return "eager"


class StaticStream:
    """A model over a growing stream through the fixed-shape step: the first call runs the prompt eagerly and
    moves its state into a ``StaticCache`` of ``capacity`` tokens; each later call runs the stream's one new
    token. Where a mechanism cannot hold the prompt's state in fixed shape (``NoStaticStep``), the stream
    goes on eagerly from the prompt's cache, with a log line."""

    def __init__(self, model: XfamModel, capacity: int, compiled: bool, mode: str | None = None):
        self.model, self.capacity, self.compiled, self.mode = model, capacity, compiled, mode
        self.cache: StaticCache | DecodeCache | None = None
        self.seen = 0
        self.step: CompiledStep | None = None  # (None: the step runs uncompiled)

    def __call__(self, tokens: Tensor) -> ModelOutput:
        if not isinstance(self.cache, StaticCache):  # the prompt (or eager decoding after NoStaticStep)
            out = self.model(tokens[:, self.seen :], cache=self.cache or self.model.empty_cache())
            first, self.seen, self.cache = self.cache is None, tokens.shape[1], out.cache
            if first:
                self.token = tokens.new_zeros(tokens.shape[0], 1)  # [B, 1]: the step's input
                self._go_static()
            return out
        if tokens.shape[1] != self.seen + 1:
            raise ValueError("a fixed-shape stream grows by one token per call")
        self.seen = tokens.shape[1]
        self.token.copy_(tokens[:, -1:])  # (one input of fixed strides and address: no recompiles, CUDA graphs)
        if self.step is None:  # (the whole output: an early exit's depths too)
            return self.model(self.token, cache=self.cache)
        return ModelOutput(logits=self.step(self.model, self.token, self.cache)[:, None], aux={})

    def _go_static(self) -> None:
        """Move the prompt's decode state into the fixed-shape cache (or stay eager, saying why)."""
        assert isinstance(self.cache, DecodeCache)  # (the prompt's)
        try:
            self.cache = to_static(self.model, self.cache, self.capacity)
        except NoStaticStep as why:
            log.info("decoding eagerly from the prompt: %s", why)
            return
        batch = self.token.shape[0]
        self.step = compiled_step(self.model, batch, self.capacity, self.mode) if self.compiled else None
        if self.step is not None and self.token.is_cuda:  # CUDA graphs replay fixed addresses: the cache's are inputs
            for state in self.cache.layers:
                for t in _tensors(state):
                    torch._dynamo.mark_static_address(t)
            torch._dynamo.mark_static_address(self.cache.pos)
            torch._dynamo.mark_static_address(self.token)


def _tensors(state: Any) -> list[Tensor]:
    """Every tensor of a (nested) decode state."""
    if isinstance(state, Tensor):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list | tuple) else []
    return [t for v in values for t in _tensors(v)]
