"""Base of mechanisms defined by a sparse pattern: the block engine is their fast path, the dense
reference their test path, and on CUDA the flash kernel runs the same block layout (``backend``)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from xfam.attention import _fused as fused
from xfam.attention._base import AttentionMechanism
from xfam.attention._sparse.engine import block_sparse_attention, dense_sparse_attention, flash_sparse_attention
from xfam.attention._sparse.pattern import SparsePattern
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask


def _tileable(block: int) -> bool:
    """Whether the flash kernel tiles ``block`` (Triton's tl.dot: a power of two >= 16)."""
    return block >= 16 and block & (block - 1) == 0


class SparseMechanism(AttentionMechanism):
    """Attention restricted to ``self.pattern``; subclasses build the pattern from their parameters.

    The score bias is evaluated on the (query, key) pairs the engine visits, never on a dense
    ``Sq x Sk`` matrix; score modifiers need explicit full scores and are not hosted.
    """

    hosts_modifiers: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("block", "dense", "triton")

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
        return self.attend(self.pattern, q, k, v, mask, bias, modifier)

    def attend(
        self,
        pattern: SparsePattern,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None,
        modifier: ScoreModifier | None,
        fallback: str = "block",
    ) -> Tensor:
        """``pattern`` through the path ``backend`` picks (``auto``: the flash kernel on CUDA where it
        applies, else ``fallback``); a subclass with its own fast path runs it when ``fallback`` is chosen."""
        p = self.dropout if self.training else 0.0
        b = pattern.block
        odd = None if _tileable(b) else f"block {b} (the kernel tiles powers of two >= 16)"
        path = fused.choose(self.registry_name, self.backend, fallback, q, mask, bias, p, modifier, odd)
        if path == "dense":
            return dense_sparse_attention(q, k, v, pattern, mask, bias, p)
        if path == "triton":
            return flash_sparse_attention(q, k, v, pattern, mask, bias)
        if path == "block":
            return block_sparse_attention(q, k, v, pattern, mask, bias, p)
        return self.fast_path(path, pattern, q, k, v, mask, bias, p)

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        """``backend=triton`` with a ``block`` the flash kernel cannot tile, attention dropout or persistent keys
        (found in the first training step otherwise). A subclass's own refusals add to these."""
        b = params.get("block")
        odd = f"block {b} (the kernel tiles powers of two >= 16)" if isinstance(b, int) and not _tileable(b) else None
        return fused.triton_refusals(cls, params, selection, cls.backends[0], (odd,))

    def fast_path(
        self, path: str, pattern: SparsePattern, q: Tensor, k: Tensor, v: Tensor, mask: AttnMask, bias: Any, p: float
    ) -> Tensor:
        """A subclass's own path (``backends`` beyond block / dense / triton)."""
        raise ValueError(f"attention={self.registry_name}: unknown backend {path!r}")
