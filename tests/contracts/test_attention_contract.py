"""The attention contract, for every registered ``xfam.`` mechanism (and each of its backends).

The contracts are the kit's (``xfam.testing``: ``attention`` for the mechanism alone, ``decode`` and
``aux_losses`` in a model, ``backends`` for every fast path against the reference, ``yaml_defaults``), the same
functions a component author runs with ``contract_tests("attention", "<name>")``; a new mechanism of xfam gets
them by registering. Its pairs with every positional encoding are test_attention_pos_matrix.py's.
"""

from __future__ import annotations

from doubles import xfam_components

from xfam.attention import ATTENTION
from xfam.testing import contract_tests

# Their bidirectional layouts are cut over the padded width (as the papers' code, which pads every input to one
# fixed length): BlockBERT's blocks are k_len / n_blocks long, BigBird's last global blocks are the last blocks.
WIDTH_DEPENDENT = {
    f"test_right_padding_leaves_the_real_tokens_unchanged[{name}-*-bidir]": "layout cut over the padded width "
    "(docs/attention.md)"
    for name in ("blockwise", "bigbird")
}

TestAttention = contract_tests(
    "attention",
    xfam_components(ATTENTION),
    parts=["attention", "decode", "aux_losses", "backends", "yaml_defaults"],
    xfail=WIDTH_DEPENDENT,
)
