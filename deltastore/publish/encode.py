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
from deltastore.format.codecs.v2 import V1_MAX_CHANGES
from deltastore.format.manifest import Frame
from deltastore.publish.snapshot import FrameChange

#: Elements per step when a dense frame's changes are gathered (:func:`_changes`).
SCAN_ELEMENTS = 1 << 13

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
    is stored); ``change``: the frame's changes against the job's ``old`` words, compact
    (:class:`~deltastore.publish.snapshot.FrameChange`; None without ``old`` or when nothing
    changed); ``full``: the new words encoded for an anchor copy (None unless the job asked
    for it)."""

    changed: int
    adler: int
    codec: Codec
    data: bytes | None
    xxh3: str
    change: FrameChange | None
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

    def _diff(self, old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, int]:
        """Where the words differ, as a bool map in this thread's reused buffer (valid until
        the thread's next frame), and how many differ."""
        ne: np.ndarray | None = getattr(self._local, "ne", None)
        if ne is None or ne.size < new.size:
            ne = self._local.ne = np.empty(new.size, dtype=np.bool_)
        out = ne[: new.size]
        np.not_equal(old, new, out=out)
        return out, int(np.count_nonzero(out))

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
        old, new, parent_adler = job.old, job.new, job.parent_adler
        if old is None:  # no parent: the new words
            codec, data = self._encoder().new_words(new)
            t1 = time.perf_counter()
            digest = xxhash.xxh3_64_hexdigest(data)
            return Encoded(
                new.size, adler32(new), codec, data, digest, None, 0.0, time.perf_counter() - t0
            )
        ne, k = self._diff(old, new)
        t1 = time.perf_counter()
        change: FrameChange | None = None
        if not (job.delta and parent_adler is not None):  # the new words, and the changes
            if k:
                change = FrameChange.of(ne, *_changes(ne, old, new, k))
            value = adler32(new)
            codec, data = self._encoder().new_words(new)
        elif not k:  # unchanged: nothing stored
            return Encoded(0, parent_adler, RAW, None, "", None, t1 - t0, 0.0)
        else:
            found: tuple[np.ndarray, np.ndarray] | None = None
            if k * 8 <= new.size:
                # few words changed: the Adler-32 in O(changed) from the parent's (the
                # snapshot was checked against it)
                pos64 = np.flatnonzero(ne)
                old_at, new_at = old[pos64], new[pos64]
                value = apply_delta(parent_adler, *delta_sums(pos64, old_at, new_at, new.nbytes))
                found = (pos64.astype(np.uint32), np.bitwise_xor(old_at, new_at, out=old_at))
                del pos64, old_at, new_at
            else:
                value = adler32(new)
            positions, masks = found if found is not None else _changes(ne, old, new, k)
            found = None
            change = FrameChange.of(ne, positions, masks)
            if k <= V1_MAX_CHANGES:  # xor-sparse (tried on a few changes) wants int64 ones
                positions = positions.astype(np.int64)
            codec, data = self._encoder().encode_delta(old, new, positions, masks=masks)
            del positions, masks
        digest = xxhash.xxh3_64_hexdigest(data)
        return Encoded(k, value, codec, data, digest, change, t1 - t0, time.perf_counter() - t1)

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


def _changes(
    ne: np.ndarray, old: np.ndarray, new: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` positions (uint32, ascending) where the bool map ``ne`` is set and the XOR
    masks ``old ^ new`` there, gathered :data:`SCAN_ELEMENTS` at a time: no int64 position
    list of the whole frame (8 bytes per change) is ever held."""
    positions = np.empty(k, dtype=np.uint32)
    masks = np.empty(k, dtype=new.dtype)
    done = 0
    for a in range(0, new.size, SCAN_ELEMENTS):
        b = min(a + SCAN_ELEMENTS, new.size)
        at = np.flatnonzero(ne[a:b])
        m = int(at.size)
        if m:
            np.bitwise_xor(old[a:b][at], new[a:b][at], out=masks[done : done + m])
            at += a
            positions[done : done + m] = at
            done += m
    return positions, masks


__all__ = ["Encoded", "FrameEncoders", "FrameJob", "FullFrame"]
