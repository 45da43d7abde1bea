"""The ``model`` config section: sizes and architectural options, with their only defaults."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from xfam.core.registry import NonNegative, Positive, Probability, Range
from xfam.model.layout import block_problems

#: Feed-forward kinds that are gated linear units (two input projections; hidden width scaled by 2/3).
GLU_FFNS = ("swiglu", "geglu", "reglu")


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
        ffn: ``gelu`` (Linear-GELU-Linear), ``relu`` (the original Transformer), ``relu2`` (squared ReLU,
            Primer), a gated linear unit (Shazeer, 2020): ``swiglu``, ``geglu``, ``reglu``, or ``sepconv``: the
            Universal Transformer's separable-convolution transition (``xfam.model.sepconv``).
        sepconv_kernel1, sepconv_kernel2: ``ffn=sepconv``'s kernel sizes along the sequence (odd), of the
            depthwise convolution into the hidden width and of the one out of it (3 and 5 in the UT code).
        ffn_mult: FFN hidden width as a multiple of ``dim`` (for the gated units scaled by 2/3, rounded
            up to a multiple of 8, which keeps the parameter count of the GELU FFN).
        norm: ``layernorm``, ``rmsnorm`` (Zhang & Sennrich, 2019), ``simple_rmsnorm`` (RMSNorm without a
            gain) or ``scalenorm`` (Nguyen & Salazar, 2019: one learned scale g, ``g x / ||x||``).
        norm_position: ``pre`` (norm inside the residual branch, plus a final norm; trains stably
            without warmup tricks), ``post`` (the original Transformer), ``sandwich`` (pre-norm plus a norm
            of the sublayer's output, CogView), ``deepnorm`` (post-norm with the residual scaled by alpha and
            the branch weights initialised with gain beta, DeepNet) or ``resi_dual`` (a post-norm stream and
            an unnormalised dual stream, ResiDual). Every block option: docs/blocks.md.
        bias: biases in the linear layers and LayerNorm.
        dropout: dropout on embeddings, attention output and FFN output.
        tie_embeddings: the output projection shares the token embedding matrix.
        max_len: longest sequence the model is built for (learned position table size).
        vocab_size: null = taken from the data; an explicit value must cover the data's tokens.
        causal: null = from the task (causal LM, bidirectional classifier).
        pool: how a classifier pools the encoder: ``cls`` (first token) or ``mean`` (non-pad).
        patch_size: image inputs (``xfam.model.inputs``, the ViT): the side P of the square patches an image
            is cut into (must divide its height and width); unused for token and vector inputs.
        init_std: std of the normal init; residual output projections use init_std/sqrt(2L)
            (GPT-2), so the residual stream does not grow with depth.
        reversible: reversible residual layers (RevNet / Reformer): activations are recomputed
            in the backward pass, so training memory does not grow with depth (pre-norm only).
        ffn_chunks: run the FFN in this many chunks along the sequence (the Reformer's chunked
            feed-forward; with ``reversible``).
        checkpoint_activations: activation checkpointing: in training, each block's activations are dropped after
            its forward and recomputed in the backward pass (``torch.utils.checkpoint``), so training keeps one
            tensor per layer instead of all of them, for about one more forward per step (docs/architecture.md).
        num_mem_kv: persistent memory (Sukhbaatar et al., 2019, arXiv:1907.01470): per layer, this many
            learned key and value vectors per key/value head, in front of every query's keys; no
            position, always visible (any mask). Needs an attention with ``accepts_persistent_kv``.
        post_emb_norm: a norm right after the token embedding (and input positions).
        l2norm_embed: l2-normalised token embeddings, initialised N(0, 1e-5) (x-transformers' small-init
            embeddings; a learned position table is left as it is).
        residual: how a sublayer's output joins the stream: ``add`` (x + f), ``rezero`` (x + alpha f, alpha = 0
            at init, no norms in the blocks; Bachlechner et al., 2020), ``layerscale`` (x + diag(lambda) f,
            lambda = ``layerscale_init``; CaiT) or ``gtrxl`` (a GRU-type gate g(x, ReLU(f)); GTrXL).
        layerscale_init: LayerScale's initial lambda; null: CaiT's rule by depth (0.1 up to 18 layers,
            1e-5 up to 24, else 1e-6).
        gtrxl_bias: GTrXL's gate bias b_g (2 in the paper): the larger, the closer to the identity at init.
        resid_scale: NormFormer's ResScale: a learned per-channel scale of the residual (lambda x + f), init 1.
        layer_drop: stochastic depth (Huang et al., 2016): the last block's probability of being skipped
            for a sample in training, the l-th block's l/L of it (the linear survival schedule); none at
            evaluation (the kept branches are scaled by 1/survival in training).
        ffn_post_act_norm: a norm after the FFN's activation (NormFormer).
        ffn_dropout: dropout after the FFN's activation.
        emb_dropout, resid_dropout: dropout of the embeddings and of every sublayer's output; null: ``dropout``.
        attn_qk_norm: ``none``, ``l2`` (cosine-similarity attention: q and k l2-normalised per head, scores
            times a temperature; Henry et al., 2020) or ``rms`` (RMSNorm of q and k per head, with gain).
        attn_qk_scale: the temperature of ``attn_qk_norm=l2``; null: learned, initialised at log2(L^2 - L)
            with L = ``max_len`` (the paper's g0).
        attn_talking_heads: learned head mixing before and after the softmax (Shazeer et al., 2020).
        residual_attn: every layer adds the previous layer's pre-softmax scores to its own (RealFormer).
        value_residual: every layer after the first attends over the mean of its values and the first
            layer's (ResFormer).
        attn_gate: a sigmoid gate on each head's output, from the layer input (AlphaFold2).
        attn_topk: each query keeps its k largest scores (Explicit Sparse Transformer); null: all.
        attn_topk_straight_through: top-k in the forward, the dense softmax's gradient in the backward.
        attn_on_attn: attention on attention (Huang et al., 2019): the output projection becomes an
            information vector gated by a sigmoid, both from [attended values | layer input].
        attn_head_scale: a learned scale per head on its output (NormFormer).
        attn_post_norm: a norm of the attention sublayer's output (NormFormer).
        macaron: FFN - attention - FFN in every block, each FFN a half step (Macaron Net).
        sandwich_coef: k > 0: the sandwich Transformer's sublayer order a^k (af)^(L-k) f^k (Press et al., 2020).
        layer_order: a custom sublayer order, a string of ``a`` (attention) and ``f`` (FFN) with exactly
            ``layers`` a's (x-transformers' ``custom_layers``); each block is one ``a`` and the f's after it.
        shift_tokens: s > 0: token shifting: the input of every sublayer is split into channel groups shifted
            by 0..s positions (causal) or -s..s (bidirectional), so each token sees its neighbours' features.
        share_layers: one block's weights for every layer (ALBERT's cross-layer sharing).
        forgetful_mask: the forgetful causal mask (Liu et al., 2022): in training, each row hides a random
            fraction, drawn from U[0, forgetful_mask], of its past tokens from every later query.
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
    ffn: Literal["gelu", "relu", "relu2", "swiglu", "geglu", "reglu", "sepconv"] = "gelu"
    sepconv_kernel1: Annotated[int, Positive] = 3
    sepconv_kernel2: Annotated[int, Positive] = 5
    ffn_mult: Annotated[float, Positive] = 4.0
    norm: Literal["layernorm", "rmsnorm", "simple_rmsnorm", "scalenorm"] = "layernorm"
    norm_position: Literal["pre", "post", "sandwich", "deepnorm", "resi_dual"] = "pre"
    bias: bool = False
    dropout: Annotated[float, Probability] = 0.0
    tie_embeddings: bool = False
    max_len: Annotated[int, Positive] = 1024
    vocab_size: Annotated[int, Range(ge=2)] | None = None
    causal: bool | None = None
    pool: Literal["cls", "mean"] = "mean"
    patch_size: Annotated[int, Positive] = 4
    init_std: Annotated[float, NonNegative] = 0.02
    reversible: bool = False
    ffn_chunks: Annotated[int, Positive] = 1
    checkpoint_activations: bool = False
    num_mem_kv: Annotated[int, NonNegative] = 0
    num_memory_tokens: Annotated[int, NonNegative] = 0
    # block options (docs/blocks.md); the defaults are the plain pre-norm block
    post_emb_norm: bool = False
    l2norm_embed: bool = False
    residual: Literal["add", "rezero", "layerscale", "gtrxl"] = "add"
    layerscale_init: Annotated[float, Positive] | None = None
    gtrxl_bias: float = 2.0
    resid_scale: bool = False
    layer_drop: Annotated[float, Probability] = 0.0
    ffn_post_act_norm: bool = False
    ffn_dropout: Annotated[float, Probability] = 0.0
    emb_dropout: Annotated[float, Probability] | None = None
    resid_dropout: Annotated[float, Probability] | None = None
    attn_qk_norm: Literal["none", "l2", "rms"] = "none"
    attn_qk_scale: Annotated[float, Positive] | None = None
    attn_talking_heads: bool = False
    residual_attn: bool = False
    value_residual: bool = False
    attn_gate: bool = False
    attn_topk: Annotated[int, Positive] | None = None
    attn_topk_straight_through: bool = False
    attn_on_attn: bool = False
    attn_head_scale: bool = False
    attn_post_norm: bool = False
    macaron: bool = False
    sandwich_coef: Annotated[int, NonNegative] = 0
    layer_order: str | None = None
    shift_tokens: Annotated[int, NonNegative] = 0
    share_layers: bool = False
    forgetful_mask: Annotated[float, Probability] = 0.0

    def arch_for(self, task: str) -> str:
        """``arch``, with ``auto`` resolved from the task: seq2seq -> encoder_decoder, lm and regress -> decoder,
        else encoder."""
        if self.arch != "auto":
            return self.arch
        decoders = {"seq2seq": "encoder_decoder", "lm": "decoder", "regress": "decoder", "decision": "decoder"}
        return decoders.get(task, "encoder")

    @property
    def emb_drop(self) -> float:
        return self.dropout if self.emb_dropout is None else self.emb_dropout

    @property
    def resid_drop(self) -> float:
        return self.dropout if self.resid_dropout is None else self.resid_dropout

    @property
    def pre_norm(self) -> bool:
        """The stream is not normalised between blocks (pre-norm and sandwich): a final norm precedes the head."""
        return self.norm_position in ("pre", "sandwich")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def ffn_hidden(self) -> int:
        hidden = self.ffn_mult * self.dim
        if self.ffn in GLU_FFNS:
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
        if self.reversible and not self.pre_norm:
            out.append(
                f"model.reversible=true needs model.norm_position=pre or sandwich (the reversible block inverts "
                f"x + f(norm(x)); a {self.norm_position} block is not invertible). Fix: model.norm_position=pre."
            )
        if self.ffn_chunks > 1 and not self.reversible:
            out.append("model.ffn_chunks applies to reversible layers. Fix: model.reversible=true or ffn_chunks=1.")
        if self.heads % self.n_kv_heads:
            out.append(
                f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}. Fix: choose kv_heads among "
                f"{[h for h in range(1, self.heads + 1) if self.heads % h == 0]}."
            )
        return out + block_problems(self)

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
