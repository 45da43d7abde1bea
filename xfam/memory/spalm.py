"""SPALM (Yogatama et al., TACL 2021, "Adaptive Semiparametric Language Models", section 2): a
Transformer-XL short-term memory in every layer plus a kNN long-term memory mixed into the final
layer's output by a learned gate.

Long-term memory: a datastore of (key, next token) pairs built once by a pretrained language model
(``xfam knnlm build``: keys are the input of that model's final FFN, as in kNN-LM). For every position
t the same frozen model encodes the context, its k nearest keys are found, and their next tokens
``y_1..y_k`` are embedded with the output word-embedding matrix W (trained: the paper's "value
encoder"; the keys and the pretrained model stay fixed). With h_t the final hidden state (after the
final norm, the head's input):

    m_t = sum_i softmax_i(y_i^T h_t) y_i                 # attention over the retrieved embeddings
    g_t = sigmoid(w_g^T h_t + b_g)                       # one scalar gate per token
    z_t = (1 - g_t) * m_t + g_t * h_t
    p(x_{t+1} | x_<=t) = softmax(z_t W^T)

Distances are not used in the aggregation (the paper found them unhelpful). Training on the split the
store was built from, a token would retrieve its own entry, whose value is the very token to predict:
neighbours whose key equals the query (squared distance within ``exclude_tol * |q|^2``, which holds
for a position's own entry up to the store's fp16 rounding, and for exact duplicates of its context)
are dropped (``exclude_identical``).

Only the last layer's instance holds the long-term part (the paper's R is the final layer); the
others are Transformer-XL memories. The component never opens its store: it asks for one
(``needs_store``, ``store_request``) and the model builder opens the datastore with its query encoder
and passes it in as ``long_term`` (an ``xfam.core.store.LongTermStore``). ``b_g`` is our addition (the
paper's gate has no bias); with ``b_g -> +inf`` the model is exactly the Transformer-XL model.
Shapes: neighbours ``[B, S, k]`` token ids (and a validity mask), h ``[B, S, D]``, W ``[V, D]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import Tensor, nn

from xfam.core.errors import ConfigError
from xfam.core.registry import Range, defaults_of
from xfam.core.store import LongTermStore, StoreRequest
from xfam.memory._base import MEMORY
from xfam.memory.xl import XLMemory

#: Extra neighbours searched, so that up to this many identical keys can be dropped.
SPARE = 8


@MEMORY.register("spalm")
class SPALMMemory(XLMemory):
    """Transformer-XL short-term memory plus a gated kNN long-term memory at the final layer"""

    paper = "Yogatama et al., TACL 2021, arXiv:2102.02557 (SPALM)"
    needs_store = True

    def __init__(
        self,
        *,
        dim: int,
        layer: int,
        num_layers: int,
        long_term: LongTermStore | None = None,
        store: str | None = None,
        k: Annotated[int, Range(ge=1)] = 4,
        index: Literal["exact", "faiss"] = "exact",
        exclude_identical: bool = True,
        exclude_tol: Annotated[float, Range(ge=0)] = 1e-3,
        gate_bias: float = 0.0,
        mem_len: Annotated[int, Range(ge=0)] = 128,
        eval_mem_len: Annotated[int, Range(ge=0)] | None = None,
        allow_absolute_pos: bool = False,
    ):
        """
        Args:
            long_term: the last layer's long-term store (injected: the model builder opens ``store`` with
                its query encoder, see ``store_request``).
            store: a datastore directory written by ``xfam knnlm build`` from a pretrained model
                (that model encodes the queries; it is loaded from the path in the store's manifest).
            k: neighbours retrieved per token.
            index: exact search in torch, or faiss (exact L2).
            exclude_identical: drop neighbours whose key equals the query (a token's own entry when
                training on the store's split).
            exclude_tol: "equal" means a squared distance at most ``exclude_tol * |q|^2``.
            gate_bias: initial b_g (0: sigmoid(0) = an even mix at the start).
            mem_len, eval_mem_len, allow_absolute_pos: the short-term memory, as ``memory=xl``.
        """
        super().__init__(mem_len=mem_len, eval_mem_len=eval_mem_len, allow_absolute_pos=allow_absolute_pos)
        self.mixes_output = layer == num_layers - 1  # the long-term part
        self.k, self.exclude, self.tol = k, exclude_identical, exclude_tol
        if self.mixes_output:
            if long_term is None:
                raise ConfigError(
                    "memory=spalm's final layer needs its long-term store, which the model builder opens from "
                    "memory.store=DIR. Fix: build the model with xfam.build_model."
                )
            self.gate = nn.Linear(dim, 1)
            nn.init.normal_(self.gate.weight, std=0.02)
            nn.init.constant_(self.gate.bias, gate_bias)
            self._store = long_term  # no submodule (nor is its encoder): frozen, never saved

    def own_init_modules(self) -> list[nn.Module]:
        return [self.gate] if self.mixes_output else []  # keep b_g through the model's init

    @classmethod
    def store_request(cls, params: Mapping[str, Any], *, layer: int, num_layers: int) -> StoreRequest | None:
        """The final layer's instance needs the datastore of ``memory.store``; the others none."""
        if layer != num_layers - 1:
            return None
        full = {**defaults_of(cls), **params}
        if full["store"] is None:
            raise ConfigError("memory=spalm needs memory.store=DIR (a datastore from `xfam knnlm build`).")
        return StoreRequest(str(full["store"]), full["index"])

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        out = []
        if not selection.causal or selection.task != "lm":
            out.append("memory=spalm predicts the next token from retrieved next tokens: it is for causal LMs.")
        if selection.memory and selection.memory[-1][0] is not cls:
            out.append(
                "memory=spalm mixes its long-term memory into the final layer's output. Fix: put it at the last "
                "layer (memory=spalm, or '+memory.per_layer={-1: {name: spalm, store: DIR}}')."
            )
        if selection.exit[0].registry_name != "none":
            out.append("memory=spalm mixes the final layer's output, which early exit skips. Fix: exit=none.")
        if params.get("store") is None:
            out.append(
                "memory=spalm needs memory.store=DIR, a datastore of a pretrained model. Fix: train a model "
                "(memory=none), run `xfam knnlm build ckpt=PATH split=train`, pass its directory."
            )
        else:
            try:
                manifest = selection.store_manifest(params["store"])
            except ConfigError as e:
                out.append(f"memory.store: {e}")
            else:
                if (n := manifest["count"]) < params.get("k", 4) + SPARE:
                    out.append(f"memory.store holds {n} entries, fewer than k + {SPARE}. Fix: a larger store.")
        return out

    # -- long-term memory -------------------------------------------------------------------------
    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a store of another vocabulary (its values index the word embeddings)."""
        store_vocab = self._store.vocab_size
        if store_vocab != vocab_size:
            raise ConfigError(
                f"memory.store {self._store.path} holds next tokens of a vocabulary of {store_vocab}, this model has "
                f"{vocab_size}. Fix: a datastore built from a model of this data."
            )

    @torch.no_grad()
    def retrieve(self, tokens: Tensor, key_padding: Tensor | None, segments: Tensor | None) -> tuple[Tensor, Tensor]:
        """Neighbours of every position: token ids ``[B, S, k]`` and whether each is usable ``[B, S, k]``."""
        q = self._store.encode(tokens, key_padding, segments)  # [B*S, De]
        extra = SPARE if self.exclude else 0
        nb = self._store.search(q.cpu(), self.k + extra)  # dists ascending [B*S, k + extra] (the store is on CPU)
        ok = torch.ones_like(nb.dists, dtype=torch.bool)
        if self.exclude:
            ok = nb.dists > self.tol * q.pow(2).sum(-1, keepdim=True)
        order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices[:, : self.k]  # usable first, by distance
        values, ok = nb.values.gather(1, order), ok.gather(1, order)  # [B*S, k]
        return values.view(*tokens.shape, self.k).to(tokens.device), ok.view(*tokens.shape, self.k).to(tokens.device)

    def mix(self, h: Tensor, neighbours: tuple[Tensor, Tensor], embedding: Tensor) -> Tensor:
        """``z [B, S, D]`` from the final hidden state ``h [B, S, D]``, the neighbours of ``retrieve`` and the
        output word embeddings ``embedding [V, D]``."""
        ids, ok = neighbours
        y = embedding[ids].to(h.dtype)  # [B, S, k, D]
        scores = torch.einsum("bskd,bsd->bsk", y, h).masked_fill(~ok, float("-inf"))
        any_ok = ok.any(-1, keepdim=True)  # [B, S, 1]
        w = torch.softmax(torch.where(any_ok, scores, torch.zeros_like(scores)), dim=-1)
        m = torch.einsum("bsk,bskd->bsd", w * any_ok, y)  # [B, S, D] (0 where nothing was retrieved)
        g = torch.sigmoid(self.gate(h))  # [B, S, 1]
        return (1 - g) * m + g * h
