"""The positional contract, for every registered ``xfam.`` encoding, in a full model.

The contracts are the kit's (``xfam.testing.pos``, ``backends``, ``yaml_defaults``), the same functions a
component author runs with ``contract_tests("pos", "<name>")``; a new encoding of xfam gets them by registering.
Its pairs with every attention mechanism are test_attention_pos_matrix.py's.
"""

from __future__ import annotations

import pytest
from doubles import xfam_components

from xfam.pos import POS
from xfam.testing import contract_tests
from xfam.testing import pos as pos_contract

TestPos = contract_tests("pos", xfam_components(POS), parts=["pos", "backends", "yaml_defaults"])


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_sdpa_path_equals_reference_path_with_the_toy_bias(task):
    """The fast path with an arbitrary-looking bias, b = -scale (h + 1) (i - j)^2 (``toy_bias``)."""
    pos_contract.test_sdpa_path_equals_reference_path("toy_bias", {}, task)
