"""The model card (``README.md``) of an exported model folder (``xfam export``): what the Hugging Face Hub shows for
a model, with a YAML front matter block (``library_name``, ``tags``, ``pipeline_tag``) and sections read by people:
the component chosen in each slot with its paper, the model's size, the training data, the final metrics, the
command that trained it, provenance and how to load it.

Everything comes from the checkpoint and from the run directory beside it (``<run>/checkpoints/<ckpt>``), where
the runner keeps ``data_manifest.json``, ``metrics.json`` (the final metrics), ``logs/*/metrics.csv`` (the logged
ones) and, for a job of a sweep, ``status.json`` with its overrides. What is not found is said so, never guessed:
a section names the file it came from. The manifest's folders are shortened to their last part (the card is for
readers; ``config.json`` keeps every setting as the run had it).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

import xfam
from xfam.config.slots import SLOTS
from xfam.core.config_dir import CONFIG_DIR
from xfam.core.registry import Registry
from xfam.data.base import DATA
from xfam.model.block_compat import OPTIONS
from xfam.model.spec import ModelSpec


def model_card(model: torch.nn.Module, meta: dict[str, Any], config: dict[str, Any], ckpt: Path, title: str) -> str:
    """The card of ``model`` (built from checkpoint ``ckpt`` with metadata ``meta``; ``config``: the folder's
    ``config.json``; ``title``: the model's name, the folder's)."""
    cfg, info = meta["config"], meta["data_info"]
    run = run_dir(ckpt)
    slots = list(components(cfg, info))
    sections = [
        front_matter(slots, info),
        f"# {title}\n",
        f"A {describe_task(info)} trained with xfam (run group `{cfg.get('name')}`) and exported with `xfam export` on "
        f"{config['exported'][:10]} from the checkpoint `{ckpt.name}` (step {config.get('step')}). It is a folder "
        f"without pickle: `config.json` (the run's resolved config and data info), `model.safetensors` (the "
        f"weights){', `tokenizer.json`' if (info.get('tokenizer') or {}).get('json') else ''} and this card.\n",
        components_section(slots, cfg),
        size_section(model, cfg, info),
        data_section(run, info),
        metrics_section(run, config.get("step")),
        command_section(run, cfg),
        usage_section(info),
        provenance_section(meta, config),
    ]
    return "\n".join(sections)


# -- where things are ----------------------------------------------------------------------------------------------


def run_dir(ckpt: Path) -> Path | None:
    """The run directory of checkpoint ``ckpt``: ``<run>/checkpoints/<ckpt>``'s ``<run>``, or the checkpoint's own
    folder when it holds a run's record; None when neither does."""
    ckpt = ckpt.resolve()
    for folder in (ckpt.parent.parent, ckpt.parent) if ckpt.parent.name == "checkpoints" else (ckpt.parent,):
        if any((folder / f).is_file() for f in ("config.yaml", "data_manifest.json", "metrics.json", "status.json")):
            return folder
    return None


def short(value: Any) -> str:
    """A manifest value as a card shows it: an absolute path shortened to ``…/<last part>``, None as ``null``."""
    if isinstance(value, str) and value.startswith("/") and "\n" not in value:
        return f"…/{Path(value).name}"
    return _show(value)


# -- components ------------------------------------------------------------------------------------------------------


def components(cfg: dict[str, Any], info: dict[str, Any]) -> Iterator[tuple[str, str, type]]:
    """``(slot, component name, class)`` of every component the run chose: each slot's, every per-layer or
    per-head choice, an encoder-decoder's encoder and cross-attention, and the data source."""
    arch = ModelSpec(**cfg.get("model", {})).arch_for(info.get("task", "lm"))
    places: list[tuple[str, Any, Registry]] = [(slot, cfg.get(slot), SLOTS[slot]) for slot in SLOTS]
    if arch == "encoder_decoder":
        enc = cfg.get("encoder") or {}
        places += [("encoder attention", enc.get("attention") or cfg.get("attention"), SLOTS["attention"])]
        places += [("encoder pos", enc.get("pos") or cfg.get("pos"), SLOTS["pos"])]
        places += [("cross_attention", cfg.get("cross_attention"), SLOTS["attention"])]
    places.append(("data", cfg.get("data"), DATA))
    for slot, section, registry in places:
        for name in dict.fromkeys(_names(section, registry)):
            yield slot, name, registry.get(name)


def _names(section: Any, registry: Registry) -> Iterator[str]:
    """Component names in a config section, depth first (a ``per_layer`` list, a ``per_head`` split)."""
    if isinstance(section, dict):
        if isinstance(section.get("name"), str) and section["name"] in registry:
            yield section["name"]
        for value in section.values():
            yield from _names(value, registry)
    elif isinstance(section, list):
        for value in section:
            yield from _names(value, registry)


def summary(cls: type) -> str:
    """The first sentence of a component's docstring, on one line."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split()).split(". ")[0].rstrip(".").replace("|", "/").replace("``", "`")


def block_options(model_cfg: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(override, what, paper)`` of each block option (``xfam.model.block_compat.OPTIONS``) the model has on."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}

    def on(key: str, value: Any) -> bool:
        got = model_cfg.get(key, defaults.get(key))
        if got == value:
            return True
        free = not isinstance(value, str) or defaults.get(key) is None  # a number or a free-form string
        return free and not isinstance(value, bool) and got not in (None, False, 0, defaults.get(key))

    return [
        (" ".join(f"model.{k}={model_cfg.get(k)}" for k in opt.override), opt.what, opt.paper)
        for opt in OPTIONS.values()
        if all(on(k, v) for k, v in opt.override.items())
    ]


def components_section(slots: list[tuple[str, str, type]], cfg: dict[str, Any]) -> str:
    lines = ["## Components\n", "| slot | component | what it is | paper |", "|---|---|---|---|"]
    lines += [
        f"| {slot} | `{name}` | {summary(cls)} | {getattr(cls, 'paper', '') or '—'} |" for slot, name, cls in slots
    ]
    options = block_options(cfg.get("model", {}))
    if options:
        lines += ["", "Block options:", "", "| option | what it changes | paper |", "|---|---|---|"]
        lines += [f"| `{o}` | {what.replace('|', '/')} | {paper} |" for o, what, paper in options]
    return "\n".join(lines) + "\n"


# -- size, data, metrics ----------------------------------------------------------------------------------------


def size_section(model: torch.nn.Module, cfg: dict[str, Any], info: dict[str, Any]) -> str:
    m = cfg.get("model", {})
    params = sum(p.numel() for p in model.parameters())  # (shared parameters counted once)
    rows = [
        ("parameters", f"{params:,} ({params / 1e6:.2f} M)"),
        ("layers", m.get("layers")),
        ("width (model.dim)", m.get("dim")),
        ("heads", m.get("heads") if m.get("kv_heads") is None else f"{m.get('heads')} ({m.get('kv_heads')} kv)"),
        ("vocabulary", m.get("vocab_size") or info.get("vocab_size")),
        ("max length (model.max_len)", m.get("max_len")),
        ("task", info.get("task")),
    ]
    if info.get("num_classes"):
        rows.append(("classes", info["num_classes"]))
    body = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"## Size\n\n| | |\n|---|---|\n{body}\n"


def data_section(run: Path | None, info: dict[str, Any]) -> str:
    head = (
        f"## Training data\n\nData source `{info.get('name')}`, data fingerprint `{info.get('fingerprint')}` (a hash "
        f"of the rows' contents: documents, tokenizer, row length), tokenizer "
        f"`{(info.get('tokenizer') or {}).get('kind', 'none')}`.\n"
    )
    path = run / "data_manifest.json" if run else None
    if path is None or not path.is_file():
        return head + "\nThe run's data manifest (`data_manifest.json`) was not found beside the checkpoint.\n"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return head + f"\nThe run's `data_manifest.json` cannot be read ({type(err).__name__}).\n"
    rows = []
    for key, value in manifest.items() if isinstance(manifest, dict) else ():
        if isinstance(value, (str, int, float, bool)) or value is None:
            rows.append((key, short(value)))
        elif isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value) and len(value) <= 8:
            rows.append((key, ", ".join(str(short(v)) for v in value)))
        elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
            splits: dict[str, int] = {}
            for v in value:
                splits[str(v.get("split", "all"))] = splits.get(str(v.get("split", "all")), 0) + 1
            rows.append((key, f"{len(value)} ({', '.join(f'{s}: {n}' for s, n in splits.items())})"))
    body = "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows)
    return head + f"\nFrom the run's `data_manifest.json`:\n\n| | |\n|---|---|\n{body}\n"


def metrics_section(run: Path | None, step: int | None) -> str:
    """The run's final metrics (``metrics.json``), else the last logged value of each metric (``metrics.csv``)."""
    found = final_metrics(run) if run else None
    if found is None:
        return "## Metrics\n\nNo metrics were found beside the checkpoint (`metrics.json`, `logs/*/metrics.csv`).\n"
    source, at, values = found
    note = f" (the exported checkpoint is at step {step})" if at is not None and step is not None and at != step else ""
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in values.items())
    return f"## Metrics\n\nFrom the run's `{source}`, step {at}{note}:\n\n| metric | value |\n|---|---|\n{rows}\n"


def final_metrics(run: Path) -> tuple[str, int | None, dict[str, float]] | None:
    """``(file, step, {metric: value})`` from the run's ``metrics.json`` or its CSV log; None when neither exists."""
    path = run / "metrics.json"
    if path.is_file():
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            result = None
        if isinstance(result, dict):
            values = {k: float(v) for k, v in result.items() if isinstance(v, (int, float)) and k != "step"}
            return "metrics.json", result.get("step"), values
    for log in sorted(run.glob("logs/*/metrics.csv")):
        last: dict[str, float] = {}
        step = None
        with open(log, newline="") as fh:
            for row in csv.DictReader(fh):
                for key, value in row.items():
                    if value not in (None, "") and key not in ("step", "epoch") and not key.startswith("lr"):
                        last[key] = float(value)
                step = int(float(row["step"])) if row.get("step") else step
        if last:
            return str(log.relative_to(run)), step, last
    return None


# -- the command, usage, provenance ---------------------------------------------------------------------------------


def command_section(run: Path | None, cfg: dict[str, Any]) -> str:
    overrides, source = recorded_overrides(run) if run else (None, None)
    if overrides is not None:
        return f"## Training command\n\nFrom the run's `{source}`:\n\n```bash\n{train_command(overrides)}\n```\n"
    return (
        "## Training command\n\nNo record of the command line was found beside the checkpoint "
        "(`.hydra/overrides.yaml`, a sweep job's `status.json`); reconstructed from the config: each group's option "
        "and every setting that differs from its file in configs/ (`config.json` holds every value):\n\n"
        f"```bash\n{train_command(reconstructed_overrides(cfg))}\n```\n"
    )


def train_command(overrides: list[str]) -> str:
    return " ".join(["python train.py", *(shlex.quote(o) for o in overrides)])


def recorded_overrides(run: Path) -> tuple[list[str] | None, str | None]:
    """The command-line overrides of the run: Hydra's ``.hydra/overrides.yaml``, or a sweep job's ``status.json``."""
    hydra = run / ".hydra" / "overrides.yaml"
    if hydra.is_file():
        found = yaml.safe_load(hydra.read_text())
        if isinstance(found, list):
            return [str(o) for o in found], ".hydra/overrides.yaml"
    status = run / "status.json"
    if status.is_file():
        try:
            found = json.loads(status.read_text()).get("overrides")
        except (OSError, json.JSONDecodeError, AttributeError):
            found = None
        if isinstance(found, list):
            return [str(o) for o in found], "status.json"
    return None, None


def reconstructed_overrides(cfg: dict[str, Any]) -> list[str]:
    """``group=<name>`` where the run chose another option than ``configs/train.yaml``'s defaults, and
    ``section.key=value`` for every setting that differs from its section's file (``configs/<group>/<name>.yaml``,
    or train.yaml itself for a section written there; every key when the file is not found, ``+key`` for a key the
    file lacks); top-level keys that differ from train.yaml's."""
    train = _config_file("train.yaml")
    chosen = {k: v for d in train.get("defaults", []) if isinstance(d, dict) for k, v in d.items()}
    out = [f"{k}={_show(v)}" for k, v in cfg.items() if not isinstance(v, dict) and k in train and train[k] != v]
    for section, values in cfg.items():
        if not isinstance(values, dict):
            continue
        name = values.get("name") if section in chosen else None
        if name is not None and chosen.get(section) != name:
            out.append(f"{section}={name}")
        option = name if name is not None else chosen.get(section)
        base = _flat(_config_file(section, f"{option}.yaml") if option else train.get(section) or {})
        for key, value in _flat(values).items():
            if key != "name" and (key not in base or base[key] != value):
                out.append(f"{'+' if base and key not in base else ''}{section}.{key}={_show(value)}")
    return out


def _config_file(*parts: str) -> dict[str, Any]:
    """A file of ``configs/`` as a dict; empty when there is no such file (every key of a section is then written
    out)."""
    try:
        found = yaml.safe_load(CONFIG_DIR.joinpath(*parts).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return found if isinstance(found, dict) else {}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    """A value as a Hydra override writes it (``null``, ``true``, ``[a,b]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def describe_task(info: dict[str, Any]) -> str:
    what = {"lm": "causal language model", "mlm": "masked language model", "classify": "sequence classifier"}
    return what.get(info.get("task", ""), f"{info.get('task')} model")


def usage_section(info: dict[str, Any]) -> str:
    lines = [
        "## How to use\n",
        "With xfam installed (`pip install xfam`, or a source checkout), from this folder (`DIR`):\n",
        "```python",
        "import xfam",
        "",
        'model, meta = xfam.load_model("DIR")  # JSON and safetensors only: no pickle is loaded',
        'print(meta["config"]["model"], meta["data_info"]["task"])',
        "```\n",
        "```bash",
        "xfam eval ckpt=DIR split=test  # needs the training data (the run's data settings are in config.json)",
    ]
    if info.get("task") in ("lm", "seq2seq") and info.get("tokenizer"):
        lines.append('xfam generate ckpt=DIR prompt="Once upon a time" temperature=0  # greedy')
    lines.append("```\n")
    return "\n".join(lines)


def provenance_section(meta: dict[str, Any], config: dict[str, Any]) -> str:
    packages = ", ".join(f"{k} {v}" for k, v in (meta.get("packages") or {}).items())
    rows = [
        ("xfam version", meta.get("xfam_version")),
        ("config version", meta.get("config_version")),
        ("git commit", meta.get("git_commit") or "unknown"),
        ("packages", packages or "unknown"),
        ("checkpoint", f"`{config.get('source')}`, step {config.get('step')}, epoch {config.get('epoch')}"),
        ("exported", f"{config.get('exported')} with xfam {xfam.__version__}"),
        ("format", f"{config['format']} version {config['format_version']}"),
    ]
    return "## Provenance\n\n| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


#: The Hub's ``pipeline_tag`` of a text model of each task.
PIPELINES = {
    "lm": "text-generation",
    "seq2seq": "text2text-generation",
    "mlm": "fill-mask",
    "classify": "text-classification",
    "tag": "token-classification",
}


def front_matter(slots: list[tuple[str, str, type]], info: dict[str, Any]) -> str:
    """The YAML block the Hub reads: ``library_name``, ``tags`` (xfam and each component), ``pipeline_tag``."""
    tags = ["xfam", "transformer", *(f"{slot.split()[-1]}-{name}" for slot, name, _ in slots)]
    card: dict[str, Any] = {"library_name": "xfam", "tags": list(dict.fromkeys(tags))}
    pipeline = PIPELINES.get(info.get("task", ""))
    if pipeline and info.get("tokenizer"):  # (a text model: the Hub's widgets need a tokenizer)
        card["pipeline_tag"] = pipeline
    return "---\n" + yaml.safe_dump(card, sort_keys=False) + "---\n"
