"""The progress display of the tools that run a scenario (demo, fleet): one line per step on
stderr, a bar where the step can be counted, each saying what it waits for."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


class Steps:
    """The progress display: one line per step, a bar where the step can be counted."""

    def __init__(self, enabled: bool) -> None:
        self._progress = Progress(
            SpinnerColumn(finished_text="[green]done"),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )

    def __enter__(self) -> Steps:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    @contextmanager
    def step(self, description: str, total: int = 1) -> Iterator[Callable[[], None]]:
        """A step of ``total`` parts; the caller advances it by calling what it gets."""
        task = self.begin(description, total)
        yield partial(self._progress.advance, task)
        self.finish(task)

    def advance(self, task: TaskID) -> None:
        self._progress.advance(task)

    def begin(self, description: str, total: int = 1) -> TaskID:
        return self._progress.add_task(description, total=total)

    def finish(self, task: TaskID) -> None:
        self._progress.update(task, completed=self._progress.tasks[task].total)
