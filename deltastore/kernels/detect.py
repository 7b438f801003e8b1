"""The publisher's detect-and-encode kernels (numba): a frame's changes, their Adler-32 delta
and their ``xor-sparse2`` sections, and the XOR-scatter of a commit into the held words.

:func:`find` compares a frame's old (held) and new words in one pass, 64 words a block (a
64-bit map of the block's changed words, vectorized compares and no branch but the one on the
map; then one step per change, from the map's lowest set bit) and writes the changed positions
(uint32, frame-local, ascending) and XOR masks (``old ^ new``, never zero) straight into a
per-thread :class:`Scratch`, with, in the same pass, the sums ``(dA, dB)`` of
:func:`deltastore.format.checksum.delta_sums` (so the frame's Adler-32 comes from its
parent's, :func:`~deltastore.format.checksum.apply_delta`): no bool map, no int64 temporary.
When more than about one word in :data:`SCRATCH_SHARE` changed (the scratch is full), the
rest of the frame is counted first, then gathered into arrays of the exact size. On the
development machine (2 shared cores): ~0.7x the time of the numpy ``not_equal`` +
``flatnonzero`` pass it replaces on a frame of 8 Mi bf16 words with 0.8% changed (2.1 against
3.7 ms in cache); over a 490 MB model, about the time of reading both copies once.

:func:`sparse2_sections` lays out the decompressed content of an ``xor-sparse2`` frame (spec
``docs/spec/format-v1.md`` section 8.2.4) in one buffer, in one kernel call of two O(changed)
passes (the escapes counted, then every byte written), and returns it cut into the sections
the encoder compresses, byte for byte what
:func:`~deltastore.format.codecs.v2.position_sections` ``+``
:func:`~deltastore.format.codecs.v2.byte_planes` make (the numpy reference, which
``tests/test_kernels_detect.py`` compares it with). :func:`pack_masks` packs the masks a
writer holds until its commit as ``PackedMasks.of`` does.

:func:`xor_scatter` XORs a frame's masks (as they are, or packed: low bytes and the few high
parts) into held words at their positions, one pass (the numpy reference unpacks the masks,
then gathers, XORs and scatters: ~3x slower).

Words: 1-D contiguous unsigned (or signed, viewed as unsigned) little-endian integers of 1,
2, 4 or 8 bytes; a frame has fewer than ``2**32 - 1`` words. Every kernel is compiled with
``nogil=True`` and ``cache=True`` (see :mod:`deltastore.kernels`); importing this module
imports numba (the publisher imports it on its first delta). Functions are thread-safe on
distinct outputs; a :class:`Scratch` belongs to one thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba  # type: ignore[import-untyped, unused-ignore]
import numpy as np
from numba.cpython.unsafe.numbers import (  # type: ignore[import-untyped, unused-ignore]
    trailing_zeros as _trailing_zeros,
)

from deltastore.format.checksum import MOD
from deltastore.format.codecs.v2 import (
    ESCAPE,
    MAX_SPARSE2_ELEMENTS,
    SPARSE2_HEADER,
    choose_low_bits,
)

#: Words per block of the comparison (one 64-bit map of its changed words, :func:`_bits`).
BLOCK = 64
#: A scratch holds up to ``n /`` this changes of a frame of ``n`` words (plus a block);
#: beyond, the frame is dense: the rest is counted and the changes go to exact-size arrays.
SCRATCH_SHARE = 16

#: LLVM's ``cttz`` (numba's intrinsic): the index of the lowest set bit of a non-zero word.
trailing_zeros: Any = _trailing_zeros


# --- kernels ---------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True, inline="always")
def _byte_sums(word: Any, size: int) -> tuple[int, int]:
    """(sum of the bytes of ``word``, sum of byte index * byte), little-endian bytes."""
    u = np.uint64(word)
    s = 0
    t = 0
    for b in range(size):
        v = np.int64((u >> np.uint64(8 * b)) & np.uint64(255))
        s += v
        t += b * v
    return s, t


@numba.njit(cache=True, nogil=True, inline="always")
def _change(was: Any, now: Any, size: int) -> tuple[int, int]:
    """Of a word changed from ``was`` to ``now``: (sum of its byte differences, sum of byte
    index in the word times byte difference)."""
    ns, nt = _byte_sums(now, size)
    os_, ot = _byte_sums(was, size)
    return ns - os_, nt - ot


@numba.njit(cache=True, nogil=True, inline="always")
def _bits(a: np.ndarray, b: np.ndarray, i: int) -> Any:
    """The 64-bit map (uint64, bit ``j``: word ``i + j``) of the changed words of the block
    of :data:`BLOCK` (64) words at ``i`` of ``a`` (old) and ``b`` (new): a fixed-size loop
    over indexes known non-negative, which LLVM vectorizes (compares and a movemask); no
    branch per block but the one on the map."""
    bits = np.uint64(0)
    for j in range(BLOCK):
        bits |= np.uint64(a[i + j] != b[i + j]) << np.uint64(j)
    return bits


@numba.njit(cache=True, nogil=True, inline="always")
def _block(
    a: np.ndarray, b: np.ndarray, i: int, bits: Any, pos: np.ndarray, masks: np.ndarray, k: int
) -> tuple[int, int, int]:
    """The changes of the block at ``i`` of ``a`` (old) and ``b`` (new) whose map is ``bits``
    (non-zero), written from ``k`` (with room for all of them): returns ``(k, bs, bw)``,
    ``bs`` the sum of their byte differences, ``bw`` the sum of byte offset from the block's
    first byte times difference. One step per change (the map's lowest set bit). Positions
    are indexes of ``a``."""
    size = a.itemsize
    bs = 0
    bw = 0
    while bits:
        j = np.int64(trailing_zeros(bits))
        bits &= bits - np.uint64(1)
        p = i + j
        pos[k] = p
        masks[k] = a[p] ^ b[p]
        k += 1
        d, jd = _change(a[p], b[p], size)
        bs += d
        bw += j * size * d + jd
    return k, bs, bw


@numba.njit(cache=True, nogil=True)
def _words(
    a: np.ndarray, b: np.ndarray, i: int, stop: int, pos: np.ndarray, masks: np.ndarray, k: int
) -> tuple[int, int, int, int]:
    """The changes of ``[i, stop)`` of ``a`` (old) and ``b`` (new), word by word, until
    ``pos`` is full: ``(k, end, s, w)`` as :func:`_scan` (``end`` -1: all of them
    written; positions are indexes of ``a``)."""
    size = a.itemsize
    s = 0
    w = 0
    for j in range(i, stop):
        v = a[j] ^ b[j]
        if v != 0:
            if k == pos.size:
                return k, j, s, w
            pos[k] = j
            masks[k] = v
            k += 1
            d, jd = _change(a[j], b[j], size)
            s += d
            w = (w + ((j * size) % MOD) * d + jd) % MOD
    return k, -1, s, w


@numba.njit(cache=True, nogil=True)
def _scan(
    old: np.ndarray, new: np.ndarray, start: int, pos: np.ndarray, masks: np.ndarray, k: int
) -> tuple[int, int, int, int]:
    """Changes of ``[start, n)`` written from index ``k`` of ``pos``/``masks`` until they
    are full: returns ``(k, stop, s, w)``, every change of ``[start, stop)`` written, ``s``
    the sum of their byte differences (new - old), ``w`` the sum of byte position times byte
    difference, modulo :data:`MOD`.

    Blocks of :data:`BLOCK` words: the map of a block's changed words (:func:`_bits`:
    vectorized; no array is made in the loop), its changes then taken one by one from the map
    (:func:`_block`), or, with less than a block of room left and in the tail, word by word
    (:func:`_words`). The blocks are counted from ``start``; their positions are written
    relative to it, then shifted."""
    a = old[start:]
    b = new[start:]
    size = a.itemsize
    s = 0
    w = 0
    blocks = a.size // BLOCK
    for blk in range(blocks):
        i = blk * BLOCK
        bits = _bits(a, b, i)
        if bits:
            k0 = k
            if pos.size - k >= BLOCK:
                k, bs, bw = _block(a, b, i, bits, pos, masks, k)
                s += bs
                w = (w + (((start + i) * size) % MOD) * bs + bw) % MOD
                stop = -1
            else:
                k, stop, ds, dw = _words(a, b, i, i + BLOCK, pos, masks, k)
                s += ds
                w = (w + dw + ((start * size) % MOD) * ds) % MOD
            if start:
                for t in range(k0, k):
                    pos[t] += start
            if stop >= 0:
                return k, start + stop, s, w
    k0 = k
    k, stop, ds, dw = _words(a, b, blocks * BLOCK, a.size, pos, masks, k)
    if start:
        for t in range(k0, k):
            pos[t] += start
    s += ds
    w = (w + dw + ((start * size) % MOD) * ds) % MOD
    return k, old.size if stop < 0 else start + stop, s, w


@numba.njit(cache=True, nogil=True)
def _count(old: np.ndarray, new: np.ndarray, start: int) -> int:
    """Changed words of ``[start, n)``."""
    a = old[start:]
    b = new[start:]
    k = 0
    blocks = a.size // BLOCK
    for blk in range(blocks):
        x = a[blk * BLOCK : blk * BLOCK + BLOCK]
        y = b[blk * BLOCK : blk * BLOCK + BLOCK]
        acc = x[0] ^ y[0]
        for j in range(1, BLOCK):
            acc |= x[j] ^ y[j]
        if acc != 0:
            for j in range(BLOCK):
                k += x[j] != y[j]
    for j in range(blocks * BLOCK, a.size):
        k += a[j] != b[j]
    return k


@numba.njit(cache=True, nogil=True)
def _escapes(pos: np.ndarray, low_bits: int) -> int:
    """Gaps of ``pos`` whose high part (``gap >> low_bits``) is at least :data:`ESCAPE`."""
    e = 0
    prev = -1
    for i in range(pos.size):
        p = np.int64(pos[i])
        e += ((p - prev - 1) >> low_bits) >= ESCAPE
        prev = p
    return e


@numba.njit(cache=True, nogil=True)
def _fill_sparse2(
    pos: np.ndarray, masks: np.ndarray, low_bits: int, width: int, e: int, out: np.ndarray
) -> None:
    """The sections of an ``xor-sparse2`` frame after its 12-byte header, into ``out``:
    tokens, ``width`` low-bit planes, 4 planes of ``e`` escapes, the mask planes."""
    k = pos.size
    size = masks.itemsize
    tok = SPARSE2_HEADER
    low = tok + k
    esc = low + width * k
    planes = esc + 4 * e
    lmask = (1 << low_bits) - 1
    prev = -1
    x = 0
    for i in range(k):
        p = np.int64(pos[i])
        gap = p - prev - 1
        prev = p
        high = gap >> low_bits
        if high >= ESCAPE:
            out[tok + i] = ESCAPE
            rest = high - ESCAPE
            for b in range(4):
                out[esc + b * e + x] = (rest >> (8 * b)) & 255
            x += 1
        else:
            out[tok + i] = high
        lo = gap & lmask
        for b in range(width):
            out[low + b * k + i] = (lo >> (8 * b)) & 255
        m = np.uint64(masks[i])
        for b in range(size):
            out[planes + b * k + i] = (m >> np.uint64(8 * b)) & np.uint64(255)


@numba.njit(cache=True, nogil=True)
def _sparse2(pos: np.ndarray, masks: np.ndarray, low_bits: int) -> np.ndarray:
    """The decompressed ``xor-sparse2`` content of the changes (``pos``, ``masks``) with
    ``L = low_bits``: the escapes counted (:func:`_escapes`), the buffer made, its header
    ``<u32 k><u32 e><u8 L><3 zero bytes>`` and sections written (:func:`_fill_sparse2`)."""
    k = pos.size
    width = (low_bits + 7) // 8
    e = _escapes(pos, low_bits)
    out = np.empty(SPARSE2_HEADER + k * (1 + width + masks.itemsize) + 4 * e, dtype=np.uint8)
    for b in range(4):
        out[b] = (k >> (8 * b)) & 255
        out[4 + b] = (e >> (8 * b)) & 255
    out[8] = low_bits
    out[9] = 0
    out[10] = 0
    out[11] = 0
    _fill_sparse2(pos, masks, low_bits, width, e, out)
    return out


@numba.njit(cache=True, nogil=True)
def _pack(masks: np.ndarray) -> tuple[bool, np.ndarray, np.ndarray, np.ndarray]:
    """``masks`` (of 2 bytes or more) packed as ``PackedMasks.of`` packs them: ``(packed,
    low, at, high)``; ``packed`` False (and empty arrays) where that would not be smaller."""
    k = masks.size
    size = masks.itemsize
    count = 0
    for i in range(k):
        count += (masks[i] >> 8) != 0
    if count * (4 + size) + k >= k * size:
        return False, np.empty(0, np.uint8), np.empty(0, np.uint32), masks[:0].copy()
    low = np.empty(k, np.uint8)
    at = np.empty(count, np.uint32)
    high = np.empty(count, masks.dtype)
    j = 0
    for i in range(k):
        m = masks[i]
        low[i] = m & 255
        h = m >> 8
        if h != 0:
            at[j] = i
            high[j] = h
            j += 1
    return True, low, at, high


@numba.njit(cache=True, nogil=True)
def _xor_at(words: np.ndarray, pos: np.ndarray, masks: np.ndarray) -> None:
    """``words[pos[i]] ^= masks[i]`` for every ``i``."""
    for i in range(pos.size):
        words[pos[i]] ^= masks[i]


@numba.njit(cache=True, nogil=True)
def _xor_at_packed(
    words: np.ndarray, pos: np.ndarray, low: np.ndarray, at: np.ndarray, high: np.ndarray
) -> None:
    """``words[pos[i]] ^= low[i] | (high[j] << 8)`` where ``at[j] == i`` (``at`` ascending),
    else ``^= low[i]``: one pass over the positions."""
    j = 0
    for i in range(pos.size):
        m = words.dtype.type(low[i])
        if j < at.size and at[j] == i:
            m |= words.dtype.type(high[j]) << 8
            j += 1
        words[pos[i]] ^= m


@numba.njit(cache=True, nogil=True)
def _bitmap_positions(bits: np.ndarray, n: int, out: np.ndarray) -> int:
    """Positions (ascending) of the set bits of a big-endian-bit-order bitmap of ``n``
    elements (:func:`numpy.packbits`) into ``out``; returns how many."""
    k = 0
    for byte in range(bits.size):
        v = bits[byte]
        if v != 0:
            for b in range(8):
                p = byte * 8 + b
                if p < n and (v >> (7 - b)) & 1:
                    out[k] = p
                    k += 1
    return k


@numba.njit(cache=True, nogil=True)
def _bitmap(pos: np.ndarray, out: np.ndarray) -> None:
    """Set the bits of ``pos`` in the zeroed big-endian-bit-order bitmap ``out``."""
    for i in range(pos.size):
        p = pos[i]
        out[p >> 3] |= np.uint8(0x80 >> (p & 7))


# --- the Python side --------------------------------------------------------------------------


def _unsigned(words: np.ndarray) -> np.ndarray:
    """``words`` as a plain 1-D contiguous ndarray of unsigned words (a view when it can)."""
    a = np.ascontiguousarray(words).reshape(-1)
    if a.dtype.kind != "u" or not a.dtype.isnative:
        a = a.view(f"<u{a.dtype.itemsize}")
    return a


class Scratch:
    """One thread's reusable buffers of positions (uint32) and masks (8 bytes each, viewed as
    each frame's words), grown to ``n /`` :data:`SCRATCH_SHARE` changes of the largest frame
    seen (plus a block): 12 bytes per entry of address space, resident only as far as
    changes were written (at most ~6 MiB a thread for the default 16 MiB frames of bf16).
    Not thread-safe: one per thread."""

    def __init__(self) -> None:
        self._pos = np.empty(0, dtype=np.uint32)
        self._masks = np.empty(0, dtype=np.uint64)

    def buffers(self, n: int, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
        """(positions, masks of ``dtype``) of room for a frame of ``n`` words."""
        want = n // SCRATCH_SHARE + BLOCK
        if self._pos.size < want:
            self._pos = np.empty(want, dtype=np.uint32)
            self._masks = np.empty(want, dtype=np.uint64)
        return self._pos[:want], self._masks.view(dtype)[:want]


@dataclass(frozen=True)
class Found:
    """A frame's changes: uint32 ascending frame-local ``positions``, their XOR ``masks``
    (``old ^ new``, never zero; unsigned words), and ``(da, db)``, the Adler-32 sums of
    :func:`~deltastore.format.checksum.delta_sums` over the frame's bytes (each in
    ``[0, 65521)``). Both arrays are the caller's own (exact size, no scratch)."""

    positions: np.ndarray
    masks: np.ndarray
    da: int
    db: int


def find(old: np.ndarray, new: np.ndarray, scratch: Scratch) -> Found:
    """The changes of a frame, ``old`` to ``new`` (same size and word size, fewer than
    ``2**32 - 1`` words), in one pass when at most about one word in :data:`SCRATCH_SHARE`
    changed (else a second counts the rest and a third gathers it). ``scratch``: the calling
    thread's."""
    a, b = _unsigned(old), _unsigned(new)
    if a.size != b.size or a.dtype != b.dtype:
        raise ValueError("old and new differ in size or word size")
    n = int(a.size)
    if n >= MAX_SPARSE2_ELEMENTS:
        raise ValueError("a frame has fewer than 2**32 - 1 words")
    pos, masks = scratch.buffers(n, a.dtype)
    k, stop, s, w = _scan(a, b, 0, pos, masks, 0)
    if stop == n:
        positions, xors = pos[:k].copy(), masks[:k].copy()
    else:  # dense: the rest counted, then gathered into arrays of the exact size
        total = k + int(_count(a, b, stop))
        positions = np.empty(total, dtype=np.uint32)
        xors = np.empty(total, dtype=a.dtype)
        positions[:k] = pos[:k]
        xors[:k] = masks[:k]
        k2, stop2, s2, w2 = _scan(a, b, stop, positions, xors, k)
        assert k2 == total and stop2 == n
        s, w = s + s2, (w + w2) % MOD
    nbytes = n * a.dtype.itemsize
    return Found(positions, xors, int(s) % MOD, (nbytes * int(s) - int(w)) % MOD)


def sparse2_sections(positions: np.ndarray, masks: np.ndarray) -> list[memoryview]:
    """The decompressed ``xor-sparse2`` content of ``k >= 1`` changes (strictly increasing
    integer ``positions`` below ``2**32 - 1``, their non-zero unsigned ``masks``), with the
    writer's ``L`` (:func:`~deltastore.format.codecs.v2.choose_low_bits`), cut as
    ``[header + tokens, *low-bit planes, *escape planes, *mask planes]``: views of one
    buffer, the bytes of ``position_sections(positions, XOR_SPARSE2) +
    byte_planes(masks)``. Positions and masks are not checked (the kernel's are valid)."""
    k = int(positions.size)
    if k == 0 or masks.size != k:
        raise ValueError("sparse2_sections needs k >= 1 positions and as many masks")
    low_bits = choose_low_bits(k, int(positions[-1]) + 1)
    width = (low_bits + 7) // 8
    size = masks.dtype.itemsize
    out = _sparse2(positions, _unsigned(masks), low_bits)
    e = (out.size - SPARSE2_HEADER - k * (1 + width + size)) // 4
    view = out.data
    cuts = [SPARSE2_HEADER + k] + [k] * width + ([e] * 4 if e else []) + [k] * size
    sections = []
    at = 0
    for length in cuts:
        sections.append(view[at : at + length])
        at += length
    return sections


def pack_masks(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(low, at, high)`` of :class:`deltastore.publish.snapshot.PackedMasks` for unsigned
    ``masks``: the low bytes (uint8, one per mask), the indexes (uint32) of the masks with
    higher bits and those bits shifted right by 8 (the masks' dtype); None where that is not
    smaller than the masks (words of one byte, no mask), as ``PackedMasks.of`` decides. One
    pass to count, one to fill."""
    if masks.dtype.itemsize < 2 or not masks.size:
        return None
    packed, low, at, high = _pack(_unsigned(masks))
    return (low, at, high.view(masks.dtype)) if packed else None


def bitmap(positions: np.ndarray, n: int) -> np.ndarray:
    """The :func:`numpy.packbits` bitmap (big-endian bit order) of ``n`` elements with the
    bits of ``positions`` set."""
    out = np.zeros(-(-n // 8), dtype=np.uint8)
    _bitmap(positions, out)
    return out


def bitmap_positions(bits: np.ndarray, n: int, k: int) -> np.ndarray:
    """The uint32 positions of the ``k`` set bits of a :func:`numpy.packbits` bitmap of ``n``
    elements."""
    out = np.empty(k, dtype=np.uint32)
    got = int(_bitmap_positions(bits, n, out))
    if got != k:
        raise ValueError(f"the bitmap holds {got} set bits, not {k}")
    return out


def xor_scatter(
    words: np.ndarray,
    positions: np.ndarray,
    masks: np.ndarray | None = None,
    packed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> None:
    """XOR masks into ``words`` (1-D contiguous, writable, in place) at ``positions``
    (integers below its size, distinct): ``masks`` (words of ``words``'s size), or
    ``packed`` = ``(low, at, high)``: low bytes (uint8, one per position), the indexes of
    the masks with higher bits and those bits shifted right by 8 (words' size)."""
    if not words.flags.c_contiguous or words.ndim != 1:
        raise ValueError("words must be 1-D and contiguous")
    target = _unsigned(words)
    if packed is not None:
        low, at, high = packed
        _xor_at_packed(target, positions, low, at, _unsigned(high))
    elif masks is not None:
        _xor_at(target, positions, _unsigned(masks))


def warm() -> None:
    """Load (or, in a fresh environment, compile) the kernels for 2-byte words, the common
    case, so that the first frame does not wait for them: about 0.25 s from the on-disk
    cache, about 2 s to compile (measured on the development machine). Thread-safe; cheap
    after the first call."""
    old = np.zeros(200, dtype=np.uint16)
    new = old.copy()
    new[:20] = 1
    new[150] = 0x101  # one high part among low bytes: the masks pack
    found = find(old, new, Scratch())
    sparse2_sections(found.positions, found.masks)
    packed = pack_masks(found.masks)
    xor_scatter(old, found.positions, found.masks)
    xor_scatter(old, found.positions, packed=packed)
    bitmap_positions(bitmap(found.positions, old.size), old.size, found.positions.size)


__all__ = [
    "BLOCK",
    "SCRATCH_SHARE",
    "Found",
    "Scratch",
    "bitmap",
    "bitmap_positions",
    "find",
    "pack_masks",
    "sparse2_sections",
    "warm",
    "xor_scatter",
]
