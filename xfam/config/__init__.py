"""Validation of a whole composed configuration, before any tensor is allocated or file written.

``validate(cfg)`` collects every problem in every section (unknown names and keys, wrong types,
impossible values, incompatible slot combinations) and raises one ``ConfigError`` listing them
all, each with the fix. It reads signatures and class attributes only: no data, no model.
"""

from __future__ import annotations

import ast
import dataclasses
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
from xfam.attention._base import ATTENTION
from xfam.config import trainer_args
from xfam.config.specs import CallbacksSpec, LoaderSpec, LoggerSpec, OptimSpec, RunSpec, wandb_online_problem
from xfam.core.errors import ConfigError, did_you_mean, unknown_choice
from xfam.core.registry import check_params
from xfam.core.schedule import per_head, per_layer
from xfam.data.base import DATA
from xfam.exit._base import EXIT
from xfam.memory._base import MEMORY
from xfam.model import compat
from xfam.model.spec import ModelSpec
from xfam.pos._base import POS

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
            hint = did_you_mean(key, valid)
            out.append(f"trainer: unknown key {key!r}.{hint} Valid keys: {', '.join(valid)}. Fix: remove or rename it.")
    out += trainer_args.problems(trainer)  # values and combinations of Lightning's arguments
    valid_precision = not any(p.startswith("trainer.precision") for p in out)
    if trainer.get("accelerator") == "cpu" and str(trainer.get("precision", "32")).startswith("16") and valid_precision:
        out.append(
            f"trainer.precision={trainer['precision']!r} needs a GPU (fp16 autocast is not supported on CPU). "
            f"Fix: trainer.precision=32-true or bf16-mixed (slow on CPUs without bf16 units)."
        )
    return out


def check_machine(cfg: Mapping[str, Any]) -> None:
    """Refuse a trainer this machine cannot run (no GPU for ``trainer=gpu/ddp/fsdp``), a Triton backend
    it cannot run (``backend=triton`` without CUDA or ``TRITON_INTERPRET=1``), or wandb online without
    credentials here (``xfam.config.specs.wandb_online_problem``), in one message.

    Kept apart from ``validate``, which judges the config alone: a config meant for a GPU node is
    valid on a laptop or a SLURM login node, and is checked where it runs."""
    import torch

    if (why := wandb_online_problem(cfg["logger"])) is not None:  # credentials: where it runs, as the GPUs
        raise ConfigError(why)
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


_ABSENT = object()


def _missing_section(section: str, value: Any) -> str:
    """A config section that is absent (``~model``) or not a mapping (``model=null``, ``+model=3``)."""
    groups = {
        "model": "model=tiny",
        "attention": "attention=vanilla",
        "pos": "pos=rope",
        "memory": "memory=none",
        "exit": "exit=none",
        "data": "data=text",
        "optim": "optim=adamw",
        "trainer": "trainer=cpu",
        "logger": "logger=csv",
        "callbacks": "callbacks=default",
    }
    what = "is missing (deleted, e.g. by ~" + section + ")" if value is _ABSENT else f"is {value!r}, not a section"
    if section in groups:
        fix = f"select one with {groups[section]} (`python train.py --help` lists the options)"
    else:  # (loader: a section of configs/train.yaml itself)
        fix = f"remove the override that deleted or replaced it ({section} is a section of configs/train.yaml)"
    return f"config section {section!r} {what}: every run needs it. Fix: {fix}."


def _yaml(value: Any) -> str:
    """``value`` as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    return str(value)


def _missing_keys(cls: type, params: Mapping[str, Any], section: str) -> list[str]:
    """Keys of a fixed section (its dataclass's fields) that the config lacks: xfam reads every one, and the
    YAML carries them all, so a missing one was deleted (``~model.dim``)."""
    out = []
    for field in dataclasses.fields(cls):
        if field.name in params:
            continue
        key = f"{section}.{field.name}" if section else field.name
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        out.append(
            f"{key}: missing (deleted, e.g. by ~{key}); xfam reads every key of "
            f"{'the ' + section + ' section' if section else 'the top level of the config'}. "
            f"Fix: remove the ~{key} override, or set {key}={_yaml(default)} (its default)."
        )
    return out


def _name_problems(name: Any) -> list[str]:
    """``name`` is one folder under the runs folder: ``runs/<name>/<overrides>``."""
    if not isinstance(name, str):
        return []  # (check_params: must be a string)
    fix = "Fix: name=<one folder name, without '/' or '..'>, e.g. name=baseline."
    if not name.strip():
        return [f"name={name!r} is empty: the run directory is runs/<name>/<overrides>. {fix}"]
    if "/" in name or "\\" in name or ".." in name:
        return [
            f"name={name!r} contains {'/' if '/' in name else '..' if '..' in name else chr(92)!r}: the run "
            f"directory is runs/<name>/<overrides>, so this name would write outside the runs folder (or into a "
            f"folder of another run group). {fix}"
        ]
    if name != name.strip() or any(ord(c) < 32 for c in name):
        return [f"name={name!r} starts or ends with white space or holds control characters. {fix}"]
    return []


def _causal_problems(spec: ModelSpec, task: str, data: Any) -> list[str]:
    """``model.causal`` against the task: a language model must not see the token it predicts, and a causal
    classifier that pools the first token sees only that token."""
    if task == "lm" and spec.causal is False:
        classify = ", ".join(f"data={n}" for n, c in DATA.items() if c.task == "classify")
        return [
            f"model.causal=false with data={data}, a language-modelling task: each position is trained to predict "
            f"the next token, and with bidirectional attention it sees that token (the loss falls by copying its "
            f"targets; a masked-LM objective would be a separate task). Fix: model.causal=null (causal for "
            f"language modelling) or model.causal=true, or a classification dataset ({classify}) for a "
            f"bidirectional model."
        ]
    if task == "classify" and spec.causal is True and spec.pool == "cls":
        return [
            f"model.causal=true with model.pool=cls on data={data}: under causal attention the first token sees "
            f"only itself, so the pooled vector the classifier reads carries nothing of the rest of the input. "
            f"Fix: model.pool=mean (the mean of every position, each of which sees its prefix), or "
            f"model.causal=null (bidirectional for classification)."
        ]
    return []


#: Aux-loss metrics are ``{split}/{slot}/{name}`` with names of the components' own (``val/attention/span``).
AUX_METRIC_SLOTS = ("attention", "memory", "exit")


def final_metrics(cfg: Mapping[str, Any], data_cls: type | None, sel: compat.Selection) -> list[str]:
    """The metric names a run of ``cfg`` returns when it ends (``runner.train``; what ``optimized_metric``
    may name): ``step``, ``train/tokens_per_s``, and for val (and test, with ``test=true``) the task's metrics
    (``xfam.eval.metrics.summarize``): loss and acc; lm: ppl, and bpb for byte-backed text; an exit policy's depth
    and compute_saved; an early-exit policy's full-depth metrics and agreement. Aux losses
    (``val/attention/span`` ...) are named by the components and matched by prefix (``AUX_METRIC_SLOTS``)."""
    from xfam.data.packing import PackedLM

    names = ["loss", "acc"]
    if sel.task == "lm":
        names += ["ppl"] + (["bpb"] if data_cls is not None and issubclass(data_cls, PackedLM) else [])
    exit_cls = sel.exit[0]
    if exit_cls.registry_name != "none":
        names += ["depth", "compute_saved"]
    if exit_cls.early_exit:
        full = ["loss", "acc"] + (["ppl", "bpb"] if "bpb" in names else ["ppl"] if sel.task == "lm" else [])
        names += [f"full/{n}" for n in full] + ["agreement"]
    splits = ["val", "test"] if cfg.get("test", True) else ["val"]
    return ["step", "train/tokens_per_s"] + [f"{s}/{n}" for s in splits for n in names]


def _metric_problems(cfg: Mapping[str, Any], data_cls: type | None, sel: compat.Selection) -> list[str]:
    """``optimized_metric`` (read when the run ends) and ``callbacks.monitor`` (read at each validation) must
    name metrics this run produces: found wrong only after training, otherwise."""
    out = []
    final = final_metrics(cfg, data_cls, sel)
    aux = lambda *splits: tuple(f"{s}/{slot}/" for s in splits for slot in AUX_METRIC_SLOTS)  # noqa: E731
    metric = cfg.get("optimized_metric")
    splits = ("val", "test") if cfg.get("test", True) else ("val",)
    if isinstance(metric, str) and metric not in final and not metric.startswith(aux(*splits)):
        hint = did_you_mean(metric, final)
        out.append(
            f"optimized_metric={metric!r} is not a metric this run reports when it ends (the sweeper would get "
            f"nothing after the whole training).{hint} Valid: {', '.join(final)}, or an auxiliary loss "
            f"val/<attention|memory|exit>/<name>. Fix: optimized_metric=val/loss (say)."
        )
    monitor, callbacks = cfg["callbacks"].get("monitor"), cfg["callbacks"]
    logged = [m for m in final if m.startswith("val/")] + ["train/loss", "global_step"]
    if "val/depth" in final:
        logged.append("train/depth")
    if (
        callbacks.get("save_best")
        and isinstance(monitor, str)
        and monitor not in logged
        and not monitor.startswith(aux("val", "train"))
    ):
        hint = did_you_mean(monitor, logged)
        out.append(
            f"callbacks.monitor={monitor!r} is not a metric logged at validation (best.ckpt keeps the lowest "
            f"one; Lightning stops at the first validation without it).{hint} Valid: {', '.join(logged)}. "
            f"Fix: callbacks.monitor=val/loss, or callbacks.save_best=false."
        )
    return out


def validate(cfg: Mapping[str, Any]) -> None:
    """Raise one ``ConfigError`` with every problem in ``cfg`` (a plain, resolved config dict)."""
    problems: list[str] = []
    if missing := [s for s in SECTIONS if not isinstance(cfg.get(s), Mapping)]:
        raise ConfigError([_missing_section(s, cfg.get(s, _ABSENT)) for s in missing])
    top = {k: v for k, v in cfg.items() if k not in SECTIONS}
    problems += check_params(RunSpec, top, "config", structural=()) + _missing_keys(RunSpec, top, "")
    problems += _name_problems(top.get("name"))
    for section, cls in (("loader", LoaderSpec), ("optim", OptimSpec), ("logger", LoggerSpec)):
        problems += check_params(cls, cfg[section], section, structural=()) + _missing_keys(cls, cfg[section], section)
    problems += check_params(CallbacksSpec, cfg["callbacks"], "callbacks", structural=())
    problems += _missing_keys(CallbacksSpec, cfg["callbacks"], "callbacks")
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
    model_problems += _missing_keys(ModelSpec, cfg["model"], "model")
    problems += model_problems
    if model_problems:
        raise ConfigError(problems)
    spec = ModelSpec(**cfg["model"])
    problems += spec.problems()
    if spec.problems():
        raise ConfigError(problems)
    task = data_cls.task if data_cls else "lm"
    causal = spec.causal if spec.causal is not None else task == "lm"
    problems += _causal_problems(spec, task, cfg["data"].get("name"))
    slot_problems, sel = _slot_problems(cfg, spec, causal, task)
    problems += slot_problems
    if sel is not None:
        problems += compat.check(sel)
        problems += _metric_problems(cfg, data_cls, sel)
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
