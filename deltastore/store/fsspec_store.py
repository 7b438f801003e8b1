"""Stores on fsspec filesystems (object stores): shared plumbing for the backends.

:class:`FsspecStore` moves bytes with the filesystem's ordinary calls (``cat_file``,
``pipe_file``, ``find``, ``rm_file``), without fsspec's instance or listing caches (a poller
must never see stale state), and retries transient failures with :class:`RetryPolicy`.
The conditional writes (create-if-absent, compare-and-swap) are backend-specific: each
backend module subclasses it and implements them with what the service guarantees.

Thread-safe: fsspec async filesystems may be called from several threads.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from deltastore.errors import (
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    VersionExistsError,
)
from deltastore.store.base import Store, validate_key

log = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
    errno.EBUSY,
    errno.EAGAIN,
    getattr(errno, "EREMOTEIO", 121),
}


class TransientError(StoreError):
    """A failure worth retrying (5xx, throttling, connection reset, timeout)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, bounded in attempts and in total seconds."""

    attempts: int = 8
    base_delay: float = 0.05
    max_delay: float = 5.0
    total_seconds: float = 120.0

    def delays(self) -> list[float]:
        return [
            random.uniform(0, min(self.max_delay, self.base_delay * 2**i))
            for i in range(self.attempts - 1)
        ]


class FsspecStore(Store):
    """A :class:`Store` over an fsspec filesystem rooted at ``root`` (``bucket/prefix``)."""

    #: The precondition create-if-absent relies on, named in messages.
    precondition = "If-None-Match"

    def __init__(self, url: str, fs: Any, root: str, *, retry: RetryPolicy | None = None) -> None:
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.unsafe_commits = False
        self._probed: bool | None = None

    # --- plumbing -----------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return f"{self.root}/{validate_key(key)}"

    def transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is worth retrying; backends add their service's codes."""
        if isinstance(exc, TransientError | ConnectionError | TimeoutError):
            return True
        return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries; map permanent errors to typed store errors."""
        deadline = time.monotonic() + self.retry.total_seconds
        delays = self.retry.delays()
        for attempt in range(self.retry.attempts):
            try:
                return fn()
            except (VersionExistsError, PreconditionFailedError, ObjectNotFoundError):
                raise
            except FileNotFoundError:
                raise ObjectNotFoundError(f"{key} not found in store {self.url}") from None
            except Exception as exc:
                if not self.transient(exc):
                    raise StoreError(f"{op} {key} in store {self.url} failed: {exc}") from exc
                if attempt == len(delays) or time.monotonic() + delays[attempt] > deadline:
                    raise StoreError(
                        f"{op} {key} in store {self.url} still failing after {attempt + 1} "
                        f"attempts: {exc}"
                    ) from exc
                log.debug("%s %s: transient %r, retry %d", op, key, exc, attempt + 1)
                time.sleep(delays[attempt])
        raise StoreError(f"{op} {key}: no attempt made")  # pragma: no cover - attempts >= 1

    # --- Store --------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        path = self._path(key)
        return self._call("get", key, lambda: bytes(self.fs.cat_file(path)))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        path = self._path(key)
        if length <= 0:
            self._call("get_range", key, lambda: self.fs.info(path))
            return b""
        return self._call(
            "get_range", key, lambda: bytes(self.fs.cat_file(path, start=start, end=start + length))
        )

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._call("put", key, lambda: self.fs.pipe_file(path, data))

    def _conditional(
        self, op: str, key: str, data: bytes, write: Callable[[], None], lost: type[Exception]
    ) -> None:
        """Run a conditional write with ambiguity resolution: if an attempt failed after it
        may have reached the service and a retry then fails its precondition (``lost``), the
        object is read back; if it holds exactly ``data`` this writer won (as Delta Lake's S3
        writer does). Manifests carry the writer's random token, so no two writers write the
        same bytes."""
        ambiguous = False

        def attempt() -> None:
            nonlocal ambiguous
            try:
                write()
            except lost:
                if ambiguous and self.get(key) == data:
                    return
                raise
            except Exception as exc:
                ambiguous = ambiguous or self.transient(exc)
                raise

        self._call(op, key, attempt)

    def put_if_absent(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._conditional(
            "put_if_absent", key, data, lambda: self._create(path, data), VersionExistsError
        )

    def get_with_token(self, key: str) -> tuple[bytes, str] | None:
        try:
            return self._call("get", key, lambda: self._read_with_token(self._path(key)))
        except ObjectNotFoundError:
            return None

    def put_if_match(self, key: str, data: bytes, token: str | None) -> None:
        if token is None:
            try:
                self.put_if_absent(key, data)
            except VersionExistsError:
                raise PreconditionFailedError(f"{key} exists in store {self.url}") from None
            return
        path = self._path(key)
        self._conditional(
            "put_if_match",
            key,
            data,
            lambda: self._replace_if(path, data, token),
            PreconditionFailedError,
        )

    def list(self, prefix: str = "") -> list[str]:
        if prefix:
            validate_key(prefix.rstrip("/"))
        base = f"{self.root}/{prefix}" if prefix.endswith("/") or not prefix else self.root

        def find() -> list[str]:
            self.fs.invalidate_cache(base)
            try:
                return list(self.fs.find(base))
            except FileNotFoundError:
                return []

        start = len(self.root) + 1
        keys = [p[start:] for p in self._call("list", prefix or "/", find)]
        return sorted(
            k
            for k in keys
            if k.startswith(prefix) and not any(s.startswith(".") for s in k.split("/"))
        )

    def delete(self, key: str) -> None:
        path = self._path(key)

        def rm() -> None:
            if not self.fs.exists(path):
                raise FileNotFoundError(path)
            self.fs.rm_file(path)

        self._call("delete", key, rm)

    def head_token(self, key: str) -> str | None:
        path = self._path(key)
        try:
            info = self._call("head", key, lambda: self.fs.info(path, refresh=True))
        except ObjectNotFoundError:
            return None
        return self._token_of(info)

    def check_conditional_writes(self) -> bool:
        """Probe once (create a probe key twice) whether the service enforces create-if-absent.

        True when it does. When it ignores the precondition, raise :class:`StoreError` unless
        :attr:`unsafe_commits` (then False: only one publisher may use the store).
        """
        if self._probed is None:
            key = f"_probe/{uuid.uuid4().hex}"
            self.put_if_absent(key, b"1")
            try:
                self.put_if_absent(key, b"2")
                self._probed = False
            except VersionExistsError:
                self._probed = True
            finally:
                with contextlib.suppress(StoreError):
                    self.delete(key)
        if not self._probed and not self.unsafe_commits:
            raise StoreError(
                f"store {self.url} ignores {self.precondition} preconditions: two writers could "
                "both commit a version. Use a service that enforces them, or (S3, GCS) pass "
                "unsafe_commits=True (one publisher only) to accept the risk"
            )
        return self._probed

    # --- backend hooks ------------------------------------------------------------------

    def _token_of(self, info: dict[str, Any]) -> str:
        """The change token in a ``fs.info`` result (ETag, generation)."""
        for field in ("ETag", "etag", "generation"):
            if info.get(field):
                return str(info[field])
        raise StoreError(f"store {self.url} reports no ETag or generation")

    def _create(self, path: str, data: bytes) -> None:
        """Atomic create-if-absent; :class:`VersionExistsError` when the object exists."""
        raise StoreError(f"store {self.url} cannot create objects atomically")

    def _read_with_token(self, path: str) -> tuple[bytes, str]:
        """Object bytes and a token naming exactly that content (ETag, generation)."""
        raise StoreError(f"store {self.url} has no compare-and-swap")

    def _replace_if(self, path: str, data: bytes, token: str) -> None:
        """Replace only if the object still has ``token``; :class:`PreconditionFailedError`."""
        raise StoreError(f"store {self.url} has no compare-and-swap")
