"""The sparse attention engine shared by every pattern-based mechanism (see ``engine``)."""

from xfam.attention._sparse.engine import block_sparse_attention, dense_sparse_attention, pattern_dense
from xfam.attention._sparse.mechanism import SparseMechanism
from xfam.attention._sparse.pattern import SparsePattern, auto_block, band_layout, window_band, window_layout

__all__ = [
    "SparseMechanism",
    "SparsePattern",
    "auto_block",
    "band_layout",
    "block_sparse_attention",
    "dense_sparse_attention",
    "pattern_dense",
    "window_band",
    "window_layout",
]
