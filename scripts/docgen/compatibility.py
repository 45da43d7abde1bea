"""What a component refuses next to other choices, stated without building anything.

The build-time check (``xfam.model.compat.check``, which also applies the block options' rules of
``xfam.model.block_compat``) reads only class attributes and parameters, so it can be asked about every pair:
a default selection (``BASE``: vanilla attention, rope, no memory, no exit, a causal language model) with the
component put in, then each other component or model option added. A refusal counts for the pair when the
pair's check says something that neither choice's own check says on its own (e.g. memory=spalm without a
datastore is refused alone, which is not a refusal of the pair spalm x calm).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from xfam.cli.listing import _fmt
from xfam.config import SLOTS
from xfam.core.registry import defaults_of
from xfam.data.base import DATA
from xfam.model import block_compat, compat
from xfam.model.spec import ModelSpec

BASE = {"attention": "vanilla", "pos": "rope", "memory": "none", "exit": "none"}

#: Model options that some components refuse, as ``Selection`` fields (shown as the override that sets them).
MODEL_OPTIONS: dict[str, dict[str, Any]] = {
    "model.reversible=true": {"reversible": True},
    "model.num_mem_kv=4": {"num_mem_kv": 4},
    "model.num_memory_tokens=4": {"num_memory_tokens": 4},
    "model.num_memory_tokens=4 data.doc_mask=true": {"num_memory_tokens": 4, "documents": True},
    "model.arch=encoder_decoder": {"arch": "encoder_decoder"},
}


def builtin(slot: str) -> list[tuple[str, type]]:
    """xfam's own components of a slot or of ``data`` (a test's or a plugin's are not documented here)."""
    return (DATA if slot == "data" else SLOTS[slot]).builtin()


def _params(cls: type) -> dict[str, Any]:
    return {k: (None if v == "???" else v) for k, v in defaults_of(cls).items()}


def selection(choice: dict[str, type], **fields: Any) -> compat.Selection:
    """The selection of ``choice`` (a class per slot) at default settings; a causal language model where the
    attention can be causal, else a bidirectional model."""
    att, pos, mem, ex = (choice[s] for s in ("attention", "pos", "memory", "exit"))
    fields.setdefault("causal", att.causal)
    if fields.get("arch") == "encoder_decoder":
        fields.setdefault("cross", [(SLOTS["attention"].get("vanilla"), {})])
    return compat.Selection(
        attention=[(att, _params(att), False)],
        pos=(pos, _params(pos)),
        memory=[(mem, _params(mem))],
        exit=(ex, _params(ex)),
        streams=mem.needs_streams,
        **fields,
    )


def _base(**put: type) -> dict[str, type]:
    return {**{s: SLOTS[s].get(n) for s, n in BASE.items()}, **put}


def _check(choice: dict[str, type], **fields: Any) -> list[str]:
    problems = compat.check(selection(choice, **fields))
    spec = fields.get("block")
    return problems + (spec.problems() if spec is not None else [])


def short(reason: str) -> str:
    """A refusal without its list of alternatives (the reference lists what combines)."""
    return reason.split(" Alternatives: ")[0].rstrip(".") + "."


def refusals(slot: str, cls: type) -> dict[str, list[str]]:
    """``{other choice: [reasons]}``: each component of the other slots, model option and block option that
    the check refuses next to ``cls`` (and only next to it), e.g. ``{"pos=da": ["pos=da runs only inside ..."]}``."""
    mine = _base(**{slot: cls})
    own = set(_check(mine))
    out: dict[str, list[str]] = {}
    for other in SLOTS:
        if other == slot:
            continue
        for name, ocls in builtin(other):
            if name == BASE[other]:
                continue
            causal = mine["attention"].causal if other != "attention" else ocls.causal
            alone = set(_check(_base(**{other: ocls}), causal=causal)) | set(_check(mine, causal=causal))
            new = [p for p in _check({**mine, other: ocls}, causal=causal) if p not in alone | own]
            if new:
                out[f"{other}={name}"] = new
    for override, fields in MODEL_OPTIONS.items():
        plain = set(_check(_base(), **fields))
        new = [p for p in _check(mine, **fields) if p not in plain | own]
        if new and new not in out.values():  # (the doc_mask variant adds nothing when the reasons are the same)
            out[override] = new
    if slot == "attention" and cls.cross_attention is False:
        out["cross_attention=" + cls.registry_name] = [
            f"cross_attention={cls.registry_name} cannot attend over another sequence (an encoder-decoder's "
            f"cross-attention needs an attention with cross_attention=true)."
        ]
    for option in block_compat.OPTIONS.values():
        spec = dataclasses.replace(ModelSpec(layers=4), **option.override)
        plain = set(_check(_base(), block=spec))
        new = [p for p in _check(mine, block=spec) if p not in plain | own]
        if new:
            out[" ".join(f"model.{k}={_fmt(v)}" for k, v in option.override.items())] = new
    return out


def own_refusals(slot: str, cls: type) -> list[str]:
    """What the check refuses about ``cls`` in the default selection (e.g. a datastore it needs)."""
    return _check(_base(**{slot: cls}))


def data_refusals(cls: type) -> dict[str, list[str]]:
    """``{other choice: [reasons]}`` for a data source: the components the check refuses with the model it makes
    (its task and its inputs at its defaults; e.g. per-token early exit with vectors to regress)."""
    params = _params(cls)
    task, inputs = cls.task_for(params), cls.inputs_for(params)
    fields = {
        "task": task,
        "inputs": inputs["kind"],
        "continuous_actions": inputs.get("action_dim") is not None,
        "documents": cls.documents_for(params),
        "causal": task not in ("classify", "tag"),
    }
    if task == "seq2seq":
        fields["arch"] = "encoder_decoder"
    own = set(_check(_base(), **fields))
    out: dict[str, list[str]] = {}
    for other in ("memory", "exit"):
        for name, ocls in builtin(other):
            if name == BASE[other]:
                continue
            alone = set(_check(_base(**{other: ocls}))) | own
            new = [p for p in _check(_base(**{other: ocls}), **fields) if p not in alone]
            if new:
                out[f"{other}={name}"] = new
    return out
