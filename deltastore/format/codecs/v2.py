"""Frame codecs written from deltastore 0.2.0: ``xor-sparse2`` and ``raw-planes``.

Both keep the rules for stored frames (``docs/spec/format-v1.md`` section 8.1: exactly one
zstd frame, content size in the header, no dictionary, window at most 2^27 bytes); their
decompressed layouts are specified in section 8.2 of the spec. Receivers reach them through
the one codec dispatch, ``deltastore.format.codecs.FrameDecoder``. A frame covers
``n = stop - start`` elements of ``s`` bytes each, handled as little-endian unsigned words.

``xor-sparse2``
    the changed elements of a delta frame, ``k`` of them, coded closer to their entropy than
    ``xor-sparse``: each gap (unchanged elements before a change) is split at a per-frame
    bit ``L`` (from the mean gap) into a one-byte *token* ``min(gap >> L, 255)``, which zstd's
    Huffman stage codes near its entropy, and its ``L`` low bits, which are near uniform (a
    Huffman code of ``2^L`` equally likely bytes costs exactly ``L`` bits), with a 32-bit
    escape for the rare tokens of 255; the XOR masks follow as ``s`` byte planes, as in
    ``xor-sparse``. Content (``w = ceil(L / 8)``)::

        <u32 k><u32 e><u8 L><3 zero bytes>      12-byte header
        k bytes                                 tokens
        w planes of k bytes                     gap & (2^L - 1), least significant byte first
        4 planes of e bytes                     (gap >> L) - 255 of each token 255, in order
        s planes of k bytes                     XOR masks, least significant byte first

``raw-planes``
    the ``n * s`` bytes of the new words as ``s`` byte planes of ``n`` bytes (plane ``j``:
    byte ``j`` of every word). For an anchor of bf16 the sign/exponent plane compresses to
    about a third of its size, the mantissa plane hardly at all: ~67% of the dense bytes
    where ``raw`` reaches ~78%.

The encoder starts a zstd block at every section and plane of a frame (from
:data:`BLOCKS_MIN_CHANGES` changes on), so each gets its own Huffman table, and compresses
with :data:`DEFAULT_PARAMS` (zstd's ``fast`` strategy, 128 KiB window, a 64-entry hash
table and 7-byte minimum matches): on planes of few distinct bytes the default levels find
many short random matches that cost more than the literals they replace. Readers are not
affected by either choice.

Decoders never allocate more than the frame's declared content size, which they check against
the bound the manifest implies before anything is decompressed; every decoded position is
checked against the frame's end and every mask against zero. Decoding is vectorized numpy,
O(changed) for ``xor-sparse2``.

Thread-safety: :class:`FrameEncoder2` and :class:`FrameDecoder2` hold zstd contexts and
reusable buffers; use one instance per thread.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any, Final

import numpy as np
import zstandard

from deltastore.errors import FrameError
from deltastore.format.codecs.zstdframe import (
    MAX_WINDOW_SIZE,
    content_size,
    one_shot,
)
from deltastore.format.dtypes import word_dtype

XOR_SPARSE2: Final = "xor-sparse2"
RAW_PLANES: Final = "raw-planes"
#: The codecs this module adds to format v1.
CODECS_V2: Final = (XOR_SPARSE2, RAW_PLANES)

SPARSE2_HEADER: Final = 12
#: Largest number of low bits ``L`` of an ``xor-sparse2`` gap.
MAX_LOW_BITS: Final = 31
#: Token value that says "the high part continues in the escape section".
ESCAPE: Final = 255
#: Largest ``n`` of an ``xor-sparse2`` frame (``k`` and gaps are 32-bit).
MAX_SPARSE2_ELEMENTS: Final = (1 << 32) - 1
#: The writer's ``L`` is ``floor(log2(mean gap + 1)) - LOW_BITS_BIAS`` (at least 0): tokens
#: then carry ~``LOW_BITS_BIAS + 2`` bits of entropy each and the low bits are near uniform.
LOW_BITS_BIAS: Final = 2
#: Fewest changes for which the encoder starts a zstd block per section: below, one block
#: (block headers and Huffman tables cost more than they save on small sections).
BLOCKS_MIN_CHANGES: Final = 256
#: Most changes for which ``FrameEncoder.encode_delta`` also tries the 0.1.0
#: ``xor-sparse`` (4 bytes less header; it wins on a handful of changes).
V1_MAX_CHANGES: Final = 64
#: Bytes per step when streaming planes in and out of zstd.
CHUNK_BYTES: Final = 1 << 20
#: Most gaps per step of :func:`position_sections` (an int64 buffer of 256 KiB); a step is
#: about 1/16 of the positions, from :data:`GAP_CHUNK_MIN` up.
GAP_CHUNK: Final = 1 << 15
GAP_CHUNK_MIN: Final = 1 << 12

_HEADER = struct.Struct("<IIB3s")

#: zstd parameters of :class:`FrameEncoder2` (see the module docstring); any zstd
#: parameters produce valid frames.
DEFAULT_PARAMS: Final = zstandard.ZstdCompressionParameters(
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstandard.STRATEGY_FAST,
    write_content_size=True,
    write_checksum=False,
    write_dict_id=False,
)


# --- sizes and bounds -------------------------------------------------------------------------


def sparse2_size(k: int, size: int, low_bits: int, escapes: int) -> int:
    """Decompressed size of an ``xor-sparse2`` frame: ``k`` changes of ``size``-byte words,
    ``low_bits`` low bits per gap (in ``ceil(low_bits / 8)`` byte planes) and ``escapes``
    escaped tokens."""
    return SPARSE2_HEADER + k * (1 + size + (low_bits + 7) // 8) + 4 * escapes


def max_escapes(n: int, changed: int) -> int:
    """Most escapes a valid ``xor-sparse2`` frame of ``n`` elements and ``changed`` changes
    can hold: an escaped gap is at least 255 and the gaps add up to at most ``n - changed``."""
    return max(0, min(changed, (n - changed) // ESCAPE))


def sparse2_bounds(n: int, size: int, changed: int) -> tuple[int, int]:
    """Smallest and largest content size of a valid ``xor-sparse2`` frame of ``n`` elements
    of ``size`` bytes and ``changed`` changes (``L`` from 0 to :data:`MAX_LOW_BITS`, from 0 to
    :func:`max_escapes` escapes)."""
    return (
        sparse2_size(changed, size, 0, 0),
        sparse2_size(changed, size, MAX_LOW_BITS, max_escapes(n, changed)),
    )


def sparse2_possible(content: int, n: int, size: int, changed: int) -> bool:
    """Whether ``content`` equals :func:`sparse2_size` for ``k = changed``, some ``L`` in
    0..31 and some escape count in 0..:func:`max_escapes` (what a reader checks before
    decompressing)."""
    rest = content - sparse2_size(changed, size, 0, 0)
    most = max_escapes(n, changed)
    for width in range(_low_width(MAX_LOW_BITS) + 1):
        left = rest - width * changed
        if left >= 0 and left % 4 == 0 and left // 4 <= most:
            return True
    return False


def choose_low_bits(k: int, span: int, bias: int = LOW_BITS_BIAS) -> int:
    """The writer's ``L`` for ``k`` changes spread over ``span`` elements (last position + 1):
    ``floor(log2(span / k)) - bias``, clamped to 0..:data:`MAX_LOW_BITS`."""
    if k <= 0:
        return 0
    return max(0, min(MAX_LOW_BITS, (span // k).bit_length() - 1 - bias))


def _low_width(low_bits: int) -> int:
    """Bytes that hold ``low_bits`` bits: ``ceil(low_bits / 8)``."""
    return (low_bits + 7) // 8


# --- byte planes ------------------------------------------------------------------------------


def byte_planes(words: np.ndarray) -> list[bytes]:
    """Byte planes of unsigned words: [all byte 0s, all byte 1s, ...] (plane by plane)."""
    size = words.dtype.itemsize
    src = np.ascontiguousarray(words).view(np.uint8).reshape(-1, size)
    return [src[:, j].tobytes() for j in range(size)]


def from_byte_planes(
    raw: bytes, offset: int, count: int, size: int, dtype: np.dtype[Any] | None = None
) -> np.ndarray:
    """Words from ``size`` byte planes of ``count`` bytes at ``offset``, as ``dtype``
    (default: unsigned words of ``size`` bytes; a wider dtype gets zero high bytes)."""
    planes = np.frombuffer(raw, dtype=np.uint8, count=count * size, offset=offset)
    dtype = word_dtype(size) if dtype is None else dtype
    out = np.empty(count, dtype=dtype)
    dst = out.view(np.uint8).reshape(count, dtype.itemsize)
    if dtype.itemsize > size:
        dst[:, size:] = 0
    for j in range(size):
        dst[:, j] = planes[j * count : (j + 1) * count]
    return out


def _low_planes(gaps: np.ndarray, low_bits: int) -> list[bytes]:
    """The first ``ceil(low_bits / 8)`` byte planes of ``gaps & (2^low_bits - 1)``."""
    width = _low_width(low_bits)
    if not width:
        return []
    low = np.empty(gaps.size, dtype=np.uint8 if width == 1 else word_dtype(2 if width == 2 else 4))
    np.bitwise_and(gaps, (1 << low_bits) - 1, out=low, casting="unsafe")  # each fits
    if width == 1:
        return [low.tobytes()]
    return byte_planes(low)[:width]


# --- the position coding (shared by ``xor-sparse2`` and ``xor-patch``) ----------------------


def position_gaps(positions: np.ndarray, codec: str) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, gaps)`` of a non-empty writer's position list (integers; ``positions``
    returned as given, ``gaps`` int64): ``gaps[i]`` is the number of elements skipped before
    position ``i``; :class:`ValueError` unless the positions are strictly increasing and in
    ``[0, 2^32 - 1)``. Allocates only ``gaps`` (no int64 copy of the positions)."""
    pos = positions if positions.dtype.kind in "iu" else positions.astype(np.int64)
    if int(pos[0]) < 0 or int(pos[-1]) >= MAX_SPARSE2_ELEMENTS:
        raise ValueError(f"{codec} positions must be in [0, 2^32 - 1)")
    gaps = np.empty(pos.size, dtype=np.int64)
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:], dtype=np.int64)
    gaps[1:] -= 1
    if int(gaps.min()) < 0:
        raise ValueError(f"{codec} needs strictly increasing positions")
    return pos, gaps


def position_parts(
    pos: np.ndarray, gaps: np.ndarray, low_bits: int | None = None
) -> tuple[bytes, list[bytes]]:
    """The 12-byte header ``<u32 k><u32 e><u8 L><3 zero bytes>`` and the sections that code
    ``k`` positions (from :func:`position_gaps`): ``[tokens, *low-bit planes, *escape
    planes]`` (spec section 8.2.4). ``low_bits`` overrides the writer's ``L``
    (:func:`choose_low_bits`); :class:`ValueError` outside 0..:data:`MAX_LOW_BITS`."""
    k = int(pos.size)
    if low_bits is None:
        low_bits = choose_low_bits(k, int(pos[-1]) + 1)
    if not 0 <= low_bits <= MAX_LOW_BITS:
        raise ValueError(f"low_bits must be in 0..{MAX_LOW_BITS}")
    high = gaps >> low_bits if low_bits else gaps  # no copy when L is 0 (dense changes)
    tokens = np.empty(k, dtype=np.uint8)
    np.minimum(high, ESCAPE, out=tokens, casting="unsafe")  # each fits: no int64 temporary
    escaped = high[tokens == ESCAPE]
    escaped -= ESCAPE
    header = _HEADER.pack(k, int(escaped.size), low_bits, b"\0\0\0")
    return header, [
        tokens.tobytes(),
        *_low_planes(gaps, low_bits),
        *(byte_planes(escaped.astype("<u4")) if escaped.size else []),
    ]


def position_sections(
    positions: np.ndarray, codec: str, low_bits: int | None = None
) -> list[bytes | memoryview]:
    """What :func:`position_gaps` then :func:`position_parts` make of ``positions``, with the
    header joined to the tokens: ``[header + tokens, *low-bit planes, *escape planes]``, the
    same bytes and the same :class:`ValueError` s. The gaps are made about 1/16 of the
    positions at a time (:data:`GAP_CHUNK_MIN` to :data:`GAP_CHUNK`), never an int64 array of
    every gap: beside its output (about ``1 + ceil(L / 8)`` bytes per position) it allocates
    at most about a MiB, whatever the number of positions."""
    k = int(positions.size)
    if int(positions[0]) < 0 or int(positions[-1]) >= MAX_SPARSE2_ELEMENTS:
        raise ValueError(f"{codec} positions must be in [0, 2^32 - 1)")
    if low_bits is None:
        low_bits = choose_low_bits(k, int(positions[-1]) + 1)
    if not 0 <= low_bits <= MAX_LOW_BITS:
        raise ValueError(f"low_bits must be in 0..{MAX_LOW_BITS}")
    width = _low_width(low_bits)
    first = np.empty(SPARSE2_HEADER + k, dtype=np.uint8)  # the header, then the tokens
    tokens = first[SPARSE2_HEADER:]
    low = (
        np.empty(k, dtype=np.uint8 if width == 1 else word_dtype(2 if width == 2 else 4))
        if width
        else None
    )
    escaped: list[np.ndarray] = []
    step = min(GAP_CHUNK, max(GAP_CHUNK_MIN, k // 16))
    gaps = np.empty(min(k, step), dtype=np.int64)
    prev = -1
    for a in range(0, k, step):
        pos = positions[a : a + step]
        g = gaps[: pos.size]
        g[0] = int(pos[0]) - prev
        np.subtract(pos[1:], pos[:-1], out=g[1:], dtype=np.int64)
        g -= 1
        if int(g.min()) < 0:
            raise ValueError(f"{codec} needs strictly increasing positions")
        prev = int(pos[-1])
        if low is not None:
            np.bitwise_and(g, (1 << low_bits) - 1, out=low[a : a + pos.size], casting="unsafe")
        if low_bits:
            g >>= low_bits
        t = tokens[a : a + pos.size]
        np.minimum(g, ESCAPE, out=t, casting="unsafe")
        high = g[t == ESCAPE]
        if high.size:
            high -= ESCAPE
            escaped.append(high.astype("<u4"))
    esc = np.concatenate(escaped) if escaped else np.empty(0, dtype="<u4")
    first[:SPARSE2_HEADER] = np.frombuffer(
        _HEADER.pack(k, int(esc.size), low_bits, b"\0\0\0"), dtype=np.uint8
    )
    planes: list[bytes | memoryview] = []
    if low is not None:
        planes += [low.tobytes()] if width == 1 else byte_planes(low)[:width]
    return [first.data, *planes, *(byte_planes(esc) if esc.size else [])]


def read_header(raw: bytes, n: int, codec: str) -> tuple[int, int, int]:
    """``(k, e, L)`` of the 12-byte header at the start of a decompressed ``xor-sparse2`` or
    ``xor-patch`` frame of ``n`` elements; :class:`FrameError` for non-zero reserved bytes,
    ``L`` above :data:`MAX_LOW_BITS` or more escapes than :func:`max_escapes` allows."""
    k, e, low_bits, reserved = _HEADER.unpack_from(raw, 0)
    if reserved != b"\0\0\0" or low_bits > MAX_LOW_BITS or e > max_escapes(n, k):
        raise FrameError(
            f"{codec} header is invalid (L={low_bits}, {e} escapes of {k} changes, "
            f"reserved {reserved.hex()})"
        )
    return int(k), int(e), int(low_bits)


def decode_positions(
    raw: bytes, n: int, k: int, e: int, low_bits: int, codec: str
) -> tuple[np.ndarray, int]:
    """The ``k >= 1`` positions (int64, strictly increasing, each below ``n``) coded after the
    header of a decompressed frame whose length was checked, and the offset of the first byte
    after their sections; :class:`FrameError` for a low part wider than ``L`` bits, escape
    tokens that disagree with ``e``, or a position past the frame's end. O(k), vectorized."""
    tokens = np.frombuffer(raw, dtype=np.uint8, count=k, offset=SPARSE2_HEADER)
    offset = SPARSE2_HEADER + k
    width = _low_width(low_bits)
    low = from_byte_planes(raw, offset, k, width, np.dtype("<u4")) if width > 1 else None
    if width == 1:
        low = np.frombuffer(raw, dtype=np.uint8, count=k, offset=offset)
    offset += width * k
    if low is not None and int(low.max()) >> low_bits:
        raise FrameError(f"{codec} low part does not fit its {low_bits} bits")
    shift = np.uint64(low_bits)
    if e:
        at = np.flatnonzero(tokens == ESCAPE)
        if at.size != e:
            raise FrameError(f"{codec} frame has {at.size} escape tokens and {e} escapes")
        gaps = tokens.astype(np.uint64)  # the high parts first
        gaps[at] += from_byte_planes(raw, offset, e, 4)
        top = int(gaps.max())
        if top <= (n - 1) >> low_bits:
            gaps <<= shift
    else:
        top = int(tokens.max())
        if top == ESCAPE:
            raise FrameError(f"{codec} frame has escape tokens and no escapes")
        gaps = np.left_shift(tokens, shift, dtype=np.uint64)
    offset += 4 * e
    if top > (n - 1) >> low_bits:
        raise FrameError(f"{codec} gap points past the end of the frame")
    if low is not None:
        gaps |= low
    # every gap is below (top + 1) << L; if k of them could wrap a 64-bit sum (only for
    # billions of changes in one frame), check each gap against the frame first
    if k * ((top + 1) << low_bits) >= 1 << 64 and int(gaps.max()) >= n:
        raise FrameError(f"{codec} gap points past the end of the frame")
    # positions: pos[0] = gap[0], pos[i] = pos[i - 1] + 1 + gap[i]
    gaps += np.uint64(1)
    gaps[0] -= np.uint64(1)
    positions = np.cumsum(gaps, out=gaps)
    if int(positions[-1]) >= n:
        raise FrameError(f"{codec} position {int(positions[-1])} is past the frame's {n} elements")
    return positions.view(np.int64), offset


# --- zstd frames ------------------------------------------------------------------------------


class FrameEncoder2:
    """Encodes ``xor-sparse2``, ``raw-planes`` and ``xor-dense`` frames (the choice among
    codecs is ``deltastore.format.codecs.FrameEncoder.encode_delta``). Not thread-safe.

    ``level`` None (default) compresses with :data:`DEFAULT_PARAMS`; an integer uses that
    zstd level instead (content size always in the header).
    """

    def __init__(self, level: int | None = None) -> None:
        if level is None:
            self._cctx = zstandard.ZstdCompressor(compression_params=DEFAULT_PARAMS)
        else:
            self._cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)

    def compress_parts(self, parts: Sequence[bytes | memoryview], *, blocks: bool = True) -> bytes:
        """One zstd frame of the concatenated parts; with ``blocks``, each part starts a new
        zstd block (its own Huffman table). Shared with ``xor-patch``."""
        if not blocks:
            return one_shot(self._cctx, b"".join(parts))
        parts = [part for part in parts if len(part)]
        obj = self._cctx.compressobj(size=sum(len(part) for part in parts))
        out: list[bytes] = []
        for i, part in enumerate(parts):
            out.append(obj.compress(part))
            if i + 1 < len(parts):
                out.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        out.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
        return b"".join(out)

    def xor_sparse2(
        self, positions: np.ndarray, masks: np.ndarray, *, low_bits: int | None = None
    ) -> bytes:
        """``xor-sparse2`` frame of strictly increasing frame-local ``positions`` (integers,
        each below 2^32 - 1) and their non-zero XOR ``masks`` (unsigned words of the dtype's
        size); :class:`ValueError` otherwise. ``low_bits`` overrides the writer's choice of
        ``L`` (:func:`choose_low_bits`)."""
        k = int(positions.size)
        if masks.size != k:
            raise ValueError("positions and masks differ in length")
        if k == 0:
            return self.compress_parts([_HEADER.pack(0, 0, 0, b"\0\0\0")], blocks=False)
        parts = position_sections(positions, XOR_SPARSE2, low_bits)
        if not masks.all():
            raise ValueError("xor-sparse2 needs strictly increasing positions, non-zero masks")
        return self.xor_sparse2_sections([*parts, *byte_planes(masks)], k)

    def xor_sparse2_sections(self, sections: Sequence[bytes | memoryview], k: int) -> bytes:
        """:meth:`xor_sparse2` of ``k >= 1`` changes from their content already cut into
        ``[header + tokens, *low-bit planes, *escape planes, *mask planes]`` (not checked;
        ``deltastore.kernels.detect.sparse2_sections`` makes them)."""
        return self.compress_parts(sections, blocks=k >= BLOCKS_MIN_CHANGES)

    def raw_planes(self, new: np.ndarray) -> bytes:
        """``raw-planes`` frame of the new words (1-D unsigned words), streamed plane by
        plane (no full-size copy)."""
        size = new.dtype.itemsize
        n = int(new.size)
        src = np.ascontiguousarray(new).view(np.uint8).reshape(n, size)
        obj = self._cctx.compressobj(size=n * size)
        out: list[bytes] = []
        for j in range(size):
            for a in range(0, n, CHUNK_BYTES):
                out.append(obj.compress(np.ascontiguousarray(src[a : a + CHUNK_BYTES, j]).data))
            if n and j + 1 < size:
                out.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        out.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
        return b"".join(out)

    def xor_dense(self, xor: np.ndarray) -> bytes:
        """Format v1 ``xor-dense`` frame of the full XOR words."""
        return one_shot(self._cctx, np.ascontiguousarray(xor).view(np.uint8).data)


class FrameDecoder2:
    """Decodes ``xor-sparse2`` and ``raw-planes`` frames. Not thread-safe: one per thread."""

    def __init__(self, *, max_window_size: int = MAX_WINDOW_SIZE) -> None:
        self._max_window = max_window_size
        self._dctx = zstandard.ZstdDecompressor(max_window_size=max_window_size)
        self._chunk = np.empty(-(-CHUNK_BYTES // 8) * 8, dtype=np.uint8)

    def content_size(self, data: bytes | memoryview, lo: int, hi: int, codec: str) -> int:
        """The frame's declared content size, after the checks of spec sections 8.1 and 8.3
        against the content bounds ``[lo, hi]`` its manifest entry implies (before anything is
        decompressed); :class:`FrameError` otherwise."""
        return content_size(data, lo, hi, self._max_window, codec)

    def sparse2(
        self, data: bytes, n: int, size: int, changed: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Decode ``xor-sparse2``: (frame-local int64 positions, unsigned XOR masks)."""
        raw, k, e, low_bits = self.sparse2_content(data, n, size, changed)
        if k == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=word_dtype(size))
        positions, offset = decode_positions(raw, n, k, e, low_bits, XOR_SPARSE2)
        masks = from_byte_planes(raw, offset, k, size)
        if not masks.all():
            raise FrameError("xor-sparse2 frame holds a zero mask (an element that did not change)")
        return positions, masks

    def sparse2_content(
        self, data: bytes, n: int, size: int, changed: int
    ) -> tuple[bytes, int, int, int]:
        """The decompressed content of an ``xor-sparse2`` frame and its header's ``(k, e, L)``,
        checked as far as it goes without decoding: ``n`` and ``changed`` in range, the
        declared content size possible for them (before anything is decompressed), the
        header, ``k == changed`` and the content's exact length; :class:`FrameError`
        otherwise. The positions and masks are still to be checked by whoever decodes them."""
        content = self.sparse2_precheck(data, n, size, changed)
        raw = self.decompress_exact(data, content, XOR_SPARSE2)
        k, e, low_bits = read_header(raw, n, XOR_SPARSE2)
        if k != changed or len(raw) != sparse2_size(k, size, low_bits, e):
            raise FrameError(
                f"xor-sparse2 frame holds {k} changes in {len(raw)} bytes; "
                f"its manifest entry declares {changed}"
            )
        return raw, k, e, low_bits

    def sparse2_precheck(self, data: bytes | memoryview, n: int, size: int, changed: int) -> int:
        """The declared content size of a stored ``xor-sparse2`` frame, after every check of
        :meth:`sparse2_content` that needs only its zstd frame header (``n`` and ``changed``
        in range, the size within the frame's bounds and possible for ``changed`` changes,
        no dictionary, the window limit, exactly one zstd frame); :class:`FrameError`
        otherwise. Nothing is decompressed."""
        if not 1 <= n <= MAX_SPARSE2_ELEMENTS or not 0 <= changed <= n:
            raise FrameError(
                f"an xor-sparse2 frame covers 1 to 2^32 - 1 elements with at most as many "
                f"changes (n={n}, changed={changed})"
            )
        lo, hi = sparse2_bounds(n, size, changed)
        content = self.content_size(data, lo, hi, XOR_SPARSE2)
        if not sparse2_possible(content, n, size, changed):
            raise FrameError(
                f"xor-sparse2 zstd frame declares {content} content bytes, not a size an "
                f"xor-sparse2 frame of {changed} changes can have"
            )
        return content

    def decompress_exact(self, data: bytes, content: int, codec: str) -> bytes:
        """The content of a frame whose declared ``content`` size was checked (by
        :meth:`content_size`), exactly that long; :class:`FrameError` otherwise."""
        try:
            raw = self._dctx.decompress(data)
        except zstandard.ZstdError as exc:
            raise FrameError(f"{codec} frame does not decompress ({exc})") from None
        if len(raw) != content:
            raise FrameError(f"{codec} frame holds {len(raw)} bytes, not {content}")
        return raw

    def planes_into(self, data: bytes, out: np.ndarray) -> None:
        """Decode a ``raw-planes`` frame into ``out`` (contiguous unsigned words, exactly the
        frame's elements), streaming plane by plane through a 1 MiB buffer."""
        if not out.flags.c_contiguous:
            raise ValueError("out must be contiguous")
        size = out.dtype.itemsize
        n = int(out.size)
        dst = out.reshape(-1).view(np.uint8).reshape(n, size)
        self.content_size(data, n * size, n * size, RAW_PLANES)
        try:
            with self._dctx.stream_reader(data, read_across_frames=False) as reader:
                for j in range(size):
                    for a in range(0, n, CHUNK_BYTES):
                        m = min(CHUNK_BYTES, n - a)
                        self._read_full(reader, self._chunk.data[:m])
                        dst[a : a + m, j] = self._chunk[:m]
                if reader.read(1):  # also makes zstd check the frame's end and checksum
                    raise FrameError("raw-planes frame holds more than its declared content")
        except zstandard.ZstdError as exc:
            raise FrameError(f"raw-planes frame does not decompress ({exc})") from None

    def planes_chunks(self, data: bytes, n: int, size: int) -> Iterator[tuple[int, np.ndarray]]:
        """Decode a ``raw-planes`` frame as ``(first_element, words)`` chunks of at most 1 MiB
        (in element order). The whole content (``n * size`` bytes, its declared size) is
        decompressed first; each yielded array is a view of a reused buffer, valid until the
        next step."""
        self.content_size(data, n * size, n * size, RAW_PLANES)
        try:
            raw = self._dctx.decompress(data)
        except zstandard.ZstdError as exc:
            raise FrameError(f"raw-planes frame does not decompress ({exc})") from None
        if len(raw) != n * size:
            raise FrameError(f"raw-planes frame holds {len(raw)} bytes, not {n * size}")
        planes = np.frombuffer(raw, dtype=np.uint8).reshape(size, n)
        step = max(1, min(CHUNK_BYTES, self._chunk.size) // size)
        words = self._chunk.view(word_dtype(size))
        for first in range(0, n, step):
            m = min(step, n - first)
            dst = self._chunk[: m * size].reshape(m, size)
            for j in range(size):
                dst[:, j] = planes[j, first : first + m]
            yield first, words[:m]

    @staticmethod
    def _read_full(reader: zstandard.ZstdDecompressionReader, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            got = reader.readinto(view[done:])
            if not got:
                raise FrameError(
                    f"frame ended after {done} of {view.nbytes} bytes (truncated frame)"
                )
            done += got


__all__ = [
    "BLOCKS_MIN_CHANGES",
    "CODECS_V2",
    "DEFAULT_PARAMS",
    "ESCAPE",
    "LOW_BITS_BIAS",
    "MAX_LOW_BITS",
    "MAX_SPARSE2_ELEMENTS",
    "RAW_PLANES",
    "SPARSE2_HEADER",
    "V1_MAX_CHANGES",
    "XOR_SPARSE2",
    "FrameDecoder2",
    "FrameEncoder2",
    "byte_planes",
    "choose_low_bits",
    "decode_positions",
    "from_byte_planes",
    "max_escapes",
    "position_gaps",
    "position_parts",
    "read_header",
    "sparse2_bounds",
    "sparse2_possible",
    "sparse2_size",
]
