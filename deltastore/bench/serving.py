"""Serving while syncing (benchmarks/README.md, Floors): how much an engine's Python thread
still gets done while deltastore syncs beside it in the same process.

:class:`ServingThread` is a Python thread doing fixed pure-Python work (small dict and list
operations) in units of about a few microseconds, counting the units it completed. For each
version, :func:`measure` counts the units completed while the process is otherwise idle (the
calling thread sleeps) just before the sync (as long as the previous sync took;
:data:`FIRST_IDLE_S` before the first), during the sync, and idle again right after it for
as long as the sync took: progress = units per second during the sync / units per second
over both idle windows (rates, as a sleep may overshoot; two windows around the sync, so
that other load on the machine weighs on both sides alike).
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

#: Seconds of the idle window before the first sync (later ones: the previous sync's time).
FIRST_IDLE_S = 0.05


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


def _idle(serving: ServingThread, seconds: float) -> tuple[int, float]:
    """Units the serving thread completes while this thread sleeps ``seconds``, and the
    seconds that took."""
    u0, t0 = serving.units, time.perf_counter()
    time.sleep(seconds)
    return serving.units - u0, time.perf_counter() - t0


def measure(sync: Callable[[int], object], versions: Iterable[int]) -> list[ServingSample]:
    """Per version: an idle window, ``sync(version)`` with the serving thread running, an
    idle window as long as the sync (see the module docstring)."""
    out: list[ServingSample] = []
    with ServingThread() as serving:
        for version in versions:
            before = _idle(serving, out[-1].sync_s if out else FIRST_IDLE_S)
            u0, t0 = serving.units, time.perf_counter()
            sync(version)
            t1, u1 = time.perf_counter(), serving.units
            after = _idle(serving, t1 - t0)
            busy, sync_s = u1 - u0, t1 - t0
            idle, idle_s = before[0] + after[0], before[1] + after[1]
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
