"""The store interface: moves bytes by key, knows nothing about tensors or versions.

Keys are relative POSIX paths made of segments ``[A-Za-z0-9_-][A-Za-z0-9._-]*`` joined by
``/``: no empty segment, no segment starting with ``.`` (so no ``..``), no backslash, NUL,
scheme or leading ``/``. Nothing a manifest names can escape the store root.

Call order used by deltastore (docs/spec/format-v1.md, section 4.2): data objects with
:meth:`Store.put`, then the manifest with :meth:`Store.put_if_absent` (the commit point), then
``LATEST`` with :meth:`Store.put_if_match` (compare-and-swap). Implementations must be safe to
call from several threads at once.
"""

from __future__ import annotations

import builtins
import math
import re
from abc import ABC, abstractmethod
from typing import Any

from deltastore.errors import AccessDeniedError, InvalidKeyError, StoreError
from deltastore.format.keys import KEY_PATTERN
from deltastore.format.keys import MAX_KEY_LENGTH as MAX_KEY_LENGTH

_KEY = re.compile(KEY_PATTERN)

#: Storage options deltastore reads itself; they never reach the filesystem.
OWN_OPTIONS = ("timeout", "unsafe_commits")


def split_options(
    storage_options: dict[str, Any] | None,
    *,
    timeout: float | None = None,
    unsafe_commits: bool = False,
) -> tuple[dict[str, Any], float | None, bool]:
    """``(filesystem options, timeout, unsafe_commits)``: deltastore's own storage options
    (:data:`OWN_OPTIONS`, e.g. ``-o timeout=30`` on the CLI) taken out of
    ``storage_options``. An explicit ``timeout`` argument wins over the option;
    ``unsafe_commits`` is on when either asks for it."""
    options = dict(storage_options or {})
    own_timeout = options.pop("timeout", None)
    own_unsafe = options.pop("unsafe_commits", False)
    if timeout is None:
        timeout = own_timeout
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise StoreError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(own_unsafe, bool) or not isinstance(unsafe_commits, bool):
        raise StoreError(
            f"unsafe_commits must be true or false, got {own_unsafe!r}: "
            "-o unsafe_commits=true (or deltastore publish --unsafe-commits)"
        )
    return options, None if timeout is None else float(timeout), unsafe_commits or own_unsafe


def access_denied(op: str, key: str, url: str, exc: BaseException) -> AccessDeniedError:
    """The error of an operation the store refused for lack of permission."""
    return AccessDeniedError(
        f"{op} {key} in store {url}: access denied ({exc}): these credentials may not "
        f"{op} this key; give the role the permissions docs/stores.md (Least privilege) "
        "lists, or use the role meant for this command"
    )


def validate_key(key: str) -> str:
    """Return ``key`` if it is a clean relative key; :class:`InvalidKeyError` otherwise."""
    if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH or not _KEY.fullmatch(key):
        raise InvalidKeyError(
            f"invalid store key {key!r}: keys are relative paths of [A-Za-z0-9._-] segments "
            "joined by '/', with no segment starting with '.', and never leave the store root"
        )
    return key


class Store(ABC):
    """Byte storage addressed by validated keys. Thread-safe."""

    #: Human-readable location (URL or path), used in messages; never holds credentials.
    url: str

    #: Accept commits on a service found to ignore create-if-absent preconditions (then only
    #: one publisher may write to the store). A no-op where create-if-absent is always
    #: enforced (a local folder; Azure Blob Storage).
    unsafe_commits: bool = False

    #: Whether a listing shows every object created before it started (S3, GCS and Azure
    #: listings are strongly consistent). False where a listing may lag (a local folder may
    #: be an NFS mount, whose clients cache directory listings for up to a minute): readers
    #: then also read ``LATEST`` on every poll, which an NFS client re-reads on open.
    consistent_listing: bool = False

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Whole object; :class:`ObjectNotFoundError` when missing."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)``; fewer when the object is shorter."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Create or replace atomically: readers see the old object or the new one, whole."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create atomically if absent: of N racing writers exactly one wins, the others get
        :class:`VersionExistsError` and the object is the winner's, whole."""

    @abstractmethod
    def get_with_token(self, key: str) -> tuple[bytes, str] | None:
        """Object and an opaque change token for :meth:`put_if_match`; None when missing."""

    @abstractmethod
    def put_if_match(self, key: str, data: bytes, token: str | None) -> None:
        """Replace only if the object still has ``token`` (None: only if still absent);
        :class:`PreconditionFailedError` otherwise."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with ``prefix`` (a key prefix ending in ``/`` or empty)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; :class:`ObjectNotFoundError` when missing."""

    def list_after(self, prefix: str, start_after: str) -> builtins.list[str]:
        """Sorted keys under ``prefix`` that sort after ``start_after`` (cheap polling)."""
        return [k for k in self.list(prefix) if k > start_after]

    def head_token(self, key: str) -> str | None:
        """Change token of ``key`` (as :meth:`get_with_token` gives) or None when missing;
        backends answer from metadata without reading the object."""
        current = self.get_with_token(key)
        return current[1] if current is not None else None

    def check_conditional_writes(self) -> bool:
        """Whether :meth:`put_if_absent` is enforced by the backend; a backend that may
        ignore it probes once and, when it does, raises
        :class:`~deltastore.errors.PreconditionsIgnoredError` unless :attr:`unsafe_commits`
        (then it returns False)."""
        return True

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds an object."""
        return self.get_with_token(key) is not None
