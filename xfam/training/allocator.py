"""Host memory allocator settings for CPU training.

CPU attention works on large temporaries (scores, probabilities and their gradients: ~100 MB each
for a 512-window at L = 8192). glibc's malloc serves such blocks with ``mmap`` and gives them back
on ``free``, or trims its heap as soon as the top is free, so every step faults the same pages in
again: measured on a 2-core AMD EPYC CPU, a 512-window local attention's forward and
backward at L = 8192 spent ~40% of its time there (303 ms -> 180 ms when freed memory is kept).
PyTorch's CPU tuning guide suggests jemalloc or tcmalloc for the same reason; this does it without
a preloaded library: glibc keeps freed memory for reuse (no ``mmap`` for large blocks, no trimming).
The resident size then stays at the step's peak instead of going up and down within a step.

``train.py`` calls ``keep_freed_memory`` once per job; set ``XFAM_KEEP_FREED_MEMORY=0`` to leave
the allocator alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_DONE: list[str] = []


def keep_freed_memory() -> str:
    """Make glibc keep freed memory for reuse; returns a sentence saying what was done (for the log)."""
    if _DONE:
        return _DONE[0]
    if os.environ.get("XFAM_KEEP_FREED_MEMORY", "1") == "0":
        note = "allocator: left as is (XFAM_KEEP_FREED_MEMORY=0)"
    elif platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        note = "allocator: left as is (not glibc)"
    else:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
        note = (
            "allocator: glibc keeps freed memory for reuse (no page faults on every large temporary; "
            "XFAM_KEEP_FREED_MEMORY=0 disables)"
            if ok
            else "allocator: left as is (mallopt refused)"
        )
    _DONE.append(note)
    return note
