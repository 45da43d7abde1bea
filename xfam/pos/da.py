"""DA-Transformer: distance-aware attention (Wu, Wu & Huang, NAACL 2021, arXiv:2010.06925, sec. 3).

Each head h of each layer rescales its non-negative raw scores by a learnable function of the real
distance ``R_ij = |i - j|`` (positions are key indices, see ``AttnMask``):

    R^(h) = alpha_h R,     f(R^(h); beta_h) = (1 + exp(beta_h)) / (1 + exp(beta_h - R^(h)))
    attn = row-softmax( ReLU(Q K^T) f(R^(h)) / sqrt(d) ) V

f(0) = 1, f -> 0 as R^(h) -> -inf (alpha_h < 0: a head for short-term context), f is bounded by
1 + exp(beta_h) as R^(h) -> +inf (alpha_h > 0: a head for long-term context), and monotone. It
multiplies scores that depend on q and k, so it is a score modifier (``logits`` hook on the scaled
scores; ReLU(s / sqrt(d)) = ReLU(s) / sqrt(d)), hosted by mechanisms that compute explicit scores.
Initialisation (not specified by the survey; a choice here): beta = 0 and alpha spread evenly over
[-0.1, 0.1] across the heads of a layer, so from the start some heads prefer short-term context and
others long-term context (alpha = 0 everywhere would make f = 1, an order-blind model in which beta
gets no gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xfam.core.bias import ScoreModifier
from xfam.core.mask import AttnMask
from xfam.pos._base import POS, PositionalEncoding


class DAModifier(ScoreModifier):
    """One layer's ``ReLU(scores) * f(alpha_h |i - j|; beta_h)``."""

    def __init__(self, alpha: Tensor, beta: Tensor):
        super().__init__()
        self.alpha, self.beta = alpha, beta  # [H] views into the owner's parameters

    def weights(self, mask: AttnMask, like: Tensor) -> Tensor:
        """``f [H, Sq, Sk]`` for the (query, key) positions of ``mask``."""
        q_pos, k_pos = mask.positions(like.device)
        r = (q_pos[:, None] - k_pos[None, :]).abs().to(like.dtype)  # [Sq, Sk]
        a, b = self.alpha.to(like.dtype)[:, None, None], self.beta.to(like.dtype)[:, None, None]
        return (1 + torch.exp(b)) / (1 + torch.exp(b - a * r))

    def logits(self, scores: Tensor, q: Tensor, k: Tensor, mask: AttnMask) -> Tensor:
        return torch.relu(scores) * self.weights(mask, scores)  # [B, H, Sq, Sk]


@POS.register("da")
class DA(PositionalEncoding):
    """Distance-aware attention: ReLU scores rescaled by a learned per-head sigmoid of the distance."""

    paper = "Wu, Wu & Huang, NAACL 2021, arXiv:2010.06925 (DA-Transformer)"

    kind = "modifier"
    hosts = frozenset({"vanilla"})
    hosts_why = "it multiplies the dense ReLU score matrix by a learned function of every distance"
    relative = True

    def __init__(self, *, heads: int, num_layers: int):
        super().__init__()
        spread = torch.linspace(-0.1, 0.1, heads) if heads > 1 else torch.full((1,), 0.1)
        self.alpha = nn.Parameter(spread.repeat(num_layers, 1))  # [layers, H]
        self.beta = nn.Parameter(torch.zeros(num_layers, heads))

    def score_modifier(self, layer: int) -> ScoreModifier:
        return DAModifier(self.alpha[layer], self.beta[layer])
