"""The ``pos`` slot: how order enters the model. Importing this package registers every encoding."""

from xfam.pos import alibi, da, dynamic, learned, learned_per_layer, none, rope, shaw, sinusoidal, t5, xl  # noqa: F401  (registration)
from xfam.pos._base import KINDS, POS, PositionalEncoding

__all__ = ["KINDS", "POS", "PositionalEncoding"]
