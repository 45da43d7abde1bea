"""The ``model`` config section: sizes and architectural options, with their only defaults."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from xfam.core.registry import NonNegative, Positive, Probability, Range


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Architecture of an xfam model (the slots are configured separately).

    Attributes:
        name: preset name, recorded for reports.
        arch: ``decoder`` (one causal stack), ``encoder`` (one bidirectional stack: classifiers, masked LM,
            tagging), ``encoder_decoder`` (``xfam.model.encoder_decoder``: source pairs, ``task=seq2seq``), or
            ``auto``: from the task (seq2seq -> encoder_decoder, lm -> decoder, the others -> encoder). A
            decoder on seq2seq pairs reads the source as a prefix of the target.
        dim: model width D.
        layers: number of blocks L.
        heads: query heads H (must divide ``dim`` unless ``head_dim`` is set).
        kv_heads: key/value heads for grouped-query attention (divides ``heads``); null = heads.
        head_dim: per-head width Dh; null = dim / heads.
        ffn: ``gelu`` (Linear-GELU-Linear) or ``swiglu`` (Shazeer, 2020).
        ffn_mult: FFN hidden width as a multiple of ``dim`` (for swiglu scaled by 2/3, rounded
            up to a multiple of 8, which keeps the parameter count of the GELU FFN).
        norm: ``layernorm`` or ``rmsnorm`` (Zhang & Sennrich, 2019).
        norm_position: ``pre`` (norm inside the residual branch, plus a final norm; trains stably
            without warmup tricks) or ``post`` (the original Transformer).
        bias: biases in the linear layers and LayerNorm.
        dropout: dropout on embeddings, attention output and FFN output.
        tie_embeddings: the output projection shares the token embedding matrix.
        max_len: longest sequence the model is built for (learned position table size).
        vocab_size: null = taken from the data; an explicit value must cover the data's tokens.
        causal: null = from the task (causal LM, bidirectional classifier).
        pool: how a classifier pools the encoder: ``cls`` (first token) or ``mean`` (non-pad).
        init_std: std of the normal init; residual output projections use init_std/sqrt(2L)
            (GPT-2), so the residual stream does not grow with depth.
        reversible: reversible residual layers (RevNet / Reformer): activations are recomputed
            in the backward pass, so training memory does not grow with depth (pre-norm only).
        ffn_chunks: run the FFN in this many chunks along the sequence (the Reformer's chunked
            feed-forward; with ``reversible``).
        num_mem_kv: persistent memory (Sukhbaatar et al., 2019, arXiv:1907.01470): per layer, this many
            learned key and value vectors per key/value head, in front of every query's keys; no
            position, always visible (any mask). Needs an attention with ``accepts_persistent_kv``.
        num_memory_tokens: memory tokens (Burtsev et al., 2020, arXiv:2006.11527; "registers", Darcet
            et al., 2023): this many learned embeddings in front of every input, run by every block
            as ordinary tokens (without an absolute position), dropped before the head. They take
            attention slots, so ``data.seq_len + num_memory_tokens <= max_len``.
    """

    name: str = "custom"
    arch: Literal["auto", "decoder", "encoder", "encoder_decoder"] = "auto"
    dim: Annotated[int, Positive] = 256
    layers: Annotated[int, Positive] = 4
    heads: Annotated[int, Positive] = 4
    kv_heads: Annotated[int, Positive] | None = None
    head_dim: Annotated[int, Positive] | None = None
    ffn: Literal["gelu", "swiglu"] = "gelu"
    ffn_mult: Annotated[float, Positive] = 4.0
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_position: Literal["pre", "post"] = "pre"
    bias: bool = False
    dropout: Annotated[float, Probability] = 0.0
    tie_embeddings: bool = False
    max_len: Annotated[int, Positive] = 1024
    vocab_size: Annotated[int, Range(ge=2)] | None = None
    causal: bool | None = None
    pool: Literal["cls", "mean"] = "mean"
    init_std: Annotated[float, NonNegative] = 0.02
    reversible: bool = False
    ffn_chunks: Annotated[int, Positive] = 1
    num_mem_kv: Annotated[int, NonNegative] = 0
    num_memory_tokens: Annotated[int, NonNegative] = 0

    def arch_for(self, task: str) -> str:
        """``arch``, with ``auto`` resolved from the task: seq2seq -> encoder_decoder, lm -> decoder, else encoder."""
        if self.arch != "auto":
            return self.arch
        return {"seq2seq": "encoder_decoder", "lm": "decoder"}.get(task, "encoder")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def ffn_hidden(self) -> int:
        hidden = self.ffn_mult * self.dim
        if self.ffn == "swiglu":
            hidden = 8 * -(-int(2 * hidden / 3) // 8)
        return int(hidden)

    def problems(self) -> list[str]:
        """Constraints between fields (each field's own type and range is checked from the hints)."""
        out = []
        if self.head_dim is None and self.dim % self.heads:
            out.append(
                f"model.heads={self.heads} does not divide model.dim={self.dim}. Fix: choose heads among "
                f"{[h for h in range(1, self.dim + 1) if self.dim % h == 0 and h <= 64]} or set model.head_dim."
            )
        if self.reversible and self.norm_position != "pre":
            out.append(
                "model.reversible=true needs model.norm_position=pre (the reversible block inverts "
                "x + f(norm(x)); a post-norm block is not invertible). Fix: model.norm_position=pre."
            )
        if self.ffn_chunks > 1 and not self.reversible:
            out.append("model.ffn_chunks applies to reversible layers. Fix: model.reversible=true or ffn_chunks=1.")
        if self.heads % self.n_kv_heads:
            out.append(
                f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}. Fix: choose kv_heads among "
                f"{[h for h in range(1, self.heads + 1) if self.heads % h == 0]}."
            )
        return out

    def structural(self, causal: bool) -> dict[str, Any]:
        """The sizes injected into slot components."""
        return {
            "dim": self.dim,
            "heads": self.heads,
            "kv_heads": self.n_kv_heads,
            "head_dim": self.d_head,
            "max_len": self.max_len,
            "causal": causal,
            "num_layers": self.layers,
        }
