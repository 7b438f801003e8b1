"""A reader's lease: ``leases/<reader>.json`` tells retention which versions it still needs.

:class:`LeaseKeeper` writes the lease of one reader (a :class:`~deltastore.Subscriber`, a
``deltastore pull --watch``): before a sync fetches from a version below the one leased
(:meth:`LeaseKeeper.hold`: done before the fetch starts), at the version a sync reaches, while
it fetches that version's frames, and it renews the lease once half of ``ttl_s`` has passed
(on the reader's next poll or sync); those two moves up run in the background
(:meth:`LeaseKeeper.hold_soon`), so that their round trip overlaps the reader's own requests
instead of following them. Writes are made one at a time, in the order asked. ``gc --keep``
keeps every version from the oldest unexpired lease's up
(:mod:`deltastore.maintenance.retention`). Leases never affect correctness: a lease that
cannot be written is logged (once) and the reader goes on; when the store refuses the write
(no write permission), leasing stops for this keeper.

Not thread-safe: the reader's one syncing thread calls it (a background write runs on one
thread of the keeper's own). Each write is one ``put``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from deltastore.errors import DeltastoreError
from deltastore.format.keys import lease_key
from deltastore.format.lease import Lease
from deltastore.store import Store

log = logging.getLogger(__name__)

#: Default lease length, in seconds: renewed after half of it while the reader follows.
DEFAULT_LEASE_TTL_S = 600.0


def default_reader_id() -> str:
    """``<host>-<pid>-<random>``: unique per process and readable in a listing."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].lstrip(".") or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class LeaseKeeper:
    """Keeps the lease of reader ``reader`` (default :func:`default_reader_id`) in ``store``
    for ``ttl_s`` seconds at a time (None: no lease is written)."""

    def __init__(self, store: Store, reader: str | None, ttl_s: float | None) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"lease_ttl must be a positive number of seconds, got {ttl_s!r}")
        self.reader = reader if reader is not None else default_reader_id()
        self.key = lease_key(self.reader)  # ValueError for a bad id
        self._store, self._ttl = store, ttl_s
        self._version: int | None = None  # the version leased
        self._renew_at = 0.0  # time.monotonic() after which the lease is rewritten
        self._warned = False
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    @property
    def version(self) -> int | None:
        """The version the lease now holds (None: none written); waits for a background
        write."""
        self.wait()
        return self._version

    def hold(self, version: int) -> None:
        """Lease ``version`` now (written when this returns), unless the lease already holds
        ``version`` and is not due for renewal."""
        self.wait()
        if self._due(version):
            self._write(version)

    def hold_soon(self, version: int) -> None:
        """Lease ``version`` in the background (a move up or a renewal: nothing fetched
        meanwhile depends on it), unless not due; :meth:`wait` waits for the write."""
        self.wait()
        if not self._due(version):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltastore-lease")
        self._pending = self._pool.submit(self._write, version)

    def wait(self) -> None:
        """Wait for the background write, if one runs (a failure is logged by it)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def _due(self, version: int) -> bool:
        return self._ttl is not None and (
            version != self._version or time.monotonic() >= self._renew_at
        )

    def _write(self, version: int) -> None:
        if self._ttl is None:
            return
        now = time.monotonic()
        try:
            self._store.put(self.key, Lease.new(self.reader, version, self._ttl).to_bytes())
        except (DeltastoreError, PermissionError) as exc:
            if isinstance(exc, PermissionError) or isinstance(exc.__cause__, PermissionError):
                log.warning("%s: leases off, the store refuses the write (%s)", self.key, exc)
                self._ttl = None
            elif not self._warned:
                log.warning("%s could not be written (%s); retried at the next sync", self.key, exc)
                self._warned = True
            return
        self._version, self._renew_at, self._warned = version, now + self._ttl / 2, False

    def release(self) -> None:
        """Remove the lease (best effort): the reader stops following."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._version is None:
            return
        try:
            self._store.delete(self.key)
        except DeltastoreError as exc:
            log.info("%s could not be removed (%s); it expires by itself", self.key, exc)
        self._version = None


__all__ = ["DEFAULT_LEASE_TTL_S", "LeaseKeeper", "default_reader_id"]
