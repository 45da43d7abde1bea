"""Memorizing Transformer memory (Wu et al., ICLR 2022, "Memorizing Transformers", section 3):
a kNN-augmented attention layer.

The layer attends locally as usual (its mechanism over [local cache | segment]); in addition every
query retrieves the ``topk`` nearest (key, value) pairs of its head from an external store of the
keys/values of earlier segments (non-differentiable: no gradient reaches the stored pairs), attends
over them, and a learned per-head gate mixes the two:

    V_m = softmax(s_h * q^ K_m^T) V_m          q^, K_m: L2-normalised queries and stored keys
    out = g * V_m + (1 - g) * V_local,          g = sigmoid(b_g), one scalar b_g per head

The paper normalises keys and queries against the staleness of stored keys (section 3.3); the
normalised scores get a learned per-head temperature s_h (query-key normalisation, Henry et al. 2020),
initialised to sqrt(Dh). Keys carry no positions (positions act inside the local attention only).

The store is a FIFO of ``store_size`` pairs per batch row (each row a stream of its own), searched
exactly: chunked in torch, or with faiss (``index=faiss``, an optional extra). With document ids
(``data.doc_mask=true``) a query retrieves only pairs of its own document: the store is cleared at
document boundaries. Put it at one depth with the per-layer schedule, e.g.
``memory=xl '+memory.per_layer={-2: {name: memorizing}}'``.
Shapes: store keys/values ``[B, Hkv, N, Dh]``, queries ``[B, H, S, Dh]``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.core.registry import Range
from xfam.core.state import LayerView, MemoryState, expand_kv
from xfam.memory._base import MEMORY, Memory, fifo
from xfam.memory._knn import topk_faiss, topk_inner


@MEMORY.register("memorizing")
class MemorizingMemory(Memory):
    """kNN-augmented attention: local attention gated with top-k retrieval from a store of past pairs."""

    paper = "Wu et al., ICLR 2022, arXiv:2203.08913 (Memorizing Transformers)"
    augments_attention = True

    def __init__(
        self,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        store_size: Annotated[int, Range(ge=1)] = 8192,
        topk: Annotated[int, Range(ge=1)] = 32,
        mem_len: Annotated[int, Range(ge=0)] = 0,
        index: Literal["exact", "faiss"] = "exact",
        gate_bias: float = 0.0,
    ):
        """
        Args:
            store_size: (key, value) pairs kept per batch row (FIFO); the paper goes up to 262K. The store
                takes 2 * B * store_size * Hkv * Dh numbers, in memory and in every checkpoint.
            topk: pairs retrieved per query and head (the paper: 32).
            mem_len: local Transformer-XL cache of this layer (states prepended to the local attention).
            index: exact search in torch, or faiss (exact inner product).
            gate_bias: initial b_g of every head (sigmoid(0) = an even mix).
        """
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.store_size, self.topk, self.mem_len, self.index = store_size, topk, mem_len, index
        self.gate = nn.Parameter(torch.full((heads,), float(gate_bias)))
        self.log_scale = nn.Parameter(torch.full((heads,), 0.5 * math.log(head_dim)))

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        if not selection.causal:
            return ["memory=memorizing stores the keys of earlier segments of a stream: it is for causal models."]
        return []

    # -- local cache ------------------------------------------------------------------------------
    def read(self, state: MemoryState) -> Tensor | None:
        return None if state is None else state["h"]

    def read_segments(self, state: MemoryState) -> Tensor | None:
        return None if state is None else state["docs"]

    # -- retrieval --------------------------------------------------------------------------------
    def augment(self, state: MemoryState, q: Tensor, out: Tensor, q_segments: Tensor | None) -> Tensor:
        if state is None or state["keys"] is None:
            return out  # nothing stored yet: the local layer
        keys, values = expand_kv(state["keys"], self.heads), expand_kv(state["values"], self.heads)  # [B, H, N, Dh]
        allowed = None
        if q_segments is not None and state["kdocs"] is not None:
            allowed = q_segments[:, :, None] == state["kdocs"][:, None, :]  # [B, S, N]
        qn = F.normalize(q, dim=-1)
        k = min(self.topk, keys.shape[2])
        search = topk_faiss if self.index == "faiss" else topk_inner
        with torch.no_grad():
            _, idx = search(qn, keys, k, allowed)  # [B, H, S, k]
        k_ret, v_ret = _gather(keys, idx), _gather(values, idx)  # [B, H, S, k, Dh]
        scores = torch.einsum("bhsd,bhskd->bhsk", qn, k_ret) * self.log_scale.exp().view(1, -1, 1, 1)
        if allowed is not None:
            ok = allowed[:, None].expand(-1, self.heads, -1, -1).gather(3, idx)  # [B, H, S, k]
            scores = scores.masked_fill(~ok, float("-inf"))
            any_ok = ok.any(-1, keepdim=True)
            scores = torch.where(any_ok, scores, torch.zeros_like(scores))
        retrieved = torch.einsum("bhsk,bhskd->bhsd", torch.softmax(scores, dim=-1), v_ret)  # [B, H, S, Dh]
        g = torch.sigmoid(self.gate).view(1, -1, 1, 1).to(out.dtype)
        if allowed is not None:  # a query with nothing of its document stored keeps its local output
            g = g * any_ok.to(out.dtype)
        return g * retrieved + (1 - g) * out

    def write(self, state: MemoryState, hidden: Tensor, view: LayerView) -> tuple[MemoryState, dict[str, Tensor]]:
        st = state or dict.fromkeys(("h", "docs", "keys", "values", "kdocs"))
        with torch.no_grad():
            k, v = view.keys_values(hidden.detach())  # [B, Hkv, S, Dh], no positions
        docs = view.segments
        new = {
            "h": fifo(st["h"], hidden.detach(), self.mem_len),
            "docs": None if docs is None or self.mem_len == 0 else fifo(st["docs"], docs, self.mem_len),
            "keys": _fifo_heads(st["keys"], F.normalize(k, dim=-1), self.store_size),
            "values": _fifo_heads(st["values"], v, self.store_size),
            "kdocs": None if docs is None else fifo(st["kdocs"], docs, self.store_size),
        }
        return new, {}


def _gather(store: Tensor, idx: Tensor) -> Tensor:
    """``store [B, H, N, Dh]`` at ``idx [B, H, S, k]`` -> ``[B, H, S, k, Dh]``."""
    flat = idx.flatten(2)[..., None].expand(-1, -1, -1, store.shape[-1])  # [B, H, S*k, Dh]
    return store.gather(2, flat).view(*idx.shape, store.shape[-1])


def _fifo_heads(old: Tensor | None, new: Tensor, keep: int) -> Tensor:
    """The last ``keep`` entries along the sequence dim of ``[B, H, N, Dh]``."""
    both = new if old is None else torch.cat((old, new), dim=2)
    return both[:, :, -keep:]
