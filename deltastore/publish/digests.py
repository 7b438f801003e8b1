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
bound touches zero, the best guess, then the words within the bound nearest to it first) up
to :data:`MAX_TRIES` combinations; a match proves the whole block, certain words included
(up to XXH3-64 collisions), and leaves the matching words in place. A block that does not
match is not used as a parent: it is sent whole as absolute words. Pure functions,
thread-safe; words are ``<u2`` (or any unsigned words).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

#: Elements per digest block (4 Ki: 8 bytes of digest per 8 KiB of bf16 words).
BLOCK = 4096
#: Most candidate combinations of a block's uncertain words tried against its digest.
MAX_TRIES = 1024
#: Most candidate words of one uncertain element: as many as a block may try, so a lone
#: uncertain element whose bound spans many words (an update that cancels the weight: the
#: bound straddles zero across dozens of binades) is resolved by walking out from the guess.
MAX_CANDIDATES = MAX_TRIES
#: Most combinations tried in all the blocks of one chunk: a reconstruction that is wrong
#: everywhere (a wrong lr) costs a bounded time, its blocks are sent whole. Normal runs use a
#: few per block that misses its best guess (measured: at most 7).
CHUNK_TRIES = 4 * MAX_TRIES


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
    data = np.ascontiguousarray(words).view(np.uint8).data
    step = BLOCK * words.dtype.itemsize
    hash64 = xxhash.xxh3_64_intdigest
    return np.fromiter(
        (hash64(data[a : a + step]) for a in range(0, len(data), step)),
        dtype=np.uint64,
        count=block_count(words.size),
    )


def _key(word: int) -> int:
    """A bf16 word's rank in value order (``-0`` just below ``+0``; NaN words not handled)."""
    return word if word < 0x8000 else 0x7FFF - word


def _word(key: int) -> int:
    return key if key >= 0 else 0x7FFF - key


def candidate_lists(
    best: np.ndarray, lo: np.ndarray, hi: np.ndarray, zero: np.ndarray
) -> list[list[int]]:
    """Per uncertain element, its candidate words, most likely first: ``+0`` where the bound
    touches zero (zero-initialised elements), the best guess, then the words between the two
    ends of the bound (``lo``, ``hi``: the true word lies between them in value) nearest to
    the best guess first, at most :data:`MAX_CANDIDATES` in all (fewer for many elements:
    no more than :data:`MAX_TRIES` combinations are tried)."""
    out: list[list[int]] = []
    # ranks beyond what MAX_TRIES combinations of this many elements reach are never tried
    cap = max(2, min(MAX_CANDIDATES, MAX_TRIES // max(1, best.size) + 1))
    for b, lw, hw, z in zip(best.tolist(), lo.tolist(), hi.tolist(), zero.tolist(), strict=True):
        cands = [0, b] if z else [b]
        if all((w & 0x7F80) != 0x7F80 for w in (b, lw, hw)):  # no NaN or infinity
            kb, k1, k2 = _key(b), _key(lw), _key(hw)
            low, high = min(k1, k2, kb), max(k1, k2, kb)
            for step in range(1, cap):
                if len(cands) >= cap or (kb - step < low and kb + step > high):
                    break
                cands += [_word(k) for k in (kb - step, kb + step) if low <= k <= high]
        out.append(list(dict.fromkeys(cands))[:cap])
    return out


def _by_distance(sizes: Sequence[int]) -> Iterator[dict[int, int]]:
    """Every choice of candidate ranks (``0 <= r[i] < sizes[i]``) as ``{i: r[i]}`` for the
    non-zero ranks, by increasing sum of ranks: the most likely words first, then one word
    off by one, and so on."""
    k = len(sizes)
    for total in range(sum(sizes) - k + 1):
        for picks in itertools.combinations_with_replacement(range(k), total):
            ranks: dict[int, int] = {}
            for i in picks:
                ranks[i] = ranks.get(i, 0) + 1
            if all(r < sizes[i] for i, r in ranks.items()):
                yield ranks


def resolve_block(
    guess: np.ndarray,
    uncertain: np.ndarray,
    candidates: list[list[int]],
    expected: int,
    max_tries: int = MAX_TRIES,
) -> bool:
    """Whether some choice of ``candidates`` for the words at block-local ``uncertain``
    positions makes ``guess`` (the block's reconstructed words, changed in place) hash to
    ``expected``. On a match ``guess`` keeps the matching words (the block's published words,
    proven by the digest); otherwise it is restored to the best guess. Tries at most
    ``max_tries`` combinations, nearest to the most likely words first (by the sum of the
    candidates' ranks)."""
    saved = guess[uncertain].copy()
    base = np.asarray([c[0] for c in candidates], dtype=guess.dtype)
    for tries, ranks in enumerate(_by_distance([len(c) for c in candidates])):
        if tries >= max_tries:
            break
        words = base.copy()
        for i, r in ranks.items():
            words[i] = candidates[i][r]
        guess[uncertain] = words
        if digest(guess) == expected:
            return True
    guess[uncertain] = saved
    return False


__all__ = [
    "BLOCK",
    "CHUNK_TRIES",
    "MAX_CANDIDATES",
    "MAX_TRIES",
    "block_count",
    "block_offsets",
    "candidate_lists",
    "digest",
    "digest_blocks",
    "resolve_block",
]
