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
#: Most stored bytes fetched by one ranged read of adjacent frames.
MAX_SPAN = 32 << 20
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

    def fetch(self, f: Frame, timer: Timer, *, span: tuple[int, bytes] | None = None) -> bytes:
        """The stored bytes of ``f`` (from ``span``: bytes of its object read from offset
        ``span[0]``, when given); :class:`FrameError` if truncated, :class:`IntegrityError` if
        the xxh3 does not match."""
        if span is None:
            t0 = time.perf_counter()
            data = self.store.get_range(f.object, f.offset, f.length)
            timer.add(fetch=time.perf_counter() - t0)
        else:
            data = span[1][f.offset - span[0] : f.offset - span[0] + f.length]
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
        timer.add(nbytes=len(data))
        return data

    def _groups(self, tasks: Sequence[T]) -> list[list[T]]:
        """Consecutive tasks whose frames sit back to back in one object, fetched as one range
        of at most :data:`MAX_SPAN` bytes (a version's frames are packed in order, so a delta
        usually costs one request per data object instead of one per frame)."""
        groups: list[list[T]] = []
        limit = min(MAX_SPAN, self._max_inflight)
        for task in tasks:
            f: Frame = task[-1]
            if groups:
                last: Frame = groups[-1][-1][-1]
                first: Frame = groups[-1][0][-1]
                if (
                    f.object == last.object
                    and f.offset == last.offset + last.length
                    and f.offset + f.length - first.offset <= limit
                ):
                    groups[-1].append(task)
                    continue
            groups.append([task])
        return groups

    def run(
        self, tasks: Sequence[T], work: Callable[[T, bytes, FrameDecoder], R], timer: Timer
    ) -> list[R]:
        """``work(task, stored_bytes, decoder)`` for every task (its last item is its
        :class:`Frame`), in task order; the first real error is raised after the pool stopped.
        Adjacent frames are fetched with one ranged read (:meth:`_groups`)."""
        budget = ByteBudget(self._max_inflight)
        failed = threading.Event()

        def run(group: list[T]) -> list[R]:
            first: Frame = group[0][-1]
            size = sum(t[-1].length for t in group)
            try:
                if failed.is_set():
                    raise Cancelled("skipped after an earlier frame failed")
                span = None
                if len(group) > 1:
                    t0 = time.perf_counter()
                    span = (first.offset, self.store.get_range(first.object, first.offset, size))
                    timer.add(fetch=time.perf_counter() - t0)
                outs = []
                for task in group:
                    t0 = time.perf_counter()
                    frame: Frame = task[-1]
                    outs.append(work(task, self.fetch(frame, timer, span=span), self._decoder()))
                    timer.add(work=time.perf_counter() - t0)
                    timer.tick(frame.length)
                return outs
            except BaseException:
                failed.set()
                raise
            finally:
                budget.release(size)

        futures: list[Future[list[R]]] = []
        with ThreadPoolExecutor(self._workers, thread_name_prefix="deltastore-sync") as pool:
            for group in self._groups(tasks):
                if failed.is_set():
                    break
                budget.acquire(sum(t[-1].length for t in group))
                futures.append(pool.submit(run, group))
            wait(futures, return_when=FIRST_EXCEPTION)
        raise_first(futures)
        return [out for f in futures for out in f.result()]
