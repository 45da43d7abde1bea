"""The plain config sections besides the slots: run, loader, optimiser, logger and callbacks.

Like components, each section is a keyword-only annotated dataclass whose signature holds the only
defaults; its YAML (``configs/<group>/*.yaml`` or the top of ``configs/train.yaml``) mirrors them
and a test keeps the two equal. The ``trainer`` section is Lightning's own ``Trainer`` arguments
and is checked against ``lightning.Trainer``'s signature.
"""

from __future__ import annotations

import dataclasses
import netrc
import os
import urllib.parse
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from xfam.core.registry import NonNegative, Positive, Range

#: Signals ``callbacks.requeue_signal`` and ``callbacks.stop_signal`` may name.
Signal = Literal["USR1", "USR2", "TERM", "INT", "HUP"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Top-level keys of ``configs/train.yaml``.

    Attributes:
        name: run group; the run directory is ``runs/<name>/<overrides>``.
        seed: seeds model init, dropout and data order (same seed and config: identical losses).
        ckpt_path: null (fresh run; refused if the run directory already holds one), ``auto``
            (continue the run in this directory, or start it when there is none) or a path.
        test: evaluate the test split after training.
        debug: show full tracebacks instead of one-line errors.
        optimized_metric: the final metric returned to a sweeper (``hparams_search=optuna``).
        allow_data_change: resume a checkpoint on purpose on data with another fingerprint than it
            was trained on (e.g. to fine-tune); refused by default, as it is more often a mistake.
        init_from: a checkpoint whose matching weights start this run (fine-tuning; ``finetune`` section).
    """

    name: str = "default"
    seed: Annotated[int, Range(ge=0, le=2**32 - 1)] = 0  # (numpy's seed range, Lightning's seed_everything)
    ckpt_path: str | None = None
    test: bool = True
    debug: bool = False
    optimized_metric: str | None = None
    allow_data_change: bool = False
    init_from: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderSpec:
    """How batches are drawn (``loader`` section).

    Attributes:
        streams: contiguous streams for the memory slot: row i of batch t+1 continues row i of
            batch t (needs a contiguous source such as ``data=text``); otherwise rows are shuffled.
            ``auto``: streams exactly when the selected memory needs them (logged).
        num_workers: DataLoader worker processes (0 is fastest for small rows on a small CPU).
    """

    streams: bool | Literal["auto"] = "auto"
    num_workers: Annotated[int, NonNegative] = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimSpec:
    """AdamW (Loshchilov & Hutter, 2019) with linear warmup and a decay schedule (``optim``).

    Attributes:
        name: the optimiser (``adamw``).
        lr: peak learning rate.
        betas, eps: Adam moments.
        weight_decay: decoupled decay, applied to the weight matrices of linear maps only (not to
            biases, norms, relative-position tables, persistent memory or, unless ``decay_embeddings``,
            embedding tables; ``xfam.training.lit.optim.param_groups``).
        warmup_steps: linear warmup to ``lr``: step s (0-based) takes (s + 1) / (warmup_steps + 1) of it.
        schedule: after warmup, ``cosine`` to ``min_lr_ratio * lr`` at ``trainer.max_steps``,
            ``linear`` to the same floor, or ``constant``.
    """

    name: Literal["adamw"] = "adamw"
    lr: Annotated[float, Positive] = 1e-3
    betas: tuple[Annotated[float, Range(ge=0, lt=1)], Annotated[float, Range(ge=0, lt=1)]] = (0.9, 0.95)
    eps: Annotated[float, Positive] = 1e-8
    weight_decay: Annotated[float, NonNegative] = 0.1
    decay_embeddings: bool = False
    warmup_steps: Annotated[int, NonNegative] = 100
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggerSpec:
    """Where metrics go (``logger`` group). CSV metrics are always written to the run directory.

    Attributes:
        name: ``csv`` only, or ``tensorboard`` / ``wandb`` in addition to CSV.
        project, entity, tags: Weights & Biases run attributes.
        mode: wandb mode; ``auto`` is online with credentials (WANDB_API_KEY or a netrc entry),
            offline without (the choice is logged).
    """

    name: Literal["csv", "tensorboard", "wandb"] = "csv"
    project: str = "xfam"
    entity: str | None = None
    tags: list[str] = dataclasses.field(default_factory=list)
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"


def wandb_credentials() -> str | None:
    """Where wandb finds an API key on this machine, read locally (never a network call): ``WANDB_API_KEY``,
    or a netrc entry (``$NETRC`` or ``~/.netrc``) for the wandb host (``WANDB_BASE_URL``, api.wandb.ai by
    default); None without one."""
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY is set"
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if netrc.netrc(path).authenticators(host or "api.wandb.ai"):
            return f"credentials for {host} in {path}"
    except (OSError, netrc.NetrcParseError):
        pass
    return None


def wandb_online_problem(logger: Mapping[str, Any]) -> str | None:
    """Why ``logger`` (the logger section) cannot log to wandb online here: online is asked for (``logger.mode=
    online``, or ``auto`` under ``WANDB_MODE=online``) and this machine has no credentials."""
    if logger.get("name") != "wandb":
        return None
    mode = logger.get("mode", "auto")
    asked = mode == "online" or (mode == "auto" and os.environ.get("WANDB_MODE") == "online")
    if not asked or wandb_credentials() is not None:
        return None
    why = "logger.mode=online" if mode == "online" else "WANDB_MODE=online (with logger.mode=auto)"
    return (
        f"{why}: wandb has no credentials on this machine (no WANDB_API_KEY, no netrc entry for api.wandb.ai), so "
        f"the run would stop at its first log. Fix: `wandb login` (or export WANDB_API_KEY=<key>), or "
        f"logger.mode=offline (sync later with `wandb sync`) or logger.mode=auto (online only with credentials)."
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallbacksSpec:
    """Checkpoints, progress and plots (``callbacks`` group).

    Attributes:
        every_n_steps: write ``checkpoints/step-N.ckpt`` and ``last.ckpt`` every N optimizer steps.
        keep_last: periodic checkpoints to keep (-1: all).
        save_best: also keep ``best.ckpt`` by ``monitor`` (lowest).
        monitor: metric for the best checkpoint.
        progress_bar: ``rich``, ``tqdm`` or ``none``; when stdout is not a terminal (a batch job's
            log) a line every 30 s replaces the live bar.
        lr_monitor: log the learning rate.
        loss_curve: write ``loss_curve.png`` in the run directory at the end of training.
        requeue_signal: on this signal (SLURM: ``sbatch --signal=USR1@90``, sent before the time
            limit) write ``step-N.ckpt`` and ``last.ckpt`` at the end of the current step, requeue the
            SLURM job (``scontrol requeue``) and exit with status 128 + the signal number
            (``xfam.training.lit.preempt``); null: no requeue on any signal (Lightning's own SLURM
            auto-requeue stays off).
        stop_signal: the same without the requeue (SIGTERM: preemption, ``scancel``, the time limit
            itself); null: Lightning's default handling of it.
        async_save: sharded checkpoints (``trainer=fsdp`` / ``fsdp_cpu``) are written by a background thread
            while training continues (``torch.distributed.checkpoint.async_save``); each is renamed into place
            when complete, before the next is started, at the end of training and before a preemption exit.
    """

    every_n_steps: Annotated[int, Positive] = 250
    keep_last: Annotated[int, Range(ge=-1)] = 2
    save_best: bool = True
    monitor: str = "val/loss"
    progress_bar: Literal["rich", "tqdm", "none"] = "rich"
    lr_monitor: bool = True
    loss_curve: bool = True
    requeue_signal: Signal | None = "USR1"
    stop_signal: Signal | None = "TERM"
    async_save: bool = False
