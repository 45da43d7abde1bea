"""The xfam model: embeddings, one positional encoding, L blocks traversed by the exit policy,
per-layer memory, and a head (causal LM or pooled classifier).

    tokens [B, S] -> embed [B, S, D] -> (+ input positions) -> blocks -> norm -> head
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from xfam.attention._base import ATTENTION, AttentionMechanism
from xfam.attention.etc import MEMORY_TOKENS_REFUSAL
from xfam.core.context import LayerContext
from xfam.core.errors import ConfigError
from xfam.core.mask import SHARED, AttnMask
from xfam.core.schedule import per_head, per_layer
from xfam.core.state import DecodeState, MemoryState
from xfam.exit._base import EXIT, ExitOutput
from xfam.memory._base import MEMORY
from xfam.model.block import Block
from xfam.model.head_groups import HeadGroups
from xfam.model.layers import make_norm
from xfam.model.reversible import reversible_stack
from xfam.model.spec import ModelSpec
from xfam.pos._base import POS

Task = Literal["lm", "classify"]


@dataclasses.dataclass
class DecodeCache:
    """Incremental-decoding state: tokens seen so far, each layer's mechanism state, and the key
    padding ``[B, length]`` of the tokens seen so far (None while nothing was padded)."""

    length: int
    layers: list[DecodeState | None]
    key_padding: Tensor | None = None


@dataclasses.dataclass
class ModelOutput:
    """``logits``: ``[B, S, V]`` (lm) or ``[B, C]`` (classify). ``aux``: auxiliary losses owned by
    components (summed into the loss by the trainer). ``depth``: layers used per token, if the
    exit policy varies it. ``memory`` / ``cache``: the new states, when states were passed in."""

    logits: Tensor
    aux: dict[str, Tensor]
    memory: list[MemoryState] | None = None
    cache: DecodeCache | None = None
    depth: Tensor | None = None


class XfamModel(nn.Module):
    """A Transformer assembled from one component per slot."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        task: Task,
        vocab_size: int,
        num_classes: int | None = None,
        attention: dict[str, Any],
        pos: dict[str, Any],
        memory: dict[str, Any],
        exit: dict[str, Any],
    ):
        super().__init__()
        self.spec, self.task = spec, task
        self.causal = spec.causal if spec.causal is not None else task == "lm"
        struct = spec.structural(self.causal)
        self.embed = nn.Embedding(vocab_size, spec.dim)
        self.drop = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        self.pos = POS.build(pos, **struct)
        out_dim = vocab_size if task == "lm" else num_classes
        self.exit = EXIT.build(exit, **struct, out_dim=out_dim)  # out_dim: for policies with their own classifiers
        self.num_layers = spec.layers
        n_blocks = self.exit.blocks_needed(spec.layers)
        attn_layers = per_layer(attention, spec.layers, "attention")
        shared: dict[str, Any] = {}  # modules that components share across layers
        self.blocks = nn.ModuleList(
            Block(spec, build_mechanism(attn_layers[i], {**struct, "shared": shared}, layer=i), layer=i)
            for i in range(n_blocks)
        )
        self.memories = nn.ModuleList(
            MEMORY.build(cfg, **struct, layer=i) for i, cfg in enumerate(per_layer(memory, spec.layers, "memory"))
        )
        self.uses_memory = any(m.registry_name != "none" for m in self.memories)
        if self.output_memory is not None:
            self.output_memory.check_vocab(vocab_size)
        # Auxiliary tokens: learned inputs in front of every input, with their own states in every block,
        # dropped before the head: memory tokens (model.num_memory_tokens), or ETC's global tokens (which its
        # mechanism asks for; layers whose mechanism asks for none see ordinary tokens). In packed rows memory
        # tokens are SHARED by every document (they see only each other); ETC's globals belong to none (-1).
        self.aux_tokens = aux_token_count(self.blocks, self.uses_memory, spec.num_memory_tokens)
        self.aux_embed = nn.Embedding(self.aux_tokens, spec.dim) if self.aux_tokens else None
        self.aux_doc = SHARED if spec.num_memory_tokens else -1
        self.norm = make_norm(spec) if spec.norm_position == "pre" else nn.Identity()
        self.head = nn.Linear(spec.dim, out_dim, bias=task == "classify")
        self.apply(self._init)
        if spec.tie_embeddings and task == "lm":
            self.head.weight = self.embed.weight

    def _init(self, m: nn.Module) -> None:
        std = self.spec.init_std
        if getattr(m, "own_init", False):  # a component that initialises itself (e.g. pos=dynamic's MLP)
            return
        if isinstance(m, nn.Linear):
            scale = 1 / math.sqrt(2 * self.spec.layers) if getattr(m, "residual_out", False) else 1.0
            nn.init.normal_(m.weight, std=std * scale)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)

    @property
    def output_memory(self) -> Any:
        """The last layer's memory when it mixes into the head's input (SPALM), else None."""
        return self.memories[-1] if self.memories[-1].mixes_output else None

    def new_step(self) -> None:
        """Start a training step (every training forward calls it): each attention mechanism advances its step
        schedule once here, however often its layer then runs (``AttentionMechanism.new_step``)."""
        for m in self.modules():
            if isinstance(m, AttentionMechanism):
                m.new_step()

    # -- state -----------------------------------------------------------------------------------
    def init_memory(self, batch_size: int, device: torch.device) -> list[MemoryState]:
        """Empty memory for every layer (pass to ``forward(memory=...)``)."""
        return [m.init_state(batch_size, device) for m in self.memories]

    # -- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        tokens: Tensor,
        *,
        key_padding: Tensor | None = None,
        segments: Tensor | None = None,
        memory: list[MemoryState] | None = None,
        cache: DecodeCache | None = None,
        targets: Tensor | None = None,
    ) -> ModelOutput:
        """Run the model.

        Args:
            tokens: ``[B, S]`` token ids.
            key_padding: ``[B, S]`` bool, True for real tokens (None: no padding).
            segments: ``[B, S]`` document ids of packed rows; attention stays within a document.
            memory: per-layer memory states from the previous segment (or ``init_memory``).
            cache: decode state; when given, ``tokens`` are new tokens after ``cache.length``.
            targets: the loss's targets (``[B, S]`` ids, -100 = none, or ``[B]`` labels), given in
                training to exit policies that train per-layer classifiers (``exit=calm``, ...).
        """
        b, s = tokens.shape
        if self.training and cache is None:
            self.new_step()
        offset = cache.length if cache is not None else 0
        retrieved = None  # SPALM's neighbours of every position, mixed into the head's input
        if self.output_memory is not None and cache is None:  # (generation refuses models with memory)
            retrieved = self.output_memory.retrieve(tokens, key_padding, segments)
        # Every call's rows are [aux tokens | input]. The G aux tokens run in the first call only: later decode
        # calls find their keys/values in the cache, and their rows ride along unchanged (the head drops them).
        ride = self.aux_tokens if offset else 0
        start = offset - ride  # the input's own first position (aux tokens take none)
        positions = torch.arange(start, start + s, device=tokens.device)  # [S]
        x = self.drop(self.pos.embed(self.embed(tokens), positions))  # [B, S, D]
        input_padding = key_padding
        if self.aux_embed is not None:  # masks cover [aux | input] (relative encodings see the aux in front)
            x, key_padding, segments = self._prepend_aux(x, key_padding, segments)
        s = x.shape[1] - ride  # the rows that run in this call, and their padding and documents:
        run_pad, run_seg = (None if t is None else t[:, ride:] for t in (key_padding, segments))
        lead = self.aux_tokens - ride  # aux rows among them (memories store the input's states only)
        mems = [m.read(st) for m, st in zip(self.memories, memory, strict=True)] if memory is not None else None
        mem_docs = [m.read_segments(st) for m, st in zip(self.memories, memory, strict=True)] if mems else None
        new_mem = list(memory) if memory is not None else None
        states = list(cache.layers) if cache is not None else None
        contexts: dict[int, LayerContext] = {}
        aux: dict[str, Tensor] = {}
        cache_pad = None
        if cache is not None and (run_pad is not None or cache.key_padding is not None):
            # Keys are [cache | new tokens]: the mask needs the padding of the cached tokens too.
            ones = lambda n: tokens.new_ones(b, n, dtype=torch.bool)
            past = cache.key_padding if cache.key_padding is not None else ones(offset)
            cache_pad = torch.cat((past, run_pad if run_pad is not None else ones(s)), dim=1)  # [B, T + S]

        def context(front: int, front_docs: Tensor | None = None) -> LayerContext:
            # Keys = [persistent | front (memory or cache) | segment]; one context per distinct front length (and
            # per layer when documents are marked: each memory keeps its own entries' document ids).
            key = front if front_docs is None else (front, id(front_docs))
            if key not in contexts:
                if cache is not None:
                    pad = cache_pad
                elif run_pad is not None and front:
                    pad = torch.cat((run_pad.new_ones(b, front), run_pad), dim=1)  # [B, M + S]
                else:
                    pad = run_pad
                docs = run_seg
                if run_seg is not None and front and cache is None:  # memory of another document is never seen
                    front_docs = run_seg.new_full((b, front), -1) if front_docs is None else front_docs
                    docs = torch.cat((front_docs.to(run_seg), run_seg), dim=1)  # [B, M + S]
                p = self.spec.num_mem_kv
                mask = AttnMask(s, p + front + s, self.causal, pad, docs, persistent=p)
                key_pos = torch.arange(front + s, device=tokens.device)[-s if cache is not None else 0 :]
                contexts[key] = LayerContext(
                    mask=mask,
                    pos=self.pos,
                    bias=self.pos.score_bias(),
                    rotary=self.pos.rotary_tables(key_pos, x.dtype),
                    decoding=cache is not None,
                )
            return contexts[key]

        def run_layer(step: int, h: Tensor) -> Tensor:
            carried, h = h[:, :ride], h[:, ride:]  # aux rows riding along (decode calls after the first)
            mem = mems[step] if mems is not None else None
            front = offset if cache is not None else (0 if mem is None else mem.shape[1])
            block, memory_l = self.blocks[step % len(self.blocks)], self.memories[step]
            augment = None
            if memory is not None and memory_l.augments_attention:
                augment = lambda q, o: memory_l.augment(memory[step], q, o, run_seg)  # noqa: E731
            ctx = context(front, mem_docs[step] if mem_docs and run_seg is not None and front else None)
            out, st = block(h, ctx, mem, states[step] if states is not None else None, augment)
            if states is not None:
                states[step] = st
            for k, val in block.attn.mechanism.aux_losses().items():
                aux[f"attention/{k}"] = aux.get(f"attention/{k}", 0.0) + val
            if new_mem is not None:
                view = block.view(None if run_seg is None else run_seg[:, lead:])
                new_mem[step], losses = memory_l.write(memory[step], h[:, lead:], view)
                for k, val in losses.items():
                    aux[f"memory/{k}"] = aux.get(f"memory/{k}", 0.0) + val
            return torch.cat((carried, out), dim=1) if ride else out

        if self.spec.reversible:  # the whole stack in one recomputed pass (see xfam.model.reversible)
            front = offset if cache is not None else 0
            hidden = reversible_stack(x[:, ride:], self.blocks, lambda i: context(front), self.spec.ffn_chunks, states)
            res = ExitOutput(hidden=torch.cat((x[:, :ride], hidden), dim=1) if ride else hidden)
        else:
            pos_all = torch.arange(start - self.aux_tokens, start + len(positions), device=tokens.device)  # [G + S]
            head = lambda h, proj=None: self.head_logits(h, input_padding, proj, retrieved)  # [B, G + S, D] -> logits
            res = self.exit(x, run_layer, self.num_layers, head, pos_all, key_padding, cache is not None, targets)
        aux.update({f"exit/{k}": val for k, val in res.aux.items()})
        logits = res.logits if res.logits is not None else self.head_logits(res.hidden, input_padding, None, retrieved)
        new_cache = DecodeCache(offset + s, states, cache_pad) if states is not None else None
        depth = None if res.depth is None else res.depth[:, self.aux_tokens :]
        return ModelOutput(logits=logits, aux=aux, memory=new_mem, cache=new_cache, depth=depth)

    def _prepend_aux(
        self, x: Tensor, key_padding: Tensor | None, segments: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``[B, S, D] -> [B, G + S, D]`` with the G aux tokens in front; they are never padding. In packed
        rows their document id is ``aux_doc``: memory tokens are SHARED (every document sees them, they see
        only each other), ETC's globals belong to no document (-1); neither carries one document into another."""
        b, n = x.shape[0], self.aux_tokens
        x = torch.cat((self.aux_embed.weight.to(x.dtype).expand(b, n, -1), x), dim=1)  # [B, G + S, D]
        if key_padding is not None:
            key_padding = torch.cat((key_padding.new_ones(b, n), key_padding), dim=1)  # [B, G + S]
        if segments is not None:
            segments = torch.cat((segments.new_full((b, n), self.aux_doc), segments), dim=1)  # [B, G + S]
        return x, key_padding, segments

    def head_logits(
        self,
        hidden: Tensor,
        key_padding: Tensor | None = None,
        proj: nn.Module | None = None,
        retrieved: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Final norm and head: ``[B, S, D] -> [B, S, V]`` (lm) or pooled ``[B, C]`` (classify).
        Auxiliary global tokens in front of ``hidden`` never reach the head. ``proj`` replaces the
        output layer (an exit policy's per-layer classifier). ``retrieved``: SPALM's neighbours, mixed
        into the head's input with the output word embeddings."""
        h = self.norm(hidden[:, self.aux_tokens :])
        if retrieved is not None and proj is None:
            h = self.output_memory.mix(h, retrieved, self.head.weight)  # [B, S, D]
        out = proj if proj is not None else self.head
        if self.task == "lm":
            return out(h)
        if self.spec.pool == "cls":
            return out(h[:, 0])
        if key_padding is None:
            return out(h.mean(dim=1))
        w = key_padding.to(h.dtype).unsqueeze(-1)  # [B, S, 1]
        return out((h * w).sum(1) / w.sum(1).clamp_min(1))

    def empty_cache(self) -> DecodeCache:
        return DecodeCache(0, [None] * self.num_layers)


def aux_token_count(blocks: nn.ModuleList, uses_memory: bool, memory_tokens: int = 0) -> int:
    """Auxiliary tokens to prepend: ``memory_tokens``, or the global tokens the layers' mechanisms ask for
    (``aux_tokens``, ETC)."""
    counts = {getattr(b.attn.mechanism, "aux_tokens", 0) for b in blocks} - {0}
    if len(counts) > 1:
        raise ConfigError(f"layers ask for different numbers of auxiliary tokens: {sorted(counts)}. Fix: one value.")
    if counts and uses_memory:
        raise ConfigError("auxiliary global tokens (attention=etc) cannot be combined with memory. Fix: memory=none.")
    if counts and memory_tokens:
        raise ConfigError(MEMORY_TOKENS_REFUSAL)
    return counts.pop() if counts else memory_tokens


def build_mechanism(cfg: dict[str, Any], struct: dict[str, Any], layer: int) -> AttentionMechanism:
    """One layer's mechanism, or a ``HeadGroups`` of several when ``per_head`` splits its heads."""
    heads, kv_heads = struct["heads"], struct["kv_heads"]
    groups = per_head(cfg, heads, kv_heads, "attention")
    if len(groups) == 1:
        return ATTENTION.build(groups[0][1], **struct, layer=layer)
    per_kv = heads // kv_heads
    members = [ATTENTION.build(g, **{**struct, "heads": n, "kv_heads": n // per_kv}, layer=layer) for n, g in groups]
    return HeadGroups(members, [n for n, _ in groups], heads, kv_heads)
