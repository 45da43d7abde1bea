"""Fine-tuning: start a run from the weights of a checkpoint under a changed config (``init_from=PATH``).

``ckpt_path`` resumes a run exactly (same architecture, optimiser, step, data position); ``init_from`` takes
only weights, by name and shape, into the model this config builds, and starts a new run at step 0. What
happens to each tensor of the new model:

* **loaded**: the checkpoint has it under the same name with the same shape; copied exactly;
* **new**: the checkpoint lacks it (``memory=memorizing``'s gates over a plain decoder), or it is the output
  head (``head.*``) and the task changed (a masked-LM encoder fine-tuned as a classifier): it keeps the fresh
  initialisation the model was built with;
* **mismatched**: same name, another shape (a wider model, a longer learned position table). Refused by
  default (``ConfigError`` naming each tensor's shapes); ``finetune.allow_mismatch=true`` copies the
  overlapping block and leaves the rest at its fresh init; ``finetune.interpolate=[patterns]`` resizes the
  position axis (dim 0) of the matching tables by linear interpolation instead: row ``i`` of a table grown from
  ``L`` to ``L'`` rows is the old table at position ``i * L / L'``, position interpolation as Chen et al.
  (2023, "Extending Context Window of Large Language Models via Positional Interpolation", arXiv:2306.15595)
  do for RoPE, applied to a learned table. (RoPE's own interpolation is ``pos.interpolation``: no tensor
  changes.) Resized tensors train at ``finetune.lr_new``;
* **dropped**: in the checkpoint, not in this model (a memory removed; a separate head where this model ties it
  to the embedding).

Buffers: persistent buffers (Performer's and RFA's random features, Routing's centroids) are matched like
parameters (they are what the loaded weights were trained with), and are reported as buffers; they never
train, so freezing and learning rates do not apply. Non-persistent buffers (rotary tables, masks) are not
in checkpoints: the new model derives them from its config, which is what lets ``pos.interpolation`` or a
longer ``model.max_len`` change them. Memory states (XL's cache, memorizing's store) are not parameters: they
live in the trainer, and a fine-tuning run starts with empty memories.

``freeze`` stops parameters from training by name pattern; ``ParamSplit`` (set on the model by ``mark_split``)
tells the optimiser (``xfam.training.lit.optim.param_groups``) which parameters were loaded, so loaded and new
ones can take their own learning rates. ``finetune_problems`` checks the config before launch.

One file over 400 lines: matching, resizing, freezing and the report walk one table of tensors and are read
together.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import os
import re
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import torch
from torch import Tensor, nn

from xfam.core.errors import ConfigError
from xfam.core.registry import Positive
from xfam.model.checkpoint_file import model_state, short_reason
from xfam.model.exported import WEIGHTS_FILE, is_exported, read_config
from xfam.model.sharded import is_sharded, load_meta

#: Prefix of the output head in ``XfamModel``: a head trained for another task is never loaded.
HEAD = "head."
#: Model attribute holding the ``ParamSplit`` of a fine-tuning run (``mark_split``, ``split_of``).
SPLIT_ATTR = "finetune_split"
#: Module names that wrappers insert into parameter names (FSDP, activation checkpointing, torch.compile).
_WRAPPERS = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinetuneSpec:
    """The ``finetune`` section of ``configs/train.yaml``: how ``init_from`` loads and what trains how.

    Attributes:
        allow_mismatch: copy tensors whose shape changed (their overlapping block: a longer position table
            keeps its first rows, a wider matrix its top-left block; the rest keeps its fresh init) instead of
            refusing the start.
        freeze: parameter names (fnmatch patterns, e.g. ``[embed.*, blocks.0.*]``) that do not train; a
            pattern matching no parameter is refused, naming real ones.
        interpolate: tables (fnmatch patterns, e.g. ``[pos.table.weight]``) whose first dimension is a position
            axis: when its length changed, resample it by linear interpolation (position interpolation, Chen et
            al., 2023) instead of copying the overlap; asking for it allows that change.
        lr_loaded: learning rate of the parameters loaded exactly (null: ``optim.lr``).
        lr_new: learning rate of the parameters that are new or were resized (null: ``optim.lr``).
    """

    allow_mismatch: bool = False
    freeze: list[str] = dataclasses.field(default_factory=list)
    interpolate: list[str] = dataclasses.field(default_factory=list)
    lr_loaded: Annotated[float, Positive] | None = None
    lr_new: Annotated[float, Positive] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One tensor of the report: ``old``/``new``: its shape in the checkpoint / in the model (None: absent
    there); ``buffer``: a persistent buffer, not a parameter; ``note``: why it is new, or how it was resized."""

    name: str
    old: Shape | None
    new: Shape | None
    buffer: bool = False
    note: str = ""

    @property
    def values(self) -> int:
        shape = self.new if self.new is not None else self.old
        return _numel(shape or ())


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitReport:
    """What ``init_from`` did with every tensor (see the module docstring): lists of ``Entry``, by status."""

    path: str
    step: int
    loaded: list[Entry]
    new: list[Entry]
    mismatched: list[Entry]
    dropped: list[Entry]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def loaded_params(self) -> frozenset[str]:
        """Names of the parameters copied exactly: those that train at ``finetune.lr_loaded``."""
        return frozenset(e.name for e in self.loaded if not e.buffer)

    def table(self) -> str:
        """One table for the log: a row per group of tensors alike but for their layer index, grouped by
        status, with counts and values; a summary line on top, the totals and notes below."""
        groups = {"loaded": self.loaded, "new": self.new, "mismatched": self.mismatched, "dropped": self.dropped}
        counts = ", ".join(f"{len(v)} {k}" for k, v in groups.items())
        rows = [("status", "tensors", "shape (checkpoint -> model)", "n", "values", "")]
        for status, entries in groups.items():
            for names, first, n, values in _grouped(entries):
                tag = status + (" (buffer)" if first.buffer else "")
                rows.append((tag, names, _shapes(first), str(n), _count(values), first.note))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [f"init_from {self.path} (step {self.step}): {counts}"]
        for r in rows:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2])]
            cells += [r[3].rjust(widths[3]), r[4].rjust(widths[4])]
            lines.append(("  " + "  ".join(cells) + ("  " + r[5] if r[5] else "")).rstrip())
        total = sum(e.values for e in self.loaded + self.new + self.mismatched)
        loaded = sum(e.values for e in self.loaded)
        lines.append(
            f"  values: {_count(loaded)} loaded ({100 * loaded / max(total, 1):.1f}% of the model's {_count(total)}), "
            f"{_count(sum(e.values for e in self.new))} new, {_count(sum(e.values for e in self.mismatched))} resized, "
            f"{_count(sum(e.values for e in self.dropped))} dropped"
        )
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamSplit:
    """The optimiser's split of a fine-tuning run: ``loaded`` parameter names train at ``lr_loaded``, every
    other trainable one at ``lr_new`` (None: ``optim.lr``)."""

    loaded: frozenset[str]
    lr_loaded: float | None = None
    lr_new: float | None = None


# -- loading -------------------------------------------------------------------------------------


def init_from(
    model: nn.Module, path: str | Path, spec: FinetuneSpec, data_info: Mapping[str, Any] | None = None
) -> InitReport:
    """Copy into ``model`` every tensor of the checkpoint at ``path`` whose name and shape match (``spec``: the
    ``finetune`` section); returns the report. A shape change that ``spec`` does not allow is refused with one
    ``ConfigError`` before anything is copied. ``data_info``: this run's data (``xfam.model.build.data_info``),
    to note a tokenizer other than the checkpoint's (its token embeddings then stand for other tokens)."""
    meta, state, step = model_state(path)  # (a checkpoint, or an `xfam export` folder)
    targets, aliases = _targets(model)
    _check_patterns(spec.interpolate, "finetune.interpolate", list(targets))
    old_task, task = meta.get("data_info", {}).get("task"), getattr(model, "task", None)
    new_head = old_task is not None and task is not None and old_task != task
    loaded: list[Entry] = []
    new: list[Entry] = []
    mismatched: list[Entry] = []
    refused: list[Entry] = []
    plans: list[tuple[Tensor, Tensor, str]] = []
    for name, tensor in targets.items():
        shape, buffer = tuple(tensor.shape), not isinstance(tensor, nn.Parameter)
        source = state.get(name)
        if new_head and name.startswith(HEAD):
            old = tuple(source.shape) if source is not None else None
            new.append(Entry(name=name, old=old, new=shape, buffer=buffer, note=f"head of task {old_task}"))
        elif source is None:
            new.append(Entry(name=name, old=None, new=shape, buffer=buffer, note="not in the checkpoint"))
        elif tuple(source.shape) == shape:
            loaded.append(Entry(name=name, old=shape, new=shape, buffer=buffer))
            plans.append((tensor, source, "copy"))
        else:
            old = tuple(source.shape)
            how = _resize_plan(name, old, shape, spec)
            entry = Entry(name=name, old=old, new=shape, buffer=buffer, note=_resize_note(how, old, shape))
            (mismatched if how != "refuse" else refused).append(entry)
            plans.append((tensor, source, how))
    if refused:
        raise ConfigError(_mismatch_message(str(path), refused, model, meta))
    with torch.no_grad():
        for tensor, source, how in plans:
            _fill(tensor, source.to(tensor.device), how)
    dropped = [
        Entry(name=k, old=tuple(v.shape), new=None, note=f"tied to {aliases[k]} here" if k in aliases else "")
        for k, v in state.items()
        if k not in targets and not _tied_there(k, state, aliases)
    ]
    notes = [f"task {old_task} -> {task}: the output head ({HEAD}*) starts afresh"] if new_head else []
    notes += _tokenizer_note(meta.get("data_info", {}), data_info, loaded)
    return InitReport(
        path=str(path), step=step, loaded=loaded, new=new, mismatched=mismatched, dropped=dropped, notes=notes
    )


def _targets(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors a checkpoint can fill: every parameter and persistent buffer under its first name, and the
    other names of tied ones (``{alias: first name}``), which are filled through their first name."""
    targets: dict[str, Tensor] = {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
            continue
        first[id(tensor)] = name
        targets[name] = tensor
    return targets, aliases


def _tied_there(name: str, state: Mapping[str, Tensor], aliases: Mapping[str, str]) -> bool:
    """Whether the checkpoint's ``name`` is tied as in this model (the same values as the tensor it is tied to
    here, which was filled under its first name): nothing of it is dropped."""
    first = state.get(aliases.get(name, ""))
    return first is not None and first.shape == state[name].shape and torch.equal(first, state[name])


def _resize_plan(name: str, old: Shape, new: Shape, spec: FinetuneSpec) -> str:
    """How a tensor whose shape changed is filled: ``interpolate``, ``overlap`` or ``refuse``."""
    if any(fnmatch.fnmatchcase(name, p) for p in spec.interpolate):
        return "interpolate" if len(old) == len(new) and old[1:] == new[1:] else "refuse"
    return "overlap" if spec.allow_mismatch and len(old) == len(new) else "refuse"


def _resize_note(how: str, old: Shape, new: Shape) -> str:
    if how == "interpolate":
        return f"interpolated over {old[0]} -> {new[0]} positions"
    if how == "overlap":
        return f"overlap {_shape(tuple(min(a, b) for a, b in zip(old, new)))} copied"
    return ""


def _fill(target: Tensor, source: Tensor, how: str) -> None:
    """Write ``source`` into ``target`` (in place, under no_grad): all of it, its overlap, or resampled."""
    if how == "copy":
        target.copy_(source)
    elif how == "overlap":
        block = tuple(slice(0, min(a, b)) for a, b in zip(source.shape, target.shape))
        target[block].copy_(source[block])
    else:
        target.copy_(interpolate_rows(source, target.shape[0]))


def interpolate_rows(table: Tensor, rows: int) -> Tensor:
    """``table`` [L, ...] resampled to [rows, ...] along its first (position) axis by linear interpolation:
    row ``i`` is the old table at position ``i * L / rows`` (Chen et al., 2023, arXiv:2306.15595: position m of
    the longer context is encoded as position m L / L'), clamped to the last row."""
    length = table.shape[0]
    x = torch.arange(rows, dtype=torch.float64) * (length / rows)  # [rows]
    lo = x.floor().long().clamp(max=length - 1)
    hi = (lo + 1).clamp(max=length - 1)
    w = (x - lo).clamp(max=1.0).to(torch.float32).view(-1, *([1] * (table.dim() - 1)))  # [rows, 1, ...]
    src = table.float()
    return (src[lo] * (1 - w) + src[hi] * w).to(table.dtype)  # [rows, ...]


def _mismatch_message(path: str, refused: list[Entry], model: nn.Module, meta: Mapping[str, Any]) -> str:
    lines = [
        f"{names}: {_shape(e.old)} in the checkpoint, {_shape(e.new)} here" for names, e, _, _ in _grouped(refused)
    ]
    shown = "\n  ".join(lines[:20] + ([f"... and {len(lines) - 20} more groups"] if len(lines) > 20 else []))
    diff = _spec_diff(meta.get("config", {}).get("model", {}), getattr(model, "spec", None))
    changed = f" (the config changed {', '.join(diff)})" if diff else ""
    fixes = [
        "finetune.allow_mismatch=true to copy the overlapping block of each (the rest keeps its fresh init)",
    ]
    tables = [
        e.name
        for e in refused
        if e.name.startswith("pos.") and e.old is not None and e.new is not None and len(e.new) > 1
        if e.old[1:] == e.new[1:]
    ]
    if tables:
        fixes.append(f"finetune.interpolate=[{','.join(tables[:3])}] to resample a position table to its new length")
    fixes.append("a config with the checkpoint's sizes")
    return (
        f"init_from={path}: {len(refused)} tensor(s) have another shape in this model than in the checkpoint"
        f"{changed}:\n  {shown}\nA shape change is loaded only when asked for. Fix: " + ", or ".join(fixes) + "."
    )


def _spec_diff(saved: Mapping[str, Any], spec: Any) -> list[str]:
    """``model.key old -> new`` for the model settings that differ between the checkpoint and ``spec``."""
    if spec is None or not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return []
    now = dataclasses.asdict(spec)
    return [f"model.{k} {saved[k]!r} -> {now[k]!r}" for k in now if k != "name" and k in saved and saved[k] != now[k]]


def _tokenizer_note(saved: Mapping[str, Any], now: Mapping[str, Any] | None, loaded: list[Entry]) -> list[str]:
    if now is None or not any(e.name == "embed.weight" for e in loaded):
        return []
    was, is_now = saved.get("tokenizer"), now.get("tokenizer")
    if was is not None and is_now is not None and was != is_now:
        return ["this data's tokenizer is not the checkpoint's: the loaded token embeddings stand for other tokens"]
    return []


# -- freezing and the optimiser's split ----------------------------------------------------------


def freeze(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Stop the parameters whose names match any of ``patterns`` (fnmatch; every name of a tied parameter
    counts) from training (``requires_grad=False``); returns their names. A pattern that matches nothing is
    a ``ConfigError`` naming parameters there are."""
    patterns = list(patterns)
    named = list(model.named_parameters(remove_duplicate=False))
    _check_patterns(patterns, "finetune.freeze", [n for n, _ in named])
    frozen = []
    for name, p in named:
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def _check_patterns(patterns: list[str], key: str, names: list[str]) -> None:
    """Refuse patterns of ``key`` that match none of ``names``, showing the names nearest to each."""
    problems = []
    for pat in patterns:
        if any(fnmatch.fnmatchcase(n, pat) for n in names):
            continue
        near = difflib.get_close_matches(pat, grouped_names(names), n=6, cutoff=0.0)
        problems.append(
            f"{key}: pattern {pat!r} matches no tensor of this model. Its tensors are named like: "
            f"{', '.join(near)} ({len(names)} in all; {{a-b}}: layers a to b). Fix: correct the pattern (fnmatch: * "
            f"matches any characters, dots included, e.g. embed.* or blocks.0.*), or remove it."
        )
    if problems:
        raise ConfigError(problems)


def mark_split(model: nn.Module, split: ParamSplit) -> None:
    """Record on ``model`` the optimiser's split of a fine-tuning run (read by ``split_of``)."""
    setattr(model, SPLIT_ATTR, split)


def split_of(model: nn.Module) -> ParamSplit | None:
    """The split ``mark_split`` recorded on ``model`` (None: an ordinary run, no split)."""
    return getattr(model, SPLIT_ATTR, None)


def split_params(model: nn.Module, loaded: Collection[str]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trainable parameters of ``model`` (each once, frozen ones left out), split into those named in
    ``loaded`` and the others, in the model's order. Names are compared without the modules that wrappers
    insert (FSDP, activation checkpointing, torch.compile)."""
    loaded = {_WRAPPERS.sub("", n) for n in loaded}
    old: list[nn.Parameter] = []
    new: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (old if _WRAPPERS.sub("", name) in loaded else new).append(p)
    return old, new


# -- validation before launch --------------------------------------------------------------------


def finetune_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Problems of ``init_from`` and the ``finetune`` section of a composed config (their types are checked
    against ``RunSpec`` and ``FinetuneSpec`` besides): the file, its combination with ``ckpt_path``, settings
    that do nothing without ``init_from``, empty patterns. Reads the checkpoint's structure only (memory-mapped,
    no tensor data), not its digest: the runner's read verifies that."""
    path, ft = cfg.get("init_from"), cfg.get("finetune")
    ft = ft if isinstance(ft, Mapping) else {}
    problems = [
        f"finetune.{key}: an empty pattern matches no parameter. Fix: remove it from the list."
        for key in ("freeze", "interpolate")
        if isinstance(ft.get(key), list) and any(isinstance(p, str) and not p.strip() for p in ft[key])
    ]
    if path is None:
        unused = [f"finetune.{k}" for k in ("allow_mismatch", "interpolate", "lr_loaded", "lr_new") if ft.get(k)]
        if unused:
            problems.append(
                f"{', '.join(unused)} set without init_from: they describe how a checkpoint's weights start a run, "
                f"and this run starts from none. Fix: init_from=<a .ckpt file>, or remove them."
            )
        return problems
    if not isinstance(path, str):
        return problems  # (RunSpec's type check says so)
    if is_exported(path):
        try:
            weights_file = Path(path) / read_config(path)["weights"].get("file", WEIGHTS_FILE)
        except ConfigError as err:
            return [*problems, f"init_from={path!r}: {err}"]
        if not weights_file.is_file():  # (its digest is checked when the weights are read)
            problems.append(
                f"init_from={path!r} has no {weights_file.name}, the model's weights. Fix: copy the whole folder "
                f"again from its source."
            )
        return problems
    if not os.path.isfile(path) and not is_sharded(path):
        problems.append(
            f"init_from={path!r}: no such file (nor a checkpoint's folder). Fix: give the path of an xfam "
            f"checkpoint (a .ckpt file, a folder written by trainer=fsdp, or one written by xfam export)."
        )
    elif (why := _not_a_checkpoint(path)) is not None:
        problems.append(f"init_from={path!r}: {why}. Fix: give the path of a checkpoint written by xfam.")
    if (ckpt := cfg.get("ckpt_path")) not in (None, "auto"):
        problems.append(
            f"init_from={path!r} with ckpt_path={ckpt!r}: ckpt_path resumes that checkpoint exactly (its weights, "
            f"optimiser and step), init_from starts a new run from other weights. Fix: remove ckpt_path to "
            f"fine-tune from init_from, or remove init_from to resume; to continue a fine-tuning run after a stop, "
            f"use ckpt_path=auto (it resumes the run's own last checkpoint; init_from applies to its first start)."
        )
    return problems


def _not_a_checkpoint(path: str) -> str | None:
    """Why ``path`` is not an xfam checkpoint (None: it looks like one), from its memory-mapped structure."""
    folder = is_sharded(path)  # (its weights are the shards, not a key of meta.pt)
    try:
        ckpt = load_meta(Path(path)) if folder else torch.load(path, "cpu", weights_only=True, mmap=True)
    except Exception as err:  # not a torch zip file, truncated, hostile
        return f"cannot be read as a checkpoint ({short_reason(err)})"
    if not isinstance(ckpt, dict) or "xfam" not in ckpt or not (folder or "state_dict" in ckpt):
        return "not an xfam checkpoint (no 'xfam' metadata or no weights)"
    return None


# -- formatting ----------------------------------------------------------------------------------


def grouped_names(names: Iterable[str]) -> list[str]:
    """Names alike but for their layer index as one: ``blocks.{0-3}.attn.qkv.weight`` (for logs)."""
    return [g for g, *_ in _grouped(Entry(name=n, old=None, new=()) for n in names)]


def _grouped(entries: Iterable[Entry]) -> list[tuple[str, Entry, int, int]]:
    """Entries alike but for their first index (the layer: ``blocks.3.attn.qkv.weight``) as one row
    ``(blocks.{0-3}.attn.qkv.weight, first entry, count, values)``, in the order first seen."""
    rows: dict[tuple, list[Any]] = {}
    for e in entries:
        m = re.search(r"(?<=\.)\d+(?=\.)", e.name)
        key = (e.name[: m.start()] + "{}" + e.name[m.end() :] if m else e.name, e.old, e.new, e.buffer, e.note)
        row = rows.setdefault(key, [[], e, 0, 0])
        row[0].append(int(m.group()) if m else None)
        row[2] += 1
        row[3] += e.values
    out = []
    for (pattern, *_), (indices, first, n, values) in rows.items():
        name = pattern.replace("{}", "{" + _ranges(indices) + "}") if "{}" in pattern else pattern
        out.append((name, first, n, values))
    return out


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _shapes(e: Entry) -> str:
    if e.old is not None and e.new is not None and e.old != e.new:
        return f"{_shape(e.old)} -> {_shape(e.new)}"
    return _shape(e.new if e.new is not None else e.old)


def _shape(shape: Shape | None) -> str:
    return "-" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _count(n: int) -> str:
    """1234567 -> ``1.23M``."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
