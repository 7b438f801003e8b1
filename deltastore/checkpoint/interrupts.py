"""Ctrl-C held back over a critical section: a folder's write and its record.

A pull that updates a checkpoint folder in place writes a version's words into the files,
then flushes them and replaces the sidecar that records the version. A ``KeyboardInterrupt``
raised between the first write and the new sidecar would leave the files ahead of their
record. :class:`DeferredSignals` closes that window: while it holds, SIGINT and SIGTERM,
where Python handles them, are only noted; :meth:`DeferredSignals.release` puts the handlers
back and then calls each one once for every signal noted, so the ``KeyboardInterrupt`` (or
whatever the handler does) comes right after the record, never inside it.

Signals whose disposition is not a Python handler (``SIG_DFL``: a SIGTERM that kills the
process; ``SIG_IGN``) are left alone: a process killed there is repaired by the next pull
(the pending marker). Python runs signal handlers only in the main thread, so holding from
another thread does nothing (a ``KeyboardInterrupt`` cannot land there either). Not
thread-safe: one thread holds and releases.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]

#: The signals held back.
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredSignals:
    """Holds back SIGINT / SIGTERM handlers between :meth:`hold` and :meth:`release` (both
    idempotent; see the module docstring)."""

    def __init__(self) -> None:
        self._saved: dict[int, Handler] = {}
        self._pending: list[int] = []
        self._holding = False

    @property
    def holding(self) -> bool:
        """Whether signals are being held back now."""
        return self._holding

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._pending.append(signum)

    def hold(self) -> None:
        """From now on, note SIGINT and SIGTERM instead of handling them (main thread only;
        a second call while holding does nothing)."""
        if self._holding or threading.current_thread() is not threading.main_thread():
            return
        self._holding = True
        for sig in HELD_SIGNALS:
            current = signal.getsignal(sig)
            if callable(current):
                self._saved[sig] = current  # before the swap: release() restores it either way
                signal.signal(sig, self._note)

    def release(self) -> None:
        """Put the handlers back, then call each one for a signal noted meanwhile (once per
        signal): a ``KeyboardInterrupt`` held back is raised here."""
        if not self._holding:
            return
        saved, self._saved = self._saved, {}
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        self._holding = False
        pending, self._pending = self._pending, []
        for sig in dict.fromkeys(pending):
            noted = saved.get(sig)
            if noted is not None:
                noted(sig, None)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold for the ``with`` block (released also when it raises; inside an outer hold,
        the outer one releases)."""
        outer = self._holding
        self.hold()
        try:
            yield
        finally:
            if not outer:
                self.release()


__all__ = ["HELD_SIGNALS", "DeferredSignals"]
