"""Dynamic position bias: a small MLP maps a relative distance to one bias per head (x-transformers'
``DynamicPositionBias``, after the continuous position bias of Liu et al., 2022, Swin Transformer V2,
arXiv:2111.09883, sec. 3.3).

For query i and key j with ``n = i - j``, the input is ``n`` (``log_distance``: ``sign(n) log(1 + |n|)``,
which compresses long distances), and

    b[:, i, j] = W_out s(... s(LN(W_1 n + c_1)) ...)        s = SiLU, ``depth`` hidden layers of width
                                                             ``hidden`` (default model.dim / 4), LN optional

One MLP for the whole model. The bias depends only on ``i - j`` (relative); ``pairs`` evaluates the MLP
once per distinct distance of the call (at most Sq + Sk - 1 values) and gathers, so a sparse
mechanism never pays for an L x L table. It is not a pure distance decay, so kernelised attention
cannot host it; being continuous in n, it extends to distances never seen in training.
"""

from __future__ import annotations

from typing import Annotated, cast

import torch
from torch import Tensor, nn

from xfam.core.bias import ScoreBias
from xfam.core.registry import Positive
from xfam.pos._base import POS, PositionalEncoding


class DynamicBias(ScoreBias):
    """``b[h, i, j] = mlp(f(i - j))[h]``."""

    def __init__(self, heads: int, hidden: int, depth: int, log_distance: bool, norm: bool):
        super().__init__()
        self.heads, self.log_distance = heads, log_distance
        layers: list[nn.Module] = []
        width = 1
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), *([nn.LayerNorm(hidden)] if norm else []), nn.SiLU()]
            width = hidden
        self.mlp = nn.Sequential(*layers, nn.Linear(width, heads))

    def distances(self, n: Tensor) -> Tensor:
        """``[..., H]`` biases of integer distances ``n``."""
        x = n.to(cast(nn.Linear, self.mlp[0]).weight.dtype)[..., None]
        if self.log_distance:
            x = torch.sign(x) * torch.log1p(x.abs())
        return self.mlp(x)

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        n = q_pos - k_pos
        lo, hi = int(n.min()), int(n.max())
        table = self.distances(torch.arange(lo, hi + 1, device=n.device))  # [hi - lo + 1, H]
        return table[n - lo].movedim(-1, 0)  # [H, *pairs]


@POS.register("dynamic")
class Dynamic(PositionalEncoding):
    """A learned MLP from relative distance to a per-head score bias (x-transformers' dynamic bias).

    Args:
        hidden: width of the MLP's hidden layers; null: model.dim / 4.
        depth: hidden layers.
        log_distance: feed sign(n) log(1 + |n|) instead of n.
        norm: LayerNorm after each hidden linear layer.
    """

    paper = "Liu et al., 2022 (Swin V2 continuous position bias), arXiv:2111.09883; x-transformers"

    kind = "bias"
    relative = True

    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        hidden: Annotated[int, Positive] | None = None,
        depth: Annotated[int, Positive] = 2,
        log_distance: bool = False,
        norm: bool = False,
    ):
        super().__init__()
        self.bias = DynamicBias(heads, hidden or max(dim // 4, 1), depth, log_distance, norm)

    def own_init_modules(self) -> list[nn.Module]:
        # PyTorch's default init, as x-transformers; the model's N(0, 0.02) would make the bias ~1e-6 at the
        # start, an order-blind model (tests/contracts/test_pos_contract.py)
        return list(self.bias.mlp)

    def score_bias(self) -> ScoreBias:
        return self.bias
