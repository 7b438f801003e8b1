"""A batch of ``xor-sparse2`` frames checked, decompressed, decoded and staged in one native
call, without the GIL.

:func:`stage_batch` takes frames that lie in one fetched span (consecutive stored frames of a
data object) and, for each in turn: checks the stored bytes' XXH3-64 against the manifest's,
decompresses them with zstd into a reused buffer of exactly their declared content size (a
frame that holds more fails: no decompression bomb), checks the header (reserved bytes, ``L``,
escape count, ``k`` against the manifest's ``changed``, the content's exact length) and stages
the frame's changes against its tensor with :func:`deltastore.kernels.apply._walk` (decode,
prefetch, gather, Adler-32 sums). One GIL hand-over per batch instead of three per frame: a
Python thread beside the sync (an engine's scheduler) keeps the interpreter, and the sync does
not queue for it behind that thread for a switch interval (5 ms) at every frame.

The checks that need only the zstd frame header (declared content size within the manifest's
bounds, no dictionary, the window limit, exactly one zstd frame) are the caller's, before the
call (:meth:`deltastore.format.codecs.FrameDecoder.sparse2_precheck`). The C functions are
zstd's and xxhash's own (:mod:`deltastore.kernels.clib`), called through their addresses.

Thread-safety: distinct output buffers and decompression contexts per call; tensors are only
read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

import numba  # type: ignore[import-untyped, unused-ignore]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped, unused-ignore]
from numba import types
from numba.extending import intrinsic  # type: ignore[import-untyped, unused-ignore]
from numba.np.numpy_support import carray  # type: ignore[import-untyped, unused-ignore]

from deltastore.kernels.apply import ESCAPE, HEADER, OK, _voidptr, _walk
from deltastore.kernels.clib import DCtx, Functions

#: Status codes beyond :mod:`deltastore.kernels.apply`'s (which :func:`stage_batch` also
#: returns, for the frame's changes).
XXH_MISMATCH, NOT_DECOMPRESSED, HEADER_INVALID, COUNT_MISMATCH = 5, 6, 7, 8
_MAX_LOW_BITS: Final = 31
_I64 = ir.IntType(64)


def _call_codegen(arity: int, bits: int) -> Any:
    """Code that calls the C function at its first argument with the ``arity`` others, all
    64-bit integers (pointers, sizes), returning a ``bits``-bit integer."""

    def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
        fnty = ir.FunctionType(ir.IntType(bits), [_I64] * arity)
        fn = builder.inttoptr(values[0], fnty.as_pointer())
        return builder.call(fn, list(values[1:]))

    return codegen


def _call1_typer(typingctx: Any, fn: Any, a: Any) -> Any:
    return types.uint32(fn, a), _call_codegen(1, 32)


def _call2_typer(typingctx: Any, fn: Any, a: Any, b: Any) -> Any:
    return types.uint64(fn, a, b), _call_codegen(2, 64)


def _call5_typer(typingctx: Any, fn: Any, a: Any, b: Any, c: Any, d: Any, e: Any) -> Any:
    return types.uint64(fn, a, b, c, d, e), _call_codegen(5, 64)


#: ``fn(a)`` returning an unsigned int (``ZSTD_isError``).
_call1_u32: Any = intrinsic(_call1_typer)
#: ``fn(a, b)`` returning a 64-bit integer (``XXH3_64bits``).
_call2_u64: Any = intrinsic(_call2_typer)
#: ``fn(a, b, c, d, e)`` returning ``size_t`` (``ZSTD_decompressDCtx``).
_call5_u64: Any = intrinsic(_call5_typer)


@numba.njit(nogil=True, cache=True)
def _u32(raw: Any, at: int) -> Any:
    return (
        np.int64(raw[at])
        | (np.int64(raw[at + 1]) << 8)
        | (np.int64(raw[at + 2]) << 16)
        | (np.int64(raw[at + 3]) << 24)
    )


@numba.njit(nogil=True, cache=True)
def _batch(
    span: Any,
    frames: Any,
    pos_out: Any,
    mask_out: Any,
    sums: Any,
    scratch: Any,
    dctx: int,
    f_decompress: int,
    f_is_error: int,
    f_xxh3: int,
) -> tuple[int, int]:
    """Stage every frame of ``frames`` (int64 rows: offset in ``span``, stored length, XXH3
    (as int64 bits), content size, n, first element, changed, words address, words count,
    offset in ``pos_out`` / ``mask_out``); ``(status, index of the failing frame or -1)``."""
    size = mask_out.itemsize
    base = np.int64(span.ctypes.data)  # signed: uint64 + int64 would be float64 in numba
    dst = np.int64(scratch.ctypes.data)
    for f in range(frames.shape[0]):
        off, length, digest, content = frames[f, 0], frames[f, 1], frames[f, 2], frames[f, 3]
        n, start, changed, addr = frames[f, 4], frames[f, 5], frames[f, 6], frames[f, 7]
        numel, at = frames[f, 8], frames[f, 9]
        if _call2_u64(f_xxh3, base + off, length) != np.uint64(digest):
            return XXH_MISMATCH, f
        got = _call5_u64(f_decompress, dctx, dst, content, base + off, length)
        if _call1_u32(f_is_error, got) != 0 or got != np.uint64(content):
            return NOT_DECOMPRESSED, f
        raw = scratch[:content]
        if content < HEADER:
            return HEADER_INVALID, f
        k, e, low_bits = _u32(raw, 0), _u32(raw, 4), np.int64(raw[8])
        escapes = max(0, min(k, (n - k) // ESCAPE))
        if raw[9] or raw[10] or raw[11] or low_bits > _MAX_LOW_BITS or e > escapes:
            return HEADER_INVALID, f
        if k != changed or content != HEADER + k * (1 + size + (low_bits + 7) // 8) + 4 * e:
            return COUNT_MISMATCH, f
        words = carray(_voidptr(addr), (numel,), mask_out.dtype)
        status, total, jsum, psum = _walk(
            raw, k, e, low_bits, n, size, words, start, pos_out[at : at + k],
            mask_out[at : at + k], True,
        )  # fmt: skip
        if status != OK:
            return status, f
        sums[f, 0], sums[f, 1], sums[f, 2] = total, jsum, psum
    return OK, -1


@dataclass(frozen=True)
class BatchFrame:
    """One frame of a batch: ``offset``/``length`` of its stored bytes in the span, ``xxh3``
    (the manifest's, as an int), ``content`` (its declared content size, checked), ``n``
    elements from element ``start`` of the tensor whose words ``words`` are (1-D, contiguous,
    host), ``changed`` changes."""

    offset: int
    length: int
    xxh3: int
    content: int
    n: int
    start: int
    changed: int
    words: np.ndarray


@dataclass(frozen=True)
class BatchResult:
    """``status`` (0, or the failing frame's problem) and ``failed`` (its index, -1); per frame
    ``i``: positions ``positions[offsets[i]:offsets[i + 1]]`` (tensor-relative), masks
    likewise, and ``sums[i]`` (sum d, sum j d_j, sum (position mod 65521) d; see
    :mod:`deltastore.kernels.apply`)."""

    status: int
    failed: int
    positions: np.ndarray
    masks: np.ndarray
    offsets: np.ndarray
    sums: np.ndarray


def stage_batch(
    span: bytes | memoryview, frames: list[BatchFrame], fns: Functions, dctx: DCtx
) -> BatchResult:
    """Stage ``frames`` (stored in ``span``; every tensor's words of the same unsigned dtype)
    in one native call (see the module docstring). Positions are int32 when every tensor has
    fewer than 2^31 elements, else int64."""
    dtype = frames[0].words.dtype
    offsets = np.zeros(len(frames) + 1, dtype=np.int64)
    np.cumsum([fr.changed for fr in frames], out=offsets[1:])
    wide = any(fr.words.size >= 1 << 31 for fr in frames)
    positions = np.empty(int(offsets[-1]), dtype=np.int64 if wide else np.int32)
    masks = np.empty(int(offsets[-1]), dtype=dtype)
    rows = np.array(
        [
            (
                fr.offset, fr.length, fr.xxh3 - (1 << 64) if fr.xxh3 >= 1 << 63 else fr.xxh3,
                fr.content, fr.n, fr.start, fr.changed, fr.words.ctypes.data, fr.words.size,
                offsets[i],
            )
            for i, fr in enumerate(frames)
        ],
        dtype=np.int64,
    )  # fmt: skip
    scratch = np.empty(max(fr.content for fr in frames), dtype=np.uint8)
    sums = np.zeros((len(frames), 3), dtype=np.int64)
    src = np.frombuffer(span, dtype=np.uint8)
    status, failed = _batch(
        src, rows, positions, masks, sums, scratch, dctx.address, fns.decompress,
        fns.is_error, fns.xxh3,
    )  # fmt: skip
    return BatchResult(int(status), int(failed), positions, masks, offsets, sums)


def warm() -> None:
    """:func:`deltastore.kernels.apply.warm`, and load this module's kernel for 2-byte words
    and int32 positions (one frame of one change staged), where zstd's and xxhash's C
    functions are reachable. Thread-safe."""
    import xxhash
    import zstandard

    from deltastore.kernels import apply
    from deltastore.kernels.clib import functions

    apply.warm()
    fns = functions()
    if fns is None:
        return
    content = struct.pack("<IIB3s", 1, 0, 0, b"\0\0\0") + bytes([1, 1, 0])
    data = zstandard.ZstdCompressor().compress(content)
    words = np.zeros(2, dtype=np.uint16)
    frame = BatchFrame(0, len(data), xxhash.xxh3_64_intdigest(data), len(content), 2, 0, 1, words)
    stage_batch(data, [frame], fns, DCtx(fns, 27))


__all__ = [
    "COUNT_MISMATCH",
    "HEADER_INVALID",
    "NOT_DECOMPRESSED",
    "XXH_MISMATCH",
    "BatchFrame",
    "BatchResult",
    "stage_batch",
    "warm",
]
