"""The Lightning ``Trainer`` arguments an xfam config may set, with the values Lightning accepts.

Read from Lightning 2.x's own checks (``Trainer.__init__``, its accelerator and data connectors, the fit
and training-epoch loops, ``Timer``, ``_determine_batch_limits``), so that a value Lightning would refuse
once the run directory exists, or take silently with another meaning (``max_steps=1.5``, a negative
``gradient_clip_val``), is refused with the rest of the configuration before anything is written.

The tables are static: importing Lightning takes ~4 s, most of the time a refused command line costs.
A name outside the static tables of precisions, strategies and accelerators is looked up in Lightning's
own registries before it is refused (a strategy registered by a plugin stays valid).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from xfam.core.errors import unknown_choice
from xfam.core.registry import NonNegative, Positive, Range, type_problem

#: ``precision``: lightning.fabric.plugins.precision.precision's _PRECISION_INPUT (strings, aliases, ints).
PRECISIONS: tuple[Any, ...] = (
    "transformer-engine",
    "transformer-engine-float16",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "32-true",
    "64-true",
    "64",
    "32",
    "16",
    "bf16",
    64,
    32,
    16,
)
#: ``strategy`` names xfam builds itself: its FSDP2 strategy (``xfam.training.lit.fsdp``; ``fsdp`` is not Lightning's
#: FSDP1 of the same name), with ranks started by re-running the command line or externally, or spawned.
SHARDED_STRATEGIES = ("fsdp", "fsdp_spawn")
#: ``strategy``: "auto", xfam's own and the common names of lightning.pytorch.strategies.StrategyRegistry (the
#: registry itself is asked about any other name).
STRATEGIES = ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "deepspeed", "single_device", *SHARDED_STRATEGIES)
#: ``accelerator``: "auto", "gpu" and lightning.pytorch.accelerators.AcceleratorRegistry's built-in names.
ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps", "tpu")
#: Keyword arguments of ``datetime.timedelta`` (a ``max_time`` / ``val_check_interval`` given as a mapping).
TIMEDELTA_KEYS = ("days", "seconds", "microseconds", "milliseconds", "minutes", "hours", "weeks")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _batches(value: Any) -> str | None:
    """``limit_*_batches`` / ``overfit_batches`` (``_determine_batch_limits``): an int >= 0 batches, or a
    float share in [0, 1] (a whole float above 1 counts as that many batches)."""
    if not _number(value):
        return "must be an integer or a number"
    if value < 0:
        return "must be >= 0"
    if isinstance(value, float) and value > 1 and value % 1:
        return "a float is a share of the batches and must lie in [0.0, 1.0] (an integer counts batches)"
    return None


def _duration(value: Any, pattern: str) -> str | None:
    if isinstance(value, str):
        return None if re.fullmatch(pattern, value.strip()) else "a duration must be written DD:HH:MM:SS"
    if isinstance(value, Mapping):
        bad = [k for k in value if k not in TIMEDELTA_KEYS]
        if bad:
            return f"a duration mapping takes the keys {', '.join(TIMEDELTA_KEYS)}, not {', '.join(map(str, bad))}"
        if not all(_number(v) for v in value.values()):
            return "every value of a duration mapping must be a number"
        return None
    return "must be a duration (DD:HH:MM:SS, or a mapping such as {hours: 2})"


def _max_time(value: Any) -> str | None:
    return _duration(value, r"\d+:\d\d:\d\d:\d\d")  # lightning.pytorch.callbacks.Timer's format


def _val_check_interval(value: Any) -> str | None:
    """An int >= 1 (every so many training batches), a float in (0, 1] (a share of the epoch), or a time."""
    if isinstance(value, (str, Mapping)):
        return _duration(value, r"\d+:\d+:\d+:\d+")
    if not _number(value):
        return "must be an integer, a number in (0, 1] or a duration DD:HH:MM:SS"
    if value <= 0:
        return "must be > 0"
    if isinstance(value, float) and value > 1 and value % 1:
        return "a float is a share of the training epoch and must lie in (0.0, 1.0] (an integer counts batches)"
    return None


def _devices(value: Any) -> str | None:
    """``devices``: a positive count, -1 or "auto" (all), or device ids as a list or a "0,1" string."""
    if value in ("auto", -1, "-1") and not isinstance(value, bool):
        return None
    if _integer(value):
        return None if value > 0 else "must be a positive number of devices, -1 or auto (all), or a list of ids"
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if parts and all(p.isdigit() for p in parts) and (len(parts) > 1 or int(parts[0]) > 0 or "," in value):
            return None
        return "must be a positive number of devices, -1 or auto (all), or device ids such as '0,1'"
    if isinstance(value, (list, tuple)):
        if value and all(_integer(v) and v >= 0 for v in value) and len(set(value)) == len(value):
            return None
        return "a list of device ids must be non-empty, of distinct integers >= 0"
    return "must be a positive number of devices, -1 or auto (all), or a list of ids"


def _optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """``check``, with null allowed (Lightning's default)."""
    return lambda value: None if value is None else check(value)


def _one_of(*names: str) -> Callable[[Any], str | None]:
    """A name among ``names`` (Lightning lower-cases it first), or null."""

    def check(value: Any) -> str | None:
        if value is None or (isinstance(value, str) and value.lower() in names):
            return None
        return f"must be {', '.join(names)} or null"

    return check


@functools.cache
def registered_strategies() -> tuple[str, ...]:
    """lightning.pytorch's registered strategy names (imports Lightning: only for a name not in STRATEGIES)."""
    try:
        from lightning.pytorch.strategies import StrategyRegistry
    except ImportError:
        return STRATEGIES
    return tuple(dict.fromkeys([*STRATEGIES, *StrategyRegistry.available_strategies()]))


@functools.cache
def registered_accelerators() -> tuple[str, ...]:
    try:
        from lightning.pytorch.accelerators import AcceleratorRegistry
    except ImportError:
        return ACCELERATORS
    return tuple(dict.fromkeys([*ACCELERATORS, *AcceleratorRegistry.available_accelerators()]))


@functools.cache
def lightning_precisions() -> tuple[Any, ...]:
    try:
        from typing import get_args

        from lightning.fabric.plugins.precision import precision as p
    except ImportError:
        return PRECISIONS
    found = get_args(p._PRECISION_INPUT_STR) + get_args(p._PRECISION_INPUT_STR_ALIAS) + get_args(p._PRECISION_INPUT_INT)
    return tuple(dict.fromkeys([*PRECISIONS, *found]))


@dataclasses.dataclass(frozen=True)
class Arg:
    """One Trainer argument: an annotation checked like a component's (``type_problem``) and/or a
    ``check`` returning why a value is invalid; ``valid`` says in words what is; ``example`` a valid value."""

    hint: Any
    valid: str
    example: str
    check: Callable[[Any], str | None] | None = None


Count = Annotated[int, NonNegative]
ARGS: dict[str, Arg] = {
    "max_steps": Arg(Annotated[int, Range(ge=-1)], "an integer >= 0, or -1 (no step limit)", "1000"),
    "max_epochs": Arg(
        Annotated[int, Range(ge=-1)] | None, "an integer >= 0, -1 (no epoch limit) or null (Lightning's)", "10"
    ),
    "min_steps": Arg(Count | None, "an integer >= 0, or null", "100"),
    "min_epochs": Arg(Count | None, "an integer >= 0, or null", "1"),
    "max_time": Arg(
        None, "a duration DD:HH:MM:SS (e.g. 00:12:00:00), a mapping such as {hours: 2}, or null", "00:12:00:00"
    ),
    "limit_train_batches": Arg(None, "an integer >= 0 (batches), a float in [0.0, 1.0] (a share), or null", "1.0"),
    "limit_val_batches": Arg(None, "an integer >= 0 (batches), a float in [0.0, 1.0] (a share), or null", "40"),
    "limit_test_batches": Arg(None, "an integer >= 0 (batches), a float in [0.0, 1.0] (a share), or null", "80"),
    "limit_predict_batches": Arg(None, "an integer >= 0 (batches), a float in [0.0, 1.0] (a share), or null", "1.0"),
    "overfit_batches": Arg(None, "an integer >= 0 (batches) or a float in [0.0, 1.0] (a share); 0 = off", "0"),
    "val_check_interval": Arg(
        None,
        "an integer >= 1 (training batches), a float in (0.0, 1.0] (a share of the epoch), a duration "
        "DD:HH:MM:SS, or null",
        "250",
        _optional(_val_check_interval),
    ),
    "check_val_every_n_epoch": Arg(
        Annotated[int, Positive] | None, "an integer >= 1, or null (count batches across epochs)", "1"
    ),
    "num_sanity_val_steps": Arg(
        Annotated[int, Range(ge=-1)] | None, "an integer >= 0, -1 (the whole validation split) or null", "0"
    ),
    "log_every_n_steps": Arg(Count | None, "an integer >= 0 (0: log at the end of epochs only), or null", "10"),
    "gradient_clip_val": Arg(Annotated[float, NonNegative] | None, "a number >= 0 (0 or null: no clipping)", "1.0"),
    "gradient_clip_algorithm": Arg(None, "norm or value (or null: norm)", "norm", _one_of("norm", "value")),
    "accumulate_grad_batches": Arg(Annotated[int, Positive], "an integer >= 1 (1: no accumulation)", "1"),
    "devices": Arg(
        None, "a positive integer, -1 or auto (every device), or device ids as a list or '0,1'", "1", _devices
    ),
    "num_nodes": Arg(Annotated[int, Positive], "an integer >= 1", "1"),
    "accelerator": Arg(None, f"{', '.join(ACCELERATORS)}", "cpu"),
    "strategy": Arg(None, f"{', '.join(STRATEGIES)} or another registered Lightning strategy", "auto"),
    "precision": Arg(None, ", ".join(map(str, PRECISIONS)), "32-true"),
    "deterministic": Arg(bool | Literal["warn"] | None, "true, false, warn or null", "true"),
    "benchmark": Arg(bool | None, "true, false or null", "false"),
    "inference_mode": Arg(bool, "true or false", "true"),
    "sync_batchnorm": Arg(bool, "true or false", "false"),
    "detect_anomaly": Arg(bool, "true or false", "false"),
    "barebones": Arg(bool, "true or false", "false"),
    "enable_progress_bar": Arg(bool | None, "true, false or null", "true"),
    "enable_model_summary": Arg(bool | None, "true, false or null", "false"),
    "enable_autolog_hparams": Arg(bool, "true or false", "true"),
    "fast_dev_run": Arg(bool | Count, "true, false or an integer >= 0 (batches of each split)", "false"),
    "reload_dataloaders_every_n_epochs": Arg(Count, "an integer >= 0 (0: never reload)", "0"),
    "profiler": Arg(
        None, "simple, advanced, pytorch, xla or null", "simple", _one_of("simple", "advanced", "pytorch", "xla")
    ),
    "model_registry": Arg(str | None, "a model name, or null", "null"),
}
for _key in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
    ARGS[_key] = dataclasses.replace(ARGS[_key], check=_optional(_batches))
ARGS["overfit_batches"] = dataclasses.replace(ARGS["overfit_batches"], check=_batches)
ARGS["max_time"] = dataclasses.replace(ARGS["max_time"], check=_optional(_max_time))


def _name_problem(key: str, value: Any) -> str | None:
    """precision / strategy / accelerator: a name of the static table, else of Lightning's registry."""
    if key == "precision":
        name = isinstance(value, (str, int)) and not isinstance(value, bool)  # (16.0 == 16, True == 1)
        if name and (value in PRECISIONS or value in lightning_precisions()):
            return None
        choices = [str(p) for p in lightning_precisions() if isinstance(p, str)]
        return unknown_choice(
            "trainer.precision", value, choices, "trainer.precision=32-true (or bf16-mixed, 16-mixed on a GPU)."
        )
    if not isinstance(value, str):
        return f"trainer.{key}={value!r}: must be a name. Fix: trainer.{key}=auto."
    if key == "strategy":
        if value.lower() in STRATEGIES or value.lower() in registered_strategies():
            return None
        return unknown_choice("trainer.strategy", value, registered_strategies(), "trainer.strategy=auto.")
    if value in ACCELERATORS or value in registered_accelerators():
        return None
    return unknown_choice("trainer.accelerator", value, registered_accelerators(), "trainer.accelerator=auto.")


def problems(trainer: Mapping[str, Any]) -> list[str]:
    """Every Lightning argument of ``trainer`` with an invalid value, and the combinations Lightning (or
    xfam's learning-rate schedule) cannot run; keys not in ``ARGS`` are left to the caller."""
    out: list[str] = []
    bad: set[str] = set()
    for key, value in trainer.items():
        if key in ("precision", "strategy", "accelerator"):
            why_name = _name_problem(key, value)
            if why_name:
                out.append(why_name)
                bad.add(key)
            continue
        arg = ARGS.get(key)
        if arg is None:
            continue
        why = type_problem(value, arg.hint) if arg.hint is not None else None
        if why is None and arg.check is not None:
            why = arg.check(value)
        if why:
            out.append(
                f"trainer.{key}={value!r}: {why}. Valid: {arg.valid}. Fix: set a valid value, e.g. "
                f"trainer.{key}={arg.example}."
            )
            bad.add(key)
    if "max_steps" not in trainer:
        out.append(
            "trainer.max_steps: missing (deleted, e.g. by ~trainer.max_steps): xfam's learning-rate schedule decays "
            "to trainer.max_steps, and without it training ends only with max_epochs. Fix: remove the "
            "~trainer.max_steps override, or set trainer.max_steps=<steps> (-1 with trainer.max_epochs=<N> to "
            "train by epochs)."
        )
        bad.add("max_steps")
    return out + _combinations(trainer, bad)


def _combinations(trainer: Mapping[str, Any], bad: set[str]) -> list[str]:
    out = []
    get = trainer.get
    if not bad & {"max_steps", "max_epochs", "max_time", "fast_dev_run"} and not get("fast_dev_run"):
        steps, epochs = get("max_steps", -1), get("max_epochs")
        # Lightning: max_epochs=None becomes 1000 when neither max_steps nor max_time bounds training
        if epochs is None and steps == -1 and get("max_time") is None:
            epochs = 1000
        if steps == -1 and epochs in (None, -1):
            out.append(
                f"trainer.max_steps=-1 and trainer.max_epochs={get('max_epochs')!r}: training has no step or epoch "
                f"limit, and xfam's learning-rate schedule needs the number of steps it decays over (max_time only "
                f"stops the clock). Fix: trainer.max_steps=<steps>, or trainer.max_epochs=<epochs>."
            )
    if get("barebones") is True:
        out.append(
            "trainer.barebones=true disables logging and checkpoints, which every xfam run writes (CSV metrics, "
            "last.ckpt). Fix: remove trainer.barebones (for raw speed: callbacks.progress_bar=none, "
            "callbacks.lr_monitor=false)."
        )
    interval = get("val_check_interval")
    if (
        "check_val_every_n_epoch" in trainer
        and get("check_val_every_n_epoch") is None
        and isinstance(interval, float)
        and not bad & {"val_check_interval", "check_val_every_n_epoch"}
    ):
        out.append(
            f"trainer.val_check_interval={interval} is a share of an epoch, and trainer.check_val_every_n_epoch=null "
            f"counts batches across epochs. Fix: an integer trainer.val_check_interval (training batches), or "
            f"trainer.check_val_every_n_epoch=1."
        )
    devices = get("devices", "auto")
    count = (_integer(devices) and devices > 0) or (isinstance(devices, str) and devices.isdigit())
    cpu_ok = devices == "auto" or count
    if get("accelerator") == "cpu" and "devices" not in bad and not cpu_ok:
        out.append(
            f"trainer.devices={devices!r} with trainer.accelerator=cpu: on CPU devices is a number of processes, an "
            f"integer >= 1 (device ids and -1 are for GPUs). Fix: trainer.devices=1 (or 2 with trainer=ddp_cpu)."
        )
    return out
