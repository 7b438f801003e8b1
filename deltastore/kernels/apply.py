"""The receiver's hot loop, native: decode an ``xor-sparse2`` frame and apply it, in one pass.

An ``xor-sparse2`` frame's content (spec section 8.2.4; the checks that need no decoding are
done first by :meth:`deltastore.format.codecs.FrameDecoder.sparse2_content`) holds ``k``
changes as a token byte, ``ceil(L / 8)`` low-bit bytes and, for a token of 255, a 32-bit escape
per gap, then each XOR mask as ``s`` byte planes. :func:`stage_sparse2` walks them once, change
by change, straight from the zstd output: it rebuilds the gap and the position, checks both
against the frame, reads the mask, gathers the old word at the position in the tensor, and
accumulates the Adler-32 delta of ``old -> old ^ mask`` at the tensor's byte offsets. It keeps
what the write needs and nothing else (verify-before-write): the tensor-relative positions
(int32 where the tensor has fewer than 2^31 elements, else int64) and the masks, 4 + ``s``
bytes per change (the numpy path kept 8-byte positions, the old and the new words during the
decode, and several int64 temporaries). The write (:func:`xor_at`) XORs the masks in place; a
second :func:`xor_at` with the same arguments is its exact undo. No intermediate int64 arrays.

:func:`decode_sparse2` decodes the same content into frame-relative int64 positions and masks
(for receivers that route changes before staging them: the layout path, the engines).

The numpy code these replace stays the specification and the reference the tests compare the
kernels against bit for bit: :func:`deltastore.format.codecs.v2.decode_positions` and
:func:`deltastore.format.checksum.delta_sums`.

Words are unsigned little-endian integers of 1, 2, 4 or 8 bytes (one compiled specialization
per word size and position width, cached on disk next to this module). Every kernel releases
the GIL; calls on distinct output buffers may run on any threads at once, and
:func:`stage_sparse2` only reads the tensor. Adler-32 arithmetic is exact: per change the
word's byte differences ``d_j`` (in -255..255) are summed into ``sum d`` and ``sum j d_j``, and
``(position mod 65521) * sum d`` into a third sum; none can overflow int64 for a frame of at
most 2^32 changes, and :func:`stage_sparse2` reduces them to ``(dA, dB)`` mod 65521 as
:func:`~deltastore.format.checksum.delta_sums` defines them.
"""

from __future__ import annotations

import struct
from typing import Any, Final

import numba  # type: ignore[import-untyped, unused-ignore]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped, unused-ignore]
from numba import types
from numba.core import cgutils as _cgutils  # type: ignore[import-untyped, unused-ignore]
from numba.extending import intrinsic  # type: ignore[import-untyped, unused-ignore]
from numba.np.numpy_support import carray  # type: ignore[import-untyped, unused-ignore]

#: Bytes of the ``xor-sparse2`` header (``<u32 k><u32 e><u8 L><3 zero bytes>``).
HEADER: Final = 12
#: The token that says "the high part continues in the escape section".
ESCAPE: Final = 255
#: Adler-32's modulus.
MOD: Final = 65521
#: Status codes of the kernels (0: the frame decoded and staged).
OK, LOW_TOO_WIDE, ESCAPES_DISAGREE, PAST_END, ZERO_MASK = 0, 1, 2, 3, 4
#: What each non-zero status says about the frame (completed by the codec's name).
PROBLEMS: Final = {
    LOW_TOO_WIDE: "low part does not fit its L bits",
    ESCAPES_DISAGREE: "escape tokens disagree with the header's escape count",
    PAST_END: "gap points past the end of the frame",
    ZERO_MASK: "frame holds a zero mask (an element that did not change)",
}
cgutils: Any = _cgutils  # numba's code-generation helpers (untyped)
_INT32_MAX: Final = (1 << 31) - 1
#: Changes decoded before their old words are gathered and summed (:func:`_sums`).
BLOCK: Final = 512
#: How many changes ahead :func:`_xor_at` prefetches.
AHEAD: Final = 32


def _prefetch_typer(typingctx: Any, array: Any, index: Any) -> Any:
    """Ask the CPU to bring ``array[index]``'s cache line in for a write (LLVM's
    ``llvm.prefetch``, high locality; a hint: no fault, no effect on results)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        addr = cgutils.get_item_pointer(context, builder, signature.args[0], arr, [args[1]])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch"
        )
        write, locality, data = (ir.Constant(i32, v) for v in (1, 3, 1))
        builder.call(fn, [builder.bitcast(addr, i8p), write, locality, data])
        return context.get_dummy_value()

    return types.void(array, index), codegen


_prefetch: Any = intrinsic(_prefetch_typer)


def _voidptr_typer(typingctx: Any, address: Any) -> Any:
    """``address`` (an integer) as a ``void *``, for ``carray``."""

    def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
        return builder.inttoptr(values[0], ir.IntType(8).as_pointer())

    return types.voidptr(address), codegen


_voidptr: Any = intrinsic(_voidptr_typer)


@numba.njit(nogil=True, cache=True, inline="always")
def _plane_word(raw: Any, at: int, count: int, index: int, size: int) -> Any:
    """Word ``index`` of ``size`` byte planes of ``count`` bytes from ``raw[at]``."""
    value = np.uint64(0)
    for j in range(size):
        value |= np.uint64(raw[at + j * count + index]) << np.uint64(8 * j)
    return value


@numba.njit(nogil=True, cache=True)
def _walk(
    raw: Any,
    k: int,
    e: int,
    low_bits: int,
    n: int,
    size: int,
    words: Any,
    start: int,
    pos_out: Any,
    mask_out: Any,
    stage: bool,
) -> tuple[int, int, int, int]:
    """Decode the ``k`` changes of a checked content ``raw`` (uint8) of a frame of ``n``
    elements of ``size`` bytes. ``stage``: positions go to ``pos_out`` as ``start + position``
    and, with the old words of ``words`` (the tensor's), the Adler-32 sums are accumulated;
    else frame-relative positions, no tensor read. Returns ``(status, sum d, sum j d_j,
    sum (position mod 65521) * d)`` (sums over every changed byte; zero unless staged)."""
    size = mask_out.itemsize  # a constant of each compiled specialization: loops unroll
    width = (low_bits + 7) // 8
    at_low = HEADER + k
    at_esc = at_low + width * k
    at_mask = at_esc + 4 * e
    top = np.uint64((n - 1) >> low_bits)  # the largest high part of a gap inside the frame
    low_cap = np.uint64(1) << np.uint64(low_bits)
    shift = np.uint64(low_bits)
    old = np.empty(BLOCK if stage else 0, dtype=np.uint64)
    esc = 0
    prev = -1
    total = 0
    jsum = 0
    psum = 0
    for i in range(k):
        high = np.uint64(raw[HEADER + i])
        if high == ESCAPE:
            if esc >= e:
                return ESCAPES_DISAGREE, 0, 0, 0
            high += _plane_word(raw, at_esc, e, esc, 4)
            esc += 1
        if high > top:
            return PAST_END, 0, 0, 0
        gap = high << shift
        if width:
            low = _plane_word(raw, at_low, k, i, width)
            if low >= low_cap:
                return LOW_TOO_WIDE, 0, 0, 0
            gap |= low
        pos = prev + 1 + np.int64(gap)
        if pos >= n:
            return PAST_END, 0, 0, 0
        prev = pos
        mask = _plane_word(raw, at_mask, k, i, size)
        if mask == 0:
            return ZERO_MASK, 0, 0, 0
        mask_out[i] = mask
        pos_out[i] = start + pos if stage else pos
        if stage:
            _prefetch(words, start + pos)
        if stage and (i + 1) % BLOCK == 0:
            t, js, ps = _sums(words, pos_out, mask_out, i + 1 - BLOCK, i + 1, size, old)
            total, jsum, psum = total + t, jsum + js, psum + ps
    if esc != e:
        return ESCAPES_DISAGREE, 0, 0, 0
    if stage and k % BLOCK:
        t, js, ps = _sums(words, pos_out, mask_out, k - k % BLOCK, k, size, old)
        total, jsum, psum = total + t, jsum + js, psum + ps
    return OK, total, jsum, psum


@numba.njit(nogil=True, cache=True)
def _sums(
    words: Any, pos: Any, masks: Any, lo: int, hi: int, size: int, old: Any
) -> tuple[int, int, int]:
    """The Adler-32 sums of :func:`_walk` over changes ``[lo, hi)`` (tensor positions
    ``pos``, ``masks``): their old words are gathered first, in a loop of a few instructions
    per change (many cache misses in flight at once), into ``old`` (scratch of at least
    ``hi - lo`` words), then summed."""
    size = masks.itemsize  # a constant of each compiled specialization: loops unroll
    for i in range(lo, hi):
        old[i - lo] = words[pos[i]]
    total = 0
    jsum = 0
    psum = 0
    for i in range(lo, hi):
        was = np.uint64(old[i - lo])
        now = was ^ np.uint64(masks[i])
        d = 0
        for j in range(size):
            s = np.uint64(8 * j)
            dj = np.int64((now >> s) & np.uint64(255)) - np.int64((was >> s) & np.uint64(255))
            d += dj
            jsum += j * dj
        total += d
        psum += (np.int64(pos[i]) % MOD) * d
    return total, jsum, psum


@numba.njit(nogil=True, cache=True)
def _xor_at(words: Any, positions: Any, masks: Any) -> None:
    """``words[positions[i]] ^= masks[i]`` for every ``i``, in order; each word's cache line
    is prefetched :data:`AHEAD` changes before its turn (many misses in flight at once)."""
    k = positions.size
    for i in range(min(AHEAD, k)):
        _prefetch(words, positions[i])
    for i in range(k):
        if i + AHEAD < k:
            _prefetch(words, positions[i + AHEAD])
        words[positions[i]] ^= masks[i]


@numba.njit(nogil=True, cache=True)
def _xor_many(table: Any, pos_like: Any, mask_like: Any) -> None:
    """:func:`_xor_at` of every row of ``table`` (int64: words address, words count,
    positions address, masks address, count); positions and masks of ``pos_like``'s and
    ``mask_like``'s dtypes, words of ``mask_like``'s."""
    for r in range(table.shape[0]):
        words = carray(_voidptr(table[r, 0]), (table[r, 1],), mask_like.dtype)
        positions = carray(_voidptr(table[r, 2]), (table[r, 4],), pos_like.dtype)
        masks = carray(_voidptr(table[r, 3]), (table[r, 4],), mask_like.dtype)
        _xor_at(words, positions, masks)


def xor_many(writes: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """:func:`xor_at` of every ``(local, positions, masks)`` of ``writes`` in one native call
    per kind of positions and words (the GIL released once, not once per write). Releases
    the GIL; not thread-safe for overlapping positions."""
    groups: dict[tuple[str, str], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for local, positions, masks in writes:
        key = (positions.dtype.str, masks.dtype.str)
        groups.setdefault(key, []).append((_words(local, masks.dtype.itemsize), positions, masks))
    for group in groups.values():
        for words, positions, masks in group:
            if not (words.flags.c_contiguous and positions.flags.c_contiguous
                    and masks.flags.c_contiguous):  # fmt: skip
                raise ValueError("xor_many needs contiguous words, positions and masks")
        table = np.array(
            [(w.ctypes.data, w.size, p.ctypes.data, m.ctypes.data, p.size) for w, p, m in group],
            dtype=np.int64,
        )
        _xor_many(table, group[0][1][:0], group[0][2][:0])


def _words(local: np.ndarray, size: int) -> np.ndarray:
    """``local`` (1-D, contiguous) as unsigned words of ``size`` bytes."""
    return local.view(np.dtype(f"<u{size}"))


def stage_sparse2(
    raw: bytes,
    k: int,
    e: int,
    low_bits: int,
    n: int,
    local: np.ndarray,
    start: int,
    nbytes: int,
) -> tuple[int, np.ndarray, np.ndarray, tuple[int, int]]:
    """Decode the checked content ``raw`` of an ``xor-sparse2`` frame (header ``(k, e,
    low_bits)``, ``n`` elements) whose first element is element ``start`` of ``local`` (the
    tensor's 1-D contiguous host words, unsigned of the frame's word size, read only), and
    stage it: ``(status, positions, masks, (dA, dB))``. ``positions`` are tensor-relative,
    ascending (int32 when ``local`` has at most 2^31 - 1 elements, else int64), ``masks``
    the XOR masks (``local``'s dtype), ``(dA, dB)`` the Adler-32 contribution (mod 65521) of
    the changes to the ``nbytes``-byte tensor. ``status`` is :data:`OK` or the problem
    (:data:`PROBLEMS`; the arrays are then not to be used). Releases the GIL."""
    size = local.dtype.itemsize
    src = np.frombuffer(raw, dtype=np.uint8)
    pos = np.empty(k, dtype=np.int32 if local.size <= _INT32_MAX else np.int64)
    masks = np.empty(k, dtype=local.dtype)
    status, total, jsum, psum = _walk(src, k, e, low_bits, n, size, local, start, pos, masks, True)
    if status != OK:
        return status, pos, masks, (0, 0)
    return OK, pos, masks, reduce_sums((total, jsum, psum), size, nbytes)


def reduce_sums(raw: Any, size: int, nbytes: int) -> tuple[int, int]:
    """``(dA, dB)`` (mod 65521) of a frame's changes to an ``nbytes``-byte tensor of
    ``size``-byte words, from the kernel's ``(sum d, sum j d_j, sum (position mod 65521) d)``
    (:func:`_walk`; also a row of :func:`deltastore.kernels.batch.stage_batch`'s sums)."""
    total, jsum, psum = (int(v) for v in raw)
    return total % MOD, ((nbytes % MOD) * total - size * psum - jsum) % MOD


def decode_sparse2(
    raw: bytes, k: int, e: int, low_bits: int, n: int, size: int
) -> tuple[int, np.ndarray, np.ndarray]:
    """Decode the checked content ``raw`` of an ``xor-sparse2`` frame into ``(status,
    positions, masks)``: frame-relative int64 positions, ascending, and the XOR masks
    (unsigned words of ``size`` bytes), as
    :meth:`deltastore.format.codecs.v2.FrameDecoder2.sparse2` returns them. Releases the
    GIL."""
    src = np.frombuffer(raw, dtype=np.uint8)
    pos = np.empty(k, dtype=np.int64)
    masks = np.empty(k, dtype=np.dtype(f"<u{size}"))
    dummy = np.empty(0, dtype=masks.dtype)
    status = _walk(src, k, e, low_bits, n, size, dummy, 0, pos, masks, False)[0]
    return status, pos, masks


def xor_at(local: np.ndarray, positions: np.ndarray, masks: np.ndarray) -> None:
    """XOR ``masks`` into ``local`` (1-D contiguous host words) at ``positions`` (int32 or
    int64, each in range: not checked), in place; the same call again undoes it. Releases the
    GIL; not thread-safe for overlapping positions."""
    _xor_at(_words(local, masks.dtype.itemsize), positions, masks)


def warm() -> None:
    """Load (or, in a fresh environment, compile) the kernels for 2-byte words and int32
    positions, the common case, so that the first frame does not wait for them: about 0.2 s
    from the on-disk cache, about 1.3 s to compile (measured; docs/design/decisions.md).
    Thread-safe; cheap after the first call."""
    words = np.zeros(2, dtype=np.uint16)
    raw = struct.pack("<IIB3s", 1, 0, 0, b"\0\0\0") + bytes([1, 1, 0])
    status, pos, masks, _ = stage_sparse2(raw, 1, 0, 0, 2, words, 0, 4)
    if status == OK:
        xor_at(words, pos, masks)
        xor_many([(words, pos, masks)])
    decode_sparse2(raw, 1, 0, 0, 2, 2)


__all__ = [
    "ESCAPES_DISAGREE",
    "LOW_TOO_WIDE",
    "OK",
    "PAST_END",
    "PROBLEMS",
    "ZERO_MASK",
    "decode_sparse2",
    "reduce_sums",
    "stage_sparse2",
    "warm",
    "xor_at",
    "xor_many",
]
