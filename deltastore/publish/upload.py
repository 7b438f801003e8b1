"""Data objects of a version: encoded frames packed in order into objects of about
``max_object_bytes``, uploaded in parallel while later frames are still being encoded.

:class:`Uploads` runs the ``put`` of each data object on up to ``workers`` threads, with at
most ``workers`` objects queued or in flight (memory: that many objects); :meth:`Uploads.finish`
waits for all of them and raises the first error. So a version of many objects costs about one
round trip of the store per ``workers`` objects, not one per object, and the commit (which
must follow every data object: spec section 4.2) starts when the last one is stored.

Not thread-safe: one publishing thread calls :class:`PackWriter` and :class:`Uploads`.
"""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from deltastore.format.ed25519 import frame_digest
from deltastore.store import Store

#: Data objects uploaded at once.
UPLOAD_WORKERS = 4
#: An anchor copy written beside a delta (a full anchor's bytes, in the same pass) is packed
#: in objects of at most 1/this of the words published, from :data:`COPY_OBJECT_FLOOR` bytes
#: up (:func:`copy_object_bytes`): they go to the store while the pass goes on instead of
#: waiting, whole, for its end.
COPY_OBJECT_SHARE = 8
COPY_OBJECT_FLOOR = 1 << 20


def copy_object_bytes(max_object_bytes: int, dense_bytes: int) -> int:
    """Bytes per data object of an anchor copy encoded beside a delta of ``dense_bytes``
    (bytes of the words published): ``max_object_bytes``, or less for a small publish
    (:data:`COPY_OBJECT_SHARE`, :data:`COPY_OBJECT_FLOOR`)."""
    return min(max_object_bytes, max(COPY_OBJECT_FLOOR, dense_bytes // COPY_OBJECT_SHARE))


class Timing(Protocol):
    """Where the seconds the publisher waited on uploads are added up."""

    upload_s: float


class Uploads:
    """Parallel ``put`` of data objects to ``store``; the seconds the caller waits for them
    (a full queue, :meth:`finish`) are added to ``timing.upload_s``."""

    def __init__(self, store: Store, timing: Timing, workers: int = UPLOAD_WORKERS) -> None:
        self._store, self._timing = store, timing
        self._slots = threading.BoundedSemaphore(workers)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="deltastore-upload")
        self._futures: list[Future[None]] = []
        self._failed: BaseException | None = None  # the first upload error, set by a worker

    def put(self, key: str, data: bytes) -> None:
        """Upload ``data`` as ``key`` on a worker thread; waits while ``workers`` objects are
        queued or in flight. An earlier upload's error is raised here."""
        t0 = time.perf_counter()
        self._slots.acquire()
        self._timing.upload_s += time.perf_counter() - t0
        if self._failed is not None:
            self._slots.release()
            raise self._failed
        self._futures.append(self._pool.submit(self._put, key, data))

    def _put(self, key: str, data: bytes) -> None:
        try:
            self._store.put(key, data)
        except BaseException as exc:
            self._failed = self._failed or exc
            raise
        finally:
            self._slots.release()

    def abort(self) -> None:
        """Wait for every upload, ignoring their errors (the publish failed already)."""
        self._pool.shutdown(wait=True)

    def finish(self) -> None:
        """Wait for every upload; raise the first error (in upload order)."""
        t0 = time.perf_counter()
        try:
            for fut in self._futures:
                fut.exception()  # waits
            for fut in self._futures:
                fut.result()
        finally:
            self._pool.shutdown(wait=True)
            self._timing.upload_s += time.perf_counter() - t0


class PackWriter:
    """Concatenates encoded frames into data objects ``<prefix><seq:06d>.dsz`` of about
    ``max_bytes`` and hands each full object to ``uploads``.

    Each frame is copied into the object's buffer as it is added (the caller may drop it),
    and the buffer becomes the object without another copy (:meth:`io.BytesIO.getvalue`
    hands over its bytes once they fill it): an object costs about its own size while it is
    packed, not twice (its frames, then their join). ``digests``: :meth:`add` also returns
    each frame's BLAKE3 (for an Ed25519-signed manifest; else None). One thread adds."""

    def __init__(
        self, uploads: Uploads, prefix: str, max_bytes: int, digests: bool = False
    ) -> None:
        self._uploads, self._prefix, self._max = uploads, prefix, max_bytes
        self._digests = digests
        self._buf = io.BytesIO()
        self._size = 0
        self._seq = 0

    @property
    def key(self) -> str:
        return f"{self._prefix}{self._seq:06d}.dsz"

    def add(self, data: bytes) -> tuple[str, int, str | None]:
        """Queue ``data``; return the object key and offset it will be stored at, and its
        BLAKE3 (hex; None without ``digests``)."""
        if self._size and self._size + len(data) > self._max:
            self.flush()
        where = (self.key, self._size, frame_digest(data) if self._digests else None)
        self._buf.write(data)
        self._size += len(data)
        return where

    def flush(self) -> None:
        """Hand the object being packed to the uploads (nothing when it is empty)."""
        if not self._size:
            return
        data = self._buf.getvalue()
        self._buf = io.BytesIO()  # the old buffer's bytes now belong to the upload alone
        self._uploads.put(self.key, data)
        self._size, self._seq = 0, self._seq + 1


__all__ = ["UPLOAD_WORKERS", "PackWriter", "Uploads", "copy_object_bytes"]
