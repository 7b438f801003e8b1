"""The receiver's fetch-and-decode plumbing: timing, progress, in-flight byte budget.

Thread-safe: shared by the worker threads of one sync.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from deltastore.errors import DeltastoreError
from deltastore.progress import ProgressFn, Ticker


class Timer(Ticker):
    """Seconds summed over worker threads: fetching, and all per-frame work (fetch included);
    also counts finished frames for the progress callback."""

    def __init__(self, fn: ProgressFn | None = None, frames: int = 0, nbytes: int = 0) -> None:
        super().__init__(fn, frames, nbytes)
        self.lock = threading.Lock()
        self.fetch = 0.0
        self.work = 0.0

    def add(self, *, fetch: float = 0.0, work: float = 0.0) -> None:
        with self.lock:
            self.fetch += fetch
            self.work += work

    @property
    def decode(self) -> float:
        return max(0.0, self.work - self.fetch)


class Cancelled(DeltastoreError):
    """A frame task skipped because an earlier one failed (never surfaces to callers)."""


class ByteBudget:
    """Blocks the producer while more than ``limit`` bytes are in flight (one item always fits)."""

    def __init__(self, limit: int) -> None:
        self._limit, self._used = limit, 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._used == 0 or self._used + n <= self._limit)
            self._used += n

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


def raise_first(futures: Iterable[Future[Any]]) -> None:
    """Re-raise the first real error among the futures (skipped tasks do not count)."""
    for fut in futures:
        exc = fut.exception()
        if exc is not None and not isinstance(exc, Cancelled):
            raise exc
