"""Logging helpers: rank-zero aware, and 'once' for choices made on a hot path."""

from __future__ import annotations

import logging

log = logging.getLogger("xfam")
_seen: set[str] = set()


def log_once(msg: str, level: int = logging.INFO) -> None:
    """Log ``msg`` the first time it is seen in this process (backend choices, fallbacks)."""
    if msg not in _seen:
        _seen.add(msg)
        log.log(level, msg)
