"""Block digests of published words, and checking a reconstruction of them.

A snapshot-free publisher keeps no copy of the words it published; it keeps one XXH3-64 per
*block* of each tensor's words instead (8 bytes per :data:`BLOCK` elements: 0.1% of the bf16
bytes) and checks every reconstructed block against it before encoding a delta on it. Blocks
tile each frame of the writer's frame grid from the frame's first element (a block never
straddles a frame or a chunk: chunks are whole multiples of :data:`BLOCK` from the frame's
start), so a tensor's digests are the concatenation of its frames' (:func:`block_offsets`).

A reconstructed block holds *certain* words (proven by the error bound) and a few uncertain
ones. Its best guess misses the digest whenever an uncertain word is wrong, so
:func:`resolve_block` tries the likely candidates of the uncertain words (``+0`` where the
bound touches zero, the best guess, the words at both ends of the bound) up to
:data:`MAX_TRIES` combinations; a match proves the whole block, certain words included (up to
XXH3-64 collisions). A block that does not match is not used as a parent: it is sent whole as
absolute words. Pure functions, thread-safe; words are ``<u2`` (or any unsigned words).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import xxhash

#: Elements per digest block (4 Ki: 8 bytes of digest per 8 KiB of bf16 words).
BLOCK = 4096
#: Most candidate combinations of a block's uncertain words tried against its digest.
MAX_TRIES = 1024


def block_count(n: int) -> int:
    """Blocks of a frame of ``n`` elements."""
    return -(-n // BLOCK)


def block_offsets(frames: Sequence[tuple[int, int]]) -> list[int]:
    """Index of each frame's first block in the tensor's digest array, plus the total."""
    out = [0]
    for a, b in frames:
        out.append(out[-1] + block_count(b - a))
    return out


def digest(words: np.ndarray) -> int:
    """XXH3-64 (seed 0) of the little-endian bytes of ``words`` (contiguous)."""
    return int(xxhash.xxh3_64_intdigest(np.ascontiguousarray(words).view(np.uint8).data))


def digest_blocks(words: np.ndarray) -> np.ndarray:
    """``uint64`` digests of the consecutive :data:`BLOCK`-element blocks of ``words`` (the
    last one may be shorter)."""
    n = words.size
    return np.fromiter(
        (digest(words[a : a + BLOCK]) for a in range(0, n, BLOCK)),
        dtype=np.uint64,
        count=block_count(n),
    )


def candidate_lists(
    best: np.ndarray, lo: np.ndarray, hi: np.ndarray, zero: np.ndarray
) -> list[list[int]]:
    """Per uncertain element, its candidate words, most likely first: ``+0`` where the bound
    touches zero (zero-initialised elements), the best guess, then both ends of the bound
    (duplicates dropped)."""
    out: list[list[int]] = []
    for b, lw, hw, z in zip(best.tolist(), lo.tolist(), hi.tolist(), zero.tolist(), strict=True):
        cands = [0, b, lw, hw] if z else [b, lw, hw]
        out.append(list(dict.fromkeys(cands)))
    return out


def resolve_block(
    guess: np.ndarray, uncertain: np.ndarray, candidates: list[list[int]], expected: int
) -> bool:
    """Whether some choice of ``candidates`` for the words at block-local ``uncertain``
    positions makes ``guess`` (the block's reconstructed words, changed in place while
    trying; restored to the best guess on return) hash to ``expected``. Tries at most
    :data:`MAX_TRIES` combinations: all of them when few enough, else the first candidate
    of the elements whose bound touches zero and every combination of the others."""
    saved = guess[uncertain].copy()
    try:
        sizes = [len(c) for c in candidates]
        if math.prod(sizes) <= MAX_TRIES:
            pools = candidates
        else:  # fix the elements with several candidates around zero to their first one
            pools = [c if len(c) <= 2 else c[:1] for c in candidates]
            if math.prod(len(c) for c in pools) > MAX_TRIES:
                pools = [c[:1] if len(c) > 2 or c[0] == 0 else c for c in candidates]
                if math.prod(len(c) for c in pools) > MAX_TRIES:
                    return False
        dtype = guess.dtype
        for combo in itertools.product(*pools):
            guess[uncertain] = np.asarray(combo, dtype=dtype)
            if digest(guess) == expected:
                return True
        return False
    finally:
        guess[uncertain] = saved


__all__ = [
    "BLOCK",
    "MAX_TRIES",
    "block_count",
    "block_offsets",
    "candidate_lists",
    "digest",
    "digest_blocks",
    "resolve_block",
]
