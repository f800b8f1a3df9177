"""The progress display of the tools that run a scenario (demo, fleet): one line per step on
stderr, a bar where the step can be counted, each saying what it waits for.

Off a terminal (stderr to a file, a pipe, a CI log) a live display cannot redraw: rich would
leave each step's last frame cut to 80 columns. There every step is written as plain lines
instead, whole: one when it begins and one when it is done, with its count and duration.
"""

from __future__ import annotations

import time
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
    """The progress display: one line per step, a bar where the step can be counted; plain
    lines off a terminal. ``console``: where it writes (stderr by default)."""

    def __init__(self, enabled: bool, console: Console | None = None) -> None:
        self._console = console if console is not None else Console(stderr=True)
        self._plain = enabled and not self._console.is_terminal
        self._began: dict[TaskID, float] = {}
        self._progress = Progress(
            SpinnerColumn(finished_text="[green]done"),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self._console,
            disable=not enabled or self._plain,
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
        task = self._progress.add_task(description, total=total)
        self._began[task] = time.monotonic()
        self._line(f"{description} ...")
        return task

    def finish(self, task: TaskID) -> None:
        entry = self._progress.tasks[task]
        self._progress.update(task, completed=entry.total)
        seconds = time.monotonic() - self._began[task]
        count = f"{entry.total:.0f}/{entry.total:.0f}, " if entry.total != 1 else ""
        self._line(f"done: {entry.description} ({count}{seconds:.1f} s)")

    def _line(self, text: str) -> None:
        """Off a terminal, one whole line (never cut or wrapped, no markup read into it)."""
        if self._plain:
            self._console.print(text, soft_wrap=True, markup=False, highlight=False)
