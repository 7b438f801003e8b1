"""Progress reports for long operations (publish, sync)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Where an operation stands. Bytes are dense tensor bytes for a publish and stored
    (compressed) frame bytes for a sync."""

    frames_done: int
    frames_total: int
    bytes_done: int
    bytes_total: int


#: A progress callback; called from worker threads, one call at a time.
ProgressFn = Callable[[Progress], None]


class Ticker:
    """Counts finished frames and calls a :data:`ProgressFn` (thread-safe, serialized)."""

    def __init__(self, fn: ProgressFn | None, frames_total: int, bytes_total: int) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._frames_total, self._bytes_total = frames_total, bytes_total
        self._frames = self._bytes = 0

    def tick(self, nbytes: int, frames: int = 1) -> None:
        """Record ``frames`` finished frames of ``nbytes`` bytes."""
        if self._fn is None:
            return
        with self._lock:
            self._frames += frames
            self._bytes += nbytes
            self._fn(Progress(self._frames, self._frames_total, self._bytes, self._bytes_total))
