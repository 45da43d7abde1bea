"""The ``attention`` slot: how queries meet keys. Importing this package registers every mechanism."""

from xfam.attention import (  # noqa: F401  (registration)
    adaptive_span,
    bigbird,
    blockwise,
    etc,
    fixed,
    linformer,
    local,
    longformer,
    lsh,
    performer,
    rfa,
    routing,
    sinkhorn,
    strided,
    vanilla,
)
from xfam.attention.base import ATTENTION, AttentionMechanism, DecodeState, additive_mask, expand_kv
from xfam.attention.mask import AttnMask

__all__ = ["ATTENTION", "AttentionMechanism", "AttnMask", "DecodeState", "additive_mask", "expand_kv"]
