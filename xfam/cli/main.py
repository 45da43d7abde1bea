"""The ``xfam`` command: list components, evaluate and sample from checkpoints (``xfam --help`` lists the
subcommands: ``xfam.cli.commands.DESCRIPTION``).

Every subcommand is declared in ``xfam.cli.commands`` and read by one grammar (``xfam.cli.grammar``):
``key=value`` words (or ``--key value``), ``exit.KEY=VALUE`` for an early-exit model's inference options,
``--help`` for a command's table of options. Every problem of a command line is reported at once, as
one ``xfam: error: ...`` with the fix, exit code 2, before any checkpoint is loaded.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from xfam.cli.commands import XFAM
from xfam.cli.grammar import Args, Command, parse
from xfam.core.errors import ConfigError


def target(command: Command) -> Callable[[Args], Any]:
    """The function that runs ``command`` (its ``run``, ``"module:function"``), imported now."""
    module, _, name = command.run.partition(":")
    return getattr(importlib.import_module(module), name)


def _fail(err: ConfigError) -> NoReturn:
    print(f"xfam: error: {err}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv in (["--version"], ["-V"]):
        import xfam

        print(f"xfam {xfam.__version__}")
        return
    try:
        command, args = parse(XFAM, argv)
    except ConfigError as err:  # the command line itself: never a traceback
        _fail(err)
    try:
        target(command)(args)
    except ConfigError as err:
        if os.environ.get("XFAM_DEBUG") == "1":
            raise
        _fail(err)
