"""The publisher's per-frame work: detect the changed words, checksum, encode; on a small pool.

Frames are independent, and numpy's comparisons and zstd release the GIL, so
:class:`FrameEncoders` runs them on ``workers`` threads (each with its own zstd context and
comparison buffer) and yields the results in frame order with a bounded lookahead, while the
caller packs and uploads. Thread-safe in that sense only: one caller thread per instance.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import xxhash

from deltastore.format.checksum import adler32, apply_delta, delta_sums
from deltastore.format.codecs import NEW_WORDS_CODECS, RAW, Codec, CodecSet, FrameEncoder
from deltastore.format.manifest import Frame

J = TypeVar("J")
R = TypeVar("R")


@dataclass(frozen=True)
class FrameJob:
    """One frame: the new words, and the parent's words and frame Adler-32 (None: no parent);
    ``delta``: encode the changes (else the new words, ``raw`` or ``raw-planes``); ``full``:
    also encode the new words, for an anchor copy (:attr:`Encoded.full`)."""

    new: np.ndarray
    old: np.ndarray | None
    parent_adler: int | None
    delta: bool
    full: bool = False


@dataclass(frozen=True)
class FullFrame:
    """A frame's new words encoded for an anchor copy: codec, stored bytes, their XXH3-64."""

    codec: Codec
    data: bytes
    xxh3: str

    def frame(self, start: int, stop: int, obj: str, offset: int, adler: int) -> Frame:
        """Its manifest entry in the anchor copy: elements ``[start, stop)`` (global), stored
        at ``offset`` of data object ``obj``, ``adler`` the Adler-32 of its new words."""
        return Frame(
            start=start,
            stop=stop,
            codec=self.codec,
            object=obj,
            offset=offset,
            length=len(self.data),
            xxh3=self.xxh3,
            changed=stop - start,
            adler32=adler,
            parent_adler32=None,
        )


@dataclass(frozen=True)
class Encoded:
    """What a frame job produced. ``data`` is None for an unchanged frame of a delta (nothing
    is stored); ``pos``/``new_at``: frame-local changed positions and their new words;
    ``full``: the new words encoded for an anchor copy (None unless the job asked for it)."""

    changed: int
    adler: int
    codec: Codec
    data: bytes | None
    xxh3: str
    pos: np.ndarray | None
    new_at: np.ndarray | None
    detect_s: float
    encode_s: float
    full: FullFrame | None = None


class FrameEncoders:
    """Runs :class:`FrameJob` s on ``workers`` threads at zstd ``level`` (None: each codec's
    default), writing the codecs of ``codecs``."""

    def __init__(self, level: int | None, workers: int, codecs: CodecSet = "v2") -> None:
        self._level, self._workers, self._codecs = level, workers, codecs
        self._local = threading.local()

    def _encoder(self) -> FrameEncoder:
        enc: FrameEncoder | None = getattr(self._local, "encoder", None)
        if enc is None:
            enc = self._local.encoder = FrameEncoder(self._level, codecs=self._codecs)
        return enc

    def _diff(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        """Frame-local indices where the words differ (a reused bool buffer per thread)."""
        ne: np.ndarray | None = getattr(self._local, "ne", None)
        if ne is None or ne.size < new.size:
            ne = self._local.ne = np.empty(new.size, dtype=np.bool_)
        out = ne[: new.size]
        np.not_equal(old, new, out=out)
        return np.flatnonzero(out)

    def encode(self, job: FrameJob) -> Encoded:
        """Detect, checksum and encode one frame (any thread)."""
        out = self._encode(job)
        if not job.full:
            return out
        t0 = time.perf_counter()
        if out.codec in NEW_WORDS_CODECS and out.data is not None:  # already the new words
            full = FullFrame(out.codec, out.data, out.xxh3)
        else:
            codec, data = self._encoder().new_words(job.new)
            full = FullFrame(codec, data, xxhash.xxh3_64_hexdigest(data))
        return replace(out, full=full, encode_s=out.encode_s + time.perf_counter() - t0)

    def _encode(self, job: FrameJob) -> Encoded:
        t0 = time.perf_counter()
        pos = self._diff(job.old, job.new) if job.old is not None else None
        t1 = time.perf_counter()
        new_at = None
        if job.delta and pos is not None and job.old is not None and job.parent_adler is not None:
            if pos.size == 0:
                return Encoded(0, job.parent_adler, RAW, None, "", pos, None, t1 - t0, 0.0)
            old_at, new_at = job.old[pos], job.new[pos]
            if pos.size * 8 > job.new.size:  # most words changed: a full pass is cheaper
                value = adler32(job.new)
            else:  # O(changed) from the parent's (the snapshot was checked against it)
                value = apply_delta(
                    job.parent_adler, *delta_sums(pos, old_at, new_at, job.new.nbytes)
                )
            codec, data = self._encoder().encode_delta(job.old, job.new, pos, masks=old_at ^ new_at)
        else:
            value = adler32(job.new)
            codec, data = self._encoder().new_words(job.new)
        changed = job.new.size if pos is None else int(pos.size)
        digest = xxhash.xxh3_64_hexdigest(data)
        return Encoded(
            changed, value, codec, data, digest, pos, new_at, t1 - t0, time.perf_counter() - t1
        )

    def encoder(self) -> FrameEncoder:
        """The calling thread's :class:`FrameEncoder` (created on first use)."""
        return self._encoder()

    def map(self, jobs: Iterable[FrameJob]) -> Generator[Encoded, None, None]:
        """:meth:`encode` every job, results in job order; at most ``2 * workers`` ahead. A
        caller that may stop early closes the generator itself (its pool shuts down then)."""
        return self.run(self.encode, jobs)

    def run(self, fn: Callable[[J], R], jobs: Iterable[J]) -> Generator[R, None, None]:
        """``fn(job)`` for every job on the worker threads (``fn`` may call :meth:`encoder`),
        results in job order, at most ``2 * workers`` ahead; closing the generator shuts the
        pool down."""
        if self._workers == 1:
            yield from map(fn, jobs)
            return
        with ThreadPoolExecutor(self._workers, thread_name_prefix="deltastore-publish") as pool:
            ahead: deque[Future[R]] = deque()
            for job in jobs:
                ahead.append(pool.submit(fn, job))
                if len(ahead) >= 2 * self._workers:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()


__all__ = ["Encoded", "FrameEncoders", "FrameJob", "FullFrame"]
