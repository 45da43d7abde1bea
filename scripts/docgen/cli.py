"""docs/reference/cli.md: what ``--help`` prints, for ``xfam``, each of its commands and ``python train.py``."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

from check_links import github_slug

from docgen.components import BANNER, ROOT
from xfam.cli.commands import XFAM
from xfam.cli.grammar import Group, parse


def xfam_help(words: list[str]) -> str:
    """``xfam <words> --help`` as a user sees it: the grammar prints it and exits, and a command that hands its
    words to another parser (``xfam train``: Hydra's) is run."""
    out = io.StringIO()
    with contextlib.suppress(SystemExit):
        parse(XFAM, [*words, "--help"], out=out)
    return out.getvalue().rstrip("\n") or run_help([sys.executable, "-m", "xfam.cli", *words, "--help"])


def run_help(argv: list[str]) -> str:
    """What ``argv`` prints, run in the repository as a user runs it, with this checkout's path and the home folder
    written as ``.`` and ``~``."""
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return normalise(result.stdout.rstrip("\n"))


def command_words(group: Group = XFAM, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every group and command below ``xfam`` (``("knnlm",)``, ``("knnlm", "build")``), in declaration order."""
    out = []
    for child in group.commands:
        words = (*prefix, child.name)
        out.append(words)
        if isinstance(child, Group):
            out += command_words(child, words)
    return out


def train_help() -> str:
    """``python train.py --help``: Hydra's app help (its template is the Hydra config's ``help``)."""
    return run_help([sys.executable, "train.py", "--help"])


def normalise(text: str) -> str:
    text = text.replace(str(ROOT) + os.sep, "").replace(str(ROOT), ".")
    return text.replace(str(Path.home()), "~")


def fenced(text: str) -> list[str]:
    fence = "````" if "```" in text else "```"
    return [f"{fence}text", text, fence]


def cli_page() -> str:
    lines = [
        "# Command line",
        "",
        BANNER,
        "",
        "`python train.py` trains (Hydra: `group=option` and `key=value` overrides); `xfam` lists the components and "
        "works with what training wrote (checkpoints, datastores). Below is what each prints for `--help`.",
        "",
    ]
    train = "python train.py --help"
    helps = {train: train_help(), "xfam --help": xfam_help([])}
    helps |= {f"xfam {' '.join(words)} --help": xfam_help(list(words)) for words in command_words()}
    lines += [f"- [`{title}`](#{github_slug(title)})" for title in helps]
    for title, text in helps.items():
        lines += ["", f"## {title}", ""]
        if title != train and text == helps[train]:  # (xfam train hands its words to the same Hydra app)
            lines.append(f"The same as [`{train}`](#{github_slug(train)}).")
        else:
            lines += fenced(text)
    return "\n".join(lines).rstrip() + "\n"
