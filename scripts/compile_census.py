#!/usr/bin/env python
"""Graph-break census: ``torch._dynamo.explain`` on the training forward of every registered component.

One model per component of every slot (the other slots at their defaults: attention=vanilla, pos=rope,
memory=none, exit=none), tiny sizes (width 32, 2 layers, 2 heads, batch 2 x 32 tokens), on CPU, in training
mode, called as ``trainer.compile`` calls it (``XfamModel(ids, memory=..., targets=...)``). A memory is explained
on its second segment, with the first segment's state carried in, which is the call every later step makes.
Where a component's own defaults are refused with the defaults of the other slots, the census uses the
settings its config file names (``FIXES``), and says so.

Writes the table between markers of docs/compile.md (the rest of the page is kept), or prints it (``--print``):

    python scripts/compile_census.py            # ~2 min on 2 CPU cores
    python scripts/compile_census.py --print --only attention=local pos=t5
"""

from __future__ import annotations

import argparse
import copy
import datetime
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib.common import write_section  # noqa: E402

MARKERS = ("<!-- census:start -->", "<!-- census:end -->")
TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.max_len=64", "data.seq_len=32"]
BATCH, SEQ, VOCAB = 2, 32, 64
#: Settings a component needs with the other slots at their defaults (what its own config file says it needs).
FIXES = {
    ("attention", "bigbird"): ["attention.block=8", "attention.window_blocks=1"],
    ("attention", "etc"): ["task=mlm", "attention.radius=16"],
    ("attention", "fixed"): ["attention.stride=16"],
    ("attention", "linformer"): ["task=mlm", "attention.k=16"],
    ("attention", "local"): ["attention.window=16"],
    ("attention", "local2d"): ["model.max_len=32", "attention.shape=[4,8]", "attention.query_block=[2,4]"],
    ("attention", "longformer"): ["attention.window=16"],
    ("attention", "routing"): ["attention.window=16"],
    ("attention", "strided"): ["attention.stride=16"],
    ("attention", "blockwise"): ["task=mlm"],
    ("memory", "xl"): ["loader.streams=true"],
    ("memory", "compressive"): ["loader.streams=true"],
    ("memory", "memorizing"): ["loader.streams=true"],
    ("memory", "spalm"): ["loader.streams=true"],
}
#: Why each kind of break happens (a pattern of dynamo's reason -> one line). A reason no pattern matches is
#: reported as "(not yet classified)".
WHY = [
    (
        r"item\(\)|tolist|scalar_outputs",
        "a tensor's value read back to Python on the host (`.item()`, `int(t)`, "
        "`.tolist()`): dynamo cannot keep a value it needs for Python control flow or sizes in the graph",
    ),
    (
        r"(?i)dynamic shape operator|data dependent operator|nonzero",
        "an op whose output shape depends on the "
        "data (boolean indexing, nonzero, unique): its size is unknown while tracing",
    ),
    (r"(?i)data-dependent branching|generic_jump", "Python control flow on a tensor's value (`if t.any():`)"),
    (r"Logger|logging", "a log call in the forward"),
    (r"(?i)warn", "a warnings.warn call in the forward"),
    (r"non-contiguous `out=`", "an op writing into a non-contiguous `out=` view"),
    (r"(?i)autograd.Function", "a custom autograd.Function dynamo cannot trace"),
    (r"(?i)triton", "a Triton kernel launched outside a registered custom op"),
]


def compose(overrides: list[str]) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from xfam.training.run_names import CONFIG_DIR, register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides)
    GlobalHydra.instance().clear()
    return copy.deepcopy(OmegaConf.to_container(cfg, resolve=True))


def why(reason: str) -> str:
    for pattern, text in WHY:
        if re.search(pattern, reason):
            return text
    return "(not yet classified)"


def explain(slot: str, name: str) -> dict[str, Any]:
    """The census row of one component: graphs, breaks and the distinct break reasons (with where)."""
    import torch

    from xfam.config import validate
    from xfam.core.errors import ConfigError
    from xfam.model.build import build_model

    fixes = FIXES.get((slot, name), [])
    try:
        rc = validate(compose([*TINY, f"{slot}={name}", *fixes]))
    except ConfigError as err:
        return {"slot": slot, "name": name, "error": "refused with the defaults: " + str(err).splitlines()[0][:160]}
    torch.manual_seed(0)
    model = build_model(rc, {"task": "lm", "vocab_size": VOCAB, "num_classes": None, "token_bytes": None})
    model.train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    memory = None
    if model.uses_memory:  # the steady state: the second segment, the first one's memory carried in
        memory = model(x, targets=y).memory
    torch._dynamo.reset()
    try:
        out = torch._dynamo.explain(model)(x, memory=memory, targets=y)
    except Exception as err:  # noqa: BLE001 (a component dynamo cannot trace at all is a census row too)
        return {"slot": slot, "name": name, "error": f"explain failed: {type(err).__name__}: {str(err)[:160]}"}
    reasons: Counter[str] = Counter()
    for r in out.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        where = (
            f"{Path(frame.filename).relative_to(ROOT)}:{frame.lineno}" if frame and str(ROOT) in frame.filename else ""
        )
        reasons[(first_line(r.reason), where)] += 1
    return {
        "slot": slot,
        "name": name,
        "fixes": fixes,
        "graphs": out.graph_count,
        "breaks": out.graph_break_count,
        "reasons": [{"reason": k[0], "where": k[1], "count": n} for k, n in reasons.items()],
    }


def first_line(reason: str) -> str:
    line = reason.strip().splitlines()[0] if reason.strip() else "?"
    return line[:200]


def render(rows: list[dict[str, Any]]) -> str:
    import torch

    head = [
        f"Generated by `python scripts/compile_census.py` on {datetime.date.today().isoformat()} (torch "
        f"{torch.__version__}, CPU): `torch._dynamo.explain` of the training forward, one model per component, "
        "the other slots at their defaults, width 32, 2 layers, 2 heads, batch 2 x 32. A graph count of 1 and no "
        "break: the whole forward compiles to one graph.",
        "",
        "| component | graphs | breaks | break reasons (where) | why |",
        "|---|---|---|---|---|",
    ]
    lines = []
    for r in rows:
        comp = f"`{r['slot']}={r['name']}`" + (f" ({' '.join(r['fixes'])})" if r.get("fixes") else "")
        if "error" in r:
            lines.append(f"| {comp} | - | - | {escape(r['error'])} | |")
            continue
        reasons = r["reasons"] or [{"reason": "", "where": "", "count": 0}]
        for i, x in enumerate(reasons):
            text = f"{escape(x['reason'])}" + (f" (`{x['where']}`)" if x["where"] else "") if x["count"] else ""
            text += f" x{x['count']}" if x["count"] > 1 else ""
            first = (comp, str(r["graphs"]), str(r["breaks"])) if i == 0 else ("", "", "")
            lines.append(f"| {' | '.join(first)} | {text} | {why(x['reason']) if x['count'] else ''} |")
    return "\n".join(head + lines)


def escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--md", type=Path, default=ROOT / "docs/compile.md", help="the page to write the table into")
    p.add_argument("--print", action="store_true", help="print the table instead of writing it")
    p.add_argument("--only", nargs="*", default=None, help="slot=name pairs to explain (default: every component)")
    args = p.parse_args(argv)

    import torch

    from xfam.config.slots import SLOTS
    from xfam.training.lit.compile import dynamo_settings

    torch.set_num_threads(2)
    dynamo_settings()  # as trainer.compile has them
    pairs = (
        [tuple(x.split("=", 1)) for x in args.only]
        if args.only
        else [(slot, name) for slot, registry in SLOTS.items() for name in registry.names()]
    )
    rows = []
    for slot, name in pairs:
        row = explain(slot, name)
        rows.append(row)
        print(
            f"{slot}={name}: "
            + (row["error"] if "error" in row else f"{row['graphs']} graphs, {row['breaks']} breaks"),
            flush=True,
        )
    table = render(rows)
    if args.print:
        print(table)
    else:
        write_section(args.md, *MARKERS, table, new_file="# Compiled training\n", new_heading="## Graph-break census")
        print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
