"""The memory floor's kernel: one read-modify-write pass that XORs masks into words at sorted
positions (benchmarks/README.md, Floors).

What the bench times as the least memory work a receiver of XOR deltas does per change: read
the word, XOR its mask, write it back; no decode, no checksum, no bounds check in the loop.
Words and masks are unsigned or signed integers of the same dtype (the bench passes bf16
words as ``uint16``, the masks ``old ^ new`` in native byte order, i.e. little-endian words
on the machines deltastore runs on); positions are element indices, ``int32`` or ``int64``,
ascending (sorted positions walk memory forward; unsorted ones are correct but not the
floor). Each (words, positions) dtype pair is compiled on its first use and cached on disk
(``cache=True``).

The kernel runs with the GIL released (``nogil=True``): threads may run it at once on
disjoint words (different tensors); two threads writing the same words race. Call order:
:func:`check` (O(n), raises on bad input) once, then :func:`xor_at_unchecked` as often as
timed; :func:`xor_at` does both.
"""

from __future__ import annotations

import numba  # type: ignore[import-untyped, unused-ignore]
import numpy as np

#: Position dtypes the kernel takes.
POSITION_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


@numba.njit(nogil=True, cache=True)  # type: ignore[untyped-decorator, unused-ignore]
def _xor_at(words: np.ndarray, positions: np.ndarray, masks: np.ndarray) -> None:
    for i in range(positions.size):
        p = positions[i]
        words[p] ^= masks[i]


def check(words: np.ndarray, positions: np.ndarray, masks: np.ndarray) -> None:
    """Raise :class:`ValueError` unless the arguments suit the kernel: 1-D C-contiguous
    ``words`` of an integer dtype (writable), ``masks`` of the same dtype and as many as
    ``positions`` (``int32`` or ``int64``), every position in ``[0, words.size)``. Sortedness
    is not checked (it changes the speed, not the result)."""
    if words.ndim != 1 or positions.ndim != 1 or masks.ndim != 1:
        raise ValueError("words, positions and masks must be 1-D")
    if words.dtype.kind not in "ui" or masks.dtype != words.dtype:
        raise ValueError(
            f"words and masks must share an integer dtype: {words.dtype}, {masks.dtype}"
        )
    if positions.dtype not in POSITION_DTYPES:
        raise ValueError(f"positions must be int32 or int64, not {positions.dtype}")
    if positions.size != masks.size:
        raise ValueError(f"{positions.size} positions and {masks.size} masks")
    if not (words.flags.c_contiguous and words.flags.writeable):
        raise ValueError("words must be C-contiguous and writable")
    if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= words.size):
        raise ValueError(f"a position is outside [0, {words.size})")


def xor_at_unchecked(words: np.ndarray, positions: np.ndarray, masks: np.ndarray) -> None:
    """``words[positions] ^= masks`` in one native pass, the GIL released; the caller has
    passed the same arrays through :func:`check` (an out-of-range position writes outside
    ``words``). Positions should be distinct: a repeated position is XORed once per
    occurrence (numpy's fancy ``^=`` would apply only one of them)."""
    _xor_at(words, positions, masks)


def xor_at(words: np.ndarray, positions: np.ndarray, masks: np.ndarray) -> None:
    """:func:`check`, then :func:`xor_at_unchecked`."""
    check(words, positions, masks)
    _xor_at(words, positions, masks)
