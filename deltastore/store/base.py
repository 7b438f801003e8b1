"""The store interface: moves bytes by key, knows nothing about tensors or versions.

Keys are relative POSIX paths made of segments ``[A-Za-z0-9_-][A-Za-z0-9._-]*`` joined by
``/``: no empty segment, no segment starting with ``.`` (so no ``..``), no backslash, NUL,
scheme or leading ``/``. Nothing a manifest names can escape the store root.

Call order used by deltastore (DESIGN 2.3): data objects with :meth:`Store.put`, then the
manifest with :meth:`Store.put_if_absent` (the commit point), then ``LATEST`` with
:meth:`Store.put_if_match` (compare-and-swap). Implementations must be safe to call from
several threads at once.
"""

from __future__ import annotations

import builtins
import re
from abc import ABC, abstractmethod

from deltastore.errors import InvalidKeyError
from deltastore.manifest import KEY_PATTERN

_KEY = re.compile(KEY_PATTERN)
MAX_KEY_LENGTH = 1024


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
        ignore it probes once and raises :class:`StoreError` when commits would be unsafe."""
        return True

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds an object."""
        return self.get_with_token(key) is not None
