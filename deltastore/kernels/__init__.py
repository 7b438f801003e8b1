"""Native (numba) kernels of the hot loops: the receiver's decode-and-apply of ``xor-sparse2``
frames (:mod:`deltastore.kernels.apply`), the publisher's detect-and-encode
(:mod:`deltastore.kernels.detect`) and the memory floor the bench measures them against
(:mod:`deltastore.kernels.floor`).

Every kernel is compiled with ``nogil=True`` (threads run them in parallel, and a Python thread
beside them, an engine's scheduler, keeps the interpreter) and ``cache=True`` (compiled once per
environment, next to the module; later processes load the machine code in milliseconds).
Nothing here is imported by ``import deltastore`` or by the CLI's start-up: numba is imported
when a kernel module is, on first use. Words are unsigned little-endian integers of 1, 2, 4 or
8 bytes; positions are element indices. The numpy code each kernel replaces stays in the
package as its reference implementation, which the tests compare the kernel against bit for
bit.
"""

from __future__ import annotations

import importlib
import logging
import threading

_log = logging.getLogger(__name__)
_started: dict[str, threading.Thread] = {}
_lock = threading.Lock()


def warm_in_background(module: str) -> None:
    """Call ``module.warm()`` (e.g. ``"deltastore.kernels.batch"``) on a daemon thread, once
    per process and module, so that the first frame does not wait for numba to load (or
    compile) the kernels. Thread-safe; a failure is logged at debug level (the first frame
    loads the kernels again and reports it)."""

    def warm() -> None:
        try:
            importlib.import_module(module).warm()
        except Exception as exc:
            _log.debug("could not load the kernels of %s ahead of time: %s", module, exc)

    with _lock:
        if module in _started:
            return
        name = f"deltastore-warm-{module.rsplit('.', 1)[-1]}"
        thread = _started[module] = threading.Thread(target=warm, name=name, daemon=True)
    thread.start()


def warming(module: str) -> threading.Thread | None:
    """The thread :func:`warm_in_background` started for ``module`` (None: not started)."""
    with _lock:
        return _started.get(module)


__all__ = ["warm_in_background", "warming"]
