"""The ``exit`` slot: how depth is traversed. Importing this package registers every policy."""

from xfam.exit import act, calm, depth_adaptive, none  # noqa: F401  (registration)
from xfam.exit._base import EXIT, EarlyExitPolicy, ExitOutput, ExitPolicy

__all__ = ["EXIT", "EarlyExitPolicy", "ExitOutput", "ExitPolicy"]
