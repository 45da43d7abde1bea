"""``validate``: every problem of a whole composed configuration, before any tensor is allocated or file written.

It collects every problem in every section (unknown names and keys, wrong types, impossible values,
incompatible slot combinations) and raises one ``ConfigError`` listing them all, each with the fix; a
valid config comes back as a ``RunConfig`` (``xfam.config.run``): what validation derived, typed, for
the stages after it. It reads signatures and class attributes only: no data, no model.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, cast

import xfam.data  # noqa: F401  (registers every data source)
from xfam.config.metrics import _metric_problems
from xfam.config.run import RunConfig
from xfam.config.slots import _slot_problems, encoder_is_default, encoder_stack, streams_of
from xfam.config.specs import CallbacksSpec, LoaderSpec, LoggerSpec, OptimSpec, RunSpec
from xfam.config.task import TaskSpec, arch_problems, known_task, resolve_task
from xfam.config.trainer import check_trainer
from xfam.config.trainer_args import SHARDED_STRATEGIES
from xfam.core import plugins
from xfam.core.errors import ConfigError, unknown_choice
from xfam.core.registry import check_params
from xfam.core.schedule import per_layer
from xfam.data.base import DATA
from xfam.data.tokenize import load_pretrained
from xfam.model import compat
from xfam.model.init_from import FinetuneSpec, finetune_problems
from xfam.model.inputs import TOKENS, input_problems
from xfam.model.sharded import is_sharded
from xfam.model.spec import ModelSpec

SECTIONS = (
    "model",
    "attention",
    "pos",
    "memory",
    "exit",
    "data",
    "task",
    "encoder",
    "cross_attention",
    "loader",
    "optim",
    "trainer",
    "logger",
    "callbacks",
    "finetune",
)

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
        "task": "task=auto",
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
        if field.default is not dataclasses.MISSING:
            default = field.default
        else:
            assert callable(field.default_factory)  # (every field of a section has a default)
            default = field.default_factory()
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
    if task == "regress" and spec.causal is False:
        return [
            f"model.causal=false with data={data}, a regress task: each position is trained to predict the next "
            f"vector, and with bidirectional attention it sees that vector. Fix: model.causal=null."
        ]
    if task == "decision" and spec.causal is False:
        return [
            f"model.causal=false with data={data}, a decision task: the action a_t is predicted from the state "
            f"token s_t, and with bidirectional attention that token sees a_t (and the future). Fix: model.causal=null."
        ]
    if task == "classify" and spec.causal is True and spec.pool == "cls":
        return [
            f"model.causal=true with model.pool=cls on data={data}: under causal attention the first token sees "
            f"only itself, so the pooled vector the classifier reads carries nothing of the rest of the input. "
            f"Fix: model.pool=mean (the mean of every position, each of which sees its prefix), or "
            f"model.causal=null (bidirectional for classification)."
        ]
    return []


def _tokenizer_vocab_problems(data: Mapping[str, Any], vocab_size: int) -> list[str]:
    """A pretrained tokenizer (``data.tokenizer=<path>``) whose ids do not fit ``model.vocab_size``, known before any
    data is read (its vocabulary is in the file)."""
    kind = data.get("tokenizer")
    if kind in (None, "byte", "bpe"):
        return []
    ids = load_pretrained(kind).vocab_size
    if ids <= vocab_size:
        return []
    return [
        f"data.tokenizer={kind} has {ids} token ids, more than model.vocab_size={vocab_size}: its ids past "
        f"{vocab_size - 1} would fall outside the embedding. Fix: model.vocab_size=null (take it from the tokenizer) "
        f"or >= {ids}, or a tokenizer of at most {vocab_size} ids."
    ]


def _streaming_trainer_problems(trainer: dict[str, Any]) -> list[str]:
    """A streamed train split never ends an epoch (``xfam.data.streaming``): training stops at a step count, and
    validation runs every so many steps."""
    problems = []
    if not isinstance(trainer.get("max_steps"), int) or trainer["max_steps"] <= 0:
        problems.append(
            f"data.streaming=true reads an endless stream, so training must stop at a step count, and "
            f"trainer.max_steps={trainer.get('max_steps')}. Fix: trainer.max_steps=<steps>."
        )
    interval = trainer.get("val_check_interval")
    if interval is not None and not isinstance(interval, int):
        problems.append(
            f"data.streaming=true has no epochs, so validation runs every so many steps, and "
            f"trainer.val_check_interval={interval} is a fraction of an epoch. Fix: trainer.val_check_interval="
            f"<steps>, e.g. 250."
        )
    return problems


def _pair_length_problems(data: Mapping[str, Any], arch: str, spec: ModelSpec, sel: compat.Selection) -> list[str]:
    """Source/target pairs against a learned position table: an encoder-decoder's rows are the source and the
    target (each at most its length), a decoder-only model's one row holds both."""
    src, tgt = data.get("source_len"), data.get("target_len")
    if not (isinstance(src, int) and isinstance(tgt, int)) or not sel.pos[0].bounded:
        return []
    longest, what = (src + tgt, "data.source_len + data.target_len") if arch == "decoder" else (max(src, tgt), "")
    if longest <= spec.max_len:
        return []
    what = what or ("data.source_len" if src >= tgt else "data.target_len")
    return [
        f"{what}={longest} is longer than the learned position table (model.max_len={spec.max_len})"
        + (" (a decoder-only model reads the source and the target as one row)" if arch == "decoder" else "")
        + f". Fix: model.max_len={longest} or more, shorter pairs, or a pos that extrapolates (pos=rope, pos=alibi)."
    ]


def _image_of(data_cls: Any, data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The geometry of the data's images for ``Selection.image`` (a source with ``image_geometry``: ``data=pixels``);
    None for other data."""
    geometry = getattr(data_cls, "image_geometry", None)
    return geometry(data) if geometry is not None else None


def validate(cfg: Mapping[str, Any]) -> RunConfig:
    """Raise one ``ConfigError`` with every problem in ``cfg`` (a plain, resolved config dict); a valid one
    comes back as its ``RunConfig`` (built from a copy of ``cfg``: later changes to ``cfg`` do not reach it)."""
    cfg = copy.deepcopy(dict(cfg))
    plugins.load(cfg.get(plugins.KEY, []))  # third-party components, before any name is looked up
    problems: list[str] = []
    if missing := [s for s in SECTIONS if not isinstance(cfg.get(s), Mapping)]:
        raise ConfigError([_missing_section(s, cfg.get(s, _ABSENT)) for s in missing])
    top = {k: v for k, v in cfg.items() if k not in SECTIONS and k != plugins.KEY}
    problems += check_params(RunSpec, top, "config", structural=()) + _missing_keys(RunSpec, top, "")
    problems += _name_problems(top.get("name"))
    for section, cls in (("loader", LoaderSpec), ("optim", OptimSpec), ("logger", LoggerSpec)):
        problems += check_params(cls, cfg[section], section, structural=()) + _missing_keys(cls, cfg[section], section)
    problems += check_params(CallbacksSpec, cfg["callbacks"], "callbacks", structural=())
    problems += _missing_keys(CallbacksSpec, cfg["callbacks"], "callbacks")
    problems += check_params(FinetuneSpec, cfg["finetune"], "finetune", structural=())
    problems += _missing_keys(FinetuneSpec, cfg["finetune"], "finetune") + finetune_problems(cfg)
    if (sig := cfg["callbacks"].get("requeue_signal")) is not None and sig == cfg["callbacks"].get("stop_signal"):
        problems.append(
            f"callbacks.requeue_signal and callbacks.stop_signal are both {sig}. "
            f"Fix: give them different signals, or set one to null."
        )
    if cfg["callbacks"].get("async_save") and str(cfg["trainer"].get("strategy")) not in SHARDED_STRATEGIES:
        problems.append(
            f"callbacks.async_save=true writes sharded checkpoints in the background, and "
            f"trainer.strategy={cfg['trainer'].get('strategy')!r} writes single files. Fix: trainer=fsdp_cpu (or "
            f"trainer=fsdp on GPUs), or callbacks.async_save=false."
        )
    problems += check_trainer(cfg["trainer"])
    if (ckpt := cfg.get("ckpt_path")) not in (None, "auto") and not is_sharded(ckpt) and not os.path.isfile(ckpt):
        problems.append(
            f"ckpt_path={ckpt!r}: no such file (nor a sharded checkpoint's folder). Fix: give an existing checkpoint, "
            f"or ckpt_path=auto."
        )
    if cfg["data"].get("name") not in DATA:
        problems.append(unknown_choice("data", cfg["data"].get("name"), DATA.names(), "pass data=<one of them>."))
        data_cls, data_problems = None, []
    else:
        data_problems = DATA.check(cfg["data"], {})
        problems += data_problems
        data_cls = DATA.get(cfg["data"]["name"])
        if cfg["data"].get("streaming"):
            problems += _streaming_trainer_problems(cfg["trainer"])
    model_problems = check_params(ModelSpec, cfg["model"], "model", structural=())
    model_problems += _missing_keys(ModelSpec, cfg["model"], "model")
    problems += model_problems
    if model_problems:
        raise ConfigError(problems)
    spec = ModelSpec(**cfg["model"])
    problems += spec.problems()
    if not data_problems and spec.vocab_size is not None:
        problems += _tokenizer_vocab_problems(cfg["data"], spec.vocab_size)
    if spec.problems():
        raise ConfigError(problems)
    task_problems = check_params(TaskSpec, cfg["task"], "task", structural=())
    problems += task_problems
    task_spec = TaskSpec(**cfg["task"]) if not task_problems else TaskSpec(name=known_task(cfg["task"].get("name")))
    data_name = cfg["data"].get("name")
    data_task = data_cls.task_for(cfg["data"]) if data_cls else "lm"
    own_tasks = {n: c.task for n, c in DATA.items()}
    task, problems_of_task = resolve_task(task_spec, data_task, data_name, own_tasks)
    arch = spec.arch_for(task)
    problems += problems_of_task + arch_problems(arch, task, spec.causal, data_name)
    causal = spec.causal if spec.causal is not None else arch != "encoder"
    problems += _causal_problems(spec, task, data_name)
    slot_problems, sel = _slot_problems(cfg, spec, causal, task, arch)
    problems += slot_problems
    encoder = None
    if arch == "encoder_decoder":
        encoder, encoder_problems = encoder_stack(cfg, spec)
        problems += encoder_problems
    elif not encoder_is_default(cfg["encoder"]):
        problems.append(
            f"encoder.* is set ({cfg['encoder']}), and it configures the encoder of model.arch=encoder_decoder; this "
            f"model is a {arch}. Fix: remove the encoder.* overrides, or a source of pairs with model.arch=auto."
        )
    if sel is not None:
        # What the data's rows are (token ids, vectors, images: xfam.model.inputs), for the checks that need ids.
        # (a data section with problems of its own, reported above, is not read further)
        readable = data_cls if not data_problems else None
        inputs = readable.inputs_for(cfg["data"]) if readable is not None else TOKENS
        sel.inputs, sel.continuous_actions = inputs["kind"], inputs.get("action_dim") is not None
        sel.documents = readable.documents_for(cfg["data"]) if readable is not None else sel.documents
        problems += input_problems(inputs, spec, data_name, sel.pos[0].bounded)
        sel.image = _image_of(data_cls, cfg["data"]) if readable is not None else None
        problems += compat.check(sel)
        problems += _metric_problems(cfg, data_cls, sel)
        seq_len = cfg["data"].get("seq_len")
        problems += _pair_length_problems(cfg["data"], arch, spec, sel)
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
        if sel.streams and data_cls is not None and not data_cls.contiguous_for(cfg["data"]):
            why = streams_of(cfg["loader"], sel.memory)[1]
            own = f"{data_cls.stream_hint}, " if data_cls.stream_hint else ""
            problems.append(
                f"{why}: contiguous streams need a contiguous source (consecutive rows of one token stream); "
                f"data={cfg['data']['name']} is not. Fix: {own}data=text or data=hf"
                + (", or memory=none." if sel.has_memory else ", or loader.streams=false.")
            )
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    assert sel is not None  # (a slot problem otherwise)
    streams, why = streams_of(cfg["loader"], sel.memory)
    return RunConfig(
        raw=cast(dict[str, Any], cfg),  # (the deep copy made above)
        spec=spec,
        attention=tuple(per_layer(cfg["attention"], spec.layers, "attention")),
        memory=tuple(per_layer(cfg["memory"], spec.layers, "memory")),
        task_spec=task_spec,
        arch=arch,
        encoder=encoder,
        cross=tuple(per_layer(cfg["cross_attention"], spec.layers, "cross_attention")) if encoder else (),
        pos=dict(cfg["pos"]),
        exit=dict(cfg["exit"]),
        selection=sel,
        streams=streams,
        streams_why=why,
        run=RunSpec(**top),
        loader=LoaderSpec(**cfg["loader"]),
        optim=OptimSpec(**cfg["optim"]),
        logger=LoggerSpec(**cfg["logger"]),
        callbacks=CallbacksSpec(**cfg["callbacks"]),
        finetune=FinetuneSpec(**cfg["finetune"]),
    )
