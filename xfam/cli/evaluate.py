"""``xfam eval``: a checkpoint's metrics on a split of its data, without Lightning or Hydra.

The loop is the library's (``xfam.eval.loop``); this prints its report. For an early-exit model
(``exit=calm``, ``exit=depth_adaptive``) the report adds the full model's metrics (``{split}/full/...``)
and ``{split}/agreement``; ``exit.KEY=VALUE`` words change the policy's inference options first."""

from __future__ import annotations

from xfam.cli.grammar import Args
from xfam.eval.loop import evaluate_split


def run(args: Args) -> dict[str, float]:
    """Evaluate ``args.ckpt`` on ``args.split`` and print ``<ckpt> on <split> (...)`` and one line per metric."""
    result = evaluate_split(args.ckpt, args.split, args.batch_size, args.limit, args.device, args.overrides)
    where = f" with {' '.join(args.overrides)}" if args.overrides else ""
    print(f"{args.ckpt} on {args.split} ({result.batches} batches of {result.batch_size}){where}:")
    for k, v in result.metrics.items():
        print(f"  {k:<24} {v:.4f}")
    return result.metrics
