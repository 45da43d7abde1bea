"""Draw docs/concepts.png: how a config becomes a model, and how the four slots meet in the forward pass.

    python scripts/draw_concepts.py                  # writes docs/concepts.png
    python scripts/draw_concepts.py --out /tmp/c.png --dpi 200

The figure is drawn from this file alone (boxes and arrows in matplotlib), so it stays in step with
docs/concepts.md by editing both; nothing is measured and nothing is imported from xfam.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "concepts.png"

#: Fill colours: configuration, model steps, the slots, the training wrapper.
CONFIG, STEP, SLOT, FRAME = "#dbe9f6", "#eeeeee", "#fde9c9", "#f4f9ef"
SLOT_EDGE, EDGE = "#c77c02", "#555555"


def box(ax, x, y, w, h, title, body="", *, fill=STEP, edge=EDGE, size=11, lw=1.2, round_=0.08):
    """A rounded box whose lower-left corner is (x, y); a bold title and smaller lines under it."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=f"round,pad=0,rounding_size={round_}", fc=fill, ec=edge, lw=lw))
    if body:
        ax.text(x + w / 2, y + h - 0.2, title, ha="center", va="top", fontsize=size, fontweight="bold")
        ax.text(x + w / 2, y + h - 0.62, body, ha="center", va="top", fontsize=size - 1.8, linespacing=1.3)
    else:
        ax.text(x + w / 2, y + h / 2, title, ha="center", va="center", fontsize=size, fontweight="bold")


def arrow(ax, start, end, label="", *, color=EDGE, rad=0.0, dx=0.0, dy=0.1, size=9, ha="center", style="-|>"):
    """An arrow from ``start`` to ``end``, labelled at its middle (offset by ``dx``, ``dy``)."""
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle=style, mutation_scale=14, color=color, lw=1.4, connectionstyle=f"arc3,rad={rad}"
        )
    )
    if label:
        mx, my = (start[0] + end[0]) / 2 + dx, (start[1] + end[1]) / 2 + dy
        ax.text(mx, my, label, ha=ha, va="bottom", fontsize=size, color="#333333", style="italic")


def draw(out: Path, dpi: int) -> None:
    # 16 x 10 data units on 12 x 7.5 inches: the text stays readable when the page shows the figure ~700 px wide.
    fig, ax = plt.subplots(figsize=(12, 7.5))
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 10)
    ax.axis("off")

    # --- before anything runs: config -> validate -> build_model ---------------------------------------------
    top = 8.6
    box(ax, 0.3, top, 3.7, 1.2, "config", "configs/ + your overrides", fill=CONFIG)
    box(ax, 5.0, top, 4.3, 1.2, "validate", "RunConfig, or one error;\ncompatibility check", fill=CONFIG)
    box(ax, 10.3, top, 5.4, 1.2, "build_model", "one component per slot\nfrom the registries", fill=CONFIG)
    arrow(ax, (4.0, top + 0.6), (5.0, top + 0.6))
    arrow(ax, (9.3, top + 0.6), (10.3, top + 0.6))

    # --- the Lightning module around the model ---------------------------------------------------------------
    frame = FancyBboxPatch(
        (0.15, 0.15), 15.7, 7.95, boxstyle="round,pad=0,rounding_size=0.15", fc=FRAME, ec="#6a9a4a", lw=1.5, ls="--"
    )
    ax.add_patch(frame)
    ax.text(
        0.4,
        7.9,
        "Lightning module: training step, optimizer, checkpoints, logs",
        fontsize=11.5,
        fontweight="bold",
        color="#3d6b22",
        va="top",
    )
    arrow(ax, (11.2, top), (11.2, 7.35), "the model", dx=0.12, dy=-0.1, ha="left")

    # data module -> embed -> plan
    box(ax, 0.4, 5.25, 2.7, 1.6, "data", "datasets: shards,\nrows, streams", fill=FRAME, edge="#6a9a4a")
    box(ax, 0.4, 3.05, 2.7, 1.3, "embed", "tokens -> [B,S,D]")
    box(ax, 0.4, 0.9, 2.7, 1.4, "plan", "positions, padding,\ndocuments")
    arrow(ax, (1.75, 5.25), (1.75, 4.35), "batch", dx=0.1, dy=-0.1, ha="left")
    arrow(ax, (1.75, 3.05), (1.75, 2.3))

    # --- the exit policy and the layer stack ------------------------------------------------------------------
    ex, ey, ew, eh = 3.6, 0.45, 8.7, 6.95
    box(ax, ex, ey, ew, eh, "", fill="#fff8ec", edge=SLOT_EDGE, lw=1.8, round_=0.15)
    ax.text(ex + 0.2, ey + eh - 0.15, "exit policy traverses the stack", fontsize=12.5, fontweight="bold", va="top")
    ax.text(
        ex + 0.2,
        ey + eh - 0.6,
        "none | act | calm | depth_adaptive: which layers run for which tokens",
        fontsize=9.5,
        va="top",
        color="#444444",
    )
    arrow(ax, (3.1, 1.6), (ex, 1.6))

    # stacked blocks: layers 1..L behind the detailed one
    bx, by, bw, bh = 5.85, 0.95, 4.35, 4.75
    for k in (2, 1):
        shadow = FancyBboxPatch(
            (bx + 0.18 * k, by + 0.18 * k),
            bw,
            bh,
            boxstyle="round,pad=0,rounding_size=0.08",
            fc="#f3f3f3",
            ec="#999999",
            lw=1,
        )
        ax.add_patch(shadow)
    ax.add_patch(
        FancyBboxPatch((bx, by), bw, bh, boxstyle="round,pad=0,rounding_size=0.08", fc="white", ec=EDGE, lw=1.3)
    )
    ax.text(bx + bw + 0.35, by + bh + 0.45, "layers 1 .. L", fontsize=9.5, color="#666666", ha="right")
    ax.text(bx + 0.15, by + bh - 0.15, "block: run_layer(step, x)", fontsize=10.5, fontweight="bold", va="top")
    box(ax, bx + 0.3, by + 3.45, bw - 0.6, 0.7, "norm, q / k / v", size=10)
    box(ax, bx + 0.3, by + 1.7, bw - 0.6, 1.35, "attention", "q, k, v -> [B,H,S,Dh]", fill=SLOT, edge=SLOT_EDGE)
    box(ax, bx + 0.3, by + 0.2, bw - 0.6, 1.1, "out, FFN, residuals", size=10)
    arrow(ax, (bx + bw / 2, by + 3.45), (bx + bw / 2, by + 3.05))
    arrow(ax, (bx + bw / 2, by + 1.7), (bx + bw / 2, by + 1.3))

    # pos: bias / rotation into the mechanism
    box(ax, 3.85, 2.5, 1.75, 1.95, "pos", "rotate q, k;\nor bias\nthe scores", fill=SLOT, edge=SLOT_EDGE)
    arrow(ax, (5.6, 3.45), (bx + 0.3, by + 2.35))

    # memory: read before, write after
    mx = 10.45
    box(ax, mx, 2.5, 1.65, 2.2, "memory", "state in,\nstate out", fill=SLOT, edge=SLOT_EDGE)
    arrow(ax, (mx, 3.75), (bx + bw - 0.3, by + 2.45))
    ax.text(mx + 0.82, 4.85, "read: keys\nin front", ha="center", fontsize=9, style="italic", color="#333333")
    arrow(ax, (bx + bw, by + 0.7), (mx + 0.5, 2.5), "write", rad=0.3, dx=0.45, dy=-0.3)

    # exits to the head
    arrow(ax, (ex + ew, 1.6), (12.95, 1.6))
    box(ax, 12.95, 0.9, 2.75, 1.4, "head", "final norm,\noutput layer")
    box(ax, 12.95, 3.3, 2.75, 1.8, "loss", "cross-entropy\n+ aux losses", fill=FRAME, edge="#6a9a4a")
    arrow(ax, (14.3, 2.3), (14.3, 3.3))
    arrow(ax, (ex + ew - 0.2, ey + eh - 1.0), (12.95, 4.85), "aux", rad=-0.15, dy=0.1)

    # legend
    legend = (
        (CONFIG, EDGE, "before anything runs"),
        (SLOT, SLOT_EDGE, "a slot"),
        (STEP, EDGE, "the model's steps"),
        (FRAME, "#6a9a4a", "Lightning and data"),
    )
    for i, (fill, edge, text) in enumerate(legend):
        y = 6.75 - 0.42 * i
        ax.add_patch(
            FancyBboxPatch((12.95, y), 0.32, 0.25, boxstyle="round,pad=0,rounding_size=0.03", fc=fill, ec=edge)
        )
        ax.text(13.4, y + 0.12, text, fontsize=9.5, va="center")

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT, help=f"the PNG to write (default: {OUT})")
    parser.add_argument("--dpi", type=int, default=130, help="resolution (default: 130)")
    args = parser.parse_args()
    draw(args.out, args.dpi)


if __name__ == "__main__":
    main()
