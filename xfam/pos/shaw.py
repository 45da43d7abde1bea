"""Relative position representations (Shaw, Uszkoreit & Vaswani, NAACL 2018, arXiv:1803.02155, sec. 3).

Learned vectors for the clipped relative distance ``clip(j - i, -k, k)`` enter the keys and,
optionally, the values (eqs. 3-6; positions are key indices, see ``AttnMask``):

    e_ij = q_i . (k_j + a^K_ij) / sqrt(d),     z_i = sum_j softmax_j(e_ij) (v_j + a^V_ij)
    a^K_ij = w^K[clip(j - i, -k, k)],          a^V_ij = w^V[clip(j - i, -k, k)],   w^K, w^V [2k + 1, Dh]

One pair of tables per layer, shared by the heads of the layer (as the paper). Computed without
an [Sq, Sk, Dh] tensor (the paper's sec. 3.3 split): ``q w^K^T`` ``[B, H, Sq, 2k + 1]`` gathered at each
pair's index for the keys; the probabilities summed per index ``[B, H, Sq, 2k + 1]`` times ``w^V`` for
the values. It depends on q and changes the values, so it is a score modifier (``logits`` and
``output`` hooks), hosted by mechanisms that compute explicit scores.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from torch import Tensor, nn

from xfam.core.bias import ScoreModifier
from xfam.core.mask import AttnMask
from xfam.core.registry import Positive
from xfam.pos._base import POS, PositionalEncoding


class ShawModifier(ScoreModifier):
    """One layer's key (and value) relative terms."""

    def __init__(self, keys: Tensor, values: Tensor | None, clip: int):
        super().__init__()
        self.keys, self.values, self.clip = keys, values, clip  # [2k + 1, Dh] views of the owner's tables

    def index(self, mask: AttnMask, device: torch.device) -> Tensor:
        """``clip(j - i, -k, k) + k`` ``[Sq, Sk]``."""
        q_pos, k_pos = mask.positions(device)
        return (k_pos[None, :] - q_pos[:, None]).clamp(-self.clip, self.clip) + self.clip

    def logits(self, scores: Tensor, q: Tensor, k: Tensor, mask: AttnMask) -> Tensor:
        qa = q @ self.keys.to(q.dtype).T  # [B, H, Sq, 2k + 1]
        idx = self.index(mask, q.device).expand(*q.shape[:2], -1, -1)  # [B, H, Sq, Sk]
        return scores + qa.gather(-1, idx) / math.sqrt(q.shape[-1])

    def output(self, probs: Tensor, mask: AttnMask) -> Tensor | None:
        if self.values is None:
            return None
        idx = self.index(mask, probs.device).expand_as(probs)
        per_distance = probs.new_zeros(*probs.shape[:-1], 2 * self.clip + 1).scatter_add_(-1, idx, probs)
        return per_distance @ self.values.to(probs.dtype)  # [B, H, Sq, Dh]


@POS.register("shaw")
class Shaw(PositionalEncoding):
    """Learned embeddings of the clipped relative distance, added to keys (and values) in every layer.

    Args:
        clip: the paper's k: distances beyond +-k share the last embedding.
        values: also add a^V to the values (the paper's eq. 3); false: keys only.
    """

    paper = "Shaw, Uszkoreit & Vaswani, NAACL 2018, arXiv:1803.02155"

    kind = "modifier"
    hosts = frozenset({"vanilla"})
    hosts_why = "its key term q_i . a_ij and value term sum_j p_ij a^V_ij use the dense scores and probabilities"
    relative = True

    def __init__(self, *, head_dim: int, num_layers: int, clip: Annotated[int, Positive] = 16, values: bool = True):
        super().__init__()
        self.clip = clip
        self.keys = nn.Parameter(torch.randn(num_layers, 2 * clip + 1, head_dim) * 0.02)  # [layers, 2k + 1, Dh]
        self.values = nn.Parameter(torch.randn(num_layers, 2 * clip + 1, head_dim) * 0.02) if values else None

    def score_modifier(self, layer: int) -> ScoreModifier:
        return ShawModifier(self.keys[layer], None if self.values is None else self.values[layer], self.clip)
