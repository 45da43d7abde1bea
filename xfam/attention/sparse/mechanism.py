"""Base of mechanisms defined by a sparse pattern: the block engine is their fast path, the dense
reference their test path (``backend``)."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from xfam.attention.base import AttentionMechanism
from xfam.attention.mask import AttnMask
from xfam.attention.sparse.engine import block_sparse_attention, dense_sparse_attention
from xfam.attention.sparse.pattern import SparsePattern
from xfam.logs import log_once
from xfam.pos.base import ScoreBias, ScoreModifier


class SparseMechanism(AttentionMechanism):
    """Attention restricted to ``self.pattern``; subclasses build the pattern from their parameters.

    The score bias is evaluated on the (query, key) pairs the engine visits, never on a dense
    ``Sq x Sk`` matrix; score modifiers need explicit full scores and are not hosted.
    """

    hosts_modifiers: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("block", "dense")

    def __init__(self, pattern: SparsePattern, backend: str = "auto", dropout: float = 0.0):
        super().__init__()
        self.pattern, self.backend, self.dropout = pattern, backend, dropout

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
        if self.backend == "dense":
            return dense_sparse_attention(q, k, v, self.pattern, mask, bias, p)
        if self.backend == "auto":
            log_once(f"attention={self.registry_name} backend=auto: block engine")
        return block_sparse_attention(q, k, v, self.pattern, mask, bias, p)
