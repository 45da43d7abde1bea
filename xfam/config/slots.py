"""The four slot sections (attention, pos, memory, exit): each component's own checks, per layer and per head,
gathered into the ``compat.Selection`` the compatibility check reads; and whether batches are streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import xfam.attention
import xfam.exit
import xfam.memory
import xfam.pos  # noqa: F401  (registers every component)
from xfam.attention._base import ATTENTION
from xfam.config.run import EncoderStack
from xfam.core.errors import ConfigError
from xfam.core.registry import Registry
from xfam.core.schedule import per_head, per_layer
from xfam.exit._base import EXIT
from xfam.memory._base import MEMORY, Memory
from xfam.model import compat
from xfam.model.spec import ModelSpec
from xfam.pos._base import POS

SLOTS: dict[str, Registry[Any]] = {"attention": ATTENTION, "pos": POS, "memory": MEMORY, "exit": EXIT}


def resolve_streams(cfg: Mapping[str, Any]) -> tuple[bool, str]:
    """``streams_of`` for a validated config."""
    layers = cfg["model"]["layers"]
    memory = [(MEMORY.get(m["name"]), m) for m in per_layer(cfg["memory"], layers, "memory")]
    return streams_of(cfg["loader"], memory)


def streams_of(loader: Mapping[str, Any], memory: list[tuple[type[Memory], dict]]) -> tuple[bool, str]:
    """Whether batches are contiguous streams, and why (``loader.streams=auto``: when a memory needs them)."""
    chosen = loader.get("streams", "auto")
    if chosen != "auto":
        return bool(chosen), f"loader.streams={str(chosen).lower()}"
    needing = sorted({cls.registry_name for cls, _ in memory if cls.needs_streams})
    if needing:
        return True, f"loader.streams=auto: contiguous streams, as memory={needing[0]} carries state across batches"
    return False, "loader.streams=auto: shuffled rows (no memory needs streams)"


def _slot_problems(
    cfg: Mapping[str, Any], spec: ModelSpec, causal: bool, task: str, arch: str = "decoder"
) -> tuple[list[str], compat.Selection | None]:
    """Problems of the four slot sections (and, for an encoder-decoder, of the cross-attention section), and the
    selection when they are individually valid."""
    problems: list[str] = []
    ctx = spec.structural(causal)
    cross: list[tuple[type, dict]] = []
    if arch == "encoder_decoder":
        try:
            for i, ccfg in enumerate(per_layer(cfg["cross_attention"], spec.layers, "cross_attention")):
                problems += ATTENTION.check(ccfg, {**ctx, "causal": False, "layer": i}, "cross_attention")
                if ccfg.get("name") in ATTENTION:
                    cross.append((ATTENTION.get(ccfg["name"]), ccfg))
        except ConfigError as err:
            problems += err.problems
    attention: list[tuple[type, dict, bool]] = []
    memory: list[tuple[type, dict]] = []
    for slot in ("pos", "exit"):
        bad = [k for k in ("per_layer", "per_head") if k in cfg[slot]]
        problems += [f"{slot}.{k}: {slot} is one component for the whole model. Fix: remove {slot}.{k}." for k in bad]
    try:
        for i, layer_cfg in enumerate(per_layer(cfg["attention"], spec.layers, "attention")):
            groups = per_head(layer_cfg, spec.heads, spec.n_kv_heads, "attention")
            for n, g in groups:
                where = f"attention (layer {i})" if "per_layer" in cfg["attention"] else "attention"
                gctx = {**ctx, "heads": n, "kv_heads": n // (spec.heads // spec.n_kv_heads), "layer": i}
                problems += ATTENTION.check(g, gctx, where)
                if g.get("name") in ATTENTION:
                    attention.append((ATTENTION.get(g["name"]), g, len(groups) > 1))
        if "per_head" in cfg["memory"]:
            problems.append("memory.per_head: memory is per layer, not per head. Fix: remove memory.per_head.")
        for i, mcfg in enumerate(per_layer(cfg["memory"], spec.layers, "memory")):
            problems += MEMORY.check(mcfg, {**ctx, "layer": i}, "memory")
            if mcfg.get("name") in MEMORY:
                memory.append((MEMORY.get(mcfg["name"]), mcfg))
    except ConfigError as err:
        problems += err.problems
    problems += POS.check(cfg["pos"], ctx)
    problems += EXIT.check(cfg["exit"], {**ctx, "out_dim": None})  # out_dim: known once the data is
    if problems:
        return list(dict.fromkeys(problems)), None
    sel = compat.Selection(
        attention=list({id(p): (c, p, h) for c, p, h in attention}.values()),
        pos=(POS.get(cfg["pos"]["name"]), cfg["pos"]),
        memory=memory,
        exit=(EXIT.get(cfg["exit"]["name"]), cfg["exit"]),
        causal=causal,
        task=task,
        streams=streams_of(cfg["loader"], memory)[0],
        reversible=spec.reversible,
        num_mem_kv=spec.num_mem_kv,
        num_memory_tokens=spec.num_memory_tokens,
        documents=bool(cfg["data"].get("doc_mask", False)),
        arch=arch,
        cross=list({id(p): (c, p) for c, p in cross}.values()),
        block=spec,
    )
    return [], sel


def encoder_is_default(section: Mapping[str, Any]) -> bool:
    """The ``encoder`` section asks for nothing of its own (every key null: as the decoder)."""
    return all(v is None for v in section.values())


def encoder_stack(cfg: Mapping[str, Any], spec: ModelSpec) -> tuple[EncoderStack | None, list[str]]:
    """The encoder of an encoder-decoder (``encoder`` section; null keys: as the decoder), validated as a
    bidirectional stack with no memory and no exit policy, its problems prefixed ``encoder:``."""
    enc = cfg["encoder"]
    unknown = sorted(set(enc) - {"layers", "attention", "pos"})
    if unknown:
        return None, [
            f"encoder.{k}: unknown key. Fix: remove it (valid: encoder.layers, attention, pos)." for k in unknown
        ]
    layers = enc.get("layers")
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 1):
        return None, [f"encoder.layers={layers!r}: must be an integer >= 1, or null (model.layers). Fix: set it."]
    for key in ("attention", "pos"):
        if enc.get(key) is not None and not isinstance(enc[key], Mapping):
            return None, [
                f"encoder.{key}={enc[key]!r} is not a component config. Fix: encoder.{key}={{name:<component>,...}} "
                f"(e.g. encoder.attention={{name:longformer,window:64}}), or null (as the decoder)."
            ]
    spec_e = dataclasses.replace(spec, layers=layers or spec.layers, causal=False)
    stack_cfg = {
        **cfg,
        "attention": enc.get("attention") or cfg["attention"],
        "pos": enc.get("pos") or cfg["pos"],
        "memory": {"name": "none"},
        "exit": {"name": "none"},
    }
    problems, sel = _slot_problems(stack_cfg, spec_e, causal=False, task="encode", arch="encoder")
    if sel is not None:
        problems += compat.check(sel)
    if problems:
        return None, [f"encoder: {p}" for p in problems]
    attention = tuple(per_layer(stack_cfg["attention"], spec_e.layers, "attention"))
    return EncoderStack(spec=spec_e, attention=attention, pos=dict(stack_cfg["pos"])), []
