"""The ``xfam`` command: list components, evaluate and sample from checkpoints.

    xfam list [--markdown]                 every slot, component, parameter and capability
    xfam eval ckpt=PATH [split=test]       metrics of a checkpoint on a split of its data
    xfam generate ckpt=PATH prompt="def "  sampling with a KV cache
    xfam calibrate ckpt=PATH delta=0.1     an early-exit threshold with a guarantee (Learn-then-Test)
    xfam knnlm build ckpt=PATH             a kNN-LM datastore of a split (keys: the final FFN's input)
    xfam knnlm eval ckpt=PATH store=DIR    the checkpoint with and without kNN-LM interpolation

Early-exit models take ``exit.KEY=VALUE`` words in eval, generate and calibrate (e.g.
``exit.threshold=0.8 exit.measure=saturation``): their inference options.

Options are given as ``key=value`` (like train.py) or ``--key value``.
"""

from __future__ import annotations

import argparse
import os
import sys

from xfam.errors import ConfigError


def _kv_args(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Turn ``key=value`` words into ``--key=value`` for the parser's known options
    (``flag=true`` / ``flag=false`` for switches)."""
    actions = {a.dest: a for a in parser._actions}
    out = []
    for word in argv:
        key, eq, value = word.partition("=")
        action = actions.get(key)
        if not eq or word.startswith("-") or action is None:
            out.append(word)
        elif isinstance(action, argparse._StoreTrueAction):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                parser.error(f"{key} is a switch: use {key}=true or {key}=false")
            out += [f"--{key}"] if value.lower() in ("true", "1", "yes") else []
        else:
            out.append(f"--{word}")
    return out


EXIT_HELP = "inference options of an early-exit policy, e.g. exit.threshold=0.8 exit.measure=saturation"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="xfam", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{list,eval,generate,calibrate,knnlm}")

    p = sub.add_parser("list", help="components, their parameters and capabilities, compatibility")
    p.add_argument("--markdown", action="store_true", help="print the README's slot table instead")

    p = sub.add_parser("eval", help="evaluate a checkpoint on a split of its data")
    p.add_argument("--ckpt", required=True, help="checkpoint file (.ckpt)")
    p.add_argument("--split", default="test", choices=["train", "validation", "test"])
    p.add_argument("--batch_size", type=int, default=None, help="default: the run's data.batch_size")
    p.add_argument("--limit", type=int, default=None, help="evaluate at most this many batches")
    p.add_argument("--device", default="cpu")
    p.add_argument("overrides", nargs="*", metavar="exit.KEY=VALUE", help=EXIT_HELP)

    p = sub.add_parser("generate", help="sample text from a language-model checkpoint")
    p.add_argument("--ckpt", required=True, help="checkpoint file (.ckpt)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="also verify cached logits against a full recompute")
    p.add_argument("--knnlm_store", default=None, help="sample from kNN-LM over this datastore (xfam knnlm build)")
    p.add_argument("--knnlm_lambda", type=float, default=0.25, help="kNN-LM: weight of p_kNN")
    p.add_argument("--knnlm_k", type=int, default=1024, help="kNN-LM: neighbours retrieved per token")
    p.add_argument("--knnlm_temperature", type=float, default=1.0, help="kNN-LM: p_kNN ∝ exp(-d / temperature)")
    p.add_argument("--knnlm_index", default="exact", choices=["exact", "faiss"], help="kNN-LM: search index")
    p.add_argument("--device", default="cpu")
    p.add_argument("overrides", nargs="*", metavar="exit.KEY=VALUE", help=EXIT_HELP)

    p = sub.add_parser("calibrate", help="pick an early-exit threshold on held-out data (LTT or grid search)")
    p.add_argument("--ckpt", required=True, help="checkpoint file (.ckpt) of an exit=calm / depth_adaptive run")
    p.add_argument("--split", default="validation", choices=["train", "validation", "test"])
    p.add_argument("--method", default="ltt", choices=["ltt", "grid"], help="ltt: CALM's guarantee; grid: Elbayad")
    p.add_argument("--delta", type=float, default=0.1, help="ltt: tolerated disagreement with the full model")
    p.add_argument("--epsilon", type=float, default=0.05, help="ltt: allowed probability of exceeding delta")
    p.add_argument("--tolerance", type=float, default=0.02, help="grid: tolerated loss increase over full depth")
    p.add_argument("--thresholds", default="", help="comma-separated candidates (default: a grid for the policy)")
    p.add_argument("--batch_size", type=int, default=None, help="default: the run's data.batch_size")
    p.add_argument("--limit", type=int, default=None, help="use at most this many batches")
    p.add_argument("--device", default="cpu")
    p.add_argument("overrides", nargs="*", metavar="exit.KEY=VALUE", help=EXIT_HELP)

    from xfam.cli.knnlm import add_parsers

    add_parsers(sub)
    return parser, dict(sub.choices)


def _nested(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of a subcommand (``xfam knnlm build``), if it has any."""
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(found[0].choices) if found else {}


def main(argv: list[str] | None = None) -> None:
    parser, subparsers = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in subparsers:
        nested = _nested(subparsers[argv[0]])
        if len(argv) > 1 and argv[1] in nested:
            argv = argv[:2] + _kv_args(argv[2:], nested[argv[1]])
        else:
            argv = argv[:1] + _kv_args(argv[1:], subparsers[argv[0]])
    args = parser.parse_args(argv)
    debug = os.environ.get("XFAM_DEBUG") == "1"
    try:
        if args.command == "list":
            from xfam.cli.listing import listing, markdown_table

            print(markdown_table() if args.markdown else listing())
        elif args.command == "eval":
            from xfam.cli.evaluate import evaluate

            evaluate(args.ckpt, args.split, args.batch_size, args.limit, args.device, args.overrides)
        elif args.command == "calibrate":
            from xfam.cli.calibrate import calibrate

            calibrate(args)
        elif args.command == "knnlm":
            from xfam.cli.knnlm import run

            run(args)
        else:
            from xfam.cli.sample import sample

            sample(args)
    except ConfigError as err:
        if debug:
            raise
        print(f"xfam: error: {err}", file=sys.stderr)
        sys.exit(2)
