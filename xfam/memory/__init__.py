"""The ``memory`` slot: what survives across segments. Importing this package registers every memory."""

from xfam.memory import compressive, memorizing, none, spalm, xl  # noqa: F401  (registration)
from xfam.memory._base import MEMORY, Memory

__all__ = ["MEMORY", "Memory"]
