"""Transformer-XL segment-level recurrence (Dai et al. 2019, "Transformer-XL: Attentive Language
Models Beyond a Fixed-Length Context", section 3.2).

Each layer n keeps the last ``mem_len`` hidden states it received as input, from the previous
segments, with a stop-gradient (SG in the paper's eq. for h~^{n-1}_{tau+1}):

    h~ = [SG(m^{n-1}_tau) o h^{n-1}_{tau+1}]         # [B, M + S, D]
    q = h^{n-1}_{tau+1} W_q,  k, v = h~ W_k, h~ W_v   # queries from the segment only

The model prepends the memory's keys/values (``xfam.model.block.SelfAttention``) and positions
span memory plus segment, so a relative encoding sees each stored key at its true distance. The
paper pairs the recurrence with its own relative encoding (``pos=xl``); any relative one works.

Evaluation may keep a longer memory than training (the paper trains WikiText-103 with mem_len 150
and evaluates with 640): ``eval_mem_len`` applies whenever the module is in eval mode. Evaluation
is cached: each segment reuses the stored states instead of recomputing the overlap (the paper's
1,800x evaluation speed-up over the vanilla model's one-position-per-step sliding window).
Shapes: state ``{"h": [B, M, D], "docs": [B, M] | None}`` (M <= mem_len), hidden ``[B, S, D]``.
"""

from __future__ import annotations

from typing import Annotated

from torch import Tensor

from xfam.core.registry import Range
from xfam.core.state import LayerView, MemoryState
from xfam.memory._base import MEMORY, Memory, fifo


@MEMORY.register("xl")
class XLMemory(Memory):
    """Segment recurrence: each layer attends to its last ``mem_len`` inputs, stop-gradient"""

    paper = "Dai et al., ACL 2019, arXiv:1901.02860 (Transformer-XL)"

    def __init__(
        self,
        *,
        mem_len: Annotated[int, Range(ge=0)] = 128,
        eval_mem_len: Annotated[int, Range(ge=0)] | None = None,
        allow_absolute_pos: bool = False,
    ):
        """
        Args:
            mem_len: hidden states kept per layer in training (0: no memory).
            eval_mem_len: states kept in eval mode (None: ``mem_len``); may exceed ``mem_len``.
            allow_absolute_pos: accept an absolute input encoding anyway. The paper (section 3.3)
                explains why not: a stored state and the current one at the same index would get
                the same position. Only for ablations.
        """
        super().__init__()
        self.mem_len = mem_len
        self.eval_mem_len = mem_len if eval_mem_len is None else eval_mem_len

    @property
    def length(self) -> int:
        """Entries kept in the current mode (training or eval)."""
        return self.mem_len if self.training else self.eval_mem_len

    def read(self, state: MemoryState) -> Tensor | None:
        return None if state is None else state["h"]

    def read_segments(self, state: MemoryState) -> Tensor | None:
        return None if state is None else state["docs"]

    def write(self, state: MemoryState, hidden: Tensor, view: LayerView) -> tuple[MemoryState, dict[str, Tensor]]:
        m = self.length
        if m == 0:
            return None, {}
        old = state or {"h": None, "docs": None}
        docs = None if view.segments is None else fifo(old["docs"], view.segments, m)  # [B, M]
        return {"h": fifo(old["h"], hidden.detach(), m), "docs": docs}, {}  # [B, M, D]
