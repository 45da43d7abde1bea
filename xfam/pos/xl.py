"""Transformer-XL relative positional attention (Dai et al., ACL 2019, arXiv:1901.02860, sec. 3.3).

The score of query i and key j (positions are key indices over [memory | segment], see ``AttnMask``,
so the same terms hold across the memory) is the paper's four-term decomposition

    A_ij = q_i . k_j  +  q_i . W_R R_{i-j}  +  u . k_j  +  v . W_R R_{i-j}
           (a) content    (b) content-position  (c) global content  (d) global position

with R the sinusoidal encoding (of width ``model.dim``) of the distance i - j, W_R a per-layer
projection to the heads' widths, and u, v learned per layer and head; scores are then scaled by
1 / sqrt(Dh) like (a). Computed per distinct distance, not per pair: ``(q + v) W_R R^T``
``[B, H, Sq, n_dist]`` gathered at each pair's distance, plus ``u . k`` ``[B, H, 1, Sk]``. It depends on
q and k, so it is a score modifier (``logits``), hosted by mechanisms that compute explicit scores.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from xfam.core.bias import ScoreModifier
from xfam.core.mask import AttnMask
from xfam.core.sinusoid import sinusoid_table
from xfam.pos._base import POS, PositionalEncoding


class XLModifier(ScoreModifier):
    """One layer's terms (b), (c), (d)."""

    def __init__(self, w_r: Tensor, u: Tensor, v: Tensor, dim: int):
        super().__init__()
        self.w_r, self.u, self.v, self.dim = w_r, u, v, dim  # [D, H, Dh], [H, Dh], [H, Dh]

    def logits(self, scores: Tensor, q: Tensor, k: Tensor, mask: AttnMask) -> Tensor:
        q_pos, k_pos = mask.positions(q.device)
        dist = q_pos[:, None] - k_pos[None, :]  # [Sq, Sk], i - j
        lo, hi = int(dist.min()), int(dist.max())
        r = sinusoid_table(torch.arange(lo, hi + 1, device=q.device), self.dim).to(q.dtype)  # [n, D]
        pos_keys = torch.einsum("nd,dhe->hne", r, self.w_r.to(q.dtype))  # [H, n, Dh]: W_R R_{i-j}
        bd = (q + self.v.to(q.dtype)[:, None]) @ pos_keys.transpose(-1, -2)  # [B, H, Sq, n]: (b) + (d)
        bd = bd.gather(-1, (dist - lo).expand(*q.shape[:2], -1, -1))  # [B, H, Sq, Sk]
        c = torch.einsum("he,bhke->bhk", self.u.to(q.dtype), k)[:, :, None]  # [B, H, 1, Sk]: (c)
        return scores + (bd + c) / math.sqrt(q.shape[-1])


@POS.register("xl")
class XL(PositionalEncoding):
    """Transformer-XL relative attention: sinusoidal R_{i-j}, per-layer W_R, content and position biases u, v."""

    decay_params = ("w_r",)  # W_R decays like a Linear weight (u, v are biases) (xfam.training.lit.optim.param_groups)

    paper = "Dai et al., ACL 2019, arXiv:1901.02860 (Transformer-XL)"

    kind = "modifier"
    hosts = frozenset({"vanilla"})
    hosts_why = "its position terms are computed per distinct distance and shifted into the dense score matrix"
    relative = True

    def __init__(self, *, dim: int, heads: int, head_dim: int, num_layers: int):
        super().__init__()
        self.dim = dim
        self.w_r = nn.Parameter(torch.randn(num_layers, dim, heads, head_dim) * 0.02)  # [layers, D, H, Dh]
        self.u = nn.Parameter(torch.zeros(num_layers, heads, head_dim))
        self.v = nn.Parameter(torch.zeros(num_layers, heads, head_dim))

    def score_modifier(self, layer: int) -> ScoreModifier:
        return XLModifier(self.w_r[layer], self.u[layer], self.v[layer], self.dim)
