"""The xfam model: embeddings, one positional encoding, L blocks traversed by the exit policy,
per-layer memory, and a head: a causal LM, a bidirectional per-token head (masked LM, tagging),
a pooled classifier, a causal regression of the next vector, or none (the encoder of an
encoder-decoder, ``xfam.model.encoder_decoder``, whose decoder is this model with cross-attention in
every block). The input embedder follows the data's inputs (``xfam.model.inputs``): token ids,
continuous vectors or image patches.

    tokens [B, S] | vectors [B, S, F] | images [B, C, H, W] -> embed [B, S, D] -> (+ input positions)
        -> blocks -> norm -> head
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.attention import ATTENTION, AttentionMechanism
from xfam.core.mask import SHARED
from xfam.core.registry import Component
from xfam.core.schedule import per_head, per_layer
from xfam.core.state import MemoryState
from xfam.core.trajectory import StepLayout
from xfam.core.typed import TypedModuleList
from xfam.exit import EXIT, ExitOutput
from xfam.memory import MEMORY
from xfam.model.block import Block, SelfAttention, deepnorm_init
from xfam.model.cross import CrossSource
from xfam.model.head_groups import HeadGroups
from xfam.model.inputs import TOKENS, DecisionEmbedding, input_embedding
from xfam.model.layers import make_norm
from xfam.model.layout import block_layouts
from xfam.model.plan import CallPlan, DecodeCache, StaticCache, plan_call
from xfam.model.residual import Link, deepnorm_constants
from xfam.model.spec import ModelSpec
from xfam.model.stack import Stack
from xfam.pos import POS

#: What the head computes: ``lm`` next-token logits ``[B, S, V]`` (causal by default); ``mlm`` token logits
#: ``[B, S, V]`` and ``tag`` per-token class logits ``[B, S, C]`` (bidirectional); ``classify`` pooled ``[B, C]``;
#: ``regress`` the next vector ``[B, S, F]`` (causal); ``encode`` no head: the final-normed hidden states
#: ``[B, S, D]`` (an encoder-decoder's encoder); ``decision`` the action of every timestep ``[B, K, A]`` (the Decision
#: Transformer, causal: ``xfam.model.inputs``; logits over discrete actions, tanh-bounded continuous actions).
Task = Literal["lm", "mlm", "tag", "classify", "regress", "encode", "decision"]


@dataclasses.dataclass
class ModelOutput:
    """``logits``: ``[B, S, V]`` (lm, mlm), ``[B, S, C]`` (tag), ``[B, C]`` (classify), the predicted next vectors
    ``[B, S, F]`` (regress) or ``[B, S, D]`` (encode).
    ``aux``: auxiliary losses owned by
    components (summed into the loss by the trainer). ``depth``: layers used per token, if the
    exit policy varies it. ``memory`` / ``cache``: the new states, when states were passed in."""

    logits: Tensor
    aux: dict[str, Tensor]
    memory: list[MemoryState] | None = None
    cache: DecodeCache | StaticCache | None = None
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
        stores: dict[int, Any] | None = None,
        cross: dict[str, Any] | None = None,
        partner_layers: int = 0,
        inputs: dict[str, Any] | None = None,
        target_dim: int | None = None,
    ):
        """``cross``: the cross-attention mechanism's config (``per_layer`` allowed), for the decoder of an
        encoder-decoder: every block then attends to the encoder output passed as ``forward(source=...)``.
        ``partner_layers``: in an encoder-decoder, the other stack's depth (DeepNorm's constants use both).
        ``inputs``: the data's input description (``xfam.model.inputs``; None: token ids). ``target_dim``: the
        width F of a ``regress`` model's predicted vectors."""
        super().__init__()
        self.spec, self.task = spec, task
        self.causal = spec.causal if spec.causal is not None else task in ("lm", "regress", "decision")
        struct = spec.structural(self.causal)
        self.inputs = dict(inputs or TOKENS)
        self.embed = input_embedding(self.inputs, spec, vocab_size)  # ids, vectors or images -> [B, S, D]
        self.drop = nn.Dropout(spec.emb_drop) if spec.emb_drop else nn.Identity()
        self.emb_norm = make_norm(spec) if spec.post_emb_norm else None
        self.pos = POS.build(pos, **struct)
        if task == "decision":  # one logit per discrete action, or the continuous action's values
            target_dim = self.step_layout.num_actions or self.step_layout.action_dim
        vectors = task in ("regress", "decision")
        out_dim = vocab_size if task in ("lm", "mlm") else target_dim if vectors else num_classes
        self.exit = EXIT.build(exit, **struct, out_dim=out_dim)  # out_dim: for policies with their own classifiers
        self.num_layers = spec.layers
        n_blocks = 1 if spec.share_layers else self.exit.blocks_needed(spec.layers)  # (ALBERT: one block, L steps)
        attn_layers = per_layer(attention, spec.layers, "attention")
        cross_layers = per_layer(cross, spec.layers, "cross_attention") if cross is not None else [None] * n_blocks
        layouts = block_layouts(spec)
        shared: dict[str, Any] = {}  # modules that components share across layers
        self.blocks = TypedModuleList(
            Block(
                spec,
                build_mechanism(attn_layers[i], {**struct, "shared": shared}, layer=i),
                layer=i,
                cross=None if (c := cross_layers[i]) is None else ATTENTION.build(c, **struct_cross(struct), layer=i),
                layout=layouts[i],
                causal=self.causal,
            )
            for i in range(n_blocks)
        )
        stores = stores or {}  # long-term stores the builder opened, by layer (Memory.needs_store)
        self.memories = TypedModuleList(
            MEMORY.build(cfg, **struct, layer=i, long_term=stores.get(i))
            for i, cfg in enumerate(per_layer(memory, spec.layers, "memory"))
        )
        self.uses_memory = any(m.registry_name != "none" for m in self.memories)
        if self.output_memory is not None:
            self.output_memory.check_vocab(vocab_size)
        # Auxiliary tokens: learned inputs in front of every input, with their own states in every block,
        # dropped before the head: memory tokens (model.num_memory_tokens), or ETC's global tokens (which its
        # mechanism asks for; layers whose mechanism asks for none see ordinary tokens). In packed rows memory
        # tokens are SHARED by every document (they see only each other); ETC's globals belong to none (-1).
        self.aux_tokens = aux_token_count(self.blocks, spec.num_memory_tokens)
        self.aux_embed = nn.Embedding(self.aux_tokens, spec.dim) if self.aux_tokens else None
        self.aux_doc = SHARED if spec.num_memory_tokens else -1
        # An objective the attention adds over the whole model (``AttentionMechanism.model_objective``: ETC's CPC).
        self.objective = next((o for b in self.blocks if (o := b.attn.mechanism.model_objective()) is not None), None)
        final_norm = spec.pre_norm and spec.residual != "rezero"  # (ReZero has no norms at all)
        self.norm = make_norm(spec) if final_norm else nn.Identity()
        self.dual_norm = make_norm(spec) if spec.norm_position == "resi_dual" else None  # ResiDual's x_L + N(d_L)
        if task == "encode":
            self.head: nn.Linear | nn.Identity = nn.Identity()
        else:
            assert out_dim is not None  # (the data's classes or target width: the builder passes them)
            self.head = nn.Linear(spec.dim, out_dim, bias=task in ("classify", "tag", "regress", "decision"))
        self.deepnorm = None
        if spec.norm_position == "deepnorm":
            role = "encdec_encoder" if task == "encode" else "encdec_decoder" if cross is not None else None
            role = role or ("decoder" if self.causal else "encoder")
            self.deepnorm = deepnorm_constants(role, spec.layers, partner_layers)  # (alpha, beta)
            for link in self.modules():
                if isinstance(link, Link):
                    link.alpha = self.deepnorm[0]
        self._init_weights()
        if spec.tie_embeddings and task in ("lm", "mlm"):
            self.head.weight = self.embed.weight

    def _init_weights(self) -> None:
        """N(0, init_std) for every linear and embedding weight, zero biases; the projections into the residual
        stream (``Block.residual_projections``) scaled by 1/sqrt(2 L) (GPT-2); modules a component initialises
        itself (``Component.own_init_modules``, e.g. pos=dynamic's MLP) are left as they are."""
        own = {id(m) for c in self.modules() if isinstance(c, Component | SelfAttention) for m in c.own_init_modules()}
        residual = {id(m) for b in self.blocks for m in b.residual_projections()}
        std = self.spec.init_std
        if self.deepnorm is not None:  # DeepNet's init of the branch weights; its residual scale replaces 1/sqrt(2L)
            own |= {id(m) for b in self.blocks for m in deepnorm_init(b, self.deepnorm[1])}
            residual = set()

        def init(m: nn.Module) -> None:
            if id(m) in own:
                return
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std / math.sqrt(2 * self.spec.layers) if id(m) in residual else std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=1e-5 if m is self.embed and self.spec.l2norm_embed else std)

        self.apply(init)  # children first, as the random draws always were

    @property
    def step_layout(self) -> StepLayout:
        """A decision model's timestep layout (its embedder's, ``xfam.model.inputs``)."""
        return cast(DecisionEmbedding, self.embed).layout

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
        cache: DecodeCache | StaticCache | None = None,
        targets: Tensor | None = None,
        source: CrossSource | None = None,
    ) -> ModelOutput:
        """Run the model: embed, plan the call, traverse the layers (the exit policy), head.

        Args:
            tokens: ``[B, S]`` token ids, or the inputs the model's embedder takes (``self.inputs``: vectors
                ``[B, S, F]``, images ``[B, C, H, W]``, which make S rows of patches).
            key_padding: ``[B, S]`` bool, True for real tokens (None: no padding).
            segments: ``[B, S]`` document ids of packed rows; attention stays within a document.
            memory: per-layer memory states from the previous segment (or ``init_memory``).
            cache: decode state; when given, ``tokens`` are new tokens after ``cache.length`` (a ``StaticCache``:
                one new token at ``cache.pos``, through the mechanisms' fixed-shape ``decode_step``).
            targets: the loss's targets (``[B, S]`` ids, -100 = none, or ``[B]`` labels), given in
                training to exit policies that train per-layer classifiers (``exit=calm``, ...).
            source: the encoder's output, for a decoder with cross-attention (a decode cache keeps it
                after the first call).
        """
        if self.training and cache is None:
            self.new_step()
        res, stack = self.traverse(tokens, key_padding, segments, memory, cache, targets, source)
        logits = res.logits if res.logits is not None else stack.head(res.hidden)
        aux = {**stack.aux, **{f"exit/{k}": val for k, val in res.aux.items()}}
        if self.objective is not None and cache is None:  # a model-level objective of the attention (ETC's CPC)
            aux[f"attention/{self.objective.name}"] = self.objective(self, tokens, key_padding, segments)
        depth = None if res.depth is None else self.scored_rows(res.depth)
        return ModelOutput(logits=logits, aux=aux, memory=stack.new_memory, cache=stack.new_cache(), depth=depth)

    def traverse(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        segments: Tensor | None = None,
        memory: list[MemoryState] | None = None,
        cache: DecodeCache | StaticCache | None = None,
        targets: Tensor | None = None,
        source: CrossSource | None = None,
    ) -> tuple[ExitOutput, Stack]:
        """Embed, plan the call and run the layers the exit policy chooses (``forward``'s arguments): the exit
        policy's output (hidden ``[B, G + S, D]``, aux rows first) and the stack that ran, before the head."""
        e = self.embed(tokens)  # [B, S, D]
        plan = plan_call(e, key_padding, segments, cache, self.aux_tokens, self.aux_doc)
        x = self.embed_rows(e, plan)  # [B, G + S, D]
        retrieved = None  # an output memory's (SPALM's) neighbours of every position, mixed into the head's input
        if self.output_memory is not None and cache is None:  # (memory models generate without a decode cache)
            retrieved = self.output_memory.retrieve(tokens, key_padding, segments)
        stack = Stack(
            self, plan, memory=memory, cache=cache, targets=targets, retrieved=retrieved, dtype=x.dtype, source=source
        )
        if self.spec.reversible:  # the whole stack in one recomputed pass (exit=none only: compat)
            return ExitOutput(hidden=stack.run_reversible(x)), stack
        return self.exit(x, stack), stack  # [B, G + S, D] through the layers the policy runs

    def global_states(
        self, tokens: Tensor, key_padding: Tensor | None = None, segments: Tensor | None = None
    ) -> Tensor:
        """``[B, G, D]``: the final-normed hidden states of the G auxiliary tokens in front of the input (ETC's
        global tokens), which the head never sees; what ETC's CPC objective compares."""
        res, _ = self.traverse(tokens, key_padding, segments)
        return self.norm(res.hidden[:, : self.aux_tokens])

    def embed_rows(self, e: Tensor, plan: CallPlan) -> Tensor:
        """``[B, S, D] -> [B, G + S, D]``: the embedded inputs (``self.embed``'s output), with input positions,
        behind the G aux tokens."""
        if self.spec.l2norm_embed:  # unit-norm token embeddings (x-transformers' l2norm_embed, after FixNorm)
            e = F.normalize(e, dim=-1)
        x = self.pos.embed(e, plan.positions)
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        x = self.drop(x)
        if self.aux_embed is None:
            return x
        aux = self.aux_embed.weight.to(x.dtype).expand(x.shape[0], -1, -1)  # [B, G, D]
        return torch.cat((aux, x), dim=1)

    def head_logits(
        self,
        hidden: Tensor,
        key_padding: Tensor | None = None,
        proj: nn.Module | None = None,
        retrieved: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Final norm and head: ``[B, S, D] -> [B, S, V|C]`` (per-token tasks), pooled ``[B, C]`` (classify), or the
        normed ``[B, S, D]`` (encode).
        Auxiliary global tokens in front of ``hidden`` never reach the head. ``proj`` replaces the
        output layer (an exit policy's per-layer classifier). ``retrieved``: SPALM's neighbours, mixed
        into the head's input with the output word embeddings."""
        if self.task == "decision":  # a_t from the state token s_t: [B, G + n K, D] -> [B, K, A]
            a = (proj if proj is not None else self.head)(self.norm(self.scored_rows(hidden)))
            return a if self.step_layout.discrete_actions else torch.tanh(a)
        h = self.norm(hidden[:, self.aux_tokens :])
        if retrieved is not None and proj is None:
            h = self.output_memory.mix(h, retrieved, self.head.weight)  # [B, S, D]
        out = proj if proj is not None else self.head
        if self.task != "classify":
            return out(h)
        if self.spec.pool == "cls":
            return out(h[:, 0])
        if key_padding is None:
            return out(h.mean(dim=1))
        w = key_padding.to(h.dtype).unsqueeze(-1)  # [B, S, 1]
        return out((h * w).sum(1) / w.sum(1).clamp_min(1))

    def scored_rows(self, rows: Tensor) -> Tensor:
        """The rows the head scores, of per-row values ``[B, G + S, ...]`` (hidden states, depths): the input's
        rows ``[B, S, ...]`` (the G aux rows dropped), a decision model's state rows ``[B, K, ...]``."""
        rows = rows[:, self.aux_tokens :]
        return self.step_layout.state_rows(rows) if self.task == "decision" else rows

    def spread_scores(self, scores: Tensor, rows: int, fill: float) -> Tensor:
        """The inverse of ``scored_rows`` for per-row scores: ``[B, T] -> [B, rows]``, ``fill`` on every row the
        head does not score (aux rows; a decision model's return and action rows)."""
        if self.task != "decision":
            return F.pad(scores, (rows - scores.shape[1], 0), value=fill)
        out = scores.new_full((scores.shape[0], rows), fill)
        n = self.step_layout.tokens
        out[:, self.aux_tokens + n - 2 :: n] = scores  # (state_rows' slice, behind the aux rows)
        return out

    def empty_cache(self) -> DecodeCache:
        return DecodeCache(0, [None] * self.num_layers)


def struct_cross(struct: dict[str, Any]) -> dict[str, Any]:
    """The sizes a cross-attention mechanism is built with: bidirectional (every source token is visible)."""
    return {**struct, "causal": False}


def aux_token_count(blocks: TypedModuleList[Block], memory_tokens: int = 0) -> int:
    """Auxiliary tokens to prepend: ``memory_tokens``, or the global tokens the layers' mechanisms declare
    (``AttentionMechanism.aux_tokens``, ETC). ``xfam.model.compat`` refused every other combination
    (different counts, memory, memory tokens, early exits) before anything was built."""
    return max((b.attn.mechanism.aux_tokens for b in blocks), default=0) or memory_tokens


def build_mechanism(cfg: dict[str, Any], struct: dict[str, Any], layer: int) -> AttentionMechanism:
    """One layer's mechanism, or a ``HeadGroups`` of several when ``per_head`` splits its heads."""
    heads, kv_heads = struct["heads"], struct["kv_heads"]
    groups = per_head(cfg, heads, kv_heads, "attention")
    if len(groups) == 1:
        return ATTENTION.build(groups[0][1], **struct, layer=layer)
    per_kv = heads // kv_heads
    members = [ATTENTION.build(g, **{**struct, "heads": n, "kv_heads": n // per_kv}, layer=layer) for n, g in groups]
    return HeadGroups(members, [n for n, _ in groups], heads, kv_heads)
