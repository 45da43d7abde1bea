"""The command-line grammar every ``xfam`` subcommand shares: declared options read from ``key=value`` words.

A subcommand is a :class:`Command`: its options (:class:`Option`: a name, a :class:`Type`, a default or
``required=True``, a one-line help and optionally a check of the value), an optional passthrough group of
dotted words, and the function that runs it. Subcommands nest in a :class:`Group` (``xfam knnlm build``).
:func:`parse` reads a command line against that tree, Hydra-style:

    key=value              as train.py's overrides (``prompt="def "``, ``split=test``)
    --key=value            also accepted, as is ``--key value``
    switch=true            a bool option: true/false, 1/0, yes/no; ``--switch`` alone means true
    key=null               None, for an option whose default is None
    exit.KEY=VALUE         a word of the command's passthrough group (kept verbatim for the command)
    -h, --help             the command's options: key, type, default and help, as a table

Every problem is collected before anything runs: an unknown key (with the close matches), a value its type
cannot read, a missing required option, a value its check refuses, a problem across options (the command's
``checks``). They are raised together as one :class:`ConfigError`, one line each, phrased
``<prog>: <problem>. Fix: <fix>``; the ``xfam`` command prints it as ``xfam: error: ...`` and exits with 2.
Nothing here imports torch: ``xfam --help`` stays quick.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TextIO

from xfam.cli.option_types import (  # noqa: F401  (the types commands declare, read from here)
    BOOL,
    FLOAT,
    INT,
    NULL,
    PATH,
    STR,
    Choice,
    Invalid,
    ListOf,
    Type,
)
from xfam.core.errors import ConfigError, did_you_mean

#: What a parsed command line is: ``args.<option>`` for every option of the command (its default when not
#: given), ``args.<group dest>`` naming the chosen command (``args.command``, ``args.step``) and the
#: passthrough words (``args.overrides``); ``vars(args)`` gives them as a dict.
Args = SimpleNamespace

HELP_WORDS = ("-h", "--help")
# -- declarations --------------------------------------------------------------------------------------

#: A check of one option's value: None when valid, else ``"<problem>. Fix: <fix>."``.
Check = Callable[["Option", Any], "str | None"]


@dataclass(frozen=True)
class Option:
    """One ``key=value`` option of a command.

    ``default`` is the value when the option is not given (ignored when ``required``); ``check`` refuses
    values the type reads but the command cannot use (a range, a file that must exist); ``example`` is a
    valid value that messages suggest (default: the default)."""

    name: str
    type: Type = STR
    default: Any = None
    help: str = ""
    required: bool = False
    check: Check | None = None
    example: str | None = None

    @property
    def example_value(self) -> str:
        if self.example is not None:
            return self.example
        if isinstance(self.default, bool):  # a switch: the value that changes something
            return self.type.show(not self.default)
        if self.default is not None and not self.required and self.default not in ("", [], ()):
            return self.type.show(self.default)
        return self.type.sample

    @property
    def shown_default(self) -> str:
        return "(required)" if self.required else self.type.show(self.default)


@dataclass(frozen=True)
class Passthrough:
    """Dotted words ``<prefix>.KEY=VALUE`` that a command hands on verbatim (``exit.threshold=0.8``): their
    keys and values are checked by what receives them (``args.<dest>``, a list of the words in order)."""

    prefix: str
    help: str
    what: str  # in words, for an unknown key: "neither an option nor <what>"
    example: str  # a valid word
    dest: str = "overrides"

    @property
    def metavar(self) -> str:
        return f"{self.prefix}.KEY=VALUE"


@dataclass(frozen=True)
class Command:
    """A subcommand: its options, its passthrough group, the checks across options (each returns the
    problems it finds, ``"<problem>. Fix: <fix>."``) and what runs it (``"module:function"``, called
    with the parsed :data:`Args`; imported only when the command runs)."""

    name: str
    help: str
    options: tuple[Option, ...] = ()
    run: str = ""
    passthrough: Passthrough | None = None
    description: str = ""
    checks: tuple[Callable[[Args], list[str]], ...] = ()
    #: The command reads its words itself (``xfam train``: Hydra's grammar), as ``args.words``, ``--help`` included.
    raw: bool = False

    def __post_init__(self) -> None:
        names = [o.name for o in self.options]
        if len(set(names)) != len(names):
            raise ValueError(f"command {self.name}: an option is declared twice: {names}")

    def option(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)


@dataclass(frozen=True)
class Group:
    """Commands under one name (``xfam``, ``xfam knnlm``): the first word chooses one, stored as
    ``args.<dest>``; ``what`` names the choice in messages (command, step)."""

    name: str
    help: str
    commands: tuple[Command | Group, ...] = field(default=())
    dest: str = "command"
    what: str = "command"
    description: str = ""

    def child(self, name: str) -> Command | Group | None:
        return next((c for c in self.commands if c.name == name), None)


# -- checks --------------------------------------------------------------------------------------------


def must(valid: str, ok: Callable[[Any], bool]) -> Check:
    """A check from a test: ``key=value: must be <valid>. Fix: a valid value, e.g. key=<example>.``"""

    def check(option: Option, value: Any) -> str | None:
        if ok(value):
            return None
        return f"{option.name}={value}: must be {valid}. Fix: a valid value, e.g. {option.name}={option.example_value}."

    return check


def at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low


def finite(ok: Callable[[float], bool]) -> Callable[[Any], bool]:
    """``ok`` for finite numbers only (nan and inf pass no range test)."""
    return lambda v: math.isfinite(v) and ok(v)


# -- parsing -------------------------------------------------------------------------------------------


def _line(prog: str, problem: str, fix: str) -> str:
    stop = "" if problem.endswith((".", "?", "!")) else "."
    return f"{prog}: {problem}{stop} Fix: {fix}"


def parse(root: Group | Command, argv: Sequence[str], out: TextIO | None = None) -> tuple[Command, Args]:
    """The command ``argv`` names under ``root`` and its parsed options.

    ``-h`` / ``--help`` print that command's (or group's) help to ``out`` (stdout) and exit with 0; every
    problem of the command line raises one :class:`ConfigError` (a line per problem)."""
    args, prog, node, words = Args(), root.name, root, list(argv)
    while isinstance(node, Group):
        chosen = node.child(words[0]) if words else None
        if chosen is None:
            if any(w in HELP_WORDS for w in words):
                _print_help(node, prog, out)
            names = [c.name for c in node.commands]
            fix = f"name a {node.what}: {prog} {{{','.join(names)}}} ... (`{prog} --help` describes each)."
            if not words:
                raise ConfigError(_line(prog, f"a {node.what} is required", fix))
            hint = did_you_mean(words[0], names)
            raise ConfigError(_line(prog, f"invalid choice: {words[0]!r} (choose from {', '.join(names)}).{hint}", fix))
        setattr(args, node.dest, chosen.name)
        node, prog, words = chosen, f"{prog} {chosen.name}", words[1:]
    if node.raw:
        args.words = words
        return node, args
    if any(w in HELP_WORDS for w in words):
        _print_help(node, prog, out)
    problems, unread = _read(node, prog, words, args)
    problems += value_problems(node, prog, args, skip=unread)
    if problems:
        raise ConfigError(problems)
    return node, args


def _read(command: Command, prog: str, words: list[str], args: Args) -> tuple[list[str], set[str]]:
    """Set every option of ``command`` on ``args`` from ``words`` (defaults for the rest); the problems, and
    the options whose words could not be read (or are missing)."""
    values: dict[str, Any] = {}
    passed: list[str] = []
    problems: list[str] = []
    unread: set[str] = set()
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        dashed = word.startswith("--")
        key, eq, text = (word[2:] if dashed else word).partition("=")
        option = command.option(key) if (eq or dashed) else None
        group = command.passthrough
        if group is not None and key.startswith(group.prefix + ".") and (eq or dashed):
            if not eq and i < len(words) and not words[i].startswith("--"):
                text, i = words[i], i + 1
            passed.append(f"{key}={text}")
            continue
        if option is None:
            if dashed and not eq and i < len(words) and "=" not in words[i] and not words[i].startswith("-"):
                word, i = f"{word} {words[i]}", i + 1  # an unknown --key's value: one problem, not two
            problems.append(_unknown(command, prog, word, key.lstrip("-+~")))
            continue
        if not eq:  # --key [value]
            if option.type is BOOL:
                text = "true"
            elif i < len(words) and not words[i].startswith("--"):
                text, i = words[i], i + 1
            else:
                fix = f"{key}=VALUE or --{key} VALUE, e.g. {key}={option.example_value}."
                problems.append(_line(prog, f"--{key} expects a value ({option.type.label})", fix))
                unread.add(key)
                continue
        try:
            nullable = option.default is None and not option.required
            values[key] = None if nullable and text.lower() in NULL else option.type.parse(key, text)
            unread.discard(key)
        except Invalid as err:
            fix = f"{key} takes {option.type.expects}, e.g. {key}={option.example_value} (`{prog} --help`)."
            problems.append(_line(prog, str(err), fix))
            unread.add(key)
    missing = [o for o in command.options if o.required and o.name not in values and o.name not in unread]
    if missing:
        example = " ".join([prog, *(f"{o.name}={o.example_value}" for o in command.options if o.required)])
        fix = f"pass every required option as key=value, e.g. {example} (`{prog} --help` lists them)."
        names = ", ".join(f"--{o.name}" for o in missing)
        problems.append(_line(prog, f"the following options are required: {names}", fix))
    for option in command.options:
        default = None if option.required else copy.copy(option.default)  # (a list default is not shared)
        setattr(args, option.name, values.get(option.name, default))
    if command.passthrough is not None:
        setattr(args, command.passthrough.dest, passed)
    return problems, unread | {o.name for o in missing}


def _unknown(command: Command, prog: str, word: str, key: str) -> str:
    names = sorted(o.name for o in command.options)
    hint = did_you_mean(key, names) if key else ""
    valid = f" Valid options: {', '.join(names)}." if names else " It takes no options."
    fix = f"use one of them (`{prog} --help`)." if names else f"leave it out (`{prog} --help`)."
    group = command.passthrough
    if group is None:
        return _line(prog, f"unrecognized arguments: {word} (not an option of {prog}).{hint}{valid}", fix)
    what = f"{word!r} is neither an option nor {group.what} (expected {group.metavar}, e.g. {group.example})."
    return _line(prog, f"{what}{hint}{valid}", fix)


def value_problems(command: Command, prog: str, args: Args, skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """What the options' checks and the command's checks refuse in ``args`` (options in ``skip``, whose words
    could not be read, are left out): ``<prog>: <problem>. Fix: <fix>.`` each."""
    out = []
    for option in command.options:
        value = getattr(args, option.name, None)
        if option.check is None or value is None or option.name in skip:
            continue
        if (problem := option.check(option, value)) is not None:
            out.append(f"{prog}: {problem}")
    for check in command.checks:
        out += [f"{prog}: {problem}" for problem in check(args)]
    return out


# -- help ----------------------------------------------------------------------------------------------


def _print_help(node: Command | Group, prog: str, out: TextIO | None) -> None:
    print(help_text(node, prog), file=out or sys.stdout)
    raise SystemExit(0)


def _table(rows: Sequence[tuple[str, ...]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip() for r in rows]


def usage(node: Command | Group, prog: str) -> str:
    if isinstance(node, Group):
        return f"usage: {prog} <{node.what}> [key=value ...]"
    words = [prog, *(f"{o.name}={o.type.sample}" for o in node.options if o.required)]
    if any(not o.required for o in node.options):
        words.append("[key=value ...]")
    if node.passthrough is not None:
        words.append(f"[{node.passthrough.metavar} ...]")
    return "usage: " + " ".join(words)


def _leaves(group: Group, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for child in group.commands:
        name = f"{prefix}{child.name}"
        if isinstance(child, Group):
            rows += _leaves(child, f"{name} ")
        else:
            rows.append((name, child.help))
    return rows


def help_text(node: Command | Group, prog: str) -> str:
    """``--help``: the usage line, the description, and the table of options (key, type, default, help) or
    of commands."""
    lines = [usage(node, prog), "", node.help]
    if node.description:
        lines += ["", node.description.strip("\n")]
    if isinstance(node, Group):
        lines += ["", f"{node.what}s:", *_table([(name, text) for name, text in _leaves(node)])]
        lines += ["", f"`{prog} <{node.what}> --help` lists its options: key, type, default and help."]
        return "\n".join(lines)
    lines += ["", "options (key=value, --key=value or --key value; a bool also as --key for true):"]
    rows = [("KEY", "TYPE", "DEFAULT", "HELP")]
    rows += [(o.name, o.type.label, o.shown_default, o.help) for o in node.options]
    if node.passthrough is not None:
        rows.append((node.passthrough.metavar, "passthrough", "-", node.passthrough.help))
    rows.append(("-h, --help", "", "", "show this help and exit"))
    lines += _table(rows)
    return "\n".join(lines)
