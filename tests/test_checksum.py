"""Property tests of deltastore.format.checksum against zlib's Adler-32 (docs/spec/format-v1.md,
section 7.1).

Large buffers come from a numpy generator seeded by hypothesis (drawing 100k-byte buffers
byte by byte would be slow); sizes, seeds, change sets and word sizes are drawn. Sizes go past
65521 bytes so every ``mod 65521`` (and the ``(n - p)`` reduction) is exercised.
"""

from __future__ import annotations

import zlib
from itertools import pairwise

import numpy as np
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from deltastore.format import checksum
from deltastore.format.checksum import (
    MOD,
    adler32,
    apply_delta,
    combine,
    combine_frames,
    delta_sums,
    shift_to_outer,
)
from deltastore.format.dtypes import word_dtype

# derandomize: the same examples on every run (deterministic CI); bounded for speed.
SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
WORD_SIZES = st.sampled_from([1, 2, 4, 8])
SEEDS = st.integers(0, 2**32 - 1)
# Byte lengths: small ones, ones around the 65521 modulus and the 5552-byte zlib block, big ones.
LENGTHS = st.one_of(
    st.integers(0, 64),
    st.integers(5500, 5600),
    st.integers(MOD - 8, MOD + 8),
    st.integers(0, 300_000),
)


def rand_bytes(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def z(data: bytes) -> int:
    return zlib.adler32(data) & 0xFFFFFFFF


# --- full checksum -------------------------------------------------------------------------


@SETTINGS
@given(data=st.binary(max_size=2000))
def test_adler32_of_bytes_equals_zlib(data: bytes) -> None:
    assert adler32(data) == z(data)
    assert adler32(memoryview(data)) == z(data)


@SETTINGS
@given(seed=SEEDS, n=LENGTHS, size=WORD_SIZES, start=st.integers(0, 2**32 - 1))
def test_adler32_of_arrays_equals_zlib(seed: int, n: int, size: int, start: int) -> None:
    raw = rand_bytes(seed, n - n % size)
    words = np.frombuffer(raw, dtype=word_dtype(size))
    assert adler32(words) == z(raw)
    # a 2-D array and a non-contiguous one are checksummed in C order
    if words.size % 2 == 0 and words.size:
        two_d = words.reshape(2, -1)
        assert adler32(two_d) == z(raw)
        assert adler32(two_d.T) == z(np.ascontiguousarray(two_d.T).tobytes())
    # continuing from a value is zlib's running checksum
    assert adler32(words, start) == zlib.adler32(raw, start) & 0xFFFFFFFF


def test_adler32_known_values() -> None:
    assert adler32(b"") == 1
    assert adler32(b"Wikipedia") == 0x11E60398
    assert adler32(np.zeros(0, np.uint16)) == 1
    # all 0xFF bytes: A and B wrap many times
    ones = b"\xff" * 300_000
    assert adler32(np.frombuffer(ones, np.uint64)) == z(ones)


# --- combine -------------------------------------------------------------------------------


@SETTINGS
@given(seed=SEEDS, nx=LENGTHS, ny=LENGTHS)
@example(seed=0, nx=0, ny=0)
@example(seed=1, nx=0, ny=MOD)
@example(seed=2, nx=MOD, ny=0)
@example(seed=3, nx=7, ny=MOD + 1)
@example(seed=4, nx=3 * MOD + 5, ny=2 * MOD)
def test_combine_equals_adler_of_concatenation(seed: int, nx: int, ny: int) -> None:
    data = rand_bytes(seed, nx + ny)
    x, y = data[:nx], data[nx:]
    assert combine(z(x), z(y), len(y)) == z(x + y)


@SETTINGS
@given(seed=SEEDS, cuts=st.lists(st.integers(0, 200_000), max_size=6))
def test_combine_folds_many_pieces(seed: int, cuts: list[int]) -> None:
    """Folding pieces left to right (as publisher and subscriber do per frame) matches zlib."""
    data = rand_bytes(seed, max(cuts, default=0))
    bounds = [0, *sorted(cuts), len(data)]
    total = 1
    for a, b in pairwise(bounds):
        total = combine(total, z(data[a:b]), b - a)
    assert total == z(data)


@SETTINGS
@given(seed=SEEDS, cuts=st.lists(LENGTHS, max_size=8))
@example(seed=0, cuts=[])
@example(seed=1, cuts=[0, 0, 0])
@example(seed=2, cuts=[MOD, MOD, 2 * MOD + 1])
def test_combine_frames_equals_zlib_of_the_concatenation(seed: int, cuts: list[int]) -> None:
    """The one "combine frame Adlers" of publisher, shard coordinator and subscriber: pieces
    of any length (empty ones too, none at all) in order give zlib's Adler-32 of all the
    bytes."""
    data = rand_bytes(seed, max(cuts, default=0))
    bounds = [0, *sorted(cuts), len(data)]
    pieces = [data[a:b] for a, b in pairwise(bounds)]
    assert combine_frames((z(p), len(p)) for p in pieces) == z(data)
    assert combine_frames([]) == 1 == z(b"")


def test_combine_extreme_checksums() -> None:
    """Checksums whose A half is 0: ``a1 + a2 - 1`` is negative before the mod.

    A = 1 + sum(bytes) mod 65521 is 0 exactly when the bytes sum to 65520 (mod 65521).
    """
    x = b"\xff" * 256 + bytes([65520 - 255 * 256])
    assert z(x) & 0xFFFF == 0
    for y in (x, b"", b"\x00" * (MOD + 3), x * 300):
        assert combine(z(x), z(y), len(y)) == z(x + y)
        assert combine(z(y), z(x), len(x)) == z(y + x)


# --- incremental update --------------------------------------------------------------------


def _changes(
    seed: int, n_words: int, size: int, k: int, *, mode: str = "random"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Random old words, k distinct unsorted positions, their old and new words, new buffer.

    ``mode``: ``random`` new words (some may equal the old ones), ``distinct`` (every
    position really changes), ``up``/``down`` (every changed byte goes to 0xFF / 0x00, so all
    differences have one sign and the weighted sums are as large as they get).
    """
    rng = np.random.default_rng(seed)
    wdt = word_dtype(size)
    old = rng.integers(0, 256, n_words * size, dtype=np.uint8).view(wdt)
    k = min(k, n_words)
    positions = rng.choice(n_words, size=k, replace=False).astype(np.int64)
    new_words = rng.integers(0, 256, k * size, dtype=np.uint8).view(wdt)
    if mode == "distinct":
        new_words = np.where(new_words == old[positions], ~old[positions], new_words)
    elif mode in ("up", "down"):
        new_words[:] = np.iinfo(wdt).max if mode == "up" else 0
    new = old.copy()
    new[positions] = new_words
    return old, positions, old[positions].copy(), new


@SETTINGS
@given(
    seed=SEEDS,
    n_bytes=LENGTHS,
    size=WORD_SIZES,
    k=st.one_of(st.integers(0, 20), st.integers(0, 100_000)),
    mode=st.sampled_from(["random", "distinct", "up", "down"]),
)
@example(seed=0, n_bytes=MOD * 2 + 16, size=8, k=2000, mode="distinct")
@example(seed=1, n_bytes=MOD + 1, size=1, k=MOD + 1, mode="distinct")
@example(seed=2, n_bytes=300_000, size=4, k=75_000, mode="up")
def test_incremental_update_matches_zlib(
    seed: int, n_bytes: int, size: int, k: int, mode: str
) -> None:
    n_words = n_bytes // size
    nb = n_words * size
    old, positions, old_words, new = _changes(seed, n_words, size, k, mode=mode)
    da, db = delta_sums(positions, old_words, new[positions], nb)
    assert 0 <= da < MOD and 0 <= db < MOD
    assert apply_delta(z(old.tobytes()), da, db) == z(new.tobytes())
    # sorted positions give the same sums (the order of changes does not matter)
    order = np.argsort(positions)
    assert delta_sums(positions[order], old_words[order], new[positions][order], nb) == (da, db)


def test_incremental_update_extremes() -> None:
    """Every byte 0x00 -> 0xFF and back on a buffer of several moduli: the int64 products
    (n - p) * d would overflow without the early reduction."""
    for size in (1, 2, 4, 8):
        n_words = (5 * MOD) // size + 3
        nb = n_words * size
        zeros = np.zeros(n_words, dtype=word_dtype(size))
        ones = np.full(n_words, np.iinfo(word_dtype(size)).max, dtype=word_dtype(size))
        everywhere = np.arange(n_words, dtype=np.int64)
        up = delta_sums(everywhere, zeros, ones, nb)
        assert apply_delta(z(zeros.tobytes()), *up) == z(ones.tobytes())
        down = delta_sums(everywhere, ones, zeros, nb)
        assert apply_delta(z(ones.tobytes()), *down) == z(zeros.tobytes())


def test_delta_sums_of_no_change_is_zero() -> None:
    empty = np.zeros(0, np.uint16)
    assert delta_sums(np.zeros(0, np.int64), empty, empty, 10) == (0, 0)
    value = z(b"some bytes")
    assert apply_delta(value, 0, 0) == value


# --- frame-level sums shifted to the tensor ------------------------------------------------


@SETTINGS
@given(
    seed=SEEDS,
    n_bytes=LENGTHS,
    size=WORD_SIZES,
    n_frames=st.integers(1, 6),
    k=st.integers(0, 3000),
)
@example(seed=5, n_bytes=3 * MOD + 24, size=4, n_frames=3, k=3000)
def test_shift_to_outer_matches_zlib(
    seed: int, n_bytes: int, size: int, n_frames: int, k: int
) -> None:
    """Split a buffer into frames, compute each frame's sums in frame coordinates, shift them
    to the whole buffer, apply them one after the other: equals zlib on the new buffer."""
    n_words = n_bytes // size
    assume(n_words >= 1)
    rng = np.random.default_rng(seed + 1)
    cuts = sorted(rng.integers(0, n_words + 1, n_frames - 1).tolist())
    bounds = [0, *cuts, n_words]
    old, positions, _, new = _changes(seed, n_words, size, k)
    outer = n_words * size
    value = z(old.tobytes())
    for a, b in pairwise(bounds):
        local = np.sort(positions[(positions >= a) & (positions < b)]) - a
        frame_old, frame_new = old[a:b], new[a:b]
        da, db = delta_sums(local, frame_old[local], frame_new[local], (b - a) * size)
        # frame-level sums update the frame's own Adler-32
        assert apply_delta(z(frame_old.tobytes()), da, db) == z(frame_new.tobytes())
        value = apply_delta(value, *shift_to_outer(da, db, (b - a) * size, a * size, outer))
    assert value == z(new.tobytes())


def test_shift_to_outer_known_values() -> None:
    """A frame that ends at the end of the buffer needs no shift; one byte earlier adds dA."""
    assert shift_to_outer(7, 11, 40, 60, 100) == (7, 11)
    assert shift_to_outer(7, 11, 40, 59, 100) == (7, 18)
    assert shift_to_outer(MOD - 1, 5, 16, 0, 16 + MOD) == (MOD - 1, 5)
    assert shift_to_outer(2, MOD - 1, 16, 0, 17) == (2, 1)


def test_module_constant() -> None:
    assert checksum.MOD == 65521
