"""Callers waiting for a ``req_id`` that no ``/encode`` has named yet.

SGLang's prefill ranks pull a part's metadata as soon as they see the request, which may be
before its tokenizer's ``/encode`` has reached this server. Such a pull cannot join a scope that
does not exist, so it waits here until the service announces the id (a scope opened for it, or
the ``/encode`` was refused) or gives up. An entry lives only while someone waits on it: a
caller that goes away leaves nothing.

Keys may belong to a group (the parts of one SGLang request): :meth:`Arrivals.waiting_in`
names the keys of a group someone waits for, so a failure that ends a whole group costs the
keys that exist, never the number of parts a client claims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from trio_encode.errors import RequestError


@dataclass(eq=False)
class _Waiting:
    event: trio.Event = field(default_factory=trio.Event)
    waiters: int = 0
    error: RequestError | None = None


class Arrivals:
    """Keyed wake-ups: :meth:`wait` for a key until :meth:`announce` names it.

    ``group`` maps a key to its group (None: in none); :meth:`waiting_in` lists a group's
    waiting keys."""

    def __init__(self, group: Callable[[str], str | None] | None = None) -> None:
        self._waiting: dict[str, _Waiting] = {}
        self._group = group
        self._groups: dict[str, set[str]] = {}

    def __len__(self) -> int:
        """Keys someone is waiting for now."""
        return len(self._waiting)

    def __contains__(self, key: object) -> bool:
        """Whether someone is waiting for ``key`` now."""
        return key in self._waiting

    def waiting_in(self, group: str) -> list[str]:
        """The keys of ``group`` someone is waiting for now."""
        return list(self._groups.get(group, ()))

    def _add(self, key: str) -> _Waiting:
        entry = self._waiting[key] = _Waiting()
        group = None if self._group is None else self._group(key)
        if group is not None:
            self._groups.setdefault(group, set()).add(key)
        return entry

    def _remove(self, key: str) -> _Waiting | None:
        entry = self._waiting.pop(key, None)
        group = None if entry is None or self._group is None else self._group(key)
        if group is not None:
            keys = self._groups[group]
            keys.discard(key)
            if not keys:
                del self._groups[group]
        return entry

    async def wait(self, key: str) -> None:
        """Return once ``key`` is announced (or :meth:`announce_all` runs); raise the error
        it was announced with, if any."""
        entry = self._waiting.get(key)
        if entry is None:
            entry = self._add(key)
        entry.waiters += 1
        try:
            await entry.event.wait()
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and self._waiting.get(key) is entry:
                self._remove(key)
        if entry.error is not None:
            raise entry.error.fresh()  # each waiter its own: see RequestError.fresh

    def announce(self, key: str, *, error: RequestError | None = None) -> None:
        """Wake everyone waiting for ``key`` (to raise ``error``, when given, as the reason
        no scope will come); a no-op when nobody is."""
        entry = self._remove(key)
        if entry is not None:
            entry.error = None if error is None else error.fresh()  # not the raiser's frames
            entry.event.set()

    def announce_all(self) -> None:
        """Wake every waiter (shutdown: they re-check and learn why)."""
        waiting, self._waiting = self._waiting, {}
        self._groups = {}
        for entry in waiting.values():
            entry.event.set()
