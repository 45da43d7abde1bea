"""The layer stack of one forward call, as the exit policy drives it (``xfam.core.stack.LayerStack``).

``run_layer(step, x)`` runs one layer on the rows of the call: it finds the layer's memory (or decode
cache) in front of the keys, builds the layer context once per distinct key layout, lets a memory
that augments attention into the layer, writes the new memory and decode state, and gathers the
components' auxiliary losses. Keys are ``[persistent | front | rows]`` where the front is the
layer's memory ``[B, M, D]`` or the decode cache (T tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from xfam.core.context import LayerContext
from xfam.core.mask import AttnMask
from xfam.core.state import DecodeState, MemoryState
from xfam.core.typed import TypedModuleList
from xfam.memory import Memory
from xfam.model import propagate
from xfam.model.attn_options import Carry
from xfam.model.block import Block
from xfam.model.cross import CrossSource
from xfam.model.plan import CallPlan, DecodeCache, StaticCache
from xfam.model.reversible import reversible_stack
from xfam.model.spec import ModelSpec
from xfam.pos import PositionalEncoding


class StackModel(Protocol):
    """What a ``Stack`` uses of its model: an ``XfamModel`` (``xfam.model.transformer``, which imports this module)."""

    @property
    def spec(self) -> ModelSpec: ...
    @property
    def causal(self) -> bool: ...
    @property
    def pos(self) -> PositionalEncoding: ...
    @property
    def blocks(self) -> TypedModuleList[Block]: ...
    @property
    def memories(self) -> TypedModuleList[Memory]: ...
    @property
    def dual_norm(self) -> nn.Module | None: ...
    @property
    def training(self) -> bool: ...

    def head_logits(
        self,
        hidden: Tensor,
        key_padding: Tensor | None = None,
        proj: nn.Module | None = None,
        retrieved: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor: ...

    def scored_rows(self, rows: Tensor) -> Tensor: ...

    def spread_scores(self, scores: Tensor, rows: int, fill: float) -> Tensor: ...


class Stack:
    """The blocks and per-layer memories of a model, bound to one call's plan, states and targets."""

    def __init__(
        self,
        model: StackModel,
        plan: CallPlan,
        *,
        memory: list[MemoryState] | None,
        cache: DecodeCache | StaticCache | None,
        targets: Tensor | None,
        retrieved: tuple[Tensor, Tensor] | None,
        dtype: torch.dtype,
        source: CrossSource | None = None,
    ):
        """``model``: the ``XfamModel`` whose blocks, memories, positional encoding and head run; ``memory`` /
        ``cache``: the states passed in; ``retrieved``: an output memory's neighbours, for the head; ``dtype``:
        the embedded input's (the rotary tables'); ``source``: the encoder output a decoder's cross-attention
        reads (a decode cache carries it after the first call)."""
        self.model, self.plan, self.retrieved = model, plan, retrieved
        self.spec, self.causal, self.pos = model.spec, model.causal, model.pos
        self.blocks, self.memories = model.blocks, model.memories
        self.num_layers = len(self.memories)
        self.positions, self.key_padding, self.decoding = plan.row_positions, plan.key_padding, plan.decoding
        self.targets = targets
        self.memory = memory  # the states passed in (read), and the new ones (written)
        self.new_memory = list(memory) if memory is not None else None
        # per layer: memory states [B, M, D] in front of the keys, their documents
        self.reads: list[Tensor | None] | None = None
        self.read_docs: list[Tensor | None] | None = None
        if memory is not None:
            self.reads = [m.read(st) for m, st in zip(self.memories, memory, strict=True)]
            self.read_docs = [m.read_segments(st) for m, st in zip(self.memories, memory, strict=True)]
        self.states = list(cache.layers) if cache is not None else None
        # per layer: keys in front of the tokens in the decode state (a memory the cache's first call read)
        self.fronts = list(cache.front or [0] * len(self.memories)) if isinstance(cache, DecodeCache) else None
        if cache is not None:  # a memory read by a decode call enters its cache; the segment writes it elsewhere
            self.new_memory = None
        self.static = cache if isinstance(cache, StaticCache) else None
        self.source = source if source is not None or not isinstance(cache, DecodeCache) else cache.source
        self.aux: dict[str, Tensor] = {}
        self.carry = Carry()  # what a layer passes to the next (block options that read an earlier layer)
        self._contexts: dict[object, LayerContext] = {}
        self._dtype = dtype  # of the embedded input: the rotary tables'

    # -- the LayerStack contract ---------------------------------------------------------------------
    def run_layer(self, step: int, x: Tensor) -> Tensor:
        """Layer ``step`` on ``x [B, G + S, D]`` (rows riding along in a decode call pass unchanged)."""
        plan = self.plan
        carried, h = x[:, : plan.ride], x[:, plan.ride :]
        block: Block = self.blocks[step % len(self.blocks)]
        mem = self.reads[step] if self.reads is not None else None
        fresh = 0 if mem is None else mem.shape[1]  # memory rows whose keys this call computes
        front = self._front(step) + fresh
        docs = self.read_docs[step] if self.read_docs and plan.run_segments is not None and front else None
        ctx, augment = self.context(front, docs, fresh), self._augment(step)
        if self.fronts is not None:
            self.fronts[step] += fresh
        h = self._layer_positions(step, h)
        if step == 0 and self.model.dual_norm is not None:  # ResiDual's second stream starts as the input
            self.carry.dual = [h]
        self.carry.step = step
        if self.spec.checkpoint_activations and self.model.training and self.states is None and torch.is_grad_enabled():
            out, state = self._checkpointed(block, h, ctx, mem, augment), None
        else:
            out, state = block(h, ctx, mem, self._state(step), augment, self.source, self.carry)
        if self.states is not None:
            self.states[step] = state
        self._add_aux("attention", block.attn.mechanism.aux_losses())
        if self.new_memory is not None:
            self._write_memory(step, block, h)
        return torch.cat((carried, out), dim=1) if plan.ride else out

    def run_layer_rows(self, step: int, x: Tensor, running: Tensor) -> Tensor:
        """Layer ``step`` on ``x [B, G + S, D]`` for the rows ``running [B, G + S]`` only (an early-exit traversal's):
        the others come back unchanged and leave only their keys and values in the decode state
        (``xfam.model.propagate``); the whole layer where it cannot run partly."""
        plan = self.plan
        if self.memory is not None or bool(running.all()):
            return self.run_layer(step, x)
        carried, h = x[:, : plan.ride], x[:, plan.ride :]
        block: Block = self.blocks[step % len(self.blocks)]
        ctx = self.context(self._front(step))  # (no memory reaches here: run_layer takes those calls)
        h = self._layer_positions(step, h)
        self.carry.step = step
        res = propagate.layer_rows(block, h, running[:, plan.ride :], ctx, self._state(step), self.carry, self.source)
        if res is None:
            return self.run_layer(step, x)
        out, state = res
        if self.states is not None:
            self.states[step] = state
        self._add_aux("attention", block.attn.mechanism.aux_losses())
        return torch.cat((carried, out), dim=1) if plan.ride else out

    def head(self, x: Tensor, proj: nn.Module | None = None) -> Tensor:
        if self.carry.dual is not None:  # ResiDual: the output is x_L + norm(d_L)
            ride, dual_norm = self.plan.ride, self.model.dual_norm
            assert dual_norm is not None  # (the second stream runs only with its norm)
            x = torch.cat((x[:, :ride], x[:, ride:] + dual_norm(self.carry.dual[0])), dim=1)
        return self.model.head_logits(x, self.plan.input_padding, proj, self.retrieved)

    def scored_rows(self, rows: Tensor) -> Tensor:
        """Of per-row values ``[B, G + S, ...]``, the rows the head scores (``XfamModel.scored_rows``)."""
        return self.model.scored_rows(rows)

    def spread_scores(self, scores: Tensor, rows: int, fill: float) -> Tensor:
        """Per-scored-row values back to every row, ``fill`` elsewhere (``XfamModel.spread_scores``)."""
        return self.model.spread_scores(scores, rows, fill)

    # -- whole-stack paths ---------------------------------------------------------------------------
    def run_reversible(self, x: Tensor) -> Tensor:
        """Every layer in one recomputed pass (``xfam.model.reversible``), for ``model.reversible``."""
        ride, front = self.plan.ride, self.plan.offset if self.plan.decoding else 0
        ctx = self.context(front)
        hidden = reversible_stack(x[:, ride:], self.blocks, lambda i: ctx, self.spec.ffn_chunks, self.states)
        return torch.cat((x[:, :ride], hidden), dim=1) if ride else hidden

    def new_cache(self) -> DecodeCache | StaticCache | None:
        """The decode cache after this call (None when no cache was passed in)."""
        if self.static is not None:  # (its states were updated in place)
            self.static.pos.add_(self.plan.rows)
            return self.static
        if self.states is None:
            return None
        length = self.plan.offset + self.plan.rows
        fronts = self.fronts if self.fronts is not None and any(self.fronts) else None
        return DecodeCache(length, self.states, self.plan.cache_padding, self.source, fronts)

    # -- inside a layer ------------------------------------------------------------------------------
    def _front(self, step: int) -> int:
        """Keys in front of layer ``step``'s rows before any memory this call reads: a decode call's cached
        keys (the tokens seen and a memory an earlier call read), else none."""
        if not self.plan.decoding or self.fronts is None:
            return 0
        return self.plan.offset + self.fronts[step]

    def context(self, front: int, front_docs: Tensor | None = None, fresh: int | None = None) -> LayerContext:
        """The layer context of keys ``[persistent | front | rows]``, built once per distinct front length
        (and per memory when documents are marked: each memory keeps its own entries' document ids).
        ``fresh``: the front keys computed in this call (a memory it reads; None: all of them outside
        decoding, none in a decode call), which take rotary rows with the call's own rows."""
        fresh = fresh if fresh is not None else 0 if self.plan.decoding else front
        key = (front, fresh) if front_docs is None else (front, fresh, id(front_docs))
        if key not in self._contexts:
            made = self._make_context(front, front_docs, fresh) if self.static is None else self._step_context()
            self._contexts[key] = made
        return self._contexts[key]

    def _step_context(self) -> LayerContext:
        """The context of a fixed-shape decode call: its row's rotary tables picked from the cache's, the
        mechanisms' ``decode_step`` on their own state (``LayerContext.step``)."""
        assert self.static is not None and self.plan.step is not None  # (a StaticCache call)
        tables, rows = self.static.rotary, self.plan.row_positions  # [S]
        return LayerContext(
            mask=AttnMask(self.plan.rows, self.plan.rows, self.causal),
            pos=self.pos,
            bias=self.pos.score_bias(),
            rotary=None if tables is None else tuple(t.index_select(0, rows) for t in tables),
            decoding=True,
            step=self.plan.step,
        )

    def _make_context(self, front: int, front_docs: Tensor | None, fresh: int) -> LayerContext:
        plan = self.plan
        pad, seg = plan.run_padding, plan.run_segments  # [B, R]
        rows = plan.rows
        if plan.decoding:
            pad = plan.cache_padding  # [B, T + R]
            if pad is not None and front > plan.offset:  # the memory keys in front (real)
                pad = F.pad(pad, (front - plan.offset, 0), value=True)  # [B, front + R]
        elif pad is not None and front:
            pad = torch.cat((pad.new_ones(pad.shape[0], front), pad), dim=1)  # [B, M + R]
        if seg is not None and front and not plan.decoding:  # memory of another document is never seen
            front_docs = seg.new_full((seg.shape[0], front), -1) if front_docs is None else front_docs
            seg = torch.cat((front_docs.to(seg), seg), dim=1)  # [B, M + R]
        if self.spec.forgetful_mask and self.model.training and not plan.decoding:
            lead = plan.lead  # aux rows (memory or global tokens) are never hidden: they count with the front
            pad = forgetful_keys(
                pad, seg, self.spec.forgetful_mask, plan.batch, rows - lead, front + lead, plan.positions.device
            )
        p = self.spec.num_mem_kv
        mask = AttnMask(rows, p + front + rows, self.causal, pad, seg, persistent=p)
        key_pos = torch.arange(front + rows, device=plan.positions.device)[front - fresh :]  # the keys computed now
        return LayerContext(
            mask=mask,
            pos=self.pos,
            bias=self.pos.score_bias(),
            rotary=self.pos.rotary_tables(key_pos, self._dtype),
            decoding=plan.decoding,
        )

    def _layer_positions(self, step: int, h: Tensor) -> Tensor:
        """``h [B, lead + S, D]`` plus the encoding's per-layer vectors of the input rows (``layer_embedding``:
        learned positions per layer); the lead aux rows take none."""
        add = self.pos.layer_embedding(self.plan.positions, step)  # [S, D] or None
        if add is None:
            return h
        return h + F.pad(add.to(h.dtype), (0, 0, h.shape[1] - add.shape[0], 0))  # [lead + S, D]

    def _checkpointed(
        self, block: Block, h: Tensor, ctx: LayerContext, mem: Tensor | None, augment: Callable | None
    ) -> Tensor:
        """The block under activation checkpointing (``model.checkpoint_activations``): its activations are
        dropped after the forward and recomputed, layer by layer, in the backward pass
        (``torch.utils.checkpoint``, non-reentrant; the RNG state is restored, so dropout and stochastic
        depth draw the same masks).

        The recomputation runs the block exactly as its forward ran, though other layers ran in between:

        * the ``Carry`` (RealFormer's scores, ResFormer's first-layer values, ResiDual's stream) as this layer
          read it, in a copy, so the recomputation's writes reach no other layer;
        * the per-call caches (a learned bias memoised on the mask, an encoder-decoder's projected source keys)
          as this layer found them, so it recomputes what it first computed (and, e.g., T5's table gets its
          gradient through the layer that built it);
        * the block's buffers as they were before the forward (a buffer the forward updates in place, such as
          routing attention's centroid averages, is swapped for its earlier value during the recomputation,
          and the update is made once).
        """
        source, carry_in = self.source, _copy_carry(self.carry)
        caches = [ctx.mask.memos()] + ([source.kv] if source is not None else [])  # (per-call memos)
        first_seen = [dict(c) for c in caches]
        buffers = {name: (b, b._version, b.clone()) for name, b in block.named_buffers()}
        updated: dict[str, Tensor] = {}  # buffers the forward changed in place: their earlier values
        ran = [False]

        def run(x: Tensor) -> tuple[Tensor, Carry]:
            carry = _copy_carry(carry_in)
            if not ran[0]:  # the forward
                ran[0] = True
                return block(x, ctx, mem, None, augment, source, carry)[0], carry
            with _restored(caches, first_seen):  # the recomputation in the backward pass
                args = (x, ctx, mem, None, augment, source, carry)
                earlier = {name: old.clone() for name, old in updated.items()}  # (the recomputation may update them)
                out = torch.func.functional_call(block, earlier, args)[0] if earlier else block(*args)[0]
            return out, carry

        out, carry = checkpoint(run, h, use_reentrant=False)
        updated.update({name: old for name, (b, version, old) in buffers.items() if b._version != version})
        for f in dataclasses.fields(carry):  # what this layer passes on
            setattr(self.carry, f.name, getattr(carry, f.name))
        return out

    def _state(self, step: int) -> DecodeState | None:
        return self.states[step] if self.states is not None else None

    def _augment(self, step: int) -> Callable[[Tensor, Tensor], Tensor] | None:
        """A memory's hook into its layer's attention output (``Memory.augment``), if it has one."""
        memory: Memory = self.memories[step]
        if self.memory is None or not memory.augments_attention:
            return None
        state, segments = self.memory[step], self.plan.run_segments
        return lambda q, o: memory.augment(state, q, o, segments)

    def _write_memory(self, step: int, block: Block, h: Tensor) -> None:
        """The layer's new memory from its input rows (aux rows excluded: memories store the input's states)."""
        lead, seg = self.plan.lead, self.plan.run_segments
        view = block.view(None if seg is None else seg[:, lead:])
        assert self.memory is not None and self.new_memory is not None  # (called only with states passed in)
        self.new_memory[step], losses = self.memories[step].write(self.memory[step], h[:, lead:], view)
        self._add_aux("memory", losses)

    def _add_aux(self, slot: str, losses: dict[str, Tensor]) -> None:
        for k, val in losses.items():
            self.aux[f"{slot}/{k}"] = self.aux.get(f"{slot}/{k}", 0.0) + val


def _copy_carry(carry: Carry) -> Carry:
    """A copy of ``carry`` whose ResiDual stream (a list a ``Link`` updates in place) is a list of its own."""
    return dataclasses.replace(carry, dual=None if carry.dual is None else list(carry.dual))


@contextlib.contextmanager
def _restored(caches: list[dict], contents: list[dict]) -> Iterator[None]:
    """Within the context each dict of ``caches`` holds the matching ``contents``; afterwards what it held."""
    now = [dict(c) for c in caches]
    for cache, content in zip(caches, contents, strict=True):
        cache.clear()
        cache.update(content)
    try:
        yield
    finally:
        for cache, content in zip(caches, now, strict=True):
            cache.clear()
            cache.update(content)


def forgetful_keys(
    pad: Tensor | None,
    seg: Tensor | None,
    ratio: float,
    batch: int,
    rows: int,
    front: int,
    device: torch.device,
) -> Tensor:
    """The forgetful causal mask (Liu et al., 2022, "Forgetful Causal Masking Makes Causal Language Models
    Better Zero-Shot Learners", arXiv:2210.13432): each row hides a random fraction r ~ U[0, ``ratio``] of its
    tokens from every query (as keys), in training only, the same keys in every layer. The first real token of
    each document stays visible, so every query sees at least one key; the ``front`` keys before the input's
    ``rows`` tokens (memory, memory tokens, global tokens) are never hidden. ``pad`` / ``seg``: ``[B, front +
    rows]`` key padding and documents of the keys. Returns the key padding ``[B, front + rows]`` with the hidden
    keys marked False."""
    r = torch.rand(batch, 1, device=device) * ratio  # [B, 1]: this row's mask ratio
    hide = torch.rand(batch, rows, device=device) < r  # [B, R]
    real = torch.ones(batch, rows, dtype=torch.bool, device=device) if pad is None else pad[:, -rows:]
    start = real & ~F.pad(real, (1, -1), value=False)  # the first real token after padding (or the row's first)
    if seg is not None:
        s = seg[:, -rows:]
        start |= real & F.pad(s[:, 1:] != s[:, :-1], (1, 0), value=True)  # a document's first token
    keep = ~hide | start
    keep = F.pad(keep, (front, 0), value=True)  # [B, front + R]
    return keep if pad is None else pad & keep
