"""Learned positions per layer (Al-Rfou et al., 2018, "Character-Level Language Modeling with Deeper
Self-Attention", arXiv:1808.04444, section "Positional Embeddings").

In a deep stack (their 64 layers) a timing signal added once, below the first layer, may be lost on the
way up, so the paper replaces it by a learned embedding per layer: a vector for each of the ``max_len``
positions within each of the L layers (L x ``max_len`` x D parameters), added to the input of every
layer, the first included (there is no separate input encoding):

    h_0 = embed(tokens)                 h_{l+1} = block_l(h_l + P_l[positions])

``layer_embedding`` returns ``P_l[positions]``; ``xfam.model.stack.Stack.run_layer`` adds it to the layer's
input rows before the block runs (memory and global tokens in front take none, as with ``pos=learned``).
The index is the *step* the stack runs, not the block: with ``model.share_layers`` (ALBERT) one block's
weights run L times and each run still adds its own table, and ``exit=act`` (the Universal Transformer)
adds step t's table before its t-th application of the shared block, as the paper's per-layer tables
would be for a stack of that depth (the UT's own coordinate embedding does the same with a fixed signal).
In a decode call the new tokens take the tables' rows at their positions after the cache.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from xfam.core.typed import TypedModuleList
from xfam.pos._base import POS, PositionalEncoding
from xfam.pos.learned import check_in_table


@POS.register("learned_per_layer")
class LearnedPerLayer(PositionalEncoding):
    """One learned table of ``max_len`` position vectors per layer, added to that layer's input.

    Args:
        dim: model width (injected).
        max_len: positions in each table (injected from ``model.max_len``).
        num_layers: tables, one per layer or step (injected from ``model.layers``).
    """

    paper = "Al-Rfou et al., 2018, arXiv:1808.04444"

    kind = "input"
    bounded = True

    def __init__(self, *, dim: int, max_len: int, num_layers: int):
        super().__init__()
        self.tables = TypedModuleList(nn.Embedding(max_len, dim) for _ in range(num_layers))  # L x [max_len, D]
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.02)

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        if selection.reversible:
            return [
                "pos=learned_per_layer adds a table to every layer's input, and model.reversible=true runs the stack "
                "as one recomputed pass of two streams that takes no per-layer input. "
                "Fix: model.reversible=false, or pos=learned (one table, below the first layer)."
            ]
        return []

    def layer_embedding(self, positions: Tensor, layer: int) -> Tensor:
        """``[S, D]``: layer ``layer``'s vectors of ``positions [S]``."""
        table = self.tables[layer]
        if layer == 0:  # (every call runs step 0 first, on the same positions: one check per call)
            check_in_table(positions, table.num_embeddings, "pos=learned_per_layer", "tables")
        return table(positions)
