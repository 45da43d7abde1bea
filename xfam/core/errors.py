"""One exception type for every configuration problem, and the helpers that phrase its message.

xfam validates the whole configuration before any tensor is allocated and reports every problem
it finds in one message: what is wrong, the valid choices (with close matches first) and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


class ConfigError(ValueError):
    """A configuration or input problem found before any work started.

    ``problems`` holds one line per problem; ``str(err)`` joins them into the message that the
    command line prints (without a traceback unless ``XFAM_DEBUG=1``).
    """

    def __init__(self, problems: str | Sequence[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        lines = [f"{len(self.problems)} configuration problems:"]
        lines += [f"  {i}. " + p.replace("\n", "\n     ") for i, p in enumerate(self.problems, 1)]
        return "\n".join(lines)


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Choices that look like ``word`` (typos, prefixes), best first."""
    choices = list(choices)
    found = difflib.get_close_matches(word, choices, n=n, cutoff=0.5)
    found += [c for c in choices if c not in found and (c.startswith(word) or word in c)][: n - len(found)]
    return found


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'a' or 'b'?`` for the choices that look like ``word``; empty when none does."""
    near = close_matches(word, choices)
    return f" Did you mean {' or '.join(repr(c) for c in near)}?" if near else ""


def unknown_choice(what: str, value: object, choices: Iterable[str], fix: str) -> str:
    """Message for a value that is not one of ``choices``: names close matches and every choice."""
    choices = sorted(choices)
    hint = did_you_mean(str(value), choices)
    return f"{what}: unknown value {value!r}.{hint} Valid choices: {', '.join(choices)}. Fix: {fix}"
