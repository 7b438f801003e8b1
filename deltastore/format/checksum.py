"""Adler-32 (zlib-compatible) over little-endian tensor bytes: full, combined, incremental.

All functions are pure and thread-safe. Byte positions are 0-based offsets into the buffer the
checksum covers; element positions are converted with the element size (little-endian words).

Incremental update (docs/spec/format-v1.md, section 7.1; worked example in 7.2): when the byte
at position ``p`` of an ``n``-byte buffer changes by ``d = new - old``, ``A += d`` and
``B += (n - p) * d`` (mod 65521). Done vectorized with int64 and ``(n - p)`` reduced mod 65521
before multiplying, so nothing overflows.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import numpy as np

MOD = 65521


def adler32(buf: np.ndarray | bytes | memoryview, value: int = 1) -> int:
    """zlib Adler-32 of the bytes of ``buf`` (C order), continuing from ``value``."""
    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8).data
    return zlib.adler32(buf, value) & 0xFFFFFFFF


def combine(adler1: int, adler2: int, len2: int) -> int:
    """Adler-32 of ``x + y`` from ``adler32(x)``, ``adler32(y)`` and ``len(y)`` in bytes."""
    a1, b1 = adler1 & 0xFFFF, adler1 >> 16
    a2, b2 = adler2 & 0xFFFF, adler2 >> 16
    rem = len2 % MOD
    a = (a1 + a2 - 1) % MOD
    b = (b1 + b2 + rem * a1 - rem) % MOD
    return (b << 16) | a


def combine_frames(parts: Iterable[tuple[int, int]]) -> int:
    """Adler-32 of consecutive buffers joined in order, from each one's ``(adler32, nbytes)``
    (e.g. a tensor's frames, or writers' slices of it, in element order); 1, the Adler-32 of
    no bytes, when there are none. O(number of parts): no byte is read."""
    total = 1
    for adler, nbytes in parts:
        total = combine(total, adler, nbytes)
    return total


def delta_sums(
    positions: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    n_bytes: int,
    weights: np.ndarray | None = None,
) -> tuple[int, int]:
    """Return ``(dA, dB)`` (mod 65521) for words changing from ``old`` to ``new``.

    ``positions`` are element indices (int64) of the changed words inside a buffer of
    ``n_bytes`` bytes; ``old`` and ``new`` are same-length unsigned word arrays. ``weights``
    (int64, each in ``[0, 65521)``) multiplies each word's contribution (a receiver holding
    ``k`` copies of an element weighs each by the inverse of ``k``). Cost is O(len(positions)).
    """
    if positions.size == 0:
        return 0, 0
    size = old.dtype.itemsize
    ob = old.view(np.uint8).reshape(-1, size)
    nb = new.view(np.uint8).reshape(-1, size)
    # Per word: d = sum_j d_j; byte j sits at p = e*size + j, so
    # sum_j (n - p) * d_j = (n - e*size) * d - sum_j j * d_j.
    d = np.zeros(positions.size, dtype=np.int64)
    jd = np.zeros(positions.size, dtype=np.int64) if weights is not None else None
    j_weighted = 0
    for j in range(size):
        dj = nb[:, j].astype(np.int64)
        dj -= ob[:, j]
        d += dj
        if j and jd is not None:
            jd += j * dj
        elif j:
            j_weighted += j * int(dj.sum())
    if weights is not None and jd is not None:
        d *= weights
        d %= MOD
        jd *= weights
        j_weighted = int((jd % MOD).sum())
    elif n_bytes * 255 * size * positions.size < 1 << 62:  # no int64 overflow: skip the mods
        total = int(d.sum())
        pd = int(np.dot(positions.astype(np.int64, copy=False), d))
        return total % MOD, (n_bytes * total - size * pd - j_weighted) % MOD
    weight = positions.astype(np.int64) * size
    np.subtract(n_bytes, weight, out=weight)
    weight %= MOD
    return int(d.sum()) % MOD, (int(np.dot(weight, d)) - j_weighted) % MOD


#: ``INVERSE[k]``: the inverse of ``k`` modulo 65521 (k in 1..255), for weighting copies.
INVERSE = np.array([0] + [pow(k, MOD - 2, MOD) for k in range(1, 256)], dtype=np.int64)


def apply_delta(adler: int, da: int, db: int) -> int:
    """Adler-32 after adding the sums from :func:`delta_sums` to ``adler``."""
    a = ((adler & 0xFFFF) + da) % MOD
    b = ((adler >> 16) + db) % MOD
    return (b << 16) | a


def shift_to_outer(
    da: int, db: int, inner_bytes: int, inner_offset: int, outer_bytes: int
) -> tuple[int, int]:
    """Convert frame-level sums to the sums of the enclosing tensor buffer.

    A frame of ``inner_bytes`` bytes starting ``inner_offset`` bytes into an ``outer_bytes``-byte
    tensor: ``dB_outer = dB_inner + (outer - offset - inner) * dA``.
    """
    shift = (outer_bytes - inner_offset - inner_bytes) % MOD
    return da, (db + shift * da) % MOD
