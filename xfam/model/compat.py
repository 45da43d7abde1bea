"""Build-time compatibility check over the whole slot selection.

Reads only class-level capabilities (and each component's optional ``refusals`` classmethod), so
it runs before anything is built. Every refusal names the reason and the alternatives that would
work with the rest of the selection unchanged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from xfam.attention._base import ATTENTION, AttentionMechanism
from xfam.core.registry import Registry, defaults_of, signature_params
from xfam.exit._base import EXIT, ExitPolicy
from xfam.memory._base import MEMORY, Memory
from xfam.model import block_compat
from xfam.model.spec import ModelSpec
from xfam.pos._base import POS, PositionalEncoding


@dataclasses.dataclass
class Selection:
    """The classes and parameters chosen for each slot, plus the context they run in.

    ``attention`` lists ``(class, params, per_head)`` for every distinct layer/group configuration;
    ``memory`` lists ``(class, params)`` per layer. ``num_mem_kv`` / ``num_memory_tokens``: the model
    options of the same names; ``documents``: the data marks documents in packed rows (``doc_mask``).
    ``arch``: the model shape (``model.arch`` resolved); ``cross``: an encoder-decoder's cross-attention
    ``(class, params)`` per distinct configuration (empty for one stack). ``block``: the model spec, whose block
    options ``xfam.model.block_compat`` checks against the slots (None: none set). ``image``: the geometry of the
    data's images when its rows are images (``shape``, ``order``, ``block``: ``data=pixels``), for the mechanisms
    that lay an image over the sequence (None: the data's rows are not images).
    ``inputs``: the kind of the model's inputs (``xfam.model.inputs``: ``tokens``, ``vectors``, ``image`` or
    ``decision``); ``continuous_actions``: a decision model's actions are vectors (not ids).
    """

    attention: list[tuple[type[AttentionMechanism], dict[str, Any], bool]]
    pos: tuple[type[PositionalEncoding], dict[str, Any]]
    memory: list[tuple[type[Memory], dict[str, Any]]]
    exit: tuple[type[ExitPolicy], dict[str, Any]]
    causal: bool
    task: str = "lm"
    streams: bool = False
    reversible: bool = False
    num_mem_kv: int = 0
    num_memory_tokens: int = 0
    documents: bool = False
    arch: str = "decoder"
    cross: list[tuple[type[AttentionMechanism], dict[str, Any]]] = dataclasses.field(default_factory=list)
    block: ModelSpec | None = None
    image: dict[str, Any] | None = None
    inputs: str = "tokens"
    continuous_actions: bool = False

    @property
    def has_memory(self) -> bool:
        return any(cls.registry_name != "none" for cls, _ in self.memory)

    @staticmethod
    def alternatives(slot: str, ok: Any) -> list[str]:
        """The names of ``slot``'s components whose class satisfies ``ok`` (for a refusal's alternatives,
        so a component lists other slots' choices without importing them)."""
        registries: dict[str, Registry[Any]] = {"attention": ATTENTION, "pos": POS, "memory": MEMORY, "exit": EXIT}
        registry = registries[slot]
        return [n for n, cls in registry.items() if ok(cls)]

    @staticmethod
    def store_manifest(path: str) -> dict[str, Any]:
        """The manifest of the datastore at ``path`` (``xfam knnlm build``), or ``ConfigError`` when it is none:
        for a memory's refusals about the store it needs (``Memory.needs_store``), without importing xfam.knnlm."""
        from xfam.knnlm.datastore import read_manifest

        return read_manifest(Path(path))


def _attention_vs_pos(att: type[AttentionMechanism], pos: type[PositionalEncoding], per_head: bool) -> str | None:
    name, pname = att.registry_name, pos.registry_name
    if pos.kind == "bias" and not att.accepts_bias:
        return f"attention={name} cannot add a score bias, which pos={pname} is"
    if pos.kind == "modifier":
        if pos.hosts is not None and name not in pos.hosts:
            return f"pos={pname} runs only inside attention in {sorted(pos.hosts)} ({pos.hosts_why})"
        if not att.hosts_modifiers:
            return (
                f"attention={name} never forms the full score matrix a score modifier changes, "
                f"so it cannot host pos={pname}"
            )
        if per_head:
            return f"pos={pname} (a score modifier) cannot be split across a per_head schedule"
    return None


def _attention_vs_model(att: type[AttentionMechanism], causal: bool) -> str | None:
    if causal and not att.causal:
        return f"attention={att.registry_name} cannot be causal, and this model is (a causal LM)"
    if not causal and not att.bidirectional:
        return f"attention={att.registry_name} is causal-only, and this model is bidirectional (a classifier)"
    return None


def _memory_reasons(mem: type[Memory], params: dict[str, Any], sel: Selection) -> list[str]:
    name = mem.registry_name
    out = []
    if mem.needs_relative_pos and not sel.pos[0].relative and not params.get("allow_absolute_pos"):
        relative = [n for n, c in POS.items() if c.relative and n != "none"]
        out.append(
            f"memory={name} needs relative positions (stored keys must keep their meaning in the next segment), "
            f"but pos={sel.pos[0].registry_name} is absolute: use pos in [{', '.join(relative)}]"
            + (
                " (or memory.allow_absolute_pos=true, for an ablation only)"
                if "allow_absolute_pos" in signature_params(mem)
                else ""
            )
        )
    if mem.needs_streams and not sel.streams:
        out.append(
            f"memory={name} needs contiguous streams (row i of batch t+1 continues row i of batch t); "
            f"set loader.streams=auto (or true)"
        )
    for att, _, _ in sel.attention:
        if not att.accepts_memory and name != "none":
            out.append(f"attention={att.registry_name} cannot attend to memory keys in front of the segment")
    return out


def _reversible_reasons(sel: Selection) -> list[str]:
    """Reversible layers recompute the whole stack in one pass; what needs the ordinary graph or
    per-layer states inside the stack cannot run with them."""
    out = []
    exit_cls = sel.exit[0]
    if not exit_cls.full_stack:
        alt = _alternatives("exit", lambda c: c.full_stack)
        out.append(
            f"model.reversible=true runs every layer in one recomputed pass, but exit={exit_cls.registry_name} "
            f"traverses depth itself. Fix: {alt}, or model.reversible=false."
        )
    if sel.has_memory:
        out.append(
            "model.reversible=true cannot carry memory (memory reads and writes per-layer states inside the "
            "stack). Fix: memory=none, or model.reversible=false."
        )
    for att, _, _ in sel.attention:
        if att.aux_loss:
            out.append(
                f"attention={att.registry_name} returns an auxiliary loss, which needs the ordinary autograd graph "
                f"that reversible layers do not keep. Fix: model.reversible=false, or another attention."
            )
    return out


def _model_option_reasons(sel: Selection) -> list[str]:
    """Persistent memory (``model.num_mem_kv``) and memory tokens (``model.num_memory_tokens``) against
    the slots that cannot take them."""
    out = []
    if n := sel.num_mem_kv:
        bad = sorted({att.registry_name for att, _, _ in sel.attention if not att.accepts_persistent_kv})
        if bad:
            alt = _alternatives("attention", lambda c: c.accepts_persistent_kv)
            out.append(
                f"model.num_mem_kv={n} (persistent memory: learned keys/values without position in front of every "
                f"query's keys) needs an attention that takes always-visible keys in front, and attention="
                f"{', '.join(bad)} does not. Supported: {alt}. Fix: model.num_mem_kv=0, or one of those attentions."
            )
    if n := sel.num_memory_tokens:
        exit_cls = sel.exit[0]
        if exit_cls.early_exit:
            alt = _alternatives("exit", lambda c: not c.early_exit)
            out.append(
                f"model.num_memory_tokens={n} adds tokens in front of the input, which exit={exit_cls.registry_name}'s "
                f"per-token exit decisions cannot tell apart from the input's tokens. "
                f"Fix: model.num_memory_tokens=0, or {alt}."
            )
        bad = sorted({att.registry_name for att, _, _ in sel.attention if not att.shared_keys})
        if sel.documents and bad:
            alt = _alternatives("attention", lambda c: c.shared_keys and _attention_vs_model(c, sel.causal) is None)
            out.append(
                f"model.num_memory_tokens={n} with packed documents (data.doc_mask=true): every document sees the "
                f"memory tokens, which attention={', '.join(bad)} cannot express (it treats a document as a run of "
                f"equal ids). Fix: {alt}, data.doc_mask=false, or model.num_memory_tokens=0."
            )
    return out


def _encoder_decoder_reasons(sel: Selection) -> list[str]:
    """An encoder-decoder's decoder: what its cross-attention must be, and what it cannot carry."""
    out = []
    for att, params in sel.cross:
        if not att.cross_attention:
            names = ", ".join(Selection.alternatives("attention", lambda c: c.cross_attention))
            out.append(
                f"cross_attention={att.registry_name} cannot attend over another sequence: its pattern is defined by "
                f"positions that queries and keys share (windows, blocks, buckets of one sequence). "
                f"Fix: cross_attention.name in [{names}]."
            )
        elif params.get("gate"):
            out.append(
                f"cross_attention={att.registry_name} gate=true: RFA's gate is a recency gate over a causal stream, "
                f"and cross-attention has no order over the source. Fix: cross_attention.gate=false."
            )
    if sel.has_memory:
        out.append(
            "memory with model.arch=encoder_decoder: the memory slot's methods carry states from one segment of a "
            "long stream to the next (or retrieve from it); an encoder-decoder reads independent source/target "
            "pairs, so there is no stream to carry. Fix: memory=none (or a decoder language model for memory)."
        )
    if sel.reversible:
        out.append(
            "model.reversible=true with model.arch=encoder_decoder: the reversible stack recomputes self-attention "
            "and FFN sublayers only, not cross-attention. Fix: model.reversible=false."
        )
    return out


def _inputs_reasons(sel: Selection) -> list[str]:
    """What needs token ids or token targets, against continuous inputs and the regress task."""
    out = []
    if sel.inputs != "tokens":
        for mem in sorted({cls.registry_name for cls, _ in sel.memory if cls.needs_store}):
            out.append(
                f"memory={mem} retrieves from a datastore of token contexts and their next token ids, and this "
                f"model's inputs are {sel.inputs}, not token ids. Fix: memory=none."
            )
    exit_cls = sel.exit[0]
    if sel.task == "regress" and exit_cls.early_exit:
        alt = _alternatives("exit", lambda c: not c.early_exit)
        out.append(
            f"exit={exit_cls.registry_name} trains per-layer classifiers on token or class targets (cross-entropy, "
            f"confidence of a distribution), and task=regress predicts vectors with a squared error. Fix: {alt}."
        )
    if sel.task == "decision" and exit_cls.early_exit and exit_cls.registry_name != "calm":
        out.append(
            f"exit={exit_cls.registry_name} decides with classifiers of token or sequence targets; a decision model "
            f"predicts an action at its state tokens only. Fix: exit=calm (per action), or exit=none."
        )
    if sel.task == "decision" and exit_cls.early_exit and sel.continuous_actions:
        out.append(
            f"exit={exit_cls.registry_name} measures the confidence of a distribution over actions (and trains on "
            f"agreement of the most likely one); this decision model predicts continuous actions. Fix: exit=none, "
            f"or data with discrete actions."
        )
    return out


def _alternatives(slot: str, ok: Any) -> str:
    names = Selection.alternatives(slot, ok)
    return f"{slot} in [{', '.join(names)}]" if names else f"no {slot} component"


def check(sel: Selection) -> list[str]:
    """Every incompatibility in ``sel``, each with its reason and working alternatives."""
    problems: list[str] = []
    pos_cls, pos_params = sel.pos
    for att, params, per_head in sel.attention:
        if why := _attention_vs_model(att, sel.causal):
            alt = _alternatives("attention", lambda c: _attention_vs_model(c, sel.causal) is None)
            problems.append(f"{why}. Alternatives: {alt}.")
        if why := _attention_vs_pos(att, pos_cls, per_head):
            alt_pos = _alternatives("pos", lambda c, a=att, h=per_head: _attention_vs_pos(a, c, h) is None)
            alt_att = _alternatives("attention", lambda c, h=per_head: _attention_vs_pos(c, pos_cls, h) is None)
            problems.append(f"{why}. Alternatives: {alt_pos} with this attention, or {alt_att} with this pos.")
        problems += att.refusals(params, sel)
    for mem, params in {cls.registry_name: (cls, p) for cls, p in sel.memory}.values():
        for why in _memory_reasons(mem, params, sel):
            problems.append(f"{why}. Fix: change the named setting, or use memory=none.")
        problems += mem.refusals(params, sel)
    problems += pos_cls.refusals(pos_params, sel)
    problems += sel.exit[0].refusals(sel.exit[1], sel)
    if sel.reversible:
        problems += _reversible_reasons(sel)
    problems += _model_option_reasons(sel)
    if sel.arch == "encoder_decoder":
        problems += _encoder_decoder_reasons(sel)
    if sel.block is not None:
        problems += block_compat.reasons(sel.block, sel)
    problems += _inputs_reasons(sel)
    return list(dict.fromkeys(problems))


def matrix() -> dict[tuple[str, str], str | None]:
    """attention x pos compatibility for ``xfam list``: None where they combine, else the reason."""
    return {(a, p): _attention_vs_pos(acls, pcls, False) for a, acls in ATTENTION.items() for p, pcls in POS.items()}


def block_matrix() -> dict[str, dict[str, list[str]]]:
    """Block options x slots for ``xfam list`` and docs/blocks.md: for each option of ``block_compat.OPTIONS``,
    ``{column: refusals (empty where it combines)}`` over the attention mechanisms (at their defaults, causal
    where they can be), ``memory`` (memory=xl), each exit policy but none, and ``reversible``: xfam's own
    components (not ones registered by a user's or a test's module)."""
    none_exit = (EXIT.get("none"), {"name": "none"})
    no_memory = [(MEMORY.get("none"), {"name": "none"})]
    xl = [(MEMORY.get("xl"), {"name": "xl"})]

    def sel(att: type[AttentionMechanism] | None = None, **kw: Any) -> Selection:
        att = att or ATTENTION.get("vanilla")
        base = dict(attention=[(att, {"name": att.registry_name}, False)], pos=(POS.get("rope"), {"name": "rope"}))
        return Selection(**{**base, "memory": no_memory, "exit": none_exit, "causal": att.causal, **kw})

    table = {}
    for row, option in block_compat.OPTIONS.items():
        spec = dataclasses.replace(ModelSpec(layers=4), **option.override)
        cells = {name: block_compat.reasons(spec, sel(cls)) for name, cls in ATTENTION.builtin()}
        cells["memory"] = block_compat.reasons(spec, sel(memory=xl))
        for name, cls in EXIT.builtin():
            if name != "none":
                cells[f"exit={name}"] = block_compat.reasons(spec, sel(exit=(cls, {"name": name})))
        rev = dataclasses.replace(spec, reversible=True)
        cells["reversible"] = block_compat.reasons(rev, sel(reversible=True)) + rev.problems()
        table[row] = cells
    return table


def setting_refusals(attention: str, pos: str) -> list[str]:
    """The components' own refusals of a pair that ``matrix`` allows, at their default settings, in each
    direction the mechanism supports (e.g. performer's: a score bias that is not a distance decay)."""
    att, pcls = ATTENTION.get(attention), POS.get(pos)
    out = []
    for causal in [c for c, ok in ((True, att.causal), (False, att.bidirectional)) if ok]:
        sel = Selection([(att, defaults_of(att), False)], (pcls, defaults_of(pcls)), [], (EXIT.get("none"), {}), causal)
        out += att.refusals(sel.attention[0][1], sel) + pcls.refusals(sel.pos[1], sel)
    return list(dict.fromkeys(out))
