"""The ``trainer`` section and the machine a run needs: Lightning's Trainer arguments (names read from its
source, values from ``xfam.config.trainer_args``), the keys xfam reads itself, and ``check_machine``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xfam.config import trainer_args
from xfam.config.specs import wandb_online_problem
from xfam.config.trainer_args import SHARDED_STRATEGIES
from xfam.core.errors import ConfigError, did_you_mean, unknown_choice

#: Trainer arguments xfam sets itself (from the logger/callbacks groups and the run directory).
TRAINER_OWNED = (
    "logger",
    "callbacks",
    "plugins",
    "default_root_dir",
    "use_distributed_sampler",
    "enable_checkpointing",
)


#: ``trainer.compile_mode``: torch.compile's modes (``default`` passes none); docs/compile.md.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: Keys of the trainer section that xfam reads itself (not Lightning arguments), with their choices.
XFAM_TRAINER = {
    "nonfinite": ("stop", "skip"),
    "matmul_precision": ("highest", "high", "medium"),
    "compile_mode": COMPILE_MODES,
}
#: Boolean keys of the trainer section that xfam reads itself.
XFAM_TRAINER_BOOLS = ("compile",)
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
    valid = _trainer_params() + list(XFAM_TRAINER) + list(XFAM_TRAINER_INTS) + list(XFAM_TRAINER_BOOLS)
    out = []
    for key in trainer:
        if key in XFAM_TRAINER_BOOLS:
            if not isinstance(trainer[key], bool):
                out.append(f"trainer.{key}={trainer[key]!r}: must be true or false. Fix: trainer.{key}=true.")
        elif key in XFAM_TRAINER_INTS:
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
    if str(trainer.get("strategy")) in SHARDED_STRATEGIES and str(trainer.get("precision")).startswith("16"):
        out.append(
            f"trainer.precision={trainer['precision']!r} with FSDP (trainer.strategy={trainer['strategy']}): fp16 "
            f"needs a gradient scaler aware of sharded gradients, which xfam does not set up. Fix: trainer.precision="
            f"bf16-mixed (sharded fp32 parameters, bf16 compute, fp32 reduction) or 32-true."
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
    if strategy.startswith("fsdp") and accelerator != "cpu" and not cuda:
        raise ConfigError(
            f"trainer.strategy={strategy!r} (trainer=fsdp) shards the model over CUDA GPUs, and {where}. "
            "Fix: on CPU use trainer=fsdp_cpu (FSDP over 2 CPU processes), trainer=ddp_cpu or trainer=cpu, or run "
            "it on a GPU machine (e.g. python train.py -m hydra/launcher=slurm trainer=fsdp)."
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
