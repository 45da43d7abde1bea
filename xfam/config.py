"""Validation of a whole composed configuration, before any tensor is allocated or file written.

``validate(cfg)`` collects every problem in every section (unknown names and keys, wrong types,
impossible values, incompatible slot combinations) and raises one ``ConfigError`` listing them
all, each with the fix. It reads signatures and class attributes only: no data, no model.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xfam.attention
import xfam.data
import xfam.exit
import xfam.memory
import xfam.pos  # noqa: F401  (registers every component)
from xfam import compat
from xfam.attention.base import ATTENTION
from xfam.data.base import DATA
from xfam.errors import ConfigError, close_matches, unknown_choice
from xfam.exit.base import EXIT
from xfam.memory.base import MEMORY
from xfam.model.spec import ModelSpec
from xfam.pos.base import POS
from xfam.registry import check_params
from xfam.schedule import per_head, per_layer
from xfam.specs import CallbacksSpec, LoaderSpec, LoggerSpec, OptimSpec, RunSpec

SLOTS = {"attention": ATTENTION, "pos": POS, "memory": MEMORY, "exit": EXIT}
SECTIONS = ("model", "attention", "pos", "memory", "exit", "data", "loader", "optim", "trainer", "logger", "callbacks")
#: Trainer arguments xfam sets itself (from the logger/callbacks groups and the run directory).
TRAINER_OWNED = (
    "logger",
    "callbacks",
    "plugins",
    "default_root_dir",
    "use_distributed_sampler",
    "enable_checkpointing",
)


#: Keys of the trainer section that xfam reads itself (not Lightning arguments), with their choices.
XFAM_TRAINER = {"nonfinite": ("stop", "skip"), "matmul_precision": ("highest", "high", "medium")}
#: Integer keys of the trainer section that xfam reads itself, with their smallest valid value.
XFAM_TRAINER_INTS = {"max_nonfinite_skips": 1}


def _trainer_params() -> list[str]:
    names = lightning_trainer_args()
    return [n for n in names if n not in TRAINER_OWNED]


@functools.cache
def lightning_trainer_args(source: bool = True) -> list[str]:
    """The argument names of ``lightning.Trainer``, read from its source file: importing Lightning takes
    ~4 s, most of the time a refused command line costs (its signature when the source cannot be read)."""
    spec = importlib.util.find_spec("lightning")  # finds the package without importing it
    if source and spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0], "pytorch", "trainer", "trainer.py")
        try:
            tree = ast.parse(path.read_text())
        except (OSError, SyntaxError):
            tree = ast.Module(body=[], type_ignores=[])
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Trainer":
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name == "__init__" and not fn.args.kwarg:
                        return [a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs]
    import lightning

    return [p for p in inspect.signature(lightning.Trainer.__init__).parameters if p != "self"]


def check_trainer(trainer: Mapping[str, Any]) -> list[str]:
    valid = _trainer_params() + list(XFAM_TRAINER) + list(XFAM_TRAINER_INTS)
    out = []
    for key in trainer:
        if key in XFAM_TRAINER_INTS:
            value, low = trainer[key], XFAM_TRAINER_INTS[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                out.append(f"trainer.{key}={value!r}: must be an integer >= {low}. Fix: trainer.{key}=10 (say).")
        elif key in XFAM_TRAINER:
            if trainer[key] not in (choices := XFAM_TRAINER[key]):
                out.append(unknown_choice(f"trainer.{key}", trainer[key], choices, f"trainer.{key}={choices[0]}."))
        elif key in TRAINER_OWNED:
            out.append(f"trainer.{key}: set by xfam from the logger/callbacks groups. Fix: remove it from trainer.")
        elif key not in valid:
            near = close_matches(key, valid)
            hint = f" Did you mean {' or '.join(map(repr, near))}?" if near else ""
            out.append(f"trainer: unknown key {key!r}.{hint} Valid keys: {', '.join(valid)}. Fix: remove or rename it.")
    if trainer.get("accelerator") == "cpu" and str(trainer.get("precision", "32")).startswith("16"):
        out.append(
            f"trainer.precision={trainer['precision']!r} needs a GPU (fp16 autocast is not supported on CPU). "
            f"Fix: trainer.precision=32-true or bf16-mixed (slow on CPUs without bf16 units)."
        )
    return out


def check_machine(cfg: Mapping[str, Any]) -> None:
    """Refuse a trainer this machine cannot run (no GPU for ``trainer=gpu/ddp/fsdp``), or a Triton backend
    it cannot run (``backend=triton`` without CUDA or ``TRITON_INTERPRET=1``), in one message.

    Kept apart from ``validate``, which judges the config alone: a config meant for a GPU node is
    valid on a laptop or a SLURM login node, and is checked where it runs."""
    import torch

    trainer = cfg["trainer"]
    strategy, accelerator = str(trainer.get("strategy", "auto")), str(trainer.get("accelerator", "auto"))
    cuda = torch.cuda.is_available()
    gpu = cuda or torch.backends.mps.is_available()
    where = "this machine has none (torch.cuda.is_available() is False)"
    if strategy.startswith("fsdp") and not cuda:
        raise ConfigError(
            f"trainer.strategy={strategy!r} (trainer=fsdp) shards the model over CUDA GPUs, and {where}. "
            "Fix: trainer=fsdp needs GPUs; on CPU use trainer=ddp_cpu (data parallel over 2 processes) or "
            "trainer=cpu, or run it on a GPU machine (e.g. python train.py -m hydra/launcher=slurm trainer=fsdp)."
        )
    if (accelerator == "cuda" and not cuda) or (accelerator == "gpu" and not gpu):
        raise ConfigError(
            f"trainer.accelerator={accelerator!r} (trainer=gpu / ddp) needs a GPU, and {where}. "
            "Fix: on CPU use trainer=cpu (or trainer=ddp_cpu for 2 processes), or run it on a GPU machine."
        )
    triton = [
        path for path, value in _settings(cfg, ("attention", "pos")) if path.endswith("backend") and value == "triton"
    ]
    if triton:
        from xfam.kernels.runtime import why_not

        if (why := why_not(torch.device("cuda" if cuda else "cpu"))) is not None:
            raise ConfigError(f"{', '.join(t + '=triton' for t in triton)}: {why}")


def _settings(cfg: Mapping[str, Any], sections: tuple[str, ...]) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf under ``sections`` (per-layer and per-head entries included)."""
    out: list[tuple[str, Any]] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(f"{prefix}.{key}", value)
        elif isinstance(node, list | tuple):
            for i, value in enumerate(node):
                walk(f"{prefix}.{i}", value)
        else:
            out.append((prefix, node))

    for section in sections:
        walk(section, cfg.get(section, {}))
    return out


def resolve_streams(cfg: Mapping[str, Any]) -> tuple[bool, str]:
    """``streams_of`` for a validated config."""
    layers = cfg["model"]["layers"]
    memory = [(MEMORY.get(m["name"]), m) for m in per_layer(cfg["memory"], layers, "memory")]
    return streams_of(cfg["loader"], memory)


def streams_of(loader: Mapping[str, Any], memory: list[tuple[type, dict]]) -> tuple[bool, str]:
    """Whether batches are contiguous streams, and why (``loader.streams=auto``: when a memory needs them)."""
    chosen = loader.get("streams", "auto")
    if chosen != "auto":
        return bool(chosen), f"loader.streams={str(chosen).lower()}"
    needing = sorted({cls.registry_name for cls, _ in memory if cls.needs_streams})
    if needing:
        return True, f"loader.streams=auto: contiguous streams, as memory={needing[0]} carries state across batches"
    return False, "loader.streams=auto: shuffled rows (no memory needs streams)"


def _slot_problems(
    cfg: Mapping[str, Any], spec: ModelSpec, causal: bool, task: str
) -> tuple[list[str], compat.Selection | None]:
    """Problems of the four slot sections, and the selection when they are individually valid."""
    problems: list[str] = []
    ctx = spec.structural(causal)
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
    )
    return [], sel


def validate(cfg: Mapping[str, Any]) -> None:
    """Raise one ``ConfigError`` with every problem in ``cfg`` (a plain, resolved config dict)."""
    problems: list[str] = []
    missing = [s for s in SECTIONS if not isinstance(cfg.get(s), Mapping)]
    if missing:
        raise ConfigError(f"config sections missing or not mappings: {missing}. Fix: compose from configs/train.yaml.")
    top = {k: v for k, v in cfg.items() if k not in SECTIONS}
    problems += check_params(RunSpec, top, "config", structural=())
    problems += check_params(LoaderSpec, cfg["loader"], "loader", structural=())
    problems += check_params(OptimSpec, cfg["optim"], "optim", structural=())
    problems += check_params(LoggerSpec, cfg["logger"], "logger", structural=())
    problems += check_params(CallbacksSpec, cfg["callbacks"], "callbacks", structural=())
    if (sig := cfg["callbacks"].get("requeue_signal")) is not None and sig == cfg["callbacks"].get("stop_signal"):
        problems.append(
            f"callbacks.requeue_signal and callbacks.stop_signal are both {sig}. "
            f"Fix: give them different signals, or set one to null."
        )
    problems += check_trainer(cfg["trainer"])
    if (ckpt := cfg.get("ckpt_path")) not in (None, "auto") and not os.path.isfile(ckpt):
        problems.append(f"ckpt_path={ckpt!r}: no such file. Fix: give an existing checkpoint, or ckpt_path=auto.")
    if cfg["data"].get("name") not in DATA:
        problems.append(unknown_choice("data", cfg["data"].get("name"), DATA.names(), "pass data=<one of them>."))
        data_cls = None
    else:
        problems += DATA.check(cfg["data"], {})
        data_cls = DATA.get(cfg["data"]["name"])
    model_problems = check_params(ModelSpec, cfg["model"], "model", structural=())
    problems += model_problems
    if model_problems:
        raise ConfigError(problems)
    spec = ModelSpec(**cfg["model"])
    problems += spec.problems()
    if spec.problems():
        raise ConfigError(problems)
    task = data_cls.task if data_cls else "lm"
    causal = spec.causal if spec.causal is not None else task == "lm"
    slot_problems, sel = _slot_problems(cfg, spec, causal, task)
    problems += slot_problems
    if sel is not None:
        problems += compat.check(sel)
        seq_len = cfg["data"].get("seq_len")
        if sel.pos[0].bounded and isinstance(seq_len, int) and seq_len > spec.max_len:
            problems.append(
                f"data.seq_len={seq_len} is longer than the learned position table (model.max_len={spec.max_len}). "
                f"Fix: model.max_len={seq_len} or more, a shorter data.seq_len, or a pos that extrapolates "
                f"(pos=rope, pos=alibi)."
            )
        if (n := spec.num_memory_tokens) and isinstance(seq_len, int) and seq_len + n > spec.max_len:
            problems.append(
                f"data.seq_len={seq_len} plus model.num_memory_tokens={n} makes {seq_len + n} tokens per row, more "
                f"than model.max_len={spec.max_len} (memory tokens take no absolute position, but attention slots). "
                f"Fix: model.max_len={seq_len + n} or more, a shorter data.seq_len, or fewer memory tokens."
            )
        if sel.streams and data_cls is not None and not data_cls.contiguous:
            why = streams_of(cfg["loader"], sel.memory)[1]
            problems.append(
                f"{why}: contiguous streams need a contiguous source (consecutive rows of one token stream); "
                f"data={cfg['data']['name']} is not. Fix: data=text or data=hf"
                + (", or memory=none." if sel.has_memory else ", or loader.streams=false.")
            )
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
