"""Stores on fsspec filesystems (object stores): shared plumbing for the backends.

:class:`FsspecStore` moves bytes with the filesystem's ordinary calls (``cat_file``,
``pipe_file``, ``find``, ``rm_file``), without fsspec's instance or listing caches (a poller
must never see stale state), and retries transient failures with :class:`RetryPolicy`: each
retry is logged at WARNING (what failed, attempt n of m, the wait), and ``timeout`` (seconds)
bounds the whole operation. A process may also set one deadline for all its store operations
(:func:`command_deadline`, what ``deltastore --timeout`` does): no attempt starts after it, an
attempt in flight at it is abandoned, and the error reports the attempts made and the time
since the deadline was set. The conditional writes (create-if-absent, compare-and-swap) are
backend-specific: each backend module subclasses it and implements them with what the service
guarantees.

A bucket (Azure: container) that does not exist raises :class:`BucketNotFoundError` from
every operation, instead of looking like an empty store: a not-found error or an empty
listing is checked once against the bucket itself (one request, until the bucket is seen).

Thread-safe: fsspec async filesystems may be called from several threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from deltastore.errors import (
    BucketNotFoundError,
    ObjectNotFoundError,
    PreconditionFailedError,
    PreconditionsIgnoredError,
    StoreError,
    TransientError,
    VersionExistsError,
)
from deltastore.store.base import Store, access_denied, validate_key

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


def listed_keys(keys: Iterable[str], prefix: str, start_after: str = "") -> list[str]:
    """The keys a listing returns, sorted: those under ``prefix`` and after ``start_after``
    with no segment starting with ``.`` (temporary files are never keys)."""
    return sorted(
        k
        for k in keys
        if k > start_after
        and k.startswith(prefix)
        and not any(s.startswith(".") for s in k.split("/"))
    )


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an error, on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, bounded in attempts and in total seconds: a
    retry that would start after ``total_seconds`` is not made."""

    attempts: int = 8
    base_delay: float = 0.05
    max_delay: float = 5.0
    total_seconds: float = 120.0

    def delays(self) -> list[float]:
        return [
            random.uniform(0, min(self.max_delay, self.base_delay * 2**i))
            for i in range(self.attempts - 1)
        ]


class DeadlineReached(TimeoutError):
    """An attempt still had no answer when the command's deadline came (it was abandoned)."""


@dataclass
class Deadline:
    """One deadline for every store operation of a process (a command): ``seconds`` after
    ``start`` (``time.monotonic()``). Counts the attempts that failed and keeps the last
    error, for the message of the operation that gives up. Thread-safe."""

    seconds: float
    start: float = dataclasses.field(default_factory=time.monotonic)
    failed_attempts: int = 0
    last_error: str = ""
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failed_attempts += 1
            self.last_error = _describe(exc)

    def summary(self, now: float) -> str:
        """``3 failed attempts in 5.0 s``: this deadline's attempts and elapsed seconds."""
        n = self.failed_attempts
        return f"{n} failed attempt{'' if n == 1 else 's'} in {now - self.start:.1f} s"


_deadline: Deadline | None = None


def current_deadline() -> Deadline | None:
    """The deadline :func:`command_deadline` set, or None."""
    return _deadline


@contextlib.contextmanager
def command_deadline(seconds: float | None, *, start: float | None = None) -> Iterator[None]:
    """Bound every store operation of this process, in every thread, by one deadline:
    ``seconds`` after ``start`` (``time.monotonic()``; default: now). No attempt starts after
    it; an attempt still running at it is abandoned (its thread is left to end by the
    request's own timeouts, its result dropped) and the operation fails with
    :class:`StoreError`. None: no deadline (each operation is bounded by its own
    ``timeout``). Process-wide state, meant for a command-line process (``deltastore
    --timeout``): set it from one thread, around the whole command. Local stores are not
    bounded by it (a local file operation has no timeout)."""
    global _deadline
    previous = _deadline
    _deadline = (
        None
        if seconds is None
        else Deadline(seconds, start=time.monotonic() if start is None else start)
    )
    try:
        yield
    finally:
        _deadline = previous


def _within(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` in a daemon thread, waited for at most ``seconds``; :class:`DeadlineReached`
    if it has not returned by then (it is left running; its result or error is dropped)."""
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()
    started = time.monotonic()

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="deltastore-store-attempt", daemon=True).start()
    if not done.wait(max(0.0, seconds)):
        raise DeadlineReached(
            f"no answer in {time.monotonic() - started:.1f} s, when the deadline came "
            "(attempt abandoned)"
        )
    ok, value = outcome[0]
    if ok:
        return value  # type: ignore[no-any-return]
    raise value


def request_timeouts(timeout: float | None, connect: float, read: float) -> tuple[float, float]:
    """Per-request (connect, read) timeouts: the backend's defaults, never above ``timeout``."""
    if timeout is None:
        return connect, read
    return min(connect, timeout), min(read, timeout)


class FsspecStore(Store):
    """A :class:`Store` over an fsspec filesystem rooted at ``root`` (``bucket/prefix``).

    ``timeout`` (seconds) bounds each operation, retries included (it replaces the policy's
    ``total_seconds``); backends also cap their per-request timeouts with it."""

    #: The precondition create-if-absent relies on, named in messages.
    precondition = "If-None-Match"
    #: What the first segment of the root is called, in messages.
    bucket_kind = "bucket"

    def __init__(
        self,
        url: str,
        fs: Any,
        root: str,
        *,
        retry: RetryPolicy | None = None,
        unsafe_commits: bool = False,
        timeout: float | None = None,
    ) -> None:
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/")
        self.bucket = self.root.split("/", 1)[0]
        policy = retry or RetryPolicy()
        if timeout is not None:
            policy = dataclasses.replace(policy, total_seconds=timeout)
        self.retry = policy
        self.timeout = timeout
        self.unsafe_commits = unsafe_commits
        self._probed: bool | None = None
        self._bucket_seen = False  # the bucket answered once: not-found means the key
        # When an operation gave up on transient errors, the ones that follow within the
        # timeout try once: a command that falls back to another request after a failure
        # (LATEST, then a listing) still fails within about one timeout, not one per request.
        self._failing_until = 0.0

    # --- plumbing -----------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return f"{self.root}/{validate_key(key)}"

    def transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is worth retrying; backends add their service's codes."""
        if isinstance(exc, TransientError | ConnectionError | TimeoutError):
            return True
        return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries; map permanent errors to typed store errors.

        Each retry is logged at WARNING; no retry starts after the policy's
        ``total_seconds`` (the store's ``timeout``). Within that time after an operation
        gave up on transient errors, an operation makes one attempt. Under a
        :func:`command_deadline`, no attempt starts after it and one in flight at it is
        abandoned."""
        policy = self.retry
        start = time.monotonic()
        command = _deadline
        deadline = start + policy.total_seconds
        if command is not None:
            deadline = min(deadline, command.end)
            if start >= deadline:
                raise StoreError(
                    f"{op} {key} in store {self.url} not attempted: the deadline of "
                    f"{command.seconds:g} s (--timeout) has passed (the command made "
                    f"{command.summary(start)}"
                    + (f"; last error: {command.last_error}" if command.last_error else "")
                    + "); check the endpoint, the network and the credentials, or allow "
                    "more time (--timeout)"
                )
        delays = policy.delays()
        attempts = 1 if start < self._failing_until else policy.attempts
        for attempt in range(1, attempts + 1):
            try:
                result = fn() if command is None else _within(fn, deadline - time.monotonic())
                self._failing_until = 0.0
                return result
            except (
                VersionExistsError,
                PreconditionFailedError,
                ObjectNotFoundError,
                BucketNotFoundError,
            ):
                raise
            except FileNotFoundError as exc:
                self._failing_until = 0.0  # the service answered
                self._raise_if_bucket_missing(exc, probe=True)
                raise ObjectNotFoundError(f"{key} not found in store {self.url}") from None
            except Exception as exc:
                self._raise_if_bucket_missing(exc, probe=False)
                if not self.transient(exc):
                    self._failing_until = 0.0  # the service answered
                    if isinstance(exc, PermissionError):
                        raise access_denied(op, key, self.url, exc) from exc
                    raise StoreError(f"{op} {key} in store {self.url} failed: {exc}") from exc
                now = time.monotonic()
                if command is not None:
                    command.failed(exc)
                if attempt == attempts or now + delays[attempt - 1] > deadline:
                    if command is not None and deadline == command.end:
                        self._failing_until = now + policy.total_seconds
                        when = "at" if now >= deadline else "no time left for a retry before"
                        raise StoreError(
                            f"{op} {key} in store {self.url} still failing after {attempt} "
                            f"attempt{'s' if attempt > 1 else ''} in {now - start:.1f} s, "
                            f"{when} the deadline of {command.seconds:g} s (--timeout): the "
                            f"command made {command.summary(now)}; last error: "
                            f"{_describe(exc)}; check the endpoint, the network and the "
                            "credentials, or allow more time (--timeout)"
                        ) from exc
                    bound = (
                        f"at most {policy.attempts} attempts within {policy.total_seconds:g} s"
                        if attempts > 1
                        else "one attempt: the previous operation gave up just before"
                    )
                    self._failing_until = now + policy.total_seconds
                    raise StoreError(
                        f"{op} {key} in store {self.url} still failing after {attempt} "
                        f"attempt{'s' if attempt > 1 else ''} in {now - start:.1f} s "
                        f"({bound}): {_describe(exc)}; check the endpoint, the network and "
                        "the credentials, or allow more time (--timeout / the timeout option)"
                    ) from exc
                log.warning(
                    "%s %s in store %s failed (%s); attempt %d of %d, retrying in %.2f s",
                    op,
                    key,
                    self.url,
                    _describe(exc),
                    attempt,
                    attempts,
                    delays[attempt - 1],
                )
                time.sleep(delays[attempt - 1])
        raise StoreError(f"{op} {key}: no attempt made")  # pragma: no cover - attempts >= 1

    # --- a bucket that does not exist ---------------------------------------------------

    def _raise_if_bucket_missing(self, exc: BaseException | None, *, probe: bool) -> None:
        """Raise :class:`BucketNotFoundError` when the store's bucket does not exist: the
        error says so (:meth:`_says_bucket_missing`), or with ``probe`` (a not-found error,
        an empty listing) one request for the bucket does, until it is seen once."""
        if self._bucket_seen:
            return
        missing = exc is not None and self._says_bucket_missing(exc)
        if not missing and probe:
            command = _deadline
            try:
                exists = (
                    self._bucket_exists()
                    if command is None
                    else _within(self._bucket_exists, command.end - time.monotonic())
                )
            except Exception as err:  # unknown (network, permission): say nothing
                log.debug("bucket check of store %s failed: %r", self.url, err)
                return
            if exists is None:
                return
            missing = not exists
        if missing:
            raise BucketNotFoundError(
                f"{self.bucket_kind} {self.bucket!r} of store {self.url} does not exist: "
                f"create it, or check the store URL (and the endpoint or account it is on)"
            )
        if probe:
            self._bucket_seen = True

    def _says_bucket_missing(self, exc: BaseException) -> bool:
        """Whether ``exc`` itself says the bucket does not exist (no request made)."""
        return False

    def _bucket_exists(self) -> bool | None:
        """Ask the service whether the bucket exists (one request); None when unknown."""
        return None

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
            except FileNotFoundError as exc:
                self._raise_if_bucket_missing(exc, probe=False)
                return []

        start = len(self.root) + 1
        keys = [p[start:] for p in self._call("list", prefix or "/", find)]
        if not keys:  # an empty store, or no bucket at all
            self._raise_if_bucket_missing(None, probe=True)
        return listed_keys(keys, prefix)

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

        True when it does. When it ignores the precondition, raise
        :class:`PreconditionsIgnoredError` unless :attr:`unsafe_commits` (then False: only one
        publisher may use the store).
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
            raise PreconditionsIgnoredError(
                f"store {self.url} ignores {self.precondition} preconditions: two publishers "
                "could both commit a version. Use a service that enforces them, or, if only "
                "one publisher ever writes to this store, accept the risk: "
                "deltastore publish --unsafe-commits (Python: unsafe_commits=True)"
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
