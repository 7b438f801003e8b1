"""The publisher's lean encoding paths give the same frames and the same held words as the plain
ones: xor-sparse2's position coding in steps (:func:`position_sections`) against
:func:`position_gaps` + :func:`position_parts`, frames from uint32 positions, one-shot zstd
frames copied to their size, a frame's compact changes (:class:`FrameChange`: positions or a
bitmap, XOR masks) applied to the parent's words, and the encoder pool's word budget. Every
comparison is bit-wise (uint16 words, bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from deltastore.format.checksum import adler32
from deltastore.format.codecs import FrameDecoder, FrameEncoder
from deltastore.format.codecs.v2 import (
    GAP_CHUNK,
    FrameEncoder2,
    position_gaps,
    position_parts,
    position_sections,
)
from deltastore.format.codecs.zstdframe import one_shot
from deltastore.publish.encode import SCAN_ELEMENTS, FrameEncoders, FrameJob, _changes
from deltastore.publish.snapshot import BITMAP_DENSITY, PackedMasks


def frame(n: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(old, new) uint16 words of ``n`` elements, ``density`` of them changed by +-1..3."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = old.copy()
    at = np.flatnonzero(rng.random(n) < density)
    new[at] += rng.integers(1, 4, at.size).astype(np.uint16)
    return old, new


@pytest.mark.parametrize("n", [1, 9, 300, GAP_CHUNK + 5, 200_000])
@pytest.mark.parametrize("density", [1e-4, 0.03, 0.65, 1.0])
@pytest.mark.parametrize("low_bits", [None, 0, 5, 17])
def test_position_sections_are_the_plain_coding(n: int, density: float, low_bits: int) -> None:
    old, new = frame(n, density, n)
    pos = np.flatnonzero(old != new)
    if not pos.size:
        pos = np.array([n - 1])
    gaps_pos, gaps = position_gaps(pos, "x")
    header, parts = position_parts(gaps_pos, gaps, low_bits)
    want = [header + parts[0], *parts[1:]]
    for p in (pos, pos.astype(np.uint32)):
        assert [bytes(x) for x in position_sections(p, "x", low_bits)] == want


def test_position_sections_refuse_what_the_plain_coding_refuses() -> None:
    across = np.arange(GAP_CHUNK + 10)
    across[GAP_CHUNK] = across[GAP_CHUNK - 1]  # not increasing across a step
    for bad in (np.array([3, 3]), np.array([5, 2]), np.array([-1, 2]), across):
        with pytest.raises(ValueError, match=r"strictly increasing|must be in"):
            position_sections(bad, "x")
    with pytest.raises(ValueError, match="low_bits"):
        position_sections(np.array([1, 2]), "x", 32)


@pytest.mark.parametrize("density", [0.001, 0.05, 0.65])
def test_frames_from_uint32_positions_are_the_same(density: float) -> None:
    old, new = frame(70_000, density, 3)
    pos = np.flatnonzero(old != new)
    masks = old[pos] ^ new[pos]
    enc = FrameEncoder2()
    assert enc.xor_sparse2(pos.astype(np.uint32), masks) == enc.xor_sparse2(pos, masks)
    for codecs in ("v1", "v2"):
        fe = FrameEncoder(codecs=codecs)  # type: ignore[arg-type]
        assert fe.encode_delta(old, new, pos.astype(np.uint32)) == fe.encode_delta(old, new, pos)


def test_one_shot_is_the_compressors_frame() -> None:
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    for data in (bytes(1 << 20), np.random.default_rng(0).bytes(5000), b"x"):
        assert one_shot(cctx, data) == cctx.compress(data)


@pytest.mark.parametrize("n", [1, 8, 100, SCAN_ELEMENTS + 3, 3 * SCAN_ELEMENTS])
@pytest.mark.parametrize("density", [0.001, 1 / BITMAP_DENSITY, 0.2, 1.0])
def test_frame_changes_rebuild_the_new_words(n: int, density: float) -> None:
    old, new = frame(n, density, 7 * n)
    k = int(np.count_nonzero(old != new))
    if not k:
        return
    change = _changes(np.empty(SCAN_ELEMENTS, dtype=np.bool_), old, new, k)
    want = np.flatnonzero(old != new)
    assert change.bitmap == (k * BITMAP_DENSITY > n)
    assert np.array_equal(change.positions(), want)
    assert np.array_equal(change.held().positions(), want)  # from the bitmap, if it is one
    assert np.array_equal(change.masks, old[want] ^ new[want])
    held = change.held()
    assert not hasattr(held, "found") and held.nbytes <= 4 * k + 2 * k
    words = old.copy()
    held.apply(words)
    assert np.array_equal(words, new)


@pytest.mark.parametrize("density", [0.0, 0.01, 0.65])
def test_encoded_frames_decode_and_their_changes_apply(density: float) -> None:
    old, new = frame(50_000, density, 11)
    enc = FrameEncoders(None, 1)
    out = enc.encode(FrameJob(new, old, adler32(old), True))
    assert out.adler == adler32(new) and out.changed == int(np.count_nonzero(old != new))
    words = old.copy()
    if out.change is None:
        assert out.data is None and density == 0.0
        return
    out.change.apply(words)
    assert np.array_equal(words, new)
    assert out.data is not None
    got = old.copy()
    for c in FrameDecoder().changes(out.codec, out.data, new.size, 2, out.changed):
        if c.positions is not None:
            got[c.positions] = got[c.positions] ^ c.words if c.xor else c.words
        else:
            run = got[c.first : c.first + c.words.size]
            run[:] = run ^ c.words if c.xor else c.words
    assert np.array_equal(got, new)


def test_the_word_budget_keeps_the_order_and_the_frames() -> None:
    jobs = []
    for i, n in enumerate([5000, 100, 40_000, 100, 100, 20_000, 7]):
        old, new = frame(n, 0.3, i)
        jobs.append(FrameJob(new, old, adler32(old), True))
    plain = [(o.codec, o.data) for o in FrameEncoders(None, 2).map(jobs)]
    for words in (1, 30_000, 10**9):
        got = [(o.codec, o.data) for o in FrameEncoders(None, 2).map(jobs, words=words)]
        assert got == plain


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_packed_masks_unpack_to_the_masks(dtype: type) -> None:
    rng = np.random.default_rng(3)
    masks = rng.integers(1, 256, 10_000).astype(dtype)  # low bits only: packs
    masks[rng.choice(masks.size, 300, replace=False)] |= dtype(0x4100)
    packed = PackedMasks.of(masks)
    assert packed is not None and packed.nbytes < masks.nbytes
    assert np.array_equal(packed.masks(), masks) and packed.masks().dtype == masks.dtype
    wide = rng.integers(256, 1 << 15, 10_000).astype(dtype)  # high bits everywhere: kept
    assert PackedMasks.of(wide) is None
    assert PackedMasks.of(np.ones(5, dtype=np.uint8)) is None  # 1-byte words: nothing to pack
