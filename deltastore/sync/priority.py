"""CPU priority of deltastore's own worker threads, so that a sync running beside an engine
that serves takes the cores the engine leaves idle instead of time slices from its decode.

A priority is one of:

- ``0``: unchanged (the thread keeps its process's priority);
- ``1`` to ``19``: the thread's nice value (Linux nice is per thread; the higher, the smaller
  its share of a busy core: nice 19 weighs 15 against nice 0's 1024 in the kernel's fair
  scheduler). A thread whose nice is already higher keeps it;
- ``"idle"``: the ``SCHED_IDLE`` policy: the thread runs only on a core no normal thread wants.
  On a machine whose cores the engine keeps busy the sync may then wait a long time.

Only the calling thread changes (``os.setpriority`` / ``os.sched_setscheduler`` with its native
thread id); other threads of the process keep theirs. Where the platform has no per-thread
priority (not Linux), :func:`lower_current_thread` is a no-op with a debug log. A priority
that the kernel refuses (a container without the right) is logged once at debug level and the
thread runs unchanged: priority is an optimization, never a reason for a sync to fail.

Thread-safe: each call changes only the calling thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Literal, TypeAlias

log = logging.getLogger(__name__)

#: A thread priority: a nice value 0-19 (0: unchanged) or ``"idle"`` (``SCHED_IDLE``).
Priority: TypeAlias = int | Literal["idle"]

#: The default priority of sync worker threads (measured: benchmarks/vllm_serving.py,
#: docs/engines.md, serving while syncing).
DEFAULT_PRIORITY: Priority = 19
#: The highest nice value (the lowest priority) Linux knows.
MAX_NICE = 19


def check_priority(value: object) -> Priority:
    """``value`` as a :data:`Priority`: an int 0-19 (also given as a string of digits, as
    engine options arrive) or ``"idle"``; :class:`ValueError` otherwise."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if value == "idle":
        return "idle"
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_NICE:
        return value
    raise ValueError(
        f"priority={value!r}: expected a nice value from 0 (unchanged) to {MAX_NICE} (lowest), "
        "or 'idle' (SCHED_IDLE: only cores nothing else wants)"
    )


def supported() -> bool:
    """Whether this platform sets priorities per thread (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "sched_setscheduler")


def thread_priority(tid: int | None = None) -> Priority:
    """The priority of thread ``tid`` (a native thread id of this process; default: the
    calling thread) as :func:`lower_current_thread` sets it: ``"idle"`` under ``SCHED_IDLE``,
    else its nice value (0 where the platform has none)."""
    if not supported():
        return 0
    tid = threading.get_native_id() if tid is None else tid
    if os.sched_getscheduler(tid) == os.SCHED_IDLE:
        return "idle"
    return os.getpriority(os.PRIO_PROCESS, tid)


_warned = False


def lower_current_thread(priority: Priority) -> Priority:
    """Lower the calling thread to ``priority`` (see the module docstring); return the
    priority it had (for :func:`restore_current_thread`). Never raises for a refused change."""
    global _warned
    priority = check_priority(priority)
    if not supported():
        log.debug("thread priorities are not supported on %s; running unchanged", sys.platform)
        return 0
    tid = threading.get_native_id()
    before = thread_priority(tid)
    try:
        if priority == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        elif priority and before != "idle" and priority > before:
            os.setpriority(os.PRIO_PROCESS, tid, priority)
    except OSError as exc:  # a container without the right: run unchanged
        if not _warned:
            log.debug("cannot set thread priority %r (%s); running unchanged", priority, exc)
            _warned = True
    return before


def restore_current_thread(before: Priority) -> None:
    """Give the calling thread back the priority ``before`` (from :func:`lower_current_thread`).
    Leaving ``SCHED_IDLE`` is allowed to any process; lowering nice again needs the right to
    (``CAP_SYS_NICE`` or ``RLIMIT_NICE``): without it the thread keeps the lower priority,
    logged at debug level."""
    if not supported():
        return
    tid = threading.get_native_id()
    try:
        if before != "idle" and os.sched_getscheduler(tid) == os.SCHED_IDLE:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        if before != "idle" and os.getpriority(os.PRIO_PROCESS, tid) != before:
            os.setpriority(os.PRIO_PROCESS, tid, before)
    except OSError as exc:
        log.debug("cannot restore thread priority %r (%s); keeping the lower one", before, exc)


@contextlib.contextmanager
def lowered(priority: Priority) -> Iterator[None]:
    """The calling thread at ``priority`` inside the block, restored (where allowed) after."""
    before = lower_current_thread(priority)
    try:
        yield
    finally:
        restore_current_thread(before)


__all__ = [
    "DEFAULT_PRIORITY",
    "Priority",
    "check_priority",
    "lower_current_thread",
    "lowered",
    "restore_current_thread",
    "thread_priority",
]
