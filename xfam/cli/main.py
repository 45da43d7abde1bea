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
import math
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from xfam.core.errors import ConfigError, did_you_mean


class Parser(argparse.ArgumentParser):
    """argparse with xfam's error format: one line naming the problem and the fix, exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"xfam: error: {self.prog}: {message}. Fix: {self._fix(message)}\n")

    def _fix(self, message: str) -> str:
        words = self.prog.split()[1:]
        if not words and ("required" in message or "invalid choice" in message):
            return "name a command: xfam {list,eval,generate,calibrate,knnlm} (`xfam --help` describes each)."
        if words == ["knnlm"] and ("required" in message or "invalid choice" in message):
            return "name a step: xfam knnlm build ... or xfam knnlm eval ... (`xfam knnlm --help`)."
        if "required" in message:
            example = " ".join(["xfam", *words, "ckpt=runs/<name>/<run>/checkpoints/last.ckpt"])
            return f"pass every required option as key=value, e.g. {example} (`{self.prog} --help` lists them)."
        return f"options are key=value (or --key value) with the values `{self.prog} --help` lists for each."


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
    parser = Parser(prog="xfam", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def _at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: v >= low


def _finite(ok: Callable[[float], bool]) -> Callable[[Any], bool]:
    return lambda v: math.isfinite(v) and ok(v)


POSITIVE = ("an integer >= 1", _at_least(1))
#: Numeric options of each command: option -> (the valid values in words, the test, an example).
OPTIONS: dict[str, dict[str, tuple[str, Callable[[Any], bool], str]]] = {
    "eval": {"batch_size": (*POSITIVE, "8"), "limit": (*POSITIVE, "10")},
    "generate": {
        "max_new_tokens": (*POSITIVE, "200"),
        "num_samples": (*POSITIVE, "1"),
        "temperature": ("a number >= 0 (0: greedy)", _finite(lambda v: v >= 0), "0.8"),
        "top_k": ("an integer >= 0 (0: off)", _at_least(0), "0"),
        "top_p": ("a number in (0, 1] (1: off)", _finite(lambda v: 0 < v <= 1), "0.9"),
        "knnlm_k": (*POSITIVE, "1024"),
        "knnlm_lambda": ("a number in [0, 1]", _finite(lambda v: 0 <= v <= 1), "0.25"),
        "knnlm_temperature": ("a number > 0", _finite(lambda v: v > 0), "1.0"),
    },
    "calibrate": {
        "delta": ("a number in (0, 1)", _finite(lambda v: 0 < v < 1), "0.1"),
        "epsilon": ("a number in (0, 1)", _finite(lambda v: 0 < v < 1), "0.05"),
        "tolerance": ("a number >= 0", _finite(lambda v: v >= 0), "0.02"),
        "batch_size": (*POSITIVE, "8"),
        "limit": (*POSITIVE, "10"),
    },
    "knnlm build": {"batch_size": (*POSITIVE, "8"), "limit": (*POSITIVE, "10")},
    "knnlm eval": {"batch_size": (*POSITIVE, "8"), "limit": (*POSITIVE, "10")},  # k, lambda, temperature: below
}


def option_problems(args: argparse.Namespace) -> list[str]:
    """Every out-of-range option of a parsed ``xfam`` command line, and a checkpoint or device that cannot be
    used: found before any checkpoint is loaded (the options' types are argparse's)."""
    command = args.command + (f" {args.step}" if args.command == "knnlm" else "")
    values = vars(args)
    out = []
    for key, (valid, ok, example) in OPTIONS.get(command, {}).items():
        value = values.get(key)
        if value is not None and not ok(value):
            out.append(f"xfam {command}: {key}={value}: must be {valid}. Fix: a valid value, e.g. {key}={example}.")
    for word in values.get("overrides") or []:  # (exit.KEY=VALUE words: checked against the checkpoint's policy)
        if not word.startswith("exit."):
            key = word.partition("=")[0].lstrip("-")
            parser = build_parser()[1][command]
            known = sorted(a.dest for a in parser._actions if a.dest not in ("help", "overrides"))
            hint = did_you_mean(key, known)
            out.append(
                f"xfam {command}: {word!r} is neither an option nor an early-exit model's inference option (expected "
                f"exit.KEY=VALUE, e.g. exit.threshold=0.8).{hint} Valid options: {', '.join(known)}. "
                f"Fix: use one of them (`xfam {command} --help`)."
            )
    if command == "knnlm eval":  # kNN-LM's own check, before the checkpoint and the datastore are read
        from xfam.knnlm.interpolate import check_knn_options

        try:
            check_knn_options(args.k, values["lambda"], args.temperature)
        except ConfigError as err:
            out += [f"xfam knnlm eval: {p}" for p in err.problems]
    if command == "calibrate" and args.thresholds:
        try:
            [float(v) for v in args.thresholds.split(",")]
        except ValueError:
            out.append(
                f"xfam calibrate: thresholds={args.thresholds!r}: expected comma-separated numbers. "
                f"Fix: thresholds=0.9,0.8,0.7 (or leave it out for the policy's default grid)."
            )
    ckpt = values.get("ckpt")
    if ckpt is not None and not os.path.isfile(ckpt):
        what = "is a folder" if os.path.isdir(ckpt) else "does not exist"
        out.append(
            f"xfam {command}: ckpt={ckpt!r} {what}. Fix: pass the path of a .ckpt file, e.g. "
            f"ckpt=runs/<name>/<run>/checkpoints/last.ckpt."
        )
    if (device := values.get("device")) is not None:
        out += _device_problems(command, device)
    return out


def _device_problems(command: str, device: str) -> list[str]:
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        return [
            f"xfam {command}: device={device!r} is not a device name. Fix: device=cpu, or device=cuda (cuda:1 ...)."
        ]
    if kind == "cuda" and not torch.cuda.is_available():
        return [f"xfam {command}: device={device!r}, and this machine has no CUDA GPU. Fix: device=cpu."]
    if kind == "mps" and not torch.backends.mps.is_available():
        return [f"xfam {command}: device={device!r}, and this machine has no MPS device. Fix: device=cpu."]
    return []


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
        if problems := option_problems(args):
            raise ConfigError(problems)
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
