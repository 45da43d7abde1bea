"""The attention x pos compatibility matrix, generated from the registries: every registered ``xfam.`` attention
mechanism with every positional encoding, in a causal language model and in a bidirectional classifier, either
refused with reasons consistent with ``xfam.model.compat.matrix()`` or built and trained one step
(``xfam.testing.matrix``: the contract a component author's mechanism or encoding runs against xfam's own).
"""

from __future__ import annotations

from doubles import xfam_components

from xfam.attention import ATTENTION
from xfam.testing import contract_tests

TestMatrix = contract_tests("attention", xfam_components(ATTENTION), parts=["matrix"])
