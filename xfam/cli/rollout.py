"""``xfam rollout``: a Decision Transformer checkpoint acting in its environment, conditioned on target returns
(``xfam.eval.rollout``): per target, the mean and spread of the returns over seeded episodes and, where the data
has reference returns, the normalised score (random behaviour 0, expert 100)."""

from __future__ import annotations

import json
from pathlib import Path

from xfam.cli.grammar import Args
from xfam.core.errors import ConfigError
from xfam.eval.rollout import normalised, rollout, targets_of
from xfam.model.checkpoint import load_model
from xfam.model.transformer import XfamModel


def run(args: Args) -> list[dict]:
    """Run ``args.episodes`` episodes per target return and print one line per target (and write ``out``)."""
    model, meta = load_model(args.ckpt, args.device)
    info = meta["data_info"]
    decision = info.get("decision")
    if info["task"] != "decision" or not decision:
        raise ConfigError(
            [
                f"ckpt={args.ckpt!r} is a {info['task']} model; rollouts act with a Decision Transformer "
                f"(task=decision, trained on data=gym). Fix: a checkpoint of such a run; `xfam eval` for this one."
            ]
        )
    if not decision.get("env"):
        raise ConfigError(
            [
                f"ckpt={args.ckpt!r} was trained on trajectories from a folder with no environment (data.env=null): "
                f"there is nothing to act in. Fix: train with data.env=<the environment of the trajectories>."
            ]
        )
    assert isinstance(model, XfamModel)  # (a decision model)
    reference = decision.get("reference_returns")
    rows = []
    print(f"{args.ckpt}: {args.episodes} episodes of {decision['env']} per target (seeds {args.seed}..)")
    for target in targets_of(decision, args.target_return):
        res = rollout(
            model,
            decision,
            target,
            episodes=args.episodes,
            seed=args.seed,
            max_steps=args.max_steps,
            sample=args.sample,
        )
        score = normalised(res.mean, reference)
        rows.append(
            {
                "target": target,
                "mean": res.mean,
                "std": res.std,
                "score": score,
                "returns": res.returns,
                "lengths": res.lengths,
                "steps": res.steps,
                "seconds": res.seconds,
            }
        )
        print(
            f"  target {target:>9g}: return {res.mean:9.2f} +- {res.std:7.2f}"
            + (f"  score {score:6.1f}" if score is not None else "")
            + f"  ({res.steps} steps, {res.seconds:.1f} s)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"ckpt": args.ckpt, "decision": decision, "rollouts": rows}, indent=1))
        print(f"wrote {args.out}")
    return rows
