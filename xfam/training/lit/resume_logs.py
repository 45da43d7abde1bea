"""CSV and TensorBoard loggers whose record a resumed run continues: one ``logs/version_0/metrics.csv``
and one ``tensorboard/version_0`` per run directory, each step in it once.

Lightning's loggers open a new ``version_N`` per process, and its CSV writer deletes the
``metrics.csv`` of a version it reopens, so a resumed run either starts a second file that repeats
the steps logged between the checkpoint and the interruption, or loses the first file.

Where a resumed run starts logging, measured with lightning 2.6.6 (checkpoint at ``global_step`` N,
written at the end of a batch or re-written after the validation that follows it, mid-epoch or at an
epoch boundary): its first rows carry ``step`` N (the learning rate, then the train loss of the first
batch it trains); it never logs a step below N again. The train row of step N-1 and a validation at
global step N (logged as step N-1) come after the checkpoint write in the first run and are not
repeated. So a resumed run keeps the earlier rows with ``step < N`` and replaces the rest (rows of
steps it trains again, a validation the interruption triggered, a test of the stopped model).

The cut is made when the run first writes (rank zero), not when the logger is built, so a run that
fails before logging leaves the record as it was. It is made once per run: under ``ddp_spawn``
the test stage's process sees that the fit's process already wrote and continues the file as it is.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only


def read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and the complete rows of a metrics CSV (a line cut short by a kill is dropped)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = [r for r in reader if None not in r.values() and None not in r]
        return list(reader.fieldnames or []), rows


def write_rows(path: Path, header: list[str], rows: list[dict[str, str]]) -> None:
    """Replace ``path`` atomically (temporary file, then rename): a kill mid-write loses nothing."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _stamp(path: Path) -> tuple[int, int] | None:
    return (path.stat().st_size, path.stat().st_mtime_ns) if path.is_file() else None


class ContinuedWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing file is continued, not deleted: its rows with
    ``step < keep_below`` are kept (all rows when ``keep_below`` is None) and new rows appended. Header
    changes (a metric seen for the first time) rewrite the file atomically."""

    def __init__(self, log_dir: str, keep_below: int | None) -> None:
        super().__init__(log_dir)
        path = Path(self.metrics_file_path)
        if path.is_file():
            header, rows = read_rows(path)
            if keep_below is not None:
                write_rows(path, header, [r for r in rows if int(float(r["step"])) < keep_below])
            self.metrics_keys = header  # Lightning appends with this header, extended by new metrics

    def _check_log_dir_exists(self) -> None:
        """Lightning deletes an existing ``metrics.csv`` here; it is continued instead."""

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        write_rows(Path(self.metrics_file_path), fieldnames, read_rows(Path(self.metrics_file_path))[1])


class ContinuedCSVLogger(CSVLogger):
    """``<save_dir>/logs/version_0/metrics.csv``, continued by a run resumed at ``resume_step``
    (0: a run starting from scratch replaces the rows of an earlier attempt)."""

    _experiment: ContinuedWriter | None

    def __init__(self, save_dir: Path, resume_step: int = 0) -> None:
        super().__init__(save_dir=str(save_dir), name="logs", version=0)
        self.resume_step = resume_step
        self._found = _stamp(Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE)

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuedWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            # unchanged since this logger was built: nobody has written yet in this run, so cut here
            # (the cut is idempotent; anything logged since changes the size or the time)
            fresh = _stamp(Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE) == self._found
            self._experiment = ContinuedWriter(self.log_dir, self.resume_step if fresh else None)
        return self._experiment


def _event_files(log_dir: Path) -> set[str]:
    return {p.name for p in log_dir.glob("events.out.tfevents.*")}


class ContinuedTensorBoardLogger(TensorBoardLogger):
    """``<save_dir>/tensorboard/version_0``, continued by a run resumed at ``resume_step``: the run's
    first event file starts with TensorBoard's purge marker (``SummaryWriter(purge_step=...)``), so
    readers discard the earlier events with ``step >= resume_step`` (the files themselves are kept)."""

    def __init__(self, save_dir: Path, resume_step: int = 0) -> None:
        super().__init__(save_dir=str(save_dir), name="tensorboard", version=0)
        self.resume_step = resume_step
        self._found = _event_files(Path(self.log_dir))

    @property
    def experiment(self) -> Any:
        # only in this run's first writer: unchanged files since the logger was built (see ContinuedCSVLogger)
        # (``rank`` is set on the function by Lightning at import; its type does not declare it)
        first = self._experiment is None and rank_zero_only.rank == 0  # type: ignore[attr-defined]
        if first and self._found and _event_files(Path(self.log_dir)) == self._found:
            self._kwargs["purge_step"] = self.resume_step
        return super().experiment
