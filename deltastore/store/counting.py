"""Counting store calls: how many requests an operation made, and how many of them were
sequential round trips.

:class:`CountingStore` wraps any :class:`~deltastore.store.Store` and records every call made
inside an open :meth:`~CountingStore.window` (its name, key and ``time.monotonic()`` start and
end). :func:`critical_path` turns the calls (or any timed requests) into the longest chain of
calls each of which started after the previous one ended: the round trips the operation paid
in sequence, which is what a link with high latency charges for. The publisher and the
subscriber count their own calls this way (``requests`` and ``round_trips`` in their
reports); tests count the same at the server (:mod:`deltastore.testing.link`).

A call is one store operation. On S3 and GCS every operation a sync, a poll or a publish uses
is one HTTP request; a retried operation counts once here (the retries are logged), and the
one-time probe of a store's conditional writes (:meth:`Store.check_conditional_writes`, made
by a publisher's first publish) is not counted.

Thread-safe: calls may come from any thread, windows may be opened from any thread and
overlap (each gets the calls that started while it was open).
"""

from __future__ import annotations

import builtins
import contextlib
import heapq
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from deltastore.store.base import Store
from deltastore.store.wrapper import StoreWrapper

T = TypeVar("T")


class Timed(Protocol):
    """Anything with a start and an end time in seconds (``time.monotonic()``)."""

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...


@dataclass(frozen=True)
class StoreCall:
    """One store operation: ``op`` (the method's name: ``get``, ``get_range``, ``put``,
    ``list_after`` ...), ``key``
    (the prefix for a listing) and its ``time.monotonic()`` start and end, in seconds."""

    op: str
    key: str
    start: float
    end: float


def critical_path(calls: Iterable[Timed]) -> int:
    """The longest chain of calls each starting at or after the previous one's end: the
    sequential round trips among ``calls`` (0 for none). O(n log n)."""
    done: list[tuple[float, int]] = []  # heap of (end, chain length) of calls started before
    best_done = 0  # the longest chain among calls that ended by the current start
    best = 0
    for call in sorted(calls, key=lambda c: c.start):
        while done and done[0][0] <= call.start:
            best_done = max(best_done, heapq.heappop(done)[1])
        depth = best_done + 1
        heapq.heappush(done, (call.end, depth))
        best = max(best, depth)
    return best


class CountingStore(StoreWrapper):
    """``inner`` with every call recorded into the windows open when it starts (``op``: the
    :class:`~deltastore.store.Store` method's name)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._windows: list[tuple[float, list[StoreCall]]] = []

    @contextlib.contextmanager
    def window(self) -> Iterator[list[StoreCall]]:
        """Collect the calls that start inside the block, from any thread; a call still
        running when the block ends is added when it ends."""
        calls: list[StoreCall] = []
        entry = (time.monotonic(), calls)
        with self._lock:
            self._windows.append(entry)
        try:
            yield calls
        finally:
            with self._lock:
                self._windows.remove(entry)

    def _call(self, name: str, key: str, fn: Callable[[], T]) -> T:
        if name == "check_conditional_writes":
            # not counted: cached after the first call, whose probe requests (a create twice
            # and a delete, on S3 and GCS) the inner store makes itself
            return fn()
        start = time.monotonic()
        try:
            return fn()
        finally:
            if self._windows:
                call = StoreCall(name, key, start, time.monotonic())
                with self._lock:
                    for opened, calls in self._windows:
                        if start >= opened:
                            calls.append(call)


def concurrently(calls: Sequence[Callable[[], Any]]) -> builtins.list[Any]:
    """Run ``calls`` at once, one thread each (the first in the calling thread), and return
    their results in order; the first error (in call order) is raised once all are done.
    For a few independent store requests whose round trips should overlap."""
    if len(calls) <= 1:
        return [c() for c in calls]
    results: builtins.list[Any] = [None] * len(calls)
    errors: builtins.list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors[i] = exc

    threads = [
        threading.Thread(target=run, args=(i,), name="deltastore-request", daemon=True)
        for i in range(1, len(calls))
    ]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results


__all__ = ["CountingStore", "StoreCall", "Timed", "concurrently", "critical_path"]
