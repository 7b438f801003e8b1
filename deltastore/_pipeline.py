"""The receiver's fetch-and-decode plumbing: timing, progress, in-flight byte budget, and the
:class:`Fetcher` that runs per-frame work on a thread pool.

Thread-safe: shared by the worker threads of one sync.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import xxhash

from deltastore.codecs import FrameDecoder
from deltastore.errors import DeltastoreError, FrameError, IntegrityError
from deltastore.manifest import Frame
from deltastore.progress import ProgressFn, Ticker
from deltastore.store import Store

T = TypeVar("T", bound=tuple[Any, ...])
R = TypeVar("R")


class Timer(Ticker):
    """Seconds summed over worker threads: fetching, and all per-frame work (fetch included);
    the stored frames and bytes fetched; finished frames for the progress callback."""

    def __init__(self, fn: ProgressFn | None = None, frames: int = 0, nbytes: int = 0) -> None:
        super().__init__(fn, frames, nbytes)
        self.lock = threading.Lock()
        self.fetch = 0.0
        self.work = 0.0
        self.fetched_bytes = 0
        self.fetched_frames = 0

    def add(self, *, fetch: float = 0.0, work: float = 0.0, nbytes: int = 0) -> None:
        """Add seconds of fetching / per-frame work; ``nbytes``: one more frame fetched."""
        with self.lock:
            self.fetch += fetch
            self.work += work
            if nbytes:
                self.fetched_bytes += nbytes
                self.fetched_frames += 1

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


class Fetcher:
    """Fetches stored frames (checked against their length and xxh3) and runs per-frame work
    on ``max_workers`` threads with at most ``max_inflight`` stored bytes in flight.

    Each worker thread has its own :class:`FrameDecoder`. ``run`` is called by one thread.
    """

    def __init__(self, store: Store, max_workers: int, max_inflight: int) -> None:
        self.store, self._workers, self._max_inflight = store, max_workers, max_inflight
        self._local = threading.local()

    def _decoder(self) -> FrameDecoder:
        dec: FrameDecoder | None = getattr(self._local, "decoder", None)
        if dec is None:
            dec = self._local.decoder = FrameDecoder()
        return dec

    def fetch(self, f: Frame, timer: Timer) -> bytes:
        """The stored bytes of ``f``; :class:`FrameError` if truncated, :class:`IntegrityError`
        if the xxh3 does not match."""
        t0 = time.perf_counter()
        data = self.store.get_range(f.object, f.offset, f.length)
        t1 = time.perf_counter()
        if len(data) != f.length:
            raise FrameError(
                f"{f.object}: frame at offset {f.offset} is truncated "
                f"({len(data)} of {f.length} bytes)"
            )
        if xxhash.xxh3_64_hexdigest(data) != f.xxh3:
            raise IntegrityError(
                f"{f.object}: frame at offset {f.offset} is corrupted (xxh3 mismatch): the "
                "stored object is damaged; wait for a newer anchor, or restore the object"
            )
        timer.add(fetch=t1 - t0, nbytes=len(data))
        return data

    def run(
        self, tasks: Sequence[T], work: Callable[[T, FrameDecoder], R], timer: Timer
    ) -> list[R]:
        """``work(task, decoder)`` for every task (its last item is its :class:`Frame`), in
        task order; the first real error is raised after the pool stopped."""
        budget = ByteBudget(self._max_inflight)
        failed = threading.Event()

        def run(task: T) -> R:
            frame: Frame = task[-1]
            try:
                if failed.is_set():
                    raise Cancelled("skipped after an earlier frame failed")
                t0 = time.perf_counter()
                out = work(task, self._decoder())
                timer.add(work=time.perf_counter() - t0)
                timer.tick(frame.length)
                return out
            except BaseException:
                failed.set()
                raise
            finally:
                budget.release(frame.length)

        futures: list[Future[R]] = []
        with ThreadPoolExecutor(self._workers, thread_name_prefix="deltastore-sync") as pool:
            for task in tasks:
                if failed.is_set():
                    break
                budget.acquire(task[-1].length)
                futures.append(pool.submit(run, task))
            wait(futures, return_when=FIRST_EXCEPTION)
        raise_first(futures)
        return [f.result() for f in futures]
