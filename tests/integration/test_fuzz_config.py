"""Generated bad configurations, each validated in-process through Hydra's compose API (``precheck``,
what train.py runs before anything else): every one must give exactly one clear error that names
the offending setting and says how to fix it. The cases are derived from the config groups and the
registries, so a new component or option is fuzzed without editing this file."""

from __future__ import annotations

import random
import typing

import pytest

from xfam.attention import ATTENTION
from xfam.core.errors import ConfigError
from xfam.core.registry import defaults_of
from xfam.exit import EXIT
from xfam.model import compat
from xfam.pos import POS
from xfam.training.precheck import config_groups, precheck

SLOTS = {"attention": ATTENTION, "pos": POS, "exit": EXIT}
RNG = random.Random(0)


def typo(word: str) -> str:
    return word[:-1] + ("x" if word[-1] != "x" else "y")


def numeric_params(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls.__init__, include_extras=True)
    out = []
    for name, default in defaults_of(cls).items():
        hint = str(hints.get(name, ""))
        if isinstance(default, (int, float)) and not isinstance(default, bool) and "Literal" not in hint:
            out.append(name)
    return out


def cases() -> list[tuple[list[str], list[str]]]:
    """(overrides, texts the one error must contain)."""
    out: list[tuple[list[str], list[str]]] = []
    for group, options in config_groups().items():  # an unknown option in every group
        for option in options:
            if typo(option) not in options:
                out.append(([f"{group}={typo(option)}"], [f"{group}: unknown value '{typo(option)}'", "Fix:"]))
    for slot, registry in SLOTS.items():
        for name in registry.names():
            cls, params = registry.get(name), list(defaults_of(registry.get(name)))
            if not cls.__module__.startswith("xfam."):
                continue
            base = [f"{slot}={name}"] + ([] if getattr(cls, "causal", True) else ["data=listops"])  # encoder-only
            for param in params[:2]:  # a misspelt key: the valid keys are this component's
                out.append(([*base, f"{slot}.{param}x=1"], [f"unknown key '{param}x'", f"'{param}'"]))
            for param in RNG.sample(numeric_params(cls), min(2, len(numeric_params(cls)))):  # a wrong type
                out.append(([*base, f"{slot}.{param}=abc"], [f"{slot}.{param}='abc'", "Fix:"]))
    for key in ("dim", "layers", "heads", "max_len", "ffn_mult"):  # zero and negative sizes
        for value in (0, -1):
            out.append(([f"model.{key}={value}"], [f"model.{key}={value}: must be > 0", "Fix:"]))
    for key, value in (("data.seq_len", 0), ("data.batch_size", -3), ("optim.lr", -1)):
        out.append(([f"{key}={value}"], [f"{key}={value}: must be", "Fix:"]))
    for heads in (3, 5, 6, 7, 9):  # heads that do not divide the width (128)
        out.append(([f"model.heads={heads}"], [f"model.heads={heads} does not divide model.dim=128", "Fix:"]))
    real = lambda registry, name: registry.get(name).__module__.startswith("xfam.")  # no test doubles
    for (att, pos), why in compat.matrix().items():  # every attention x pos pair that cannot combine
        if why is not None and real(ATTENTION, att) and real(POS, pos) and ATTENTION.get(att).causal:
            out.append(([f"attention={att}", f"pos={pos}"], [why, "Alternatives:"]))
    out += [
        (["attention=local", "attention.window=5000"], ["window=5000 is larger than model.max_len", "Fix:"]),
        (["pos=learned", "model.max_len=64", "data.seq_len=128"], ["longer than the learned position table"]),
        (["data.paths=[/no/such/folder]"], ["does not exist", "Fix:"]),
        (["data.paths=[]"], ["paths is an empty list", "Fix:"]),
        (["exit=calm", "data=listops"], ["exit=calm exits per generated token", "Fix:"]),
        (["exit=depth_adaptive", "exit.classifier=sequence"], ["would let every token see the future", "Fix:"]),
        (["trainer.nonfinite=ignore"], ["trainer.nonfinite: unknown value 'ignore'", "Fix:"]),
        (["trainer.matmul_precision=tf32"], ["unknown value 'tf32'", "high, highest, medium", "Fix: trainer.matmul_"]),
        (["trainer.max_stepz=3"], ["Did you mean 'max_steps'", "Fix:"]),
        (["ckpt_path=/no/such.ckpt"], ["no such file", "Fix:"]),
        (["model.num_mem_kv=-1"], ["model.num_mem_kv=-1: must be >= 0", "Fix:"]),
        (["attention=local", "model.num_mem_kv=4"], ["attention=local does not", "attention in [vanilla]", "Fix:"]),
        (["exit=calm", "model.num_memory_tokens=2"], ["exit=calm's per-token exit decisions", "Fix:"]),
        (["attention=etc", "data=listops", "model.num_memory_tokens=2"], ["with attention=etc", "Fix:"]),
        (["model.max_len=256", "model.num_memory_tokens=2"], ["makes 258 tokens per row", "Fix: model.max_len=258"]),
        (
            ["attention=performer", "data.doc_mask=true", "model.num_memory_tokens=2"],
            ["attention=performer cannot express", "Fix:"],
        ),
    ]
    return out


CASES = cases()


def test_there_are_hundreds_of_cases() -> None:
    assert len(CASES) >= 200, len(CASES)


@pytest.mark.parametrize(("overrides", "texts"), CASES, ids=[" ".join(o) for o, _ in CASES])
def test_one_clear_error(overrides: list[str], texts: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        precheck(overrides)
    message = str(err.value)
    assert len(err.value.problems) == 1, message
    for text in texts:
        assert text in message, f"{text!r} not in: {message}"
