"""Measuring tools the benchmark shares: chunked change detection on integer views, the
detect lower bound, digests, flat model buffers and a peak-RSS meter.

Everything works on flat ``int16`` views of bf16 words (never on floats: float comparison says
-0.0 == +0.0 and NaN != NaN; docs/performance.md, Measured limits and pitfalls).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType

import numpy as np
import xxhash


def stderr_log(msg: str) -> None:
    """The benchmarks' default progress log: one line to standard error, flushed."""
    print(msg, file=sys.stderr, flush=True)


def load_average() -> float:
    """The 1-minute load average (-1.0 where the system does not tell)."""
    try:
        return float(os.getloadavg()[0])
    except OSError:
        return -1.0


#: Bytes of one comparison chunk (chunked ``not_equal`` into a reused bool buffer, then
#: ``flatnonzero``: docs/performance.md, Measured limits and pitfalls).
CHUNK_BYTES = 16 << 20


class Differ:
    """Chunked bit-wise comparison of two word arrays into one reused bool buffer."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, itemsize: int = 2) -> None:
        self.step = max(1, chunk_bytes // itemsize)
        self._ne = np.empty(self.step, dtype=np.bool_)

    def _chunks(self, old: np.ndarray, new: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """(start, bool mask of the chunk), with the mask in the reused buffer."""
        if old.shape != new.shape:
            raise ValueError(f"shapes differ: {old.shape} and {new.shape}")
        for a in range(0, old.size, self.step):
            b = min(a + self.step, old.size)
            ne = self._ne[: b - a]
            np.not_equal(old[a:b], new[a:b], out=ne)
            yield a, ne

    def count(self, old: np.ndarray, new: np.ndarray) -> int:
        """Elements whose bits differ."""
        return sum(int(np.count_nonzero(ne)) for _, ne in self._chunks(old, new))

    def positions(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        """Sorted int64 positions of the elements whose bits differ."""
        parts = [np.flatnonzero(ne) + a for a, ne in self._chunks(old, new)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def lower_bound(self, olds: Sequence[np.ndarray], news: Sequence[np.ndarray]) -> float:
        """Seconds of one chunked ``not_equal`` + ``flatnonzero`` pass over every pair: the
        least work an exact change detector does (its results are dropped)."""
        t0 = time.perf_counter()
        for old, new in zip(olds, news, strict=True):
            for _, ne in self._chunks(old, new):
                np.flatnonzero(ne)
        return time.perf_counter() - t0


def digest(parts: Iterable[np.ndarray]) -> str:
    """XXH3-64 (hex) of the bytes of ``parts`` in order: the bench's bit-exactness check."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(np.ascontiguousarray(part).data.cast("B"))
    return h.hexdigest()


def flat_buffer(numel: int) -> np.ndarray:
    """A flat int16 buffer of ``numel`` words, its pages touched (so later page faults do not
    count in what is measured)."""
    buf = np.empty(numel, dtype=np.int16)
    buf.fill(0)
    return buf


def flip_positions(numel: int, count: int, seed: int) -> np.ndarray:
    """``count`` distinct sorted positions in ``[0, numel)``, seeded."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(numel, size=count, replace=False))


# --- resident memory ---------------------------------------------------------------------

_STATUS = "/proc/self/status"


def _status_kb(field: bytes) -> int | None:
    """A ``kB`` field of /proc/self/status (``b"VmRSS:"``), None where there is no /proc."""
    try:
        with open(_STATUS, "rb") as fh:
            text = fh.read()
    except OSError:
        return None
    at = text.find(field)
    if at < 0:
        return None
    return int(text[at + len(field) :].split(maxsplit=1)[0])


def rss_bytes() -> int:
    """Resident set size of this process (0 where /proc is missing)."""
    kb = _status_kb(b"VmRSS:")
    return 0 if kb is None else kb * 1024


def _reset_peak() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


class RssMeter:
    """Peak extra resident memory of this process during a ``with`` block.

    A background thread samples VmRSS every ``interval_s``; the kernel's own peak (VmHWM,
    reset on entry through ``/proc/self/clear_refs``) catches spikes between samples.
    ``extra_bytes`` = peak - ``baseline`` (default: the RSS on entry; 0 if it never grew).
    A fixed baseline taken once after setup counts memory kept from one block to the next
    (freed heap that the allocator keeps and reuses would hide a later block's use).
    ``cpu_s``: CPU seconds of the sampling thread itself (known after the block), which a
    caller that measures the process's CPU over the block subtracts.
    """

    def __init__(self, interval_s: float = 0.001, baseline: int | None = None) -> None:
        self.interval_s = interval_s
        self.baseline = baseline
        self.before = 0
        self.peak = 0
        self.samples = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm = False

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1
            self._stop.wait(self.interval_s)
        self.cpu_s = time.thread_time()  # this thread's CPU since it started

    def __enter__(self) -> RssMeter:
        self._hwm = _reset_peak()
        self.peak = rss_bytes()
        self.before = self.peak if self.baseline is None else self.baseline
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rss-meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        if self._hwm:
            hwm = _status_kb(b"VmHWM:")
            if hwm is not None:
                self.peak = max(self.peak, hwm * 1024)

    @property
    def extra_bytes(self) -> int:
        return max(0, self.peak - self.before)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ('unknown' elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def memory_bytes() -> int:
    """Physical memory of the machine (0 where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0
