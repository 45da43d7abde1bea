"""The grammar every ``xfam`` subcommand shares (``xfam.cli.grammar``) and the table that declares them
(``xfam.cli.commands``): types, defaults, switches, the passthrough group, the one-message refusals and
``--help``. The real command lines: tests/integration/test_cli.py, test_bad_command_lines.py."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from xfam.cli import main as xfam_main
from xfam.cli.commands import XFAM, commands
from xfam.cli.grammar import (
    BOOL,
    FLOAT,
    INT,
    PATH,
    STR,
    Choice,
    Command,
    Group,
    ListOf,
    Option,
    Passthrough,
    at_least,
    help_text,
    must,
    parse,
)
from xfam.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

TOY = Command(
    "toy",
    "a command of every option type",
    (
        Option("ckpt", PATH, help="a checkpoint", required=True, example="a.ckpt"),
        Option("name", STR, "", "a word"),
        Option("steps", INT, 10, "how many", check=must("an integer >= 1", at_least(1))),
        Option("rate", FLOAT, None, "a rate (null: the run's)"),
        Option("fast", BOOL, False, "a switch"),
        Option("split", Choice("train", "test"), "test", "a split"),
        Option("values", ListOf(FLOAT), [], "numbers"),
        Option("tags", ListOf(STR), ["a"], "words"),
    ),
    passthrough=Passthrough("exit", "inference options", "an exit option", "exit.threshold=0.8"),
)
PLAIN = Command("plain", "no passthrough", (Option("fast", BOOL, False, "a switch"), Option("n", INT, 1, "a number")))
TREE = Group("tool", "a tool", (TOY, Group("sub", "steps", (PLAIN,), dest="step", what="step")))


def refused(argv: list[str], root: Group = TREE) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse(root, argv)
    return err.value.problems


def test_types_and_defaults() -> None:
    command, args = parse(TREE, ["toy", "ckpt=x.ckpt", "steps=3", "rate=0.5", "values=0.9,0.8", "tags=[b, c]"])
    assert command is TOY and args.command == "toy"
    assert vars(args) == {
        "command": "toy",
        "ckpt": "x.ckpt",
        "name": "",
        "steps": 3,
        "rate": 0.5,
        "fast": False,
        "split": "test",
        "values": [0.9, 0.8],
        "tags": ["b", "c"],
        "overrides": [],
    }
    _, args = parse(TREE, ["toy", "ckpt=x", "name=a=b", "values=", "rate=null"])
    assert args.name == "a=b" and args.values == [] and args.rate is None  # the first '=' splits
    _, args = parse(TREE, ["toy", "ckpt=x", "steps=1", "steps=2"])
    assert args.steps == 2  # the last word wins


@pytest.mark.parametrize(
    "words",
    [
        ["ckpt=x", "steps=4", "split=train"],
        ["--ckpt=x", "--steps=4", "--split=train"],
        ["--ckpt", "x", "--steps", "4", "--split", "train"],
        ["--ckpt", "x", "steps=4", "--split=train"],
    ],
)
def test_key_value_and_dashed_forms_are_the_same(words: list[str]) -> None:
    _, args = parse(TREE, ["toy", *words])
    assert (args.ckpt, args.steps, args.split) == ("x", 4, "train")


@pytest.mark.parametrize(
    ("word", "value"),
    [
        ("fast=true", True),
        ("fast=True", True),
        ("fast=1", True),
        ("fast=yes", True),
        ("fast=false", False),
        ("fast=0", False),
        ("fast=NO", False),
        ("--fast", True),
        ("--fast=false", False),
    ],
)
def test_switches(word: str, value: bool) -> None:
    _, args = parse(TREE, ["sub", "plain", word])
    assert args.fast is value and args.step == "plain"


def test_a_switch_alone_takes_no_value() -> None:
    _, args = parse(TREE, ["sub", "plain", "--fast", "n=3"])
    assert args.fast is True and args.n == 3
    (problem,) = refused(["sub", "plain", "fast=maybe"])
    assert "fast is a switch: use fast=true or fast=false" in problem and "Fix:" in problem


def test_dotted_words_pass_through_in_order() -> None:
    words = ["exit.threshold=0.8", "ckpt=x", "--exit.measure", "saturation", "--exit.exit_at=2"]
    _, args = parse(TREE, ["toy", *words])
    assert args.overrides == ["exit.threshold=0.8", "exit.measure=saturation", "exit.exit_at=2"]
    (problem,) = refused(["sub", "plain", "exit.threshold=0.8"])  # no passthrough group there
    assert "unrecognized arguments: exit.threshold=0.8" in problem


def test_unknown_keys_name_the_close_option() -> None:
    (problem,) = refused(["toy", "ckpt=x", "stpes=3"])
    assert problem.startswith("tool toy: 'stpes=3' is neither an option nor an exit option")
    assert "(expected exit.KEY=VALUE, e.g. exit.threshold=0.8)" in problem
    assert "Did you mean 'steps'?" in problem and "Fix: use one of them (`tool toy --help`)." in problem
    assert "Valid options: ckpt, fast, name, rate, split, steps, tags, values." in problem
    (problem,) = refused(["sub", "plain", "--fats"])
    assert "unrecognized arguments: --fats" in problem and "Did you mean 'fast'?" in problem
    (problem,) = refused(["sub", "plain", "--bogus", "value"])  # an unknown --key and its value: one problem
    assert "unrecognized arguments: --bogus value" in problem


def test_bad_values_are_refused_with_the_expected_type() -> None:
    cases = {
        "steps=abc": "steps: invalid int value: 'abc'. Fix: steps takes an integer, e.g. steps=10 (`tool toy --help`).",
        "rate=fast": "rate: invalid float value: 'fast'. Fix: rate takes a number, e.g. rate=0.5",
        "split=tset": "split: invalid choice: 'tset' (choose from train, test). Did you mean 'test'? Fix: split takes",
        "values=0.9,x": "values='0.9,x': expected comma-separated numbers. Fix: values takes comma-separated numbers",
        "steps=0": "steps=0: must be an integer >= 1. Fix: a valid value, e.g. steps=10.",
    }
    for word, text in cases.items():
        (problem,) = refused(["toy", "ckpt=x", word])
        assert problem.startswith("tool toy: ") and text in problem, problem
    (problem,) = refused(["toy", "ckpt=x", "--steps"])
    assert "--steps expects a value (int)" in problem


def test_missing_required_option() -> None:
    (problem,) = refused(["toy", "steps=2"])
    assert problem == (
        "tool toy: the following options are required: --ckpt. Fix: pass every required option as key=value, "
        "e.g. tool toy ckpt=a.ckpt (`tool toy --help` lists them)."
    )


def test_every_problem_is_collected() -> None:
    problems = refused(["toy", "steps=x", "split=dev", "bogus=1", "values=a"])
    assert len(problems) == 5  # steps, split, bogus, values, and the missing ckpt
    assert "required: --ckpt" in problems[-1]
    problems = refused(["toy", "ckpt=x", "steps=0", "rate=q"])  # a bad type and a refused value together
    assert [p.split(":")[1].strip() for p in problems] == ["rate", "steps=0"]


def test_groups_need_a_known_command() -> None:
    (problem,) = refused([])
    assert (
        problem
        == "tool: a command is required. Fix: name a command: tool {toy,sub} ... (`tool --help` describes each)."
    )
    (problem,) = refused(["ty"])
    assert "invalid choice: 'ty' (choose from toy, sub). Did you mean 'toy'?" in problem
    (problem,) = refused(["sub"])
    assert problem.startswith("tool sub: a step is required. Fix: name a step: tool sub {plain}")


def help_of(root: Group | Command, argv: list[str]) -> str:
    out = io.StringIO()
    with pytest.raises(SystemExit) as stop:
        parse(root, argv, out=out)
    assert stop.value.code == 0
    return out.getvalue()


def test_help_anywhere_prints_the_table() -> None:
    text = help_of(TREE, ["toy", "ckpt=x", "--help"])
    assert text.startswith("usage: tool toy ckpt=PATH [key=value ...] [exit.KEY=VALUE ...]")
    assert help_of(TREE, ["toy", "-h"]) == text == help_text(TOY, "tool toy") + "\n"
    rows = {line.split()[0]: line.split() for line in text.splitlines()[5:]}
    assert rows["steps"][:3] == ["steps", "int", "10"] and rows["rate"][:3] == ["rate", "float", "null"]
    assert rows["ckpt"][:3] == ["ckpt", "path", "(required)"] and rows["split"][1] == "{train,test}"
    assert rows["values"][1:3] == ["list[float]", "[]"] and rows["tags"][1:3] == ["list[str]", "[a]"]
    assert rows["fast"][:3] == ["fast", "bool", "false"] and rows["exit.KEY=VALUE"][1] == "passthrough"
    assert "usage: tool <command>" in help_of(TREE, ["--help"]) and "sub plain" in help_of(TREE, ["-h"])


def test_a_raw_command_gets_its_words_verbatim_help_included() -> None:
    """``xfam train``'s words are Hydra's: the grammar hands them on, ``--help`` and flags included."""
    words = ["-m", "pos=alibi,rope", "--config-dir", "mine", "--help", "+plugins=[a.b]"]
    command, args = parse(XFAM, ["train", *words])
    assert command.raw and command.name == "train" and args.words == words


@pytest.mark.parametrize("name", [name for name, command in commands().items() if not command.raw])
def test_xfam_help_lists_every_key_with_type_default_and_help(name: str) -> None:
    command = commands()[name]
    text = help_of(XFAM, [*name.split(), "--help"])
    assert text.startswith(f"usage: xfam {name}")
    for option in command.options:
        (line,) = [ln for ln in text.splitlines() if ln.split()[:1] == [option.name]]
        assert option.type.label in line and option.shown_default in line and option.help in line, line
        assert option.help, f"xfam {name}: {option.name} has no help line"
    assert ("exit.KEY=VALUE" in text) == (command.passthrough is not None)


def test_xfam_help_lists_the_commands() -> None:
    text = help_of(XFAM, ["--help"])
    assert text.startswith("usage: xfam")
    for name, command in commands().items():
        assert re.search(rf"^  {name}\s+{re.escape(command.help)}$", text, re.M), name


def test_declared_defaults_read_back_and_pass_their_checks() -> None:
    for name, command in commands().items():
        assert command.run and callable(xfam_main.target(command)), name
        for option in command.options:
            if option.required or option.default in (None, "", []):
                continue
            shown = option.type.show(option.default)
            assert option.type.parse(option.name, shown) == option.default, (name, option.name)
            assert option.check is None or option.check(option, option.default) is None, (name, option.name)


@pytest.mark.parametrize(
    ("argv", "texts"),
    [
        (["evl"], ["xfam: invalid choice: 'evl'", "Did you mean 'eval'?", "name a command"]),
        (["list", "--bogus"], ["unrecognized arguments: --bogus", "Valid options: markdown"]),
        (["eval", "ckpt=/no/such.ckpt", "spilt=test"], ["2 configuration problems", "Did you mean 'split'?"]),
        (["generate", "--ckpt", "/no/such.ckpt", "top_p=2"], ["does not exist", "top_p=2.0: must be"]),
        (["knnlm", "eval", "ckpt=/no/such.ckpt", "store=/tmp", "k=0"], ["k=0: the number of neighbours"]),
        (["calibrate", "thresholds=a"], ["required: --ckpt", "thresholds='a'"]),
    ],
)
def test_xfam_refuses_in_one_message_with_exit_code_2(
    argv: list[str], texts: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        xfam_main.main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert err.startswith("xfam: error: ") and err.count("xfam: error:") == 1 and "Fix:" in err, err
    assert "Traceback" not in err and "usage:" not in err
    for text in texts:
        assert text in err, f"{text!r} not in {err}"


def test_no_private_argparse_and_no_upward_import() -> None:
    """The CLI uses its own grammar (no argparse internals); the evaluation library does not import the CLI."""
    for path in (ROOT / "xfam").rglob("*.py"):
        text = path.read_text()
        for private in ("._actions", "_StoreTrueAction", "_SubParsersAction"):
            assert private not in text, f"{path}: {private}"
        if path.parent.name == "eval":
            assert "xfam.cli" not in text, f"{path} imports the command line"
