"""The memory floor's kernel (deltastore.kernels.floor) against numpy bit for bit: random
sorted positions of either dtype, words of every integer width, empty inputs, repeated
positions, and the checks that keep it inside its words."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.kernels import floor

WORD_DTYPES = [np.uint16, np.int16, np.uint8, np.uint32, np.uint64, np.int64]


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 3000),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
    word=st.sampled_from(WORD_DTYPES),
    pos=st.sampled_from([np.int32, np.int64]),
)
def test_xor_at_equals_numpy(size: int, density: float, seed: int, word: type, pos: type) -> None:
    rng = np.random.default_rng(seed)
    info = np.iinfo(word)
    words = rng.integers(info.min, info.max, size, dtype=word, endpoint=True)
    positions = np.flatnonzero(rng.random(size) < density).astype(pos)
    masks = rng.integers(info.min, info.max, positions.size, dtype=word, endpoint=True)
    want = words.copy()
    want[positions] ^= masks
    floor.xor_at(words, positions, masks)
    assert words.dtype == want.dtype and words.tobytes() == want.tobytes()


def test_empty_and_repeated_positions() -> None:
    words = np.arange(10, dtype=np.uint16)
    before = words.copy()
    floor.xor_at(words, np.empty(0, np.int64), np.empty(0, np.uint16))
    floor.xor_at(np.empty(0, np.uint16), np.empty(0, np.int32), np.empty(0, np.uint16))
    assert words.tobytes() == before.tobytes()
    # a repeated position is XORed once per occurrence, as np.bitwise_xor.at does
    positions = np.array([1, 1, 4, 4, 4], np.int64)
    masks = np.array([0x8001, 0x0100, 3, 5, 0xFFFF], np.uint16)
    want = words.copy()
    np.bitwise_xor.at(want, positions, masks)
    floor.xor_at(words, positions, masks)
    assert words.tobytes() == want.tobytes()


def test_xor_twice_restores_and_threads_share_nothing() -> None:
    """Two passes undo each other; tensors XORed on threads at once (the GIL released) end
    as one thread would leave them."""
    rng = np.random.default_rng(7)
    parts = [rng.integers(0, 1 << 16, 200_000, dtype=np.uint16) for _ in range(4)]
    before = [p.copy() for p in parts]
    changes = [np.sort(rng.choice(p.size, 5000, replace=False)) for p in parts]
    masks = [rng.integers(1, 1 << 16, c.size, dtype=np.uint16) for c in changes]
    threads = [
        threading.Thread(target=floor.xor_at, args=(p, c, m))
        for p, c, m in zip(parts, changes, masks, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, b, c, m in zip(parts, before, changes, masks, strict=True):
        want = b.copy()
        want[c] ^= m
        assert p.tobytes() == want.tobytes()
        floor.xor_at(p, c, m)
        assert p.tobytes() == b.tobytes()


@pytest.mark.parametrize(
    ("words", "positions", "masks", "match"),
    [
        (np.zeros(4, np.uint16), np.array([4]), np.zeros(1, np.uint16), "outside"),
        (np.zeros(4, np.uint16), np.array([-1]), np.zeros(1, np.uint16), "outside"),
        (np.zeros(4, np.uint16), np.array([0, 1]), np.zeros(1, np.uint16), "2 positions"),
        (np.zeros(4, np.uint16), np.array([0]), np.zeros(1, np.int16), "dtype"),
        (np.zeros(4, np.float32), np.array([0]), np.zeros(1, np.float32), "dtype"),
        (np.zeros(4, np.uint16), np.array([0], np.uint32), np.zeros(1, np.uint16), "int32"),
        (np.zeros(8, np.uint16)[::2], np.array([0]), np.zeros(1, np.uint16), "contiguous"),
        (np.zeros((2, 2), np.uint16), np.array([0]), np.zeros(1, np.uint16), "1-D"),
    ],
)
def test_check_refuses_what_would_write_outside(
    words: np.ndarray, positions: np.ndarray, masks: np.ndarray, match: str
) -> None:
    before = words.copy()
    with pytest.raises(ValueError, match=match):
        floor.xor_at(words, positions, masks)
    assert words.tobytes() == before.tobytes()
