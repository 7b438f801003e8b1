"""The C functions the batch kernel calls without the GIL: zstd's decompression and XXH3-64.

Both come from the libraries deltastore already depends on, through the symbols their Python
packages export: ``zstandard``'s CFFI backend (``zstandard._cffi``, which links libzstd in and
exports its ``ZSTD_*`` API) and ``xxhash``'s extension (``XXH3_64bits``). No compiler, no
second copy of either library. :func:`functions` returns their addresses, or None where a
package was built without them (another platform's wheel, a distribution's build): receivers
then decode frame by frame through the Python packages, as before, with the same results.

A decompression context (:class:`DCtx`) is made per thread, with the reader's window limit
(``ZSTD_d_windowLogMax``, spec section 8.1: a frame that asks for more fails to decompress),
and freed with its owner. Addresses are plain integers (pointers and ``size_t`` share a
register on every platform numba targets); the kernels call them through
:func:`deltastore.kernels.batch` intrinsics, so that their compiled code, which holds no
address, stays in numba's on-disk cache.

Thread-safety: :func:`functions` is safe from any thread (loaded once); a :class:`DCtx` is
used by one thread at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import threading
from dataclasses import dataclass
from typing import Final

log = logging.getLogger(__name__)

#: ``ZSTD_d_windowLogMax``, the parameter that bounds a frame's window (zstd.h).
ZSTD_D_WINDOW_LOG_MAX: Final = 100


@dataclass(frozen=True)
class Functions:
    """Addresses of ``ZSTD_decompressDCtx``, ``ZSTD_isError`` and ``XXH3_64bits``, and the
    zstd library (for contexts)."""

    decompress: int
    is_error: int
    xxh3: int
    zstd: ctypes.CDLL


_lock = threading.Lock()
_loaded: list[Functions | None] = []


def _library(module: str) -> ctypes.CDLL | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return ctypes.CDLL(spec.origin)


def _load() -> Functions | None:
    try:
        zstd = _library("zstandard._cffi")
        xxh = _library("xxhash._xxhash")
        if zstd is None or xxh is None:
            return None
        for name in ("ZSTD_createDCtx", "ZSTD_freeDCtx", "ZSTD_DCtx_setParameter"):
            getattr(zstd, name)
        zstd.ZSTD_createDCtx.restype = ctypes.c_void_p
        zstd.ZSTD_freeDCtx.argtypes = [ctypes.c_void_p]
        zstd.ZSTD_DCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        zstd.ZSTD_DCtx_setParameter.restype = ctypes.c_size_t
        zstd.ZSTD_isError.argtypes = [ctypes.c_size_t]
        zstd.ZSTD_isError.restype = ctypes.c_uint
        address = ctypes.cast
        return Functions(
            decompress=int(address(zstd.ZSTD_decompressDCtx, ctypes.c_void_p).value or 0),
            is_error=int(address(zstd.ZSTD_isError, ctypes.c_void_p).value or 0),
            xxh3=int(address(xxh.XXH3_64bits, ctypes.c_void_p).value or 0),
            zstd=zstd,
        )
    except (OSError, AttributeError) as exc:
        log.debug("native zstd/xxh3 not available (%s); decoding frame by frame", exc)
        return None


def functions() -> Functions | None:
    """The C functions, loaded on the first call; None where a library lacks them."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


class DCtx:
    """A zstd decompression context limited to windows of ``2**window_log`` bytes; freed
    when collected. One thread at a time."""

    def __init__(self, fns: Functions, window_log: int) -> None:
        self._zstd = fns.zstd
        self._suppress = contextlib.suppress
        ptr = self._zstd.ZSTD_createDCtx()
        if not ptr:
            raise MemoryError("ZSTD_createDCtx failed")
        self.address = int(ptr)
        code = self._zstd.ZSTD_DCtx_setParameter(ptr, ZSTD_D_WINDOW_LOG_MAX, window_log)
        if self._zstd.ZSTD_isError(code):
            self._zstd.ZSTD_freeDCtx(ptr)
            raise ValueError(f"zstd refused a window limit of 2**{window_log} bytes")

    def __del__(self) -> None:
        address, self.address = getattr(self, "address", 0), 0
        if address:
            with self._suppress(Exception):  # held: at interpreter exit modules may be gone
                self._zstd.ZSTD_freeDCtx(address)


__all__ = ["DCtx", "Functions", "functions"]
