"""The ``data`` slot: Hugging Face ``datasets`` sources. Importing this package registers every one."""

from xfam.data import assoc_recall, duplication, hf, listops, parity, text  # noqa: F401  (registration)
from xfam.data.base import DATA, DataSource

__all__ = ["DATA", "DataSource"]
