"""A progress bar for the benchmark parents (rich), printing each finished measurement above it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Tick(Protocol):
    def __call__(self, line: str = "") -> None: ...


@contextmanager
def progress(total: int, description: str) -> Iterator[Tick]:
    """``with progress(n, "what") as tick: ... tick("a finished measurement")``: advances the bar by one and
    prints ``line`` above it (rich keeps the bar at the bottom; with output piped it prints the lines only)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, transient=False) as bar:
        task = bar.add_task(description, total=total)

        def tick(line: str = "") -> None:
            if line:
                bar.console.print(line, highlight=False, markup=False)
            bar.advance(task)

        yield tick
