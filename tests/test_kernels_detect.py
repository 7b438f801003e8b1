"""The publisher's native kernels (deltastore.kernels.detect) against the numpy reference.

:func:`find` must give the positions ``flatnonzero(old != new)`` (uint32), the masks
``old ^ new`` there and the Adler-32 sums of :func:`delta_sums`; :func:`sparse2_sections` the
bytes of ``position_sections + byte_planes``; :func:`xor_scatter` the words of the numpy
scatter; ``FrameEncoders(native=True)`` (the default) the same frames, checksums and held
changes as ``native=False``. Every comparison is bit-wise. Hypothesis draws the frames: word
sizes of 1, 2, 4 and 8 bytes, empty frames and frames without a change, changes at the first
and the last element, dense frames (past the scratch: counted, then gathered) and clustered
changes with long gaps (escapes).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore.format.checksum import adler32, apply_delta, delta_sums
from deltastore.format.codecs.v2 import XOR_SPARSE2, byte_planes, position_sections
from deltastore.kernels import detect
from deltastore.publish.encode import FrameEncoders, FrameJob
from deltastore.publish.snapshot import FrameChange, PackedMasks

#: One scratch for every example: reused across word sizes and frame sizes, as a thread's is.
SCRATCH = detect.Scratch()


def changed(n: int, size: int, shape: str, rng: np.random.Generator) -> np.ndarray:
    """Sorted distinct int64 positions of a frame of ``n`` words, drawn as ``shape`` says."""
    if shape == "none":
        return np.empty(0, dtype=np.int64)
    if shape == "dense":
        return np.flatnonzero(rng.random(n) < 0.7)
    if shape == "all":
        return np.arange(n)
    if shape == "ends":  # the first and the last element, and a few in between
        return np.unique(np.r_[0, n - 1, rng.integers(0, n, size=min(n, 3))])
    if shape == "clustered":  # a run, then long gaps: tokens of 255 and escapes
        run = np.arange(min(n, 200))
        return np.unique(np.r_[run, rng.integers(0, n, size=2), n - 1])
    return np.unique(rng.integers(0, n, size=int(rng.integers(1, n + 1))))


@st.composite
def frames(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """(old, new) unsigned words of one frame."""
    size = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(0, 6000))
    shape = draw(st.sampled_from(["none", "random", "dense", "all", "ends", "clustered"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dt = np.dtype(f"<u{size}")
    top = (1 << (8 * size)) - 1
    old = rng.integers(0, top, size=n, dtype=dt, endpoint=True)
    new = old.copy()
    if n:
        pos = changed(n, size, shape, rng)
        # low bits only, a few with high bits (masks that pack, with high parts) or any bits
        kind = draw(st.sampled_from(["low", "few-high", "any"]))
        hi = top if kind == "any" else min(top, 255)
        masks = rng.integers(1, hi, size=pos.size, dtype=dt, endpoint=True)
        if kind == "few-high" and size > 1:
            few = rng.random(pos.size) < 0.05
            masks[few] |= (
                rng.integers(1, top >> 8, size=int(few.sum()), dtype=dt, endpoint=True) << 8
            )
        new[pos] ^= masks
    return old, new


def reference(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(int64 positions, masks, dA, dB) by numpy."""
    pos = np.flatnonzero(old != new)
    da, db = delta_sums(pos, old[pos], new[pos], new.nbytes)
    return pos, old[pos] ^ new[pos], da, db


def check_find(old: np.ndarray, new: np.ndarray) -> detect.Found:
    found = detect.find(old, new, SCRATCH)
    pos, masks, da, db = reference(old, new)
    assert found.positions.dtype == np.uint32 and found.masks.dtype == new.dtype
    assert np.array_equal(found.positions, pos)
    assert np.array_equal(found.masks, masks)
    assert (found.da, found.db) == (da, db)
    assert apply_delta(adler32(old), found.da, found.db) == adler32(new)
    return found


def check_sections(found: detect.Found) -> None:
    if not found.positions.size:
        return
    got = [bytes(s) for s in detect.sparse2_sections(found.positions, found.masks)]
    want = [bytes(s) for s in position_sections(found.positions.astype(np.int64), XOR_SPARSE2)]
    assert got == want + byte_planes(found.masks)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames())
def test_find_sections_and_scatter_are_the_reference(frame: tuple[np.ndarray, np.ndarray]) -> None:
    old, new = frame
    found = check_find(old, new)
    check_sections(found)
    words = old.copy()
    detect.xor_scatter(words, found.positions, found.masks)
    assert np.array_equal(words, new)
    packed = PackedMasks.of(found.masks)
    native = detect.pack_masks(found.masks)
    assert (native is None) == (packed is None)
    if packed is not None and native is not None:
        for got, want in zip(native, (packed.low, packed.at, packed.high), strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        words = old.copy()
        detect.xor_scatter(words, found.positions, packed=(packed.low, packed.at, packed.high))
        assert np.array_equal(words, new)
    n = old.size
    bits = np.packbits(old != new)
    assert np.array_equal(detect.bitmap(found.positions, n), bits)
    got = detect.bitmap_positions(bits, n, found.positions.size)
    assert np.array_equal(got, found.positions)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames(), st.sampled_from(["v1", "v2"]), st.booleans())
def test_native_frames_are_the_reference_frames(
    frame: tuple[np.ndarray, np.ndarray], codecs: str, delta: bool
) -> None:
    old, new = frame
    if not new.size:
        return
    job = FrameJob(new, old, adler32(old), delta)
    got = FrameEncoders(None, 1, codecs, native=True).encode(job)  # type: ignore[arg-type]
    want = FrameEncoders(None, 1, codecs, native=False).encode(job)  # type: ignore[arg-type]
    assert (got.changed, got.adler, got.codec, got.data, got.xxh3) == (
        want.changed,
        want.adler,
        want.codec,
        want.data,
        want.xxh3,
    )
    assert got.adler == adler32(new)
    if want.change is None:
        assert got.change is None
        return
    assert got.change is not None
    assert np.array_equal(got.change.positions(), want.change.positions())
    gm, wm = got.change.masks, want.change.masks  # packed alike (low bytes, high parts)
    assert type(gm) is type(wm)
    if isinstance(gm, PackedMasks) and isinstance(wm, PackedMasks):
        assert np.array_equal(gm.masks(), wm.masks()) and gm.nbytes == wm.nbytes
    for native in (True, False):
        words = old.copy()
        got.change.apply(words, native=native)
        assert np.array_equal(words, new)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200_003])
@pytest.mark.parametrize("density", [0.0, 0.0079, 1 / 16, 0.3, 1.0])
def test_find_on_larger_frames(size: int, n: int, density: float) -> None:
    """Frames past a scratch of n/16 changes (counted, then gathered from a position that
    is not a block's start), sub-block and tail lengths, every word size."""
    rng = np.random.default_rng(n * 10 + size)
    dt = np.dtype(f"<u{size}")
    old = rng.integers(0, (1 << (8 * size)) - 1, size=n, dtype=dt, endpoint=True)
    new = old.copy()
    at = np.flatnonzero(rng.random(n) < density)
    new[at] ^= np.ones(at.size, dtype=dt)
    check_sections(check_find(old, new))


def test_escapes_and_the_frame_ends() -> None:
    """A run of changes then one far away: the gap's token is 255 and an escape is written;
    changes at the first and the last word of a frame."""
    n = 1 << 20
    old = np.zeros(n, dtype=np.uint16)
    new = old.copy()
    new[:200] = 1
    new[n - 1] = 0x8001
    found = check_find(old, new)
    sections = detect.sparse2_sections(found.positions, found.masks)
    header = bytes(sections[0][:12])
    assert int.from_bytes(header[4:8], "little") == 1  # one escape
    check_sections(found)
    assert found.positions[0] == 0 and found.positions[-1] == n - 1


def test_signed_words_are_compared_as_unsigned() -> None:
    rng = np.random.default_rng(5)
    old = rng.integers(-(1 << 15), 1 << 15, size=5000, dtype=np.int16)
    new = old.copy()
    new[::7] ^= 3
    a = detect.find(old, new, SCRATCH)
    b = detect.find(old.view(np.uint16), new.view(np.uint16), SCRATCH)
    assert np.array_equal(a.positions, b.positions) and (a.da, a.db) == (b.da, b.db)
    assert np.array_equal(a.masks, b.masks) and a.masks.dtype == np.uint16


def test_find_refuses_frames_that_differ() -> None:
    with pytest.raises(ValueError, match="differ"):
        detect.find(np.zeros(4, np.uint16), np.zeros(5, np.uint16), SCRATCH)
    with pytest.raises(ValueError, match="differ"):
        detect.find(np.zeros(4, np.uint16), np.zeros(4, np.uint32), SCRATCH)


def test_held_bitmap_frames_apply_natively() -> None:
    """A dense frame held as a bitmap, its masks packed, applied by the kernel."""
    rng = np.random.default_rng(9)
    old = rng.integers(0, 1 << 16, size=10_000, dtype=np.uint16)
    new = old.copy()
    at = np.flatnonzero(rng.random(old.size) < 0.4)
    new[at] ^= rng.integers(1, 256, size=at.size).astype(np.uint16)
    new[at[:5]] ^= np.uint16(0x4400)
    masks = old[at] ^ new[at]
    held = FrameChange(old.size, np.packbits(old != new), masks, True).held()
    assert isinstance(held.masks, PackedMasks)
    for native in (True, False):
        words = old.copy()
        held.apply(words, native=native)
        assert np.array_equal(words, new)


def test_importing_the_publisher_does_not_import_numba() -> None:
    code = (
        "import sys, deltastore, deltastore.publish.encode, deltastore.publish.snapshot; "
        "sys.exit('numba' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_warm_loads_the_kernels_and_encoders_start_it() -> None:
    detect.warm()  # every 2-byte kernel, packed and plain scatter included: no error
    FrameEncoders(None, 1)  # starts the daemon thread at most once per process
    from deltastore.kernels import warming

    thread = warming("deltastore.kernels.detect")
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
