"""ETC global-local attention (Ainslie et al., 2020, "ETC: Encoding Long and Structured Inputs in
Transformers", arXiv:2004.08483, sec. 3.1-3.3).

The input is two sequences: n_g auxiliary global tokens (extra inputs with their own hidden states in
every layer, not positions of the text) and the n_l long tokens. The model prepends the global tokens
(``aux_tokens`` tells it how many, see ``xfam.model.transformer``), so the mechanism sees the
concatenation ``[globals | long]``: key indices ``0 .. n_g - 1`` are the globals, ``n_g + t`` is long
token t. Attention splits into four pieces, each query taking one softmax over all its keys:

* g2g -- a global token sees every global token;
* g2l -- global token s sees the long tokens of its segment (ETC's hard g2l masking); without
  structure in the data a segment is a fixed chunk of c = ceil(max_len / n_g) tokens,
  ``t // c == s``; with ``g2l: full`` it sees every long token;
* l2g -- every long token sees every global token;
* l2l -- long token t sees the long tokens within the local radius r, ``|t - u| <= r``.

Output ``[B, H, n_g + n_l, Dh]``. Long rows run on the block engine (a banded radius plus the globals
as global key columns): O(n_l (2r + 1 + n_g)); global rows are n_g dense rows, O(n_g (n_g + n_l)).
No (n_g + n_l)^2 matrix. ETC is an encoder: bidirectional only, and without memory.

A score bias (ALiBi, T5 ...) is evaluated at the concatenated key indices: between long tokens it is
the usual relative bias; between a global token and a long token it sees the global at index s < n_g
in front of the text.

**Relative position labels** (``relative: true``; ETC sec. 3, after Shaw et al., 2018, arXiv:1803.02155): every
(query, key) pair of the four pieces gets a label l, and the score is ``(q . k + q . a_l + b_l) / sqrt(Dh)``
with a learned vector a_l ``[H, Dh]`` and scalar b_l ``[H]`` per label and head (ETC's code keeps both
tables; b starts at 0), one pair of tables for the long queries (l2l, l2g) and one for the global queries
(g2g, g2l), in every layer. With k = ``max_distance``:

* l2l: the clipped distance ``clip(u - t, -k, k)`` between long tokens t -> u (2k + 1 labels);
* g2g: the clipped distance between the global tokens' indices (2k + 1 labels);
* l2g and g2l: two labels, *own* when the long token lies in the global token's segment (the one it
  summarises) and *other* otherwise: ETC's hierarchical labels that tell a global token's own long tokens
  from the rest (the paper's sentence; here the fixed chunk of ``g2l: segment``, also under ``g2l: full``).

The term reaches the block engine through its score-bias hook (``RelativeScores``: a per-call,
query-dependent bias ``[B, H, ...]`` on the visited pairs), so the banded fast path stays O(n_l (2r + 1 + n_g)).
The model's positional encoding still applies (``pos=none`` gives ETC's relative-only model).

**CPC** (``cpc_weight > 0``; ETC's pre-training, sec. 3.4): masks whole sentences of the input and contrasts
their global tokens' states with those of a pass that sees each sentence alone, an objective over the whole
model, not a layer (``model_objective``; ``xfam.attention._etc_cpc``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

import torch
from torch import Tensor, nn

from xfam.attention._base import ATTENTION, AttentionMechanism
from xfam.attention._etc_cpc import SentenceCPC
from xfam.attention._sparse import (
    SparsePattern,
    block_sparse_attention,
    dense_sparse_attention,
    window_band,
    window_layout,
)
from xfam.attention._sparse.engine import dense_rows
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.logs import log_once
from xfam.core.mask import AttnMask
from xfam.core.registry import NonNegative, Positive, Probability, Range, defaults_of
from xfam.core.state import expand_kv

#: Refusal of ``model.num_memory_tokens`` with ETC (build-time check and model builder).
MEMORY_TOKENS_REFUSAL = (
    "model.num_memory_tokens cannot be combined with attention=etc: ETC's global tokens already are learned "
    "tokens in front of the input, which its attention pattern treats apart from the text. "
    "Fix: model.num_memory_tokens=0 (ETC's own attention.global_tokens play that part), or another attention."
)


class ETCPattern(SparsePattern):
    """The whole ETC rule over ``[globals | long]`` key indices; globals start at key index ``start``.

    ``chunk``: long tokens per global token's segment (None: g2l unrestricted). ``long_only``: the
    pattern of the long queries on the block path, where the globals are the engine's global keys.
    """

    def __init__(self, n_global: int, radius: int, chunk: int | None, start: int, block: int, long_only: bool):
        self.n_global, self.radius, self.chunk, self.start, self.block = n_global, radius, chunk, start, block
        self.long_only = long_only
        self.global_positions = tuple(range(start, start + n_global)) if long_only else ()

    def allowed(self, q_pos: Tensor, k_pos: Tensor, head: Tensor | None = None) -> Tensor:
        first_long = self.start + self.n_global
        q_glob = (q_pos >= self.start) & (q_pos < first_long)
        k_glob = (k_pos >= self.start) & (k_pos < first_long)
        l2l = ~q_glob & ~k_glob & ((q_pos - k_pos).abs() <= self.radius)
        if self.long_only:
            return l2l
        g2l = q_glob & ~k_glob
        if self.chunk is not None:
            g2l = g2l & (torch.div(k_pos - first_long, self.chunk, rounding_mode="floor") == q_pos - self.start)
        return l2l | g2l | (q_glob & k_glob) | (~q_glob & k_glob)  # ... | g2g | l2g

    def band(self, offset: int, causal: bool) -> tuple[int, int]:
        return window_band(offset, self.block, self.radius, self.radius)

    def layout(self, n_q: int, n_k: int, offset: int, causal: bool, device: torch.device) -> Tensor:
        return window_layout(n_q, n_k, offset, self.block, self.radius, self.radius, device)


@ATTENTION.register("etc")
class ETC(AttentionMechanism):
    """Global-local attention with ``global_tokens`` auxiliary global tokens (see the module docstring).

    Args:
        global_tokens: n_g, auxiliary global tokens the model prepends to the input.
        radius: r, the l2l local radius (ETC's experiments use 84).
        g2l: ``segment`` (each global token sees its chunk of ceil(max_len / n_g) long tokens) or
            ``full`` (every long token).
        block: tile of the block engine (speed only).
        backend: ``auto`` (block engine + dense global rows), ``block`` or ``dense`` (the reference).
        dropout: dropout on the attention probabilities.
        relative: ETC's relative position labels in the four pieces (the module docstring).
        max_distance: k, the clipping distance of the l2l and g2g labels (12 in ETC's released configuration).
        cpc_weight: weight of ETC's CPC pre-training loss (0: off; ``xfam.attention._etc_cpc``).
        cpc_mask_prob: the probability that CPC masks a sentence (the chunk a global token summarises).
        heads, head_dim: injected sizes (the relative tables are per head; the model always passes them).
    """

    paper = "Ainslie et al., 2020, arXiv:2004.08483"

    causal = False
    accepts_memory = False
    backends = ("block", "dense")

    def __init__(
        self,
        *,
        max_len: int,
        global_tokens: Annotated[int, Positive] = 8,
        radius: Annotated[int, Positive] = 84,
        g2l: Literal["segment", "full"] = "segment",
        block: Annotated[int, Positive] = 64,
        backend: Literal["auto", "block", "dense"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
        relative: bool = False,
        max_distance: Annotated[int, Positive] = 12,
        cpc_weight: Annotated[float, NonNegative] = 0.0,
        cpc_mask_prob: Annotated[float, Range(gt=0, le=1)] = 0.15,
        heads: int | None = None,
        head_dim: int | None = None,
    ):
        super().__init__()
        self.aux_tokens = global_tokens  # read by the model: it prepends this many learned global tokens
        self.radius, self.g2l, self.block, self.backend, self.dropout = radius, g2l, block, backend, dropout
        self.segment = -(-max_len // global_tokens)  # long tokens per global token's segment
        self.chunk = self.segment if g2l == "segment" else None
        self._patterns: dict[tuple[int, bool], ETCPattern] = {}
        self.relative = None
        if relative:
            assert heads is not None and head_dim is not None  # (injected by the model)
            self.relative = RelativeLabels(heads, head_dim, max_distance, self.segment)
        self.cpc = SentenceCPC(cpc_weight, cpc_mask_prob, self.segment, global_tokens) if cpc_weight else None

    def rule(self, start: int, long_only: bool) -> ETCPattern:
        """The rule with the globals at key indices ``start ..`` (the whole rule, or the long rows' part)."""
        key = (start, long_only)
        if key not in self._patterns:
            self._patterns[key] = ETCPattern(self.aux_tokens, self.radius, self.chunk, start, self.block, long_only)
        return self._patterns[key]

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        p = self.dropout if self.training else 0.0
        n_g, start = self.aux_tokens, mask.offset  # the globals are the first n_g queries
        kh, vh = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])  # [B, H, Sk, Dh]
        if self.relative is not None:
            # (not a ScoreBias, but what the engines call of one: ``pairs`` / ``dense``)
            bias = cast(ScoreBias, RelativeScores(self.relative, q, start, n_g, bias))
        if self.backend == "dense":
            return dense_sparse_attention(q, k, v, self.rule(start, False), mask, bias, p)
        if self.backend == "auto":
            log_once("attention=etc backend=auto: block engine (long rows) + dense global rows")
        long_mask = mask.memo(("etc_long", n_g), lambda: _long_mask(mask, n_g))
        out_long = block_sparse_attention(q[:, :, n_g:], k, v, self.rule(start, True), long_mask, bias, p)
        rows = torch.arange(n_g, device=q.device)  # g2g and g2l: the rule's rows over every key
        out_glob = dense_rows(q[:, :, :n_g], kh, vh, rows, mask, bias, p, self.rule(start, False))
        return torch.cat((out_glob, out_long), dim=2)  # [B, H, n_g + n_l, Dh]

    def model_objective(self) -> SentenceCPC | None:
        return self.cpc

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        out: list[str] = []
        max_len = ctx.get("max_len")
        if max_len is None:
            return out
        if params["radius"] > max_len:
            out.append(
                f"radius={params['radius']} is larger than model.max_len={max_len}; valid: 1..{max_len} "
                f"({max_len - 1} already covers every input). Fix: set attention.radius <= {max_len}."
            )
        if params["g2l"] == "segment" and params["global_tokens"] > max_len:
            out.append(
                f"global_tokens={params['global_tokens']} with g2l=segment leaves empty segments: model.max_len="
                f"{max_len} long tokens are split among the global tokens. Fix: global_tokens <= {max_len}, "
                f"or g2l=full."
            )
        return out

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        out = []
        mine = [(p, per_head) for c, p, per_head in selection.attention if c is cls]
        if any(per_head for _, per_head in mine):
            out.append(
                "attention=etc cannot be one group of a per_head schedule: its global tokens are extra inputs of "
                "the whole layer. Fix: remove attention.per_head."
            )
        if len({{**defaults_of(cls), **p}["global_tokens"] for p, _ in mine}) > 1:
            out.append(
                "attention=etc: every layer must use the same global_tokens (they are inputs of the whole model). "
                "Fix: set global_tokens at the slot level only."
            )
        if selection.num_memory_tokens:
            out.append(MEMORY_TOKENS_REFUSAL)
        cpc = {tuple({**defaults_of(cls), **p}[k] for k in ("cpc_weight", "cpc_mask_prob")) for p, _ in mine}
        if len(cpc) > 1:
            out.append(
                "attention=etc: cpc_weight and cpc_mask_prob must be the same in every layer (CPC is one objective "
                "over the whole model). Fix: set them at the slot level only."
            )
        if selection.inputs == "image" and any(w for w, _ in cpc):
            out.append(
                "attention.cpc_weight > 0 masks sentences of the input's rows, but image inputs are patched inside "
                "the model. Fix: attention.cpc_weight=0, or token/vector inputs."
            )
        exit_cls = selection.exit[0]
        if exit_cls.early_exit:
            out.append(
                f"attention=etc adds global tokens in front of the input, which exit={exit_cls.registry_name}'s "
                f"per-token decisions cannot tell apart from the input's tokens. Fix: exit=none."
            )
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"radius": seq_len, "g2l": "full"}


def _long_mask(mask: AttnMask, n_g: int) -> AttnMask:
    """The mask of the long queries alone: the global tokens become keys in front of them."""
    return AttnMask(
        q_len=mask.q_len - n_g,
        k_len=mask.k_len,
        causal=mask.causal,
        key_padding=mask.key_padding,
        segments=mask.segments,
        window=mask.window,
    )


def segment_of(long_index: Tensor, segment: int) -> Tensor:
    """The global token whose segment holds long token ``long_index`` (fixed chunks of ``segment`` tokens)."""
    return torch.div(long_index, segment, rounding_mode="floor")


class RelativeLabels(nn.Module):
    """ETC's relative position labels and their learned tables (the module docstring): labels ``0 .. 2k`` the
    clipped distance (l2l, g2g), ``2k + 1`` *other* and ``2k + 2`` *own* (l2g, g2l); for the long queries
    ``long_emb [V, H, Dh]`` / ``long_bias [V, H]``, for the global queries ``global_emb`` / ``global_bias``."""

    def __init__(self, heads: int, head_dim: int, max_distance: int, segment: int):
        super().__init__()
        self.k, self.segment = max_distance, segment
        n = 2 * max_distance + 3
        self.long_emb = nn.Parameter(torch.randn(n, heads, head_dim) * 0.02)
        self.global_emb = nn.Parameter(torch.randn(n, heads, head_dim) * 0.02)
        self.long_bias = nn.Parameter(torch.zeros(n, heads))
        self.global_bias = nn.Parameter(torch.zeros(n, heads))

    def labels(self, q_pos: Tensor, k_pos: Tensor, start: int, n_g: int) -> Tensor:
        """Labels at broadcast key indices (globals at ``start .. start + n_g - 1``, long tokens after them)."""
        first_long = start + n_g
        q_glob, k_glob = q_pos < first_long, k_pos < first_long
        qi = torch.where(q_glob, q_pos - start, q_pos - first_long)  # global index s or long index t
        ki = torch.where(k_glob, k_pos - start, k_pos - first_long)
        rel = (ki - qi).clamp(-self.k, self.k) + self.k  # l2l, g2g
        own = torch.where(q_glob, segment_of(ki, self.segment) == qi, segment_of(qi, self.segment) == ki)
        return torch.where(q_glob != k_glob, 2 * self.k + 1 + own.long(), rel)

    def row_terms(self, q: Tensor, n_g: int) -> Tensor:
        """``(q . a_l + b_l) / sqrt(Dh)`` for every query row and label: ``[B, H, n_g + n_l, V]``."""

        def terms(rows: Tensor, emb: Tensor, bias: Tensor) -> Tensor:  # [B, H, R, Dh] -> [B, H, R, V]
            return torch.einsum("bhqd,vhd->bhqv", rows, emb.to(q.dtype)) + bias.T[:, None].to(q.dtype)

        glob = terms(q[:, :, :n_g], self.global_emb, self.global_bias)
        long = terms(q[:, :, n_g:], self.long_emb, self.long_bias)
        return torch.cat((glob, long), dim=2) / math.sqrt(q.shape[-1])


class RelativeScores:
    """The relative term of one call as the engine's score-bias hook sees it (``pairs`` / ``dense``), plus the
    model's own bias if any. Unlike a ``ScoreBias`` it depends on the call's queries: ``[B, H, ...]``, which the
    engine's ``[B, H, ...]`` scores take by broadcasting."""

    def __init__(self, rel: RelativeLabels, q: Tensor, start: int, n_g: int, bias: ScoreBias | None):
        self.rel, self.start, self.n_g, self.bias = rel, start, n_g, bias
        self.terms = rel.row_terms(q, n_g)  # [B, H, n_g + n_l, V]
        self.heads = q.shape[1]

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        labels = self.rel.labels(q_pos, k_pos, self.start, self.n_g)
        rows = (q_pos - self.start).clamp(0, self.terms.shape[2] - 1).expand_as(labels)
        n_labels = self.terms.shape[-1]
        flat = self.terms.flatten(2)[:, :, (rows * n_labels + labels).flatten()]  # [B, H, pairs]
        out = flat.view(*self.terms.shape[:2], *labels.shape)
        return out if self.bias is None else out + self.bias.pairs(q_pos, k_pos).to(out.dtype)

    def dense(self, mask: AttnMask, dtype: torch.dtype = torch.float32) -> Tensor:
        q_pos, k_pos = mask.positions(self.terms.device)
        return self.pairs(q_pos[:, None], k_pos[None, :]).to(dtype)  # [B, H, Sq, Sk]
