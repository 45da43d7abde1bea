"""Talking-heads attention (``attention=talking_heads``; Shazeer, Lan, Cheng, Ding and Hou, 2020, arXiv:2003.02436).

Multi-head attention computes each head's softmax on its own. Talking-heads attention inserts two learned linear
maps across the heads (sec. 4, eqs. for ``talking_heads_attention``): one on the logits before the softmax and one
on the weights after it, so every head's weights are a mixture of every head's scores:

    J[h]  = q_h k_h^T / sqrt(d) + b[h]              logits per head (b: the positional score bias, if any)
    L[h]  = sum_h' P_l[h, h'] J[h']                  mixed before the softmax
    W[h]  = softmax(L[h] + mask)                     over the visible keys
    W'[h] = sum_h' P_w[h, h'] W[h']                  mixed after it
    O[h]  = W'[h] v_h

with the paper's h_k = h = h_v (as many logit and weight heads as heads). The mask is added after ``P_l``, so a
key hidden from a query stays hidden in every head's mixture: no causal leak. ``P_l`` and ``P_w`` start at the
identity (our choice), where talking-heads attention is exactly multi-head attention: its degenerate limit, so
``exact_params`` is empty and the contract tests compare it with softmax attention as built.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from xfam.api import ATTENTION, AttentionMechanism, AttnMask, ScoreBias, ScoreModifier, expand_kv


@ATTENTION.register("talking_heads")
class TalkingHeads(AttentionMechanism):
    """Softmax attention whose heads exchange their logits (``P_l``) and their weights (``P_w``).

    Args:
        heads: attention heads (injected).
    """

    paper = "Shazeer et al., 2020, arXiv:2003.02436 (Talking-Heads Attention)"

    def __init__(self, *, heads: int):
        super().__init__()
        self.logit_mix = nn.Parameter(torch.eye(heads))  # P_l [H, H]
        self.weight_mix = nn.Parameter(torch.eye(heads))  # P_w [H, H]

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        heads = q.shape[1]
        k, v = expand_kv(k, heads), expand_kv(v, heads)  # [B, H, Sk, Dh]
        logits = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # J [B, H, Sq, Sk]
        if bias is not None:
            logits = logits + bias.dense(mask, logits.dtype).to(logits.device)  # [1, H, Sq, Sk]
        mixed = torch.einsum("gh,bhqk->bgqk", self.logit_mix.to(logits.dtype), logits)  # L
        allowed = mask.dense(q.device)  # [B|1, 1, Sq, Sk] or None: every key visible
        if allowed is not None:
            mixed = mixed.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(mixed, dim=-1)  # W
        weights = torch.einsum("gh,bhqk->bgqk", self.weight_mix.to(weights.dtype), weights)  # W'
        return weights @ v  # [B, H, Sq, Dh]
