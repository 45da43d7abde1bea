"""Logging helpers: rank-zero aware, and 'once' for choices made on a hot path."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("xfam")
_seen: set[str] = set()
#: The format of xfam's log lines, on the console (Hydra's job logging) and in a run's ``train.log``.
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] %(message)s"


def log_in_spawned_rank(log_file: Path | None) -> bool:
    """In a training process that a launcher spawned (``ddp_spawn``, ``fsdp_spawn``: a fresh interpreter where
    Hydra configured no logging), send xfam's INFO lines to stderr and to the run's ``log_file``, as the main
    process does, so what a rank chooses (the optimizer, a component's backend) is not lost. Nothing where
    logging is configured already (one process, or ranks started by torchrun/srun running train.py). True if
    it attached the handlers."""
    import multiprocessing

    root = logging.getLogger()
    if root.handlers or multiprocessing.parent_process() is None:  # (not a spawned process)
        return False
    formatter = logging.Formatter(LOG_FORMAT)
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None and log_file.parent.is_dir():
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    return True


def log_once(msg: str, level: int = logging.INFO) -> None:
    """Log ``msg`` the first time it is seen in this process (backend choices, fallbacks)."""
    if msg not in _seen:
        _seen.add(msg)
        log.log(level, msg)


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return "litlogger" not in msg and "that has Tensor Cores" not in msg


def quiet_lightning() -> None:
    """Silence Lightning messages that are wrong or noise for xfam runs.

    * the mid-epoch resume warning: xfam's sampler resumes exactly (``xfam.data.sampler``);
    * "checkpoint directory exists": expected when a run continues;
    * "use sync_dist=True": epoch metrics are reduced by xfam before they are logged;
    * the LitLogger advertisement;
    * the hint to call ``torch.set_float32_matmul_precision``: xfam's knob is ``trainer.matmul_precision``, applied
      after Lightning's check (``xfam.training.lit.callbacks.MatmulPrecision``), so the hint would show whatever was
      chosen.
    """
    import warnings

    warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
    warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
    # xfam sums its epoch statistics across ranks itself (XfamLitModule._log_epoch).
    warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdverts) for f in logger.filters):
            logger.addFilter(_DropAdverts())
    one_line_per_message()


def one_line_per_message() -> None:
    """Lightning, imported before logging is configured, gives its loggers a console handler of their own; once
    Hydra's job logging (or a spawned rank's) has configured the root logger, its lines would show twice (its
    handler, then the root's). Drop Lightning's handler then: the root's prints the line once and also writes it
    to the run's ``train.log``."""
    if not logging.getLogger().handlers:
        return  # nothing configured (a library use of xfam): Lightning's own handler is the only one
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True
