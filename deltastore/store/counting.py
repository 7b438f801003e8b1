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

T = TypeVar("T")


class Timed(Protocol):
    """Anything with a start and an end time in seconds (``time.monotonic()``)."""

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...


@dataclass(frozen=True)
class StoreCall:
    """One store operation: ``op`` (``get``, ``get_range``, ``put``, ``list`` ...), ``key``
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


class CountingStore(Store):
    """``inner`` with every call recorded into the windows open when it starts."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.unsafe_commits = inner.unsafe_commits
        self.consistent_listing = inner.consistent_listing
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

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        start = time.monotonic()
        try:
            return fn()
        finally:
            if self._windows:
                call = StoreCall(op, key, start, time.monotonic())
                with self._lock:
                    for opened, calls in self._windows:
                        if start >= opened:
                            calls.append(call)

    # --- Store --------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        return self._call("get", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._call("get_range", key, lambda: self.inner.get_range(key, start, length))

    def put(self, key: str, data: bytes) -> None:
        self._call("put", key, lambda: self.inner.put(key, data))

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._call("put_if_absent", key, lambda: self.inner.put_if_absent(key, data))

    def get_with_token(self, key: str) -> tuple[bytes, str] | None:
        return self._call("get", key, lambda: self.inner.get_with_token(key))

    def put_if_match(self, key: str, data: bytes, token: str | None) -> None:
        self._call("put_if_match", key, lambda: self.inner.put_if_match(key, data, token))

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self._call("list", prefix, lambda: self.inner.list(prefix))

    def list_after(self, prefix: str, start_after: str) -> builtins.list[str]:
        return self._call("list", prefix, lambda: self.inner.list_after(prefix, start_after))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def head_token(self, key: str) -> str | None:
        return self._call("head", key, lambda: self.inner.head_token(key))

    def exists(self, key: str) -> bool:
        return self._call("head", key, lambda: self.inner.exists(key))

    def check_conditional_writes(self) -> bool:
        """Not counted: the answer is cached after the first call, whose probe requests (a
        create twice and a delete, on S3 and GCS) the inner store makes itself."""
        return self.inner.check_conditional_writes()


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
