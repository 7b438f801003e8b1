"""A store that forwards every operation to another one through one hook.

:class:`StoreWrapper` implements each :class:`~deltastore.store.Store` method as
``self._call(name, key, fn)``, where ``name`` is the method's name (one of :data:`OPERATIONS`),
``key`` the key or prefix it was called with ("" for ``check_conditional_writes``) and ``fn``
makes the inner call. Subclasses override :meth:`StoreWrapper._call` to observe or change
operations: :class:`~deltastore.store.counting.CountingStore` counts requests,
:class:`~deltastore.testing.faults.FaultyStore` injects faults. The wrapper's ``url``,
``unsafe_commits`` and ``consistent_listing`` are the inner store's.

Thread-safe when the inner store and the subclass's hook are.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import TypeVar

from deltastore.store.base import Store

T = TypeVar("T")

#: Every operation of the :class:`Store` interface, by method name.
OPERATIONS = (
    "get",
    "get_range",
    "put",
    "put_if_absent",
    "get_with_token",
    "put_if_match",
    "list",
    "list_after",
    "delete",
    "head_token",
    "exists",
    "check_conditional_writes",
)


class StoreWrapper(Store):
    """``inner``, every operation through :meth:`_call`."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.unsafe_commits = inner.unsafe_commits
        self.consistent_listing = inner.consistent_listing

    def _call(self, name: str, key: str, fn: Callable[[], T]) -> T:
        """Run one operation (``fn``); the hook subclasses override."""
        return fn()

    def get(self, key: str) -> bytes:
        return self._call("get", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._call("get_range", key, lambda: self.inner.get_range(key, start, length))

    def put(self, key: str, data: bytes) -> None:
        self._call("put", key, lambda: self.inner.put(key, data))

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._call("put_if_absent", key, lambda: self.inner.put_if_absent(key, data))

    def get_with_token(self, key: str) -> tuple[bytes, str] | None:
        return self._call("get_with_token", key, lambda: self.inner.get_with_token(key))

    def put_if_match(self, key: str, data: bytes, token: str | None) -> None:
        self._call("put_if_match", key, lambda: self.inner.put_if_match(key, data, token))

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self._call("list", prefix, lambda: self.inner.list(prefix))

    def list_after(self, prefix: str, start_after: str) -> builtins.list[str]:
        return self._call("list_after", prefix, lambda: self.inner.list_after(prefix, start_after))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def head_token(self, key: str) -> str | None:
        return self._call("head_token", key, lambda: self.inner.head_token(key))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def check_conditional_writes(self) -> bool:
        return self._call("check_conditional_writes", "", self.inner.check_conditional_writes)


__all__ = ["OPERATIONS", "StoreWrapper"]
