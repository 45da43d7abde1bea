"""The ``data`` slot: Hugging Face ``datasets`` sources. Importing this package registers every one."""

from xfam.data import (  # noqa: F401  (registration)
    assoc_recall,
    digits,
    docstrings,
    duplication,
    far_recall,
    hf,
    images,
    listops,
    parity,
    pytokens,
    repeat_segments,
    seq2seq_toy,
    text,
    timeseries,
    trajectories,
)
from xfam.data.base import DATA, DataSource

__all__ = ["DATA", "DataSource"]
