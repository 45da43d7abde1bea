"""The benchmark shape, the systems and FLOP counting, shared by workers and the parent."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

SYSTEMS = ("minimal", "xtransformers", "xtransformers_flash", "xfam", "xfam_lightning")
POS = ("learned", "rope", "alibi")
LABELS = {
    "minimal": "minimal (plain PyTorch)",
    "xtransformers": "x-transformers (default)",
    "xtransformers_flash": "x-transformers (attn_flash)",
    "xfam": "xfam (plain loop)",
    "xfam_lightning": "xfam (Lightning)",
}

# The benchmark shape and the optimiser settings shared by every system.
VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH = 256, 256, 4, 4, 256, 8
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1
MATMUL_N = 2048
#: Everything after this line of the markdown report is hand-written and kept when it is rewritten.
NOTES_MARKER = "<!-- hand-written notes: everything below this line is kept when bench_train.py rewrites the file -->"
ROOT = Path(__file__).resolve().parents[2]  # the repository


def flops_per_step() -> dict[str, float]:
    """Model FLOPs of one training step (forward + backward = 3x forward; a multiply-add = 2 FLOPs).

    Dense: 6 * N_matmul * tokens, N_matmul = L * 12 D^2 (q/k/v, output, FFN 4x) + D * V (head);
    embedding lookups, norms, softmax and the optimizer are not counted. Attention: scores q k^T
    and probs @ v, 2 * 2 * S * D per token and layer forward, counted over the full S x S square
    (not halved for the causal mask), times 3 for training: 12 * L * S * D per token.
    """
    tokens = BATCH * SEQ
    n_matmul = LAYERS * 12 * DIM * DIM + DIM * VOCAB
    dense = 6 * n_matmul * tokens
    attention = 12 * LAYERS * SEQ * DIM * tokens
    return {"n_matmul": n_matmul, "dense": dense, "attention": attention, "total": dense + attention}


def cpu_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, summed over cores (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = v[3] + v[4]  # idle + iowait
    return (sum(v[:8]) - idle) / hz, sum(v[:8]) / hz


def write_section(path: Path, start: str, end: str, body: str, new_file: str = "", new_heading: str = "") -> None:
    """Replace what stands between the ``start`` and ``end`` markers of ``path`` with ``body``; without
    markers, append them (after ``new_heading``); a missing file starts as ``new_file``."""
    text = path.read_text() if path.exists() else new_file
    block = f"{start}\n{body}\n{end}"
    if start in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + (f"{new_heading}\n\n" if new_heading else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.lstrip("\n"))


def write_report(
    md: Path, png: Path, markers: tuple[str, str], heading: str, chart: Callable[[Path], None], section: str
) -> None:
    """A benchmark's chart (``chart(png)``) and its generated ``section`` of ``md`` between ``markers`` (the rest of
    the file is kept). A new section goes after bench_train.py's notes marker, so rewriting the training report
    keeps it."""
    png.parent.mkdir(parents=True, exist_ok=True)
    chart(png)
    text = md.read_text() if md.exists() else ""
    heading = heading if NOTES_MARKER in text else f"{NOTES_MARKER}\n\n{heading}"
    write_section(md, *markers, section, new_heading=heading)
