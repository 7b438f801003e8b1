"""The publisher's per-frame work: detect the changed words, checksum, encode; on a small pool.

Frames are independent, and the native kernels, numpy's comparisons and zstd release the GIL,
so :class:`FrameEncoders` runs them on ``workers`` threads (each with its own zstd context and
scratch buffers) and yields the results in frame order with a bounded lookahead, while the
caller packs and uploads. Thread-safe in that sense only: one caller thread per instance.

By default (:data:`NATIVE`) a frame is detected, checksummed and laid out for ``xor-sparse2``
by the numba kernels of :mod:`deltastore.kernels.detect` (one pass over the frame's words,
then O(changed); loaded on a daemon thread when the first :class:`FrameEncoders` is made, so
that ``import deltastore`` does not import numba and the first delta does not wait for it);
``FrameEncoders(..., native=False)`` runs the numpy reference
(:func:`_find`, :func:`~deltastore.format.checksum.delta_sums`,
:func:`~deltastore.format.codecs.v2.position_sections`), which makes the same frames, bit for
bit.
"""

from __future__ import annotations

import logging
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
from deltastore.kernels import warm_in_background
from deltastore.publish.snapshot import BITMAP_DENSITY, FrameChange, HeldFrame, PackedMasks

log = logging.getLogger("deltastore.publish.publisher")

#: Whether :class:`FrameEncoders` runs the native kernels by default (else the numpy
#: reference; the same frames either way).
NATIVE = True
#: At most 1/this of the words of a publish are encoded at once (:meth:`FrameEncoders.map`).
ENCODE_SHARE = 4
#: Elements per step when a frame is compared and its changes gathered (:func:`_changes`).
SCAN_ELEMENTS = 1 << 16
#: The fewest elements per step (a frame is compared in about 16 steps between the two).
SCAN_MIN = 1 << 12
#: Elements per step of a frame of sparse changes (:func:`_find`): few steps, and each
#: holds little (its bool map, 8 bytes per change found in it).
SPARSE_STEP = 1 << 20
#: A frame whose first step changed at most one word in this many is compared in one pass
#: (:func:`_find`).
SPARSE_DENSITY = 16

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

    def frame(
        self, start: int, stop: int, obj: str, offset: int, adler: int, blake3: str | None
    ) -> Frame:
        """Its manifest entry in the anchor copy: elements ``[start, stop)`` (global), stored
        at ``offset`` of data object ``obj``, ``adler`` the Adler-32 of its new words,
        ``blake3`` the BLAKE3 of its stored bytes (None: not recorded)."""
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
            blake3=blake3,
        )


@dataclass(frozen=True)
class Encoded:
    """What a frame job produced. ``data`` is None for an unchanged frame of a delta (nothing
    is stored); ``change``: the frame's changes against the job's ``old`` words, compact
    (:class:`~deltastore.publish.snapshot.HeldFrame`; None without ``old`` or when nothing
    changed); ``full``: the new words encoded for an anchor copy (None unless the job asked
    for it)."""

    changed: int
    adler: int
    codec: Codec
    data: bytes | None
    xxh3: str
    change: HeldFrame | None
    detect_s: float
    encode_s: float
    full: FullFrame | None = None


class FrameEncoders:
    """Runs :class:`FrameJob` s on ``workers`` threads at zstd ``level`` (None: each codec's
    default), writing the codecs of ``codecs``; ``native`` (default :data:`NATIVE`): detect
    and lay out with the numba kernels, else the numpy reference."""

    def __init__(
        self, level: int | None, workers: int, codecs: CodecSet = "v2", native: bool | None = None
    ) -> None:
        self._level, self._workers, self._codecs = level, workers, codecs
        self._native = NATIVE if native is None else native
        self._local = threading.local()
        if self._native:
            warm_in_background("deltastore.kernels.detect")

    def _encoder(self) -> FrameEncoder:
        enc: FrameEncoder | None = getattr(self._local, "encoder", None)
        if enc is None:
            enc = self._local.encoder = FrameEncoder(self._level, codecs=self._codecs)
        return enc

    def _scan(self, n: int) -> np.ndarray:
        """This thread's bool buffer, of at least ``n`` words (grown as frames need it; at
        most :data:`SPARSE_STEP`): frames are compared a step at a time (:func:`_find`),
        never in a bool map of a whole frame."""
        ne: np.ndarray | None = getattr(self._local, "ne", None)
        if ne is None or ne.size < n:
            ne = self._local.ne = np.empty(n, dtype=np.bool_)
        return ne

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
            digest = xxhash.xxh3_64_hexdigest(data)
            return Encoded(
                new.size, adler32(new), codec, data, digest, None, 0.0, time.perf_counter() - t0
            )
        if self._native:
            return self._encode_native(job, old, new, t0)
        change = _find(self._scan, old, new)
        k = 0 if change is None else int(change.masks.size)
        t1 = time.perf_counter()
        if not (job.delta and parent_adler is not None):  # the new words, and the changes
            value = adler32(new)
            codec, data = self._encoder().new_words(new)
        elif change is None:  # unchanged: nothing stored
            return Encoded(0, parent_adler, RAW, None, "", None, t1 - t0, 0.0)
        else:
            positions, masks = change.positions(), change.masks
            if k * 8 <= new.size:
                # few words changed: the Adler-32 in O(changed) from the parent's (the
                # snapshot was checked against it)
                pos64 = positions.astype(np.int64)
                old_at = old[pos64]
                new_at = old_at ^ masks
                value = apply_delta(parent_adler, *delta_sums(pos64, old_at, new_at, new.nbytes))
                del old_at, new_at
                if k <= V1_MAX_CHANGES:  # xor-sparse (tried on a few changes) wants int64
                    positions = pos64
                del pos64
            else:
                value = adler32(new)
            codec, data = self._encoder().encode_delta(old, new, positions, masks=masks)
            del positions, masks
        digest = xxhash.xxh3_64_hexdigest(data)
        kept = None if change is None else change.held()  # no positions, packed masks
        return Encoded(k, value, codec, data, digest, kept, t1 - t0, time.perf_counter() - t1)

    def _encode_native(self, job: FrameJob, old: np.ndarray, new: np.ndarray, t0: float) -> Encoded:
        """:meth:`_encode` of a frame with a parent by the kernels: the changes, their
        Adler-32 sums and (``"v2"``) the ``xor-sparse2`` sections without numpy's passes."""
        from deltastore.kernels import detect as kernels  # numba: imported on first use

        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = kernels.Scratch()
        found = kernels.find(old, new, scratch)
        positions, masks = found.positions, found.masks
        k, n = int(positions.size), int(new.size)
        t1 = time.perf_counter()
        parent_adler = job.parent_adler
        if not (job.delta and parent_adler is not None):  # the new words, and the changes
            value = adler32(new)
            codec, data = self._encoder().new_words(new)
        elif not k:  # unchanged: nothing stored
            return Encoded(0, parent_adler, RAW, None, "", None, t1 - t0, 0.0)
        else:
            value = apply_delta(parent_adler, found.da, found.db)
            enc = self._encoder()
            sections = kernels.sparse2_sections(positions, masks) if enc.codecs == "v2" else None
            # xor-sparse (tried on a few changes) wants int64 positions
            given = positions.astype(np.int64) if k <= V1_MAX_CHANGES else positions
            codec, data = enc.encode_delta(old, new, given, masks=masks, sparse2=sections)
            del sections, given
        digest = xxhash.xxh3_64_hexdigest(data)
        kept = None
        if k:  # as FrameChange.held() keeps them
            where = kernels.bitmap(positions, n) if k * BITMAP_DENSITY > n else positions
            packed = kernels.pack_masks(masks)
            held = masks if packed is None else PackedMasks(*packed, masks.dtype)
            kept = HeldFrame(n, where, held, where is not positions)
        return Encoded(k, value, codec, data, digest, kept, t1 - t0, time.perf_counter() - t1)

    def encoder(self) -> FrameEncoder:
        """The calling thread's :class:`FrameEncoder` (created on first use)."""
        return self._encoder()

    def map(
        self, jobs: Iterable[FrameJob], *, words: int | None = None
    ) -> Generator[Encoded, None, None]:
        """:meth:`encode` every job, results in job order; at most ``2 * workers`` ahead, and,
        given the ``words`` of all the jobs together, no job started while the frames started
        and not yet yielded hold more than ``words /`` :data:`ENCODE_SHARE` words with it,
        unless none is (a frame's encoding temporaries are a few bytes per word: this bounds
        them to a fraction of what is published, one frame whatever its size). A caller that
        may stop early closes the generator itself (its pool shuts down then)."""
        if words is None:
            return self.run(self.encode, jobs)
        return self.run(self.encode, jobs, weight=_words, budget=words // ENCODE_SHARE)

    def run(
        self,
        fn: Callable[[J], R],
        jobs: Iterable[J],
        *,
        weight: Callable[[J], int] | None = None,
        budget: int | None = None,
    ) -> Generator[R, None, None]:
        """``fn(job)`` for every job on the worker threads (``fn`` may call :meth:`encoder`),
        results in job order, at most ``2 * workers`` ahead and, with ``weight`` and
        ``budget``, no job started while those started and not yet yielded weigh more than
        ``budget`` together with it (unless none is); closing the generator shuts the pool
        down."""
        if self._workers == 1:
            yield from map(fn, jobs)
            return
        with ThreadPoolExecutor(self._workers, thread_name_prefix="deltastore-publish") as pool:
            ahead: deque[tuple[Future[R], int]] = deque()
            held = 0
            for job in jobs:
                w = 0 if weight is None else weight(job)
                while ahead and (
                    len(ahead) >= 2 * self._workers or (budget is not None and held + w > budget)
                ):
                    fut, done = ahead.popleft()
                    held -= done
                    yield fut.result()
                ahead.append((pool.submit(fn, job), w))
                held += w
            while ahead:
                yield ahead.popleft()[0].result()


def _words(job: FrameJob) -> int:
    """A job's weight in :meth:`FrameEncoders.map`: its words."""
    return int(job.new.size)


def scan_step(n: int) -> int:
    """Words per step of comparing a frame of ``n`` words: about ``n / 16`` (a multiple of 8),
    from :data:`SCAN_MIN` to :data:`SCAN_ELEMENTS` (few steps: numpy's per-call cost; small
    ones: their temporaries, up to 8 bytes per changed word of a step)."""
    return min(SCAN_ELEMENTS, max(SCAN_MIN, -(-n // 128) * 8))


def _find(
    scan: Callable[[int], np.ndarray], old: np.ndarray, new: np.ndarray
) -> FrameChange | None:
    """The frame's changes (None: none); ``scan(m)``: a bool buffer of at least ``m`` words
    (the calling thread's). Where the changes of the first :func:`scan_step` words are
    sparse (at most one in :data:`SPARSE_DENSITY`), in one pass of :data:`SPARSE_STEP`
    words a step (few numpy calls: the GIL is free most of the time), each step's positions
    and masks kept until they are joined (12 bytes per change at the join); else counted,
    then gathered in a second pass into arrays of their final size (:func:`_changes`),
    :func:`scan_step` words at a time: dense changes never take more than their positions
    (or bitmap) and masks, nor a bool buffer of more than 64 Ki words."""
    n = int(new.size)
    step = scan_step(n)
    buf = scan(min(step, n))
    head = buf[: min(step, n)]
    np.not_equal(old[: head.size], new[: head.size], out=head)
    k = int(np.count_nonzero(head))
    if k * SPARSE_DENSITY > head.size:  # dense: count, then gather
        for a in range(head.size, n, step):
            b = min(a + step, n)
            ne = buf[: b - a]
            np.not_equal(old[a:b], new[a:b], out=ne)
            k += int(np.count_nonzero(ne))
        return _changes(buf, old, new, k)
    step = min(SPARSE_STEP, n)
    buf = scan(step)
    found: list[np.ndarray] = []
    xors: list[np.ndarray] = []
    for a in range(0, n, step):
        b = min(a + step, n)
        ne = buf[: b - a]
        np.not_equal(old[a:b], new[a:b], out=ne)
        at = np.flatnonzero(ne)
        if at.size:
            xors.append(old[a:b][at] ^ new[a:b][at])
            at += a
            found.append(at.astype(np.uint32))
    if not found:
        return None
    positions = np.concatenate(found) if len(found) > 1 else found[0]
    del found
    masks = np.concatenate(xors) if len(xors) > 1 else xors[0]
    return FrameChange(n, positions, masks, False, positions)


def _changes(buf: np.ndarray, old: np.ndarray, new: np.ndarray, k: int) -> FrameChange:
    """The frame's ``k >= 1`` changes (:class:`FrameChange`: uint32 positions, or a bitmap,
    and the XOR masks), compared and gathered :func:`scan_step` words at a time (``buf``: a
    bool buffer of at least ``min(new.size, scan_step(new.size))``): beside what it
    returns, no array of the whole frame (an int64 position list, a bool map) is made. The
    positions are made even when the bitmap is kept (:meth:`FrameChange.positions` returns
    them while nothing else holds them)."""
    n = int(new.size)
    step = scan_step(n)
    positions = np.empty(k, dtype=np.uint32)
    masks = np.empty(k, dtype=new.dtype)
    bits = np.empty(-(-n // 8), dtype=np.uint8) if k * BITMAP_DENSITY > n else None
    done = 0
    for a in range(0, n, step):
        b = min(a + step, n)
        ne = buf[: b - a]
        np.not_equal(old[a:b], new[a:b], out=ne)
        if bits is not None:
            bits[a // 8 : -(-b // 8)] = np.packbits(ne)
        at = np.flatnonzero(ne)
        m = int(at.size)
        if m:
            np.bitwise_xor(old[a:b][at], new[a:b][at], out=masks[done : done + m])
            at += a
            positions[done : done + m] = at
            done += m
    return FrameChange(n, positions if bits is None else bits, masks, bits is not None, positions)


__all__ = ["NATIVE", "Encoded", "FrameEncoders", "FrameJob", "FullFrame"]
