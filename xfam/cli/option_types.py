"""The value types of ``xfam`` options (``xfam.cli.grammar``): how a word is read, and how help names it."""

from __future__ import annotations

from typing import Any

from xfam.core.errors import did_you_mean

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")
NULL = ("null", "none")


class Invalid(ValueError):
    """A value its option's type cannot read; the message names the key and the value."""


# -- types ---------------------------------------------------------------------------------------------


class Type:
    """How an option's value is read from its word, and how help and messages name it.

    ``label``: the type column of ``--help``; ``expects``: the values in words (for the fix of a bad value);
    ``sample``: a valid value when the option has no default or example to show."""

    label = "str"
    expects = "a string"
    sample = "TEXT"

    def parse(self, key: str, text: str) -> Any:
        return text

    def show(self, value: Any) -> str:
        """A value as it would be typed on the command line."""
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(self.show(v) for v in value) + "]"
        if value == "":
            return "''"
        return str(value)


class _Str(Type):
    pass


class _Path(Type):
    label, expects, sample = "path", "a path", "PATH"


class _Number(Type):
    """An ``int`` or a ``float`` (``cast``), named by the cast in messages."""

    def __init__(self, cast: type, expects: str, sample: str):
        self.cast, self.label, self.expects, self.sample = cast, cast.__name__, expects, sample

    def parse(self, key: str, text: str) -> Any:
        try:
            return self.cast(text)
        except ValueError:
            raise Invalid(f"{key}: invalid {self.label} value: {text!r}") from None


class _Bool(Type):
    label, expects, sample = "bool", "true or false (also 1/0, yes/no)", "true"

    def parse(self, key: str, text: str) -> bool:
        if text.lower() not in TRUE + FALSE:
            raise Invalid(f"{key} is a switch: use {key}=true or {key}=false")
        return text.lower() in TRUE


class Choice(Type):
    """One of a fixed list of words (``split``: train, validation or test)."""

    def __init__(self, *values: str):
        self.values = tuple(values)
        self.label = "{" + ",".join(values) + "}"
        self.expects = "one of " + ", ".join(values)
        self.sample = values[0]

    def parse(self, key: str, text: str) -> str:
        if text not in self.values:
            hint = did_you_mean(text, self.values)
            raise Invalid(f"{key}: invalid choice: {text!r} (choose from {', '.join(self.values)}).{hint}")
        return text


class ListOf(Type):
    """Comma-separated values of one type (``0.9,0.8,0.7``, or Hydra's ``[0.9,0.8,0.7]``); a Python list."""

    PLURALS = {"int": "integers", "float": "numbers", "path": "paths", "str": "words"}

    def __init__(self, item: Type):
        self.item = item
        self.label = f"list[{item.label}]"
        self.expects = "comma-separated " + self.PLURALS.get(item.label, f"{item.label} values")
        self.sample = f"{item.sample},{item.sample}"

    def parse(self, key: str, text: str) -> list[Any]:
        body = text.strip()
        if body.startswith("[") and body.endswith("]"):
            body = body[1:-1]
        words = [w.strip() for w in body.split(",")] if body.strip() else []
        try:
            return [self.item.parse(key, w) for w in words]
        except Invalid:
            raise Invalid(f"{key}={text!r}: expected {self.expects}") from None


STR, PATH, INT, FLOAT, BOOL = (
    _Str(),
    _Path(),
    _Number(int, "an integer", "1"),
    _Number(float, "a number", "0.5"),
    _Bool(),
)
