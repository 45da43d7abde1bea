"""No positional information: attention is permutation-equivariant (a baseline; causal masking
alone still lets a decoder infer order, as observed by Haviv et al., 2022)."""

from __future__ import annotations

from xfam.pos._base import POS, PositionalEncoding


@POS.register("none")
class NoPos(PositionalEncoding):
    """Adds nothing; every hook is the identity."""

    paper = "Haviv et al., 2022, arXiv:2203.16634 (NoPos LMs)"

    kind = "none"
    relative = True

    def __init__(self) -> None:
        super().__init__()
