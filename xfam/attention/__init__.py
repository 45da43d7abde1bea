"""The ``attention`` slot: how queries meet keys. Importing this package registers every mechanism."""

from xfam.attention import (  # noqa: F401  (registration)
    adaptive_span,
    bigbird,
    blockwise,
    etc,
    fixed,
    linformer,
    local,
    local2d,
    longformer,
    lsh,
    performer,
    rfa,
    routing,
    sinkhorn,
    strided,
    vanilla,
)
from xfam.attention._base import ATTENTION, AttentionMechanism

__all__ = ["ATTENTION", "AttentionMechanism"]
