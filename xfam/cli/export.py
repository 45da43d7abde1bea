"""``xfam export``: a training checkpoint to a model folder without pickle, in Hugging Face's layout
(``xfam.model.export``): ``model.safetensors``, ``config.json``, the tokenizer's ``tokenizer.json`` and a model card
(``README.md``). The folder loads with ``xfam.load_model(DIR)`` and is what ``ckpt=DIR`` of ``xfam eval``,
``generate``, ``calibrate``, ``knnlm`` and ``rollout`` take; uploading it is the user's step (docs/export.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xfam.cli.grammar import Args
from xfam.model.exported import FILES


def run(args: Args) -> dict[str, Any]:
    """Export ``args.ckpt`` into ``args.out`` and print what was written and how to use it."""
    from xfam.model.export import export

    config = export(args.ckpt, args.out, force=args.force)
    out = Path(args.out)
    files = [f"{name} ({(out / name).stat().st_size / 2**20:.2f} MB)" for name in FILES if (out / name).is_file()]
    weights = config["weights"]
    shared = f", {len(weights['aliases'])} shared tensors stored once" if weights["aliases"] else ""
    print(f"{args.ckpt} (step {config['step']}) -> {out}{shared}:")
    for line in files:
        print(f"  {line}")
    print(f"load it with xfam.load_model({str(out)!r}), or: xfam eval ckpt={out} / xfam generate ckpt={out}")
    return config
