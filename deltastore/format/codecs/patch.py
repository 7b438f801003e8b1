"""The delta codec ``xor-patch`` (format edition 4, written from deltastore 0.3.0).

A frame covers ``n = stop - start`` elements of ``s`` bytes each, handled as little-endian
unsigned words. An ``xor-patch`` frame holds ``k >= 1`` *entries*: strictly increasing
frame-local positions, each with an ``s``-byte word and a flag. Flag 0: the word is
``old XOR new`` and is never zero (the element changes). Flag 1: the word is the element's
absolute **new** word, which may equal the old one. A writer that does not know some old
words (the snapshot-free publisher, where its reconstruction of the previous version is not
certain) sends those elements as absolute entries and the others as XOR masks, in one frame.
Content (``w = ceil(L / 8)``, spec section 8.2.6)::

    <u32 k><u32 e><u8 L><3 zero bytes>      12-byte header, as xor-sparse2
    k bytes                                 tokens, as xor-sparse2
    w planes of k bytes                     gap & (2^L - 1), as xor-sparse2
    4 planes of e bytes                     escapes, as xor-sparse2
    ceil(k / 8) bytes                       flags: entry i is bit i % 8 of byte i // 8
                                            (least significant bit first); padding bits 0
    s planes of k bytes                     the words, least significant byte first

The positions are coded exactly as in ``xor-sparse2`` (the shared helpers of
:mod:`deltastore.format.codecs.v2`). A frame's manifest entry declares ``changed == k``.

Decoders check the declared content size against the bounds the manifest entry implies
(:func:`patch_bounds`) before anything is decompressed, then ``k == changed``, the exact
length, positions in range and strictly increasing, zero flag padding and non-zero XOR
words; :class:`~deltastore.errors.FrameError` otherwise. Vectorized numpy, O(k).

Thread-safety: the functions here are stateless; they use the caller's
:class:`~deltastore.format.codecs.v2.FrameEncoder2` / ``FrameDecoder2`` (one per thread).
"""

from __future__ import annotations

from typing import Final

import numpy as np

from deltastore.errors import FrameError
from deltastore.format.codecs.v2 import (
    BLOCKS_MIN_CHANGES,
    ESCAPE,
    MAX_SPARSE2_ELEMENTS,
    SPARSE2_HEADER,
    FrameDecoder2,
    FrameEncoder2,
    byte_planes,
    decode_positions,
    from_byte_planes,
    position_gaps,
    position_parts,
    read_header,
    sparse2_bounds,
    sparse2_possible,
    sparse2_size,
)

XOR_PATCH: Final = "xor-patch"


def flag_bytes(k: int) -> int:
    """Bytes of the flag section of ``k`` entries: ``ceil(k / 8)``."""
    return (k + 7) // 8


def patch_size(k: int, size: int, low_bits: int, escapes: int) -> int:
    """Decompressed size (bytes) of an ``xor-patch`` frame of ``k`` entries of ``size``-byte
    words, ``low_bits`` low bits per gap and ``escapes`` escaped tokens:
    ``12 + k * (1 + ceil(L / 8) + size) + 4 * e + ceil(k / 8)``."""
    return sparse2_size(k, size, low_bits, escapes) + flag_bytes(k)


def patch_bounds(n: int, size: int, changed: int) -> tuple[int, int]:
    """Smallest and largest content size (bytes) of a valid ``xor-patch`` frame of ``n``
    elements of ``size`` bytes and ``changed`` entries (spec section 8.3)."""
    lo, hi = sparse2_bounds(n, size, changed)
    return lo + flag_bytes(changed), hi + flag_bytes(changed)


def patch_bound(n: int, size: int) -> int:
    """Largest decompressed size (bytes) of an ``xor-patch`` frame of ``n`` elements of
    ``size`` bytes, whatever its ``changed``: ``12 + n * (5 + size) + 4 * floor(n / 255) +
    ceil(n / 8)``."""
    return SPARSE2_HEADER + n * (5 + size) + 4 * (n // ESCAPE) + flag_bytes(n)


def encode_patch(
    enc: FrameEncoder2, positions: np.ndarray, words: np.ndarray, absolute: np.ndarray
) -> bytes:
    """An ``xor-patch`` frame (one zstd frame) of ``k >= 1`` entries: ``positions`` (integers,
    strictly increasing, frame-local, each below 2^32 - 1), ``words`` (unsigned little-endian
    words of the dtype's size: XOR masks, or new words where ``absolute``) and ``absolute``
    (bool). :class:`ValueError` for arrays of different lengths, no entries, positions out of
    order or range, or a zero XOR mask."""
    k = int(positions.size)
    if words.ndim != 1 or words.size != k or absolute.size != k:
        raise ValueError("positions, words and absolute differ in length")
    if k == 0:
        raise ValueError("an xor-patch frame holds at least one entry")
    flags = np.asarray(absolute, dtype=np.bool_).reshape(-1)
    pos, gaps = position_gaps(positions, XOR_PATCH)
    if not (words.astype(np.bool_) | flags).all():
        raise ValueError("an xor-patch XOR entry (absolute False) needs a non-zero mask")
    header, parts = position_parts(pos, gaps)
    return enc.compress_parts(
        [
            header + parts[0],
            *parts[1:],
            np.packbits(flags, bitorder="little").tobytes(),
            *byte_planes(words),
        ],
        blocks=k >= BLOCKS_MIN_CHANGES,
    )


def decode_patch(
    dec: FrameDecoder2, data: bytes, n: int, size: int, changed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode a stored ``xor-patch`` frame of ``n`` elements of ``size`` bytes whose manifest
    entry declares ``changed`` entries: ``(positions, words, absolute)`` (int64 frame-local
    positions, strictly increasing; unsigned words; bool flags). :class:`FrameError` for a
    damaged or inconsistent frame (checks in the module docstring)."""
    if not 1 <= n <= MAX_SPARSE2_ELEMENTS or not 1 <= changed <= n:
        raise FrameError(
            f"an xor-patch frame covers 1 to 2^32 - 1 elements with 1 to as many entries "
            f"(n={n}, changed={changed})"
        )
    lo, hi = patch_bounds(n, size, changed)
    content = dec.content_size(data, lo, hi, XOR_PATCH)
    if not sparse2_possible(content - flag_bytes(changed), n, size, changed):
        raise FrameError(
            f"xor-patch zstd frame declares {content} content bytes, not a size an "
            f"xor-patch frame of {changed} entries can have"
        )
    raw = dec.decompress_exact(data, content, XOR_PATCH)
    k, e, low_bits = read_header(raw, n, XOR_PATCH)
    if k != changed or len(raw) != patch_size(k, size, low_bits, e):
        raise FrameError(
            f"xor-patch frame holds {k} entries in {len(raw)} bytes; "
            f"its manifest entry declares {changed}"
        )
    positions, offset = decode_positions(raw, n, k, e, low_bits, XOR_PATCH)
    packed = np.frombuffer(raw, dtype=np.uint8, count=flag_bytes(k), offset=offset)
    if k % 8 and int(packed[-1]) >> (k % 8):
        raise FrameError("xor-patch flag padding bits (after the last entry) are not zero")
    absolute = np.unpackbits(packed, count=k, bitorder="little").view(np.bool_)
    words = from_byte_planes(raw, offset + flag_bytes(k), k, size)
    if not (words.astype(np.bool_) | absolute).all():
        raise FrameError(
            "xor-patch frame holds a zero XOR mask (an XOR entry whose element did not change)"
        )
    return positions, words, absolute


__all__ = [
    "XOR_PATCH",
    "decode_patch",
    "encode_patch",
    "flag_bytes",
    "patch_bound",
    "patch_bounds",
    "patch_size",
]
