"""The receiver's fetch-and-decode plumbing: timing, progress, in-flight byte budget, and the
:class:`Fetcher` that runs per-frame work on a thread pool.

Thread-safe: shared by the worker threads of one sync.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import xxhash

from deltastore.errors import DeltastoreError, FrameError, IntegrityError
from deltastore.format.codecs import FrameDecoder
from deltastore.format.ed25519 import frame_digest
from deltastore.format.manifest import Frame, Manifest, TensorEntry
from deltastore.progress import ProgressFn, Ticker
from deltastore.store import Store
from deltastore.sync.priority import Priority, check_priority, lower_current_thread

#: Most stored bytes fetched by one ranged read of adjacent frames.
MAX_SPAN = 32 << 20
#: Stored bytes of adjacent frames one pool job works on, in order: a delta's frames are small
#: (a 16 MiB frame at 0.8% changed stores ~110 KB; a small tensor's frame a few KB), and a
#: future and its hand-offs between threads cost ~50-80 us per frame on 2 busy cores, about
#: what staging a frame of 2,000 changes costs (benchmarks/profile_sync.py).
BATCH_BYTES = 128 << 10


def cpu_slots() -> int:
    """CPUs this process may run on: how many batch jobs work at once (more threads than cores
    only contend for the GIL and memory: a medium delta's sync burned 237 ms of CPU with 4
    working threads on 2 cores, 187 ms with 2, for no shorter wall time)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


R = TypeVar("R")
#: ``batch(tasks, buffer, offsets, decoder)`` of :meth:`Fetcher.run`: a job's results.
BatchWork: TypeAlias = Callable[
    [Sequence["FrameTask"], bytes, Sequence[int], FrameDecoder], Sequence[R]
]


@dataclass(frozen=True)
class FrameTask:
    """One frame of a version to fetch and work on: tensor ``name``, its manifest ``entry``
    and the ``frame`` itself."""

    name: str
    entry: TensorEntry
    frame: Frame


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


def frame_tasks(m: Manifest) -> list[FrameTask]:
    """Every frame of ``m``, in tensor and element order."""
    return [FrameTask(name, entry, f) for name, entry in m.tensors.items() for f in entry.frames]


def raise_first(futures: Iterable[Future[Any]]) -> None:
    """Re-raise the first real error among the futures (skipped tasks do not count)."""
    for fut in futures:
        exc = fut.exception()
        if exc is not None and not isinstance(exc, Cancelled):
            raise exc


class Fetcher:
    """Fetches stored frames (checked against their length and xxh3) and runs per-frame work
    on ``max_workers`` threads with at most ``max_inflight`` stored bytes in flight.

    Each worker thread has its own :class:`FrameDecoder`. The worker threads start at the
    priority of the thread that calls :meth:`run` (Linux threads inherit nice and policy from
    the thread that makes them) and are lowered to ``priority`` when it is lower
    (:mod:`deltastore.sync.priority`: a nice value 1-19 or ``"idle"``; 0: as the caller), so
    that a sync beside a serving engine takes the cores the engine leaves idle. At most
    ``threads`` of them (default: :func:`cpu_slots`) work on frames at once.
    ``run`` is called by one thread.
    """

    def __init__(
        self,
        store: Store,
        max_workers: int,
        max_inflight: int,
        priority: Priority = 0,
        *,
        threads: int | None = None,
    ) -> None:
        self.store, self._workers, self._max_inflight = store, max_workers, max_inflight
        self._threads = threads
        self.priority = check_priority(priority)
        self._local = threading.local()

    def _decoder(self) -> FrameDecoder:
        dec: FrameDecoder | None = getattr(self._local, "decoder", None)
        if dec is None:
            dec = self._local.decoder = FrameDecoder()
        return dec

    def fetch(
        self,
        f: Frame,
        timer: Timer,
        *,
        span: tuple[int, bytes] | None = None,
        check: bool = True,
    ) -> bytes:
        """The stored bytes of ``f`` (from ``span``: bytes of its object read from offset
        ``span[0]``, when given); :class:`FrameError` if truncated, :class:`IntegrityError` if
        the xxh3 does not match (``check`` False: not checked here)."""
        if span is None:
            t0 = time.perf_counter()
            data = self.store.get_range(f.object, f.offset, f.length)
            timer.add(fetch=time.perf_counter() - t0)
        else:
            data = span[1][f.offset - span[0] : f.offset - span[0] + f.length]
        check_stored(f, data, digests=check)
        timer.add(nbytes=len(data))
        return data

    def _buffer(
        self, tasks: Sequence[FrameTask], timer: Timer, span: tuple[int, bytes] | None
    ) -> tuple[bytes, list[int]]:
        """The stored bytes of consecutive ``tasks`` as one buffer and each frame's offset in
        it: the read's span (no copy), or, without one, the frames read one by one (a job of
        one frame: its own read); :class:`FrameError` for a truncated frame."""
        if span is None:
            datas = [self.fetch(t.frame, timer, check=False) for t in tasks]
            offsets = list(itertools.accumulate((len(d) for d in datas[:-1]), initial=0))
            return datas[0] if len(datas) == 1 else b"".join(datas), offsets
        base, buf = span
        offsets = [t.frame.offset - base for t in tasks]
        for t, at in zip(tasks, offsets, strict=True):
            f = t.frame
            if at + f.length > len(buf):
                got = max(0, len(buf) - at)
                raise FrameError(
                    f"{f.object}: frame at offset {f.offset} is truncated "
                    f"({got} of {f.length} bytes)"
                )
        for t in tasks:  # one frame fetched each
            timer.add(nbytes=t.frame.length)
        return buf, offsets

    def _groups(self, tasks: Sequence[FrameTask]) -> list[list[int]]:
        """Indices of consecutive tasks whose frames sit back to back in one object, fetched as
        one range of at most :data:`MAX_SPAN` bytes (a version's frames are packed in order, so
        a delta costs about one request per data object instead of one per frame)."""
        groups: list[list[int]] = []
        limit = min(MAX_SPAN, self._max_inflight)
        for i, task in enumerate(tasks):
            f = task.frame
            if groups:
                last = tasks[groups[-1][-1]].frame
                first = tasks[groups[-1][0]].frame
                if (
                    f.object == last.object
                    and f.offset == last.offset + last.length
                    and f.offset + f.length - first.offset <= limit
                ):
                    groups[-1].append(i)
                    continue
            groups.append([i])
        return groups

    def run(
        self,
        tasks: Sequence[FrameTask],
        work: Callable[[FrameTask, bytes, FrameDecoder], R],
        timer: Timer,
        *,
        batch: BatchWork[R] | None = None,
    ) -> list[R]:
        """``work(task, stored_bytes, decoder)`` for every task, called on a worker thread
        with that thread's decoder; the results in task order. The first real error is raised
        after the pool stopped.

        Adjacent frames are fetched with one ranged read (:meth:`_groups`); the frames of a
        read are then worked on in parallel, in jobs of consecutive frames of about
        :data:`BATCH_BYTES` stored bytes (:func:`batches`), at most :func:`cpu_slots` jobs at
        once (reads are not counted: they wait on the store). The in-flight budget counts a
        read's bytes until its last frame is done.

        ``batch`` (optional): called instead of ``work`` with a job's frames at once, as
        ``batch(tasks, buffer, offsets, decoder)``: frame ``i``'s stored bytes are
        ``buffer[offsets[i]:offsets[i] + length]`` (the read's span, or the frame's own bytes),
        their length checked, their XXH3 not yet (``batch`` checks it, as :meth:`fetch` does);
        it returns the job's results in order."""
        budget = ByteBudget(self._max_inflight)
        slots = threading.BoundedSemaphore(min(self._workers, self._threads or cpu_slots()))
        failed = threading.Event()
        lock = threading.Lock()
        results: list[Any] = [None] * len(tasks)
        jobs: list[Future[int]] = []  # appended by read jobs, read once every read is done

        batch_work = batch

        def batch_job(
            batch_ids: Sequence[int], span: tuple[int, bytes] | None, left: list[int]
        ) -> int:
            try:
                with slots:
                    decoder = self._decoder()
                    if batch_work is not None:
                        if failed.is_set():
                            raise Cancelled("skipped after an earlier frame failed")
                        t0 = time.perf_counter()
                        jobs_tasks = [tasks[i] for i in batch_ids]
                        buf, offsets = self._buffer(jobs_tasks, timer, span)
                        for i, result in zip(
                            batch_ids, batch_work(jobs_tasks, buf, offsets, decoder), strict=True
                        ):
                            results[i] = result
                        timer.add(work=time.perf_counter() - t0)
                        for task in jobs_tasks:
                            timer.tick(task.frame.length)
                        return len(batch_ids)
                    for i in batch_ids:
                        frame = tasks[i].frame
                        if failed.is_set():
                            raise Cancelled("skipped after an earlier frame failed")
                        t0 = time.perf_counter()
                        results[i] = work(tasks[i], self.fetch(frame, timer, span=span), decoder)
                        timer.add(work=time.perf_counter() - t0)
                        timer.tick(frame.length)
                return len(batch_ids)
            except BaseException:
                failed.set()
                raise
            finally:
                with lock:
                    left[0] -= 1
                    done = left[0] == 0
                if done:
                    budget.release(left[1])

        def read_job(pool: ThreadPoolExecutor, group: list[int], size: int) -> None:
            try:
                if failed.is_set():
                    raise Cancelled("skipped after an earlier frame failed")
                span = None
                if len(group) > 1:
                    first = tasks[group[0]].frame
                    t0 = time.perf_counter()
                    span = (first.offset, self.store.get_range(first.object, first.offset, size))
                    timer.add(fetch=time.perf_counter() - t0)
            except BaseException:
                failed.set()
                budget.release(size)
                raise
            parts = batches(tasks, group)
            left = [len(parts), size]
            for part in parts:
                jobs.append(pool.submit(batch_job, part, span, left))

        reads: list[Future[None]] = []
        with ThreadPoolExecutor(
            self._workers,
            thread_name_prefix="deltastore-sync",
            initializer=lower_current_thread,
            initargs=(self.priority,),
        ) as pool:
            for group in self._groups(tasks):
                if failed.is_set():
                    break
                size = sum(tasks[i].frame.length for i in group)
                budget.acquire(size)
                reads.append(pool.submit(read_job, pool, group, size))
            wait(reads)  # every batch job is submitted once its read is done
            submitted = list(jobs)
            wait(submitted, return_when=FIRST_EXCEPTION)
        raise_first([*reads, *submitted])
        if sum(f.result() for f in submitted) != len(tasks):  # pragma: no cover - raised above
            raise Cancelled("not every frame was worked on")
        return results


def check_stored(f: Frame, data: bytes | memoryview, *, digests: bool = True) -> None:
    """Raise :class:`FrameError` unless ``data`` (the stored frame's bytes as read) is
    ``f.length`` bytes long, then (``digests``) as :func:`check_xxh3`."""
    if len(data) != f.length:
        raise FrameError(
            f"{f.object}: frame at offset {f.offset} is truncated ({len(data)} of {f.length} bytes)"
        )
    if digests:
        check_xxh3(f, data)


def check_xxh3(f: Frame, data: bytes | memoryview) -> None:
    """Raise :class:`IntegrityError` unless ``data`` has the frame's XXH3-64 and, when the
    frame records one (Ed25519-signed manifests), its BLAKE3 (:func:`check_blake3`)."""
    if xxhash.xxh3_64_hexdigest(data) != f.xxh3:
        raise corrupted(f)
    check_blake3(f, data)


def check_blake3(f: Frame, data: bytes | memoryview) -> None:
    """Raise :class:`IntegrityError` unless ``data`` has the BLAKE3 the frame records (no
    check when it records none). Under a signed manifest, a mismatch means the stored bytes
    were replaced or damaged: they are never decoded."""
    if f.blake3 is not None and frame_digest(data) != f.blake3:
        raise IntegrityError(
            f"{f.object}: frame at offset {f.offset} does not have the BLAKE3 its signed "
            "manifest records: the data object was replaced or damaged after it was "
            "published; nothing of this version was applied. Restore the object or wait "
            "for a newer version"
        )


def corrupted(f: Frame) -> IntegrityError:
    """The error of a frame whose stored bytes do not have its XXH3-64."""
    return IntegrityError(
        f"{f.object}: frame at offset {f.offset} is corrupted (xxh3 mismatch): the "
        "stored object is damaged; wait for a newer anchor, or restore the object"
    )


def batches(tasks: Sequence[FrameTask], group: Sequence[int]) -> list[list[int]]:
    """``group`` (indices of ``tasks``) cut into runs of consecutive frames of at least
    :data:`BATCH_BYTES` stored bytes each (a frame that large alone; the last run may be
    smaller)."""
    out: list[list[int]] = []
    run: list[int] = []
    nbytes = 0
    for i in group:
        run.append(i)
        nbytes += tasks[i].frame.length
        if nbytes >= BATCH_BYTES:
            out.append(run)
            run, nbytes = [], 0
    if run:
        out.append(run)
    return out
