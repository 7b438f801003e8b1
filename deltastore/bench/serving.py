"""Serving while syncing (benchmarks/README.md, Floors): how much an engine's Python thread
still gets done while deltastore syncs beside it in the same process.

:class:`ServingThread` is a Python thread doing fixed pure-Python work (small dict and list
operations) in units of about a few microseconds, counting the units it completed. For each
version, :func:`measure` runs a sync with the thread running and counts the units completed
during it, then the units completed in the same wall time right after, the process otherwise
idle (the calling thread sleeps): progress = units per second during the sync / units per
second idle (rates, as the sleep may overshoot).
A sync that holds the GIL, or whose worker threads take it often, shows up as progress
below 1; so does a sync that keeps every core busy.

Thread-safety: :meth:`ServingThread.units` is read from other threads (an int attribute,
written by the serving thread only); one :func:`measure` at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType

from deltastore.bench.schema import ServingSample


class ServingThread:
    """The serving thread (a daemon); ``with`` starts and stops it."""

    def __init__(self) -> None:
        self.units = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serving", daemon=True)

    def _run(self) -> None:
        table: dict[int, int] = {}
        items: list[int] = []
        units = 0
        while not self._stop.is_set():
            for i in range(32):  # one unit: fixed small dict and list operations
                table[i & 7] = table.get(i & 7, 0) + i
                items.append(i)
            items.clear()
            units += 1
            self.units = units

    def __enter__(self) -> ServingThread:
        self._thread.start()
        while self.units == 0:  # running before the first measurement
            time.sleep(0.001)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()


def measure(sync: Callable[[int], object], versions: Iterable[int]) -> list[ServingSample]:
    """Per version: ``sync(version)`` with the serving thread running, then the same wall
    time idle (see the module docstring)."""
    out = []
    with ServingThread() as serving:
        for version in versions:
            u0, t0 = serving.units, time.perf_counter()
            sync(version)
            t1, u1 = time.perf_counter(), serving.units
            u2, t2 = serving.units, time.perf_counter()
            time.sleep(t1 - t0)
            t3, u3 = time.perf_counter(), serving.units
            busy, idle = u1 - u0, u3 - u2
            sync_s, idle_s = t1 - t0, t3 - t2  # the sleep may overshoot: compare rates
            out.append(
                ServingSample(
                    version=version,
                    sync_s=sync_s,
                    busy_units=busy,
                    idle_s=idle_s,
                    idle_units=idle,
                    progress=(busy / sync_s) / (idle / idle_s) if idle and sync_s > 0 else None,
                )
            )
    return out
