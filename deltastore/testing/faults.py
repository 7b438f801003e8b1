"""Fault injection: a :class:`Store` wrapper that fails one chosen operation.

Use it to test what your setup does when the store fails in the middle of a publish or a sync::

    from deltastore import LocalStore, Publisher
    from deltastore.testing.faults import FaultyStore

    store = FaultyStore(LocalStore("/tmp/s"))
    Publisher(store).publish(weights, version=1)      # a clean run: count the operations
    n = len(store.ops)
    for k in range(1, n + 1):
        store = FaultyStore(LocalStore(fresh_copy()), fail_at=k, mode="lost-response")
        ...                                            # the k-th operation fails

Every store operation counts once (``get``, ``get_range``, ``put``, ``put_if_absent``,
``get_with_token``, ``put_if_match``, ``list``, ``list_after``, ``delete``, ``head_token``,
``exists``, ``check_conditional_writes``), whichever thread calls it, and is recorded in
:attr:`FaultyStore.ops`. The ``fail_at``-th operation (1-based, counting only the operation
names in ``only`` when given) fails according to ``mode``:

- ``"raise"``: :class:`InjectedFault` (a :class:`StoreError`, like a transient backend error)
  is raised *before* the operation: it has no effect;
- ``"lost-response"``: the operation is done, then :class:`InjectedFault` is raised, like a
  response lost on the network after the backend acted;
- ``"kill"``: the process is killed with ``SIGKILL`` before the operation (a crash);
- ``"kill-after"``: the process is killed with ``SIGKILL`` right after the operation.

Only that one operation fails; the ones before and after behave normally. ``hook``, when
given, is called with each :class:`Op` (``done`` False) in the caller's thread right before
the operation or its fault: a test can pause a writer there (an event, a barrier).
"""

from __future__ import annotations

import builtins
import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar

from deltastore.errors import StoreError
from deltastore.store.base import Store
from deltastore.store.wrapper import OPERATIONS, StoreWrapper

FaultMode = Literal["raise", "lost-response", "kill", "kill-after"]
FAULT_MODES: tuple[FaultMode, ...] = ("raise", "lost-response", "kill", "kill-after")


T = TypeVar("T")


class InjectedFault(StoreError):
    """The error a :class:`FaultyStore` raises at its fault point."""


@dataclass(frozen=True)
class Op:
    """One operation seen by a :class:`FaultyStore`."""

    #: Position among all operations since construction or :meth:`FaultyStore.reset` (1-based).
    index: int
    #: Method name (one of :data:`OPERATIONS`).
    name: str
    #: The key or prefix it was called with ("" for ``check_conditional_writes``).
    key: str
    #: Whether the wrapped store completed it (False: not attempted, or it raised).
    done: bool
    #: Whether this is the injected fault.
    fault: bool
    #: ``"TypeName: message"`` of the exception the caller got, None when it returned.
    error: str | None = None

    @property
    def writes(self) -> bool:
        """Whether the operation changes the store when done."""
        return self.name in ("put", "put_if_absent", "put_if_match", "delete")


class FaultyStore(StoreWrapper):
    """Wraps ``inner`` and fails its ``fail_at``-th operation (None: none fails).

    ``mode`` is one of :data:`FAULT_MODES`; ``only`` restricts which operation names count
    toward ``fail_at`` (every operation is still logged); ``hook`` is called before every
    operation. Thread-safe.
    """

    def __init__(
        self,
        inner: Store,
        *,
        fail_at: int | None = None,
        mode: FaultMode = "raise",
        only: Iterable[str] | None = None,
        hook: Callable[[Op], None] | None = None,
    ) -> None:
        super().__init__(inner)
        self.hook = hook
        self._lock = threading.Lock()
        self._ops: builtins.list[Op] = []
        self._counted = 0
        self._fail_at: int | None = None
        self._mode: FaultMode = "raise"
        self._only: frozenset[str] | None = None
        self.reset(fail_at=fail_at, mode=mode, only=only)

    def reset(
        self,
        *,
        fail_at: int | None = None,
        mode: FaultMode = "raise",
        only: Iterable[str] | None = None,
    ) -> None:
        """Forget the operations seen so far and arm a new fault (counted from now)."""
        if mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {FAULT_MODES}, got {mode!r}")
        if fail_at is not None and (isinstance(fail_at, bool) or fail_at < 1):
            raise ValueError(f"fail_at must be a positive integer or None, got {fail_at!r}")
        names = frozenset(only) if only is not None else None
        if names is not None and not names <= set(OPERATIONS):
            raise ValueError(f"unknown operation names {sorted(names - set(OPERATIONS))}")
        with self._lock:
            self._ops, self._counted = [], 0
            self._fail_at, self._mode, self._only = fail_at, mode, names

    @property
    def ops(self) -> builtins.list[Op]:
        """The operations seen since construction or the last :meth:`reset`, in call order."""
        with self._lock:
            return builtins.list(self._ops)

    @property
    def fault(self) -> Op | None:
        """The injected fault, once it happened."""
        return next((op for op in self.ops if op.fault), None)

    def _call(self, name: str, key: str, fn: Callable[[], T]) -> T:
        with self._lock:
            index = len(self._ops) + 1
            if self._only is None or name in self._only:
                self._counted += 1
                fault = self._counted == self._fail_at
            else:
                fault = False
            op = Op(index, name, key, done=False, fault=fault)
            self._ops.append(op)
        slot = index - 1
        if self.hook is not None:
            self.hook(op)
        if fault and self._mode in ("raise", "kill"):
            self._finish(slot, done=False, error=f"injected {self._mode} before {name}")
            if self._mode == "kill":
                _kill()
            raise InjectedFault(f"injected fault: {name} {key} failed (nothing done)")
        try:
            result = fn()
        except BaseException as exc:
            self._finish(slot, done=False, error=f"{type(exc).__name__}: {exc}")
            raise
        if fault:
            self._finish(slot, done=True, error=f"injected {self._mode} after {name}")
            if self._mode == "kill-after":
                _kill()
            raise InjectedFault(f"injected fault: {name} {key} was done but its response lost")
        self._finish(slot, done=True, error=None)
        return result

    def _finish(self, slot: int, *, done: bool, error: str | None) -> None:
        with self._lock:
            op = self._ops[slot]
            self._ops[slot] = Op(op.index, op.name, op.key, done, op.fault, error)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["FAULT_MODES", "OPERATIONS", "FaultMode", "FaultyStore", "InjectedFault", "Op"]
