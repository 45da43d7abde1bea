"""``xfam eval``: a checkpoint's metrics on a split of its data, without Lightning or Hydra.

The loop is the library's (``xfam.eval.loop``); this prints its report. For an early-exit model
(``exit=calm``, ``exit=depth_adaptive``) the report adds the full model's metrics (``{split}/full/...``),
``{split}/agreement``, the wall-clock time of both passes and the saving's ratio to the layer saving
(``xfam.eval.inference``); ``exit.KEY=VALUE`` words change the policy's inference options first.
``seq_len=N`` evaluates at another length (the checkpoint's data rebuilt with ``data.seq_len=N``: length
extrapolation, Press et al., 2022, arXiv:2108.12409) and ``mem_len=M`` with another memory length; the
report's first line names the lengths used."""

from __future__ import annotations

from xfam.cli.grammar import Args
from xfam.eval.loop import Evaluation, evaluate_split


def run(args: Args) -> dict[str, float]:
    """Evaluate ``args.ckpt`` on ``args.split`` and print ``<ckpt> on <split> (...)`` and one line per metric."""
    result = evaluate_split(
        args.ckpt,
        args.split,
        args.batch_size,
        args.limit,
        args.device,
        args.overrides,
        seq_len=args.seq_len,
        mem_len=args.mem_len,
    )
    where = f" with {' '.join(args.overrides)}" if args.overrides else ""
    print(f"{args.ckpt} on {args.split} ({result.batches} batches of {result.batch_size}{lengths(result)}){where}:")
    for k, v in result.metrics.items():
        print(f"  {k:<24} {v:.4f}")
    if line := wall_clock(result.metrics, args.split):
        print(line)
    return result.metrics


def wall_clock(metrics: dict[str, float], split: str) -> str | None:
    """The early-exit pass's wall-clock saving beside its layer saving (None when the passes were not timed)."""
    if f"{split}/wall_saved" not in metrics:
        return None
    layers, wall = metrics.get(f"{split}/compute_saved", 0.0), metrics[f"{split}/wall_saved"]
    secs, full = metrics[f"{split}/seconds"], metrics[f"{split}/full/seconds"]
    ratio = f": {wall / layers:.2f} of the layer saving" if layers > 0 else ""
    return (
        f"early exit saved {layers:.1%} of the layer applications and {wall:.1%} of the wall-clock time "
        f"({secs:.2f} s against {full:.2f} s at full depth, batches after the first){ratio}"
    )


def lengths(result: Evaluation) -> str:
    """``, seq_len=N (trained S), memory: xl eval_mem_len=M (trained T) in layers 0-1`` (the trained value
    only where it differs; nothing for data without a row length)."""
    if result.seq_len is None:
        return ""
    out = f", seq_len={result.seq_len}"
    if result.seq_len != result.trained_seq_len:
        out += f" (trained {result.trained_seq_len})"
    groups: dict[tuple[str, str, int, int], list[int]] = {}
    for m in result.memory:
        groups.setdefault((m.name, m.key, m.value, m.trained), []).append(m.layer)
    parts = [_memory(*key, layers) for key, layers in groups.items()]
    return out + (f", memory: {'; '.join(parts)}" if parts else "")


def _memory(name: str, key: str, value: int, trained: int, layers: list[int]) -> str:
    where = f"layer {layers[0]}" if len(layers) == 1 else f"layers {','.join(map(str, layers))}"
    return f"{name} {key}={value}{f' (trained {trained})' if value != trained else ''} in {where}"
