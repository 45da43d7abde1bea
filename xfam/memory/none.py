"""No memory: every segment is processed on its own (the vanilla Transformer)."""

from __future__ import annotations

from xfam.memory._base import MEMORY, Memory


@MEMORY.register("none")
class NoMemory(Memory):
    """Reads nothing and stores nothing."""

    needs_streams = False
    needs_relative_pos = False

    def __init__(self) -> None:
        super().__init__()
