"""``xfam calibrate``: choose an early-exit model's threshold on held-out data.

``method=ltt`` (CALM, sec. 4): the per-example loss is the share of an example's predictions whose
top-1 differs from the full-depth model's; the candidates are tested from the most conservative down
with Hoeffding-Bentkus p-values (fixed-sequence testing), and the smallest threshold reached is chosen:
with probability >= 1 - epsilon its expected disagreement is <= delta. ``method=grid`` (Elbayad et
al.): the candidate with the lowest average depth whose loss stays within ``tolerance`` of full depth.
"""

from __future__ import annotations

from typing import Any

import torch
from rich.progress import track

from xfam.cli.grammar import Args
from xfam.core.errors import ConfigError
from xfam.eval.calibrate import grid_threshold, hoeffding_bentkus_pvalue, ltt_threshold
from xfam.eval.inference import compares_full_depth, set_exit_options, threshold_sweep
from xfam.eval.loop import split_loader
from xfam.model.checkpoint import load_model
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.transformer import XfamModel

#: Default candidates, most conservative first (confidences near 1 exit least; saturation is a cosine).
GRIDS = {
    "saturation": [0.9999, 0.9995, 0.999, 0.998, 0.995, 0.99, 0.98, 0.95, 0.9, 0.8],
    "default": [0.99, 0.98, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1],
}


def candidates(policy: Any, given: list[float]) -> list[float]:
    """The thresholds to try: ``given`` sorted most conservative first, or the default grid when empty."""
    if given:
        return sorted(given, reverse=True)
    return GRIDS["saturation" if getattr(policy, "measure", None) == "saturation" else "default"]


@torch.no_grad()
def calibrate(args: Args) -> dict[str, Any]:
    model, meta = load_model(args.ckpt, args.device)
    assert isinstance(model, XfamModel | EncoderDecoder)  # (what build_model builds)
    if not compares_full_depth(model):
        raise ConfigError(
            f"{args.ckpt} was trained with exit={meta['config']['exit']['name']}, which has no exit threshold. "
            f"Fix: calibrate a model trained with exit=calm or exit=depth_adaptive."
        )
    if not (0 < args.delta < 1 and 0 < args.epsilon < 1):
        raise ConfigError(f"delta={args.delta}, epsilon={args.epsilon}: both must lie in (0, 1). Fix: e.g. delta=0.1.")
    config = set_exit_options(model, meta["config"], args.overrides)
    info = meta["data_info"]
    thresholds = candidates(model.exit, args.thresholds)
    loader, _ = split_loader(config, info, args.split, args.batch_size)
    total = min(len(loader), args.limit) if args.limit else len(loader)
    batches = []
    for i, batch in enumerate(track(loader, total=total, description=f"loading {args.split}", transient=True)):
        if i == total:
            break
        batches.append({k: v.to(args.device) for k, v in batch.items()})
    token_bytes = torch.tensor(info["token_bytes"], device=args.device) if info.get("token_bytes") else None
    sweep = threshold_sweep(model, batches, info["task"], thresholds, token_bytes)
    risk = sweep["risk"]  # [n, K]
    n = risk.shape[0]
    if args.method == "ltt":
        chosen = ltt_threshold(risk, thresholds, args.delta, args.epsilon)
    else:
        chosen = grid_threshold(sweep["loss"], sweep["depth"], sweep["full_loss"], args.tolerance)
    print(f"{args.ckpt} on {args.split}: {n} examples, full-depth loss {sweep['full_loss']:.4f}")
    print(f"{'threshold':>10} {'depth':>7} {'saved':>7} {'loss':>8} {'disagree':>9} {'p-value':>9}")
    for k, t in enumerate(thresholds):
        mean = float(risk[:, k].mean())
        p = hoeffding_bentkus_pvalue(mean, n, args.delta)
        depth, loss = sweep["depth"][k], sweep["loss"][k]
        saved, mark = 1 - depth / model.num_layers, "  <- chosen" if k == chosen else ""
        print(f"{t:>10.4f} {depth:>7.2f} {saved:>7.1%} {loss:>8.4f} {mean:>9.4f} {p:>9.2e}{mark}")
    if chosen is None:
        rule = "disagreement <= delta with confidence 1 - epsilon" if args.method == "ltt" else "the loss tolerance"
        print(
            f"no candidate passes ({rule}): keep exits disabled (exit.threshold above 1), or allow more (a larger "
            f"delta or tolerance), use more data, or give more conservative candidates."
        )
    else:
        best = thresholds[chosen]
        print(f"chosen: exit.threshold={best}  (use: xfam eval --ckpt {args.ckpt} exit.threshold={best})")
    return {**sweep, "chosen": chosen}
