"""The 0.2.0 codecs ``xor-sparse2`` and ``raw-planes`` (deltastore.format.codecs.v2): round
trips, the layout of docs/spec/format-v1.md section 8.2 (checked by a plain-Python reading of
the spec), the writer's choices (``FrameEncoder(codecs="v2")``), and hostile frames.

Arrays come from numpy generators seeded by hypothesis; tensors are compared as integer words.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import zstandard
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deltastore.errors import DeltastoreError, FrameError
from deltastore.format.codecs import (
    MAX_WINDOW_SIZE,
    XOR_DENSE,
    XOR_SPARSE,
    FrameDecoder,
    FrameEncoder,
    stored_bound,
)
from deltastore.format.codecs import (
    v2 as codecs_v2,
)
from deltastore.format.codecs.v2 import (
    DEFAULT_PARAMS,
    ESCAPE,
    MAX_LOW_BITS,
    MAX_SPARSE2_ELEMENTS,
    RAW_PLANES,
    SPARSE2_HEADER,
    V1_MAX_CHANGES,
    XOR_SPARSE2,
    FrameDecoder2,
    FrameEncoder2,
    choose_low_bits,
    max_escapes,
    sparse2_bounds,
    sparse2_possible,
    sparse2_size,
)
from deltastore.format.codecs.zstdframe import frame_length
from deltastore.format.dtypes import word_dtype
from tests.test_codecs import FAST, SEEDS, SIZES, random_change


@st.composite
def change_params(draw: st.DrawFn, max_n: int = 200_000) -> tuple[int, int, int, int]:
    """(size, n, k, seed) with 0 <= k <= n and densities from none to all elements."""
    size = draw(st.sampled_from(SIZES))
    n = draw(st.one_of(st.integers(1, 64), st.integers(1, max_n)))
    density = draw(st.sampled_from([0.0, 0.0005, 0.008, 0.06, 0.07, 0.3, 1.0]))
    k = draw(st.one_of(st.just(round(n * density)), st.integers(0, min(n, 5000))))
    return size, n, k, draw(SEEDS)


def content(frame: bytes) -> bytes:
    return bytes(zstandard.ZstdDecompressor().decompress(frame))


def zstd(data: bytes, **kw: Any) -> bytes:
    cctx = zstandard.ZstdCompressor(write_content_size=True, **kw)
    return bytes(cctx.compress(data))


def word(raw: bytes, offset: int, count: int, i: int, width: int) -> int:
    """Value ``i`` of ``width`` byte planes of ``count`` bytes at ``offset`` (spec 8.2)."""
    return sum(raw[offset + j * count + i] << (8 * j) for j in range(width))


def spec_decode(raw: bytes, n: int, size: int) -> tuple[list[int], list[int]]:
    """A plain reading of the xor-sparse2 layout (spec section 8.2.4), one change at
    a time, for valid contents only."""
    k, e, low_bits = struct.unpack_from("<IIB", raw)
    assert raw[9:12] == b"\0\0\0"
    width = (low_bits + 7) // 8
    tokens = raw[12 : 12 + k]
    low_at = 12 + k
    esc_at = low_at + width * k
    mask_at = esc_at + 4 * e
    assert mask_at + size * k == len(raw)
    positions, masks, prev, escapes = [], [], -1, 0
    for i in range(k):
        high = tokens[i]
        if high == ESCAPE:
            high += word(raw, esc_at, e, escapes, 4)
            escapes += 1
        low = word(raw, low_at, k, i, width)
        assert low < 1 << low_bits
        prev += 1 + (high << low_bits) + low
        assert prev < n
        positions.append(prev)
        masks.append(word(raw, mask_at, k, i, size))
        assert masks[-1] != 0
    assert escapes == e
    return positions, masks


def sparse2_content(
    gaps: list[int],
    masks: list[int],
    size: int,
    low_bits: int,
    *,
    k: int | None = None,
    e: int | None = None,
    reserved: bytes = b"\0\0\0",
    extra: bytes = b"",
    low_override: dict[int, int] | None = None,
    token_override: dict[int, int] | None = None,
) -> bytes:
    """Hand-built xor-sparse2 content from the spec's layout (with knobs to break it)."""
    width = (low_bits + 7) // 8
    tokens, lows, escapes = [], [], []
    for i, gap in enumerate(gaps):
        high = gap >> low_bits
        tokens.append(min(high, ESCAPE))
        if high >= ESCAPE:
            escapes.append(high - ESCAPE)
        lows.append((low_override or {}).get(i, gap & ((1 << low_bits) - 1)))
    for i, t in (token_override or {}).items():
        tokens[i] = t
    count = len(gaps) if k is None else k
    esc_count = len(escapes) if e is None else e
    out: bytes = struct.pack("<IIB", count, esc_count, low_bits) + reserved + bytes(tokens)
    out += np.array(lows, dtype="<u4").view(np.uint8).reshape(-1, 4).T[:width].tobytes()
    out += np.array(escapes, dtype="<u4").view(np.uint8).reshape(-1, 4).T.tobytes()
    out += np.array(masks, dtype=word_dtype(size)).view(np.uint8).reshape(-1, size).T.tobytes()
    return out + extra


def with_byte(body: bytes, at: int, value: int) -> bytes:
    out = bytearray(body)
    out[at] = value
    return bytes(out)


def handmade_zstd(
    payload: bytes, content_size: int, window_log: int, *, dict_id: int | None = None
) -> bytes:
    """A zstd frame with one raw block, a 4-byte content size, an explicit window descriptor
    and, if given, a 1-byte dictionary ID."""
    out = struct.pack("<I", 0xFD2FB528)
    out += bytes([(2 << 6) | (1 if dict_id is not None else 0)])
    out += bytes([(window_log - 10) << 3])
    if dict_id is not None:
        out += bytes([dict_id])
    out += struct.pack("<I", content_size)
    out += ((len(payload) << 3) | 1).to_bytes(3, "little")
    return out + payload


def assert_frame_error(run: Callable[..., Any], *args: Any) -> FrameError:
    def call() -> None:
        out = run(*args)
        if hasattr(out, "__next__"):
            for _ in out:
                pass

    with pytest.raises(FrameError) as info:
        call()
    assert isinstance(info.value, DeltastoreError)
    assert str(info.value)
    return info.value


def chunked(dec: FrameDecoder2, data: bytes, n: int, size: int) -> np.ndarray:
    parts, expect = [], 0
    for first, words in dec.planes_chunks(data, n, size):
        assert first == expect
        assert words.dtype == word_dtype(size)
        assert words.size > 0
        parts.append(words.copy())
        expect += words.size
    assert expect == n
    return np.concatenate(parts) if parts else np.zeros(0, word_dtype(size))


class NoDecompress:
    """Stands in for the decoder's zstd context where a frame must be refused before it is
    decompressed."""

    def decompress(self, data: bytes) -> bytes:
        raise AssertionError("decompressed a frame that should have been refused first")

    def stream_reader(self, *args: Any, **kw: Any) -> Any:
        raise AssertionError("decompressed a frame that should have been refused first")


def refused_before_decompressing(run: Callable[..., Any], *args: Any) -> FrameError:
    dec = FrameDecoder2()
    with mock.patch.object(dec, "_dctx", NoDecompress()):
        return assert_frame_error(getattr(dec, run.__name__), *args)


# --- xor-sparse2: round trips ----------------------------------------------------------------


@FAST
@given(p=change_params())
@example(p=(1, 1, 1, 0))
@example(p=(2, 1, 0, 0))
@example(p=(8, 200_000, 2, 3))  # gaps far above 255 << L: escapes
@example(p=(4, 3000, 3000, 5))  # every element changed: L = 0, all gaps 0
@example(p=(2, 100_000, 790, 6))  # the bench's density
def test_xor_sparse2_round_trip(p: tuple[int, int, int, int]) -> None:
    size, n, k, seed = p
    _, _, positions, masks = random_change(seed, n, size, k)
    data = FrameEncoder2().xor_sparse2(positions, masks)
    got_pos, got_masks = FrameDecoder2().sparse2(data, n, size, k)
    assert got_pos.dtype == np.int64
    assert got_masks.dtype == word_dtype(size)
    np.testing.assert_array_equal(got_pos, positions)
    np.testing.assert_array_equal(got_masks, masks)
    raw = content(data)
    low_bits, e = raw[8], int.from_bytes(raw[4:8], "little")
    if k:
        assert low_bits == choose_low_bits(k, int(positions[-1]) + 1)
    assert len(raw) == sparse2_size(k, size, low_bits, e)
    lo, hi = sparse2_bounds(n, size, k)
    assert lo <= len(raw) <= hi and sparse2_possible(len(raw), n, size, k)
    assert len(data) <= stored_bound(XOR_SPARSE2, n, size, k)
    if k <= 3000:
        spec_pos, spec_masks = spec_decode(raw, n, size)
        assert spec_pos == positions.tolist()
        assert spec_masks == masks.tolist()


@FAST
@given(
    size=st.sampled_from(SIZES),
    n=st.integers(1, 1 << 20),
    k=st.integers(1, 400),
    low_bits=st.integers(0, MAX_LOW_BITS),
    seed=SEEDS,
)
def test_any_low_bits_round_trip(size: int, n: int, k: int, low_bits: int, seed: int) -> None:
    """Readers accept every L in 0..31, whatever the writer's choice (small L: escapes)."""
    k = min(k, n)
    _, _, positions, masks = random_change(seed, n, size, k)
    data = FrameEncoder2().xor_sparse2(positions, masks, low_bits=low_bits)
    got_pos, got_masks = FrameDecoder2().sparse2(data, n, size, k)
    np.testing.assert_array_equal(got_pos, positions)
    np.testing.assert_array_equal(got_masks, masks)
    assert spec_decode(content(data), n, size) == (positions.tolist(), masks.tolist())


@pytest.mark.parametrize("low_bits", [0, 3, 8, 9, 16, 17, 21])
def test_escape_boundaries(low_bits: int) -> None:
    """Gaps whose high part is 254, 255 (the first escape) and 256, and the largest gap."""
    n = MAX_SPARSE2_ELEMENTS
    gaps = [(254 << low_bits), (255 << low_bits) - 1, 255 << low_bits, (256 << low_bits) + 1]
    positions = np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1
    positions = np.append(positions, n - 1)
    masks = np.arange(1, positions.size + 1, dtype=np.uint8)
    data = FrameEncoder2().xor_sparse2(positions, masks, low_bits=low_bits)
    got_pos, got_masks = FrameDecoder2().sparse2(data, n, 1, positions.size)
    np.testing.assert_array_equal(got_pos, positions)
    np.testing.assert_array_equal(got_masks, masks)
    raw = content(data)
    escapes = int.from_bytes(raw[4:8], "little")
    assert escapes == 2 + ((n - 1 - int(positions[-2]) - 1) >> low_bits >= ESCAPE)


def test_single_change_at_the_last_element_of_the_largest_frame() -> None:
    n = MAX_SPARSE2_ELEMENTS
    data = FrameEncoder2().xor_sparse2(np.array([n - 1]), np.array([5], np.uint16))
    pos, masks = FrameDecoder2().sparse2(data, n, 2, 1)
    assert pos.tolist() == [n - 1] and masks.tolist() == [5]
    assert_frame_error(FrameDecoder2().sparse2, data, n - 1, 2, 1)


def test_empty_xor_sparse2() -> None:
    data = FrameEncoder2().xor_sparse2(np.empty(0, np.int64), np.empty(0, np.uint32))
    assert content(data) == bytes(SPARSE2_HEADER)
    pos, masks = FrameDecoder2().sparse2(data, 10, 4, 0)
    assert pos.size == 0 and masks.size == 0 and masks.dtype == np.uint32
    assert_frame_error(FrameDecoder2().sparse2, data, 10, 4, 1)


def test_encoder_refuses_what_it_cannot_write() -> None:
    enc = FrameEncoder2()
    with pytest.raises(ValueError, match="length"):
        enc.xor_sparse2(np.arange(3), np.ones(2, np.uint8))
    with pytest.raises(ValueError, match="2\\^32"):
        enc.xor_sparse2(np.array([MAX_SPARSE2_ELEMENTS]), np.ones(1, np.uint8))
    with pytest.raises(ValueError, match="increasing"):
        enc.xor_sparse2(np.array([1, 1]), np.ones(2, np.uint8))
    with pytest.raises(ValueError, match="increasing"):
        enc.xor_sparse2(np.array([2, 1]), np.ones(2, np.uint8))
    with pytest.raises(ValueError, match="non-zero"):
        enc.xor_sparse2(np.array([1, 2]), np.array([1, 0], np.uint8))
    with pytest.raises(ValueError, match="low_bits"):
        enc.xor_sparse2(np.arange(3), np.ones(3, np.uint8), low_bits=32)


def test_choose_low_bits() -> None:
    assert choose_low_bits(0, 0) == 0
    assert choose_low_bits(10, 10) == 0  # every element changed
    assert choose_low_bits(1, 127) == 4  # mean gap ~126 (0.79%): floor(log2 127) - 2
    assert choose_low_bits(1, 128) == 5
    assert choose_low_bits(1, 1 << 40) == MAX_LOW_BITS
    assert choose_low_bits(1, 128, bias=0) == 7


def test_sparse2_sizes() -> None:
    assert sparse2_size(0, 2, 0, 0) == SPARSE2_HEADER
    assert sparse2_size(10, 2, 4, 1) == 12 + 10 * (1 + 2 + 1) + 4
    assert sparse2_size(10, 2, 9, 0) == 12 + 10 * (1 + 2 + 2)
    assert sparse2_bounds(1000, 2, 10) == (12 + 30, 12 + 30 + 40 + 12)  # 3 escapes at most
    assert sparse2_bounds(10**6, 2, 10) == (12 + 30, 12 + 30 + 40 + 40)
    assert sparse2_bounds(10, 2, 10) == (12 + 30, 12 + 30 + 40)  # no room for an escape
    assert max_escapes(254 + 1, 1) == 0 and max_escapes(255 + 1, 1) == 1
    # sparse2_possible is exactly "some (w, e) with w in 0..4, e in 0..max_escapes gives
    # this size"
    for n, k in ((10, 0), (10, 1), (300, 2), (800, 3), (10**6, 7), (10**6, 8)):
        lo, hi = sparse2_bounds(n, 2, k)
        most = max_escapes(n, k)
        valid = {sparse2_size(k, 2, 8 * w, e) for w in range(5) for e in range(most + 1)}
        assert hi == max(valid)
        for c in range(lo - 3, hi + 4):
            assert sparse2_possible(c, n, 2, k) == (c in valid), (k, c)


def test_sections_start_zstd_blocks() -> None:
    """A frame of many changes has a block per section (its own Huffman table): more blocks
    than the content alone needs; a few changes make one block."""

    def blocks(data: bytes) -> int:
        pos, count = int(zstandard.frame_header_size(data)), 0
        while True:
            header = int.from_bytes(data[pos : pos + 3], "little")
            count += 1
            pos += 3 + (1 if (header >> 1) & 3 == 1 else header >> 3)
            if header & 1:
                return count

    _, _, positions, masks = random_change(1, 100_000, 2, 800)
    assert blocks(FrameEncoder2().xor_sparse2(positions, masks)) == 4  # tokens, low, 2 masks
    _, _, positions, masks = random_change(1, 100_000, 2, 100)
    assert blocks(FrameEncoder2().xor_sparse2(positions, masks)) == 1


# --- encode_delta ----------------------------------------------------------------------------


def decode_any(codec: str, data: bytes, old: np.ndarray, k: int) -> np.ndarray:
    """The new words of a delta frame of any codec the encoder may choose."""
    size, n = old.dtype.itemsize, old.size
    new: np.ndarray = old.copy()
    if codec == XOR_SPARSE2:
        pos, masks = FrameDecoder2().sparse2(data, n, size, k)
        new[pos] ^= masks
    elif codec == XOR_SPARSE:
        pos, masks = FrameDecoder().sparse(data, n, size, k)
        new[pos] ^= masks
    elif codec == XOR_DENSE:
        xor = np.empty_like(old)
        FrameDecoder().into(data, xor)
        new ^= xor
    else:
        assert codec == RAW_PLANES
        FrameDecoder2().planes_into(data, new)
    return new


@FAST
@given(p=change_params(max_n=50_000))
def test_encode_delta_reproduces_new(p: tuple[int, int, int, int]) -> None:
    size, n, k, seed = p
    if k == 0:
        return
    old, new, positions, masks = random_change(seed, n, size, k)
    enc = FrameEncoder2()
    codec, data = FrameEncoder(codecs="v2").encode_delta(old, new, positions)
    np.testing.assert_array_equal(decode_any(codec, data, old, k), new)
    # the choice is the smallest of the candidates tried
    assert len(data) <= len(enc.xor_sparse2(positions, masks))
    if k * 16 > n:
        assert len(data) <= len(enc.raw_planes(new))
    if k > V1_MAX_CHANGES and k * 16 <= n:
        assert codec == XOR_SPARSE2


def test_encode_delta_choices() -> None:
    enc = FrameEncoder(codecs="v2")
    old, new, positions, _ = random_change(3, 1 << 16, 2, 500)
    assert enc.encode_delta(old, new, positions)[0] == XOR_SPARSE2
    # a handful of changes: format v1's xor-sparse (4 header bytes less)
    old, new, positions, _ = random_change(3, 1 << 16, 2, 2)
    codec, data = enc.encode_delta(old, new, positions)
    assert codec == XOR_SPARSE
    np.testing.assert_array_equal(decode_any(codec, data, old, 2), new)
    # every element replaced by random words: raw-planes or xor-dense, never sparse
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, 4096).astype(np.uint16)
    new = rng.integers(0, 1 << 16, 4096).astype(np.uint16)
    pos = np.flatnonzero(old != new)
    codec, data = enc.encode_delta(old, new, pos)
    assert codec in (RAW_PLANES, XOR_DENSE)
    np.testing.assert_array_equal(decode_any(codec, data, old, pos.size), new)
    # constant new words: raw-planes is a few bytes
    new = np.full(4096, 0x3F80, np.uint16)
    pos = np.flatnonzero(old != new)
    codec, data = enc.encode_delta(old, new, pos)
    assert codec == RAW_PLANES and len(data) < 64


@pytest.mark.parametrize("level", [None, 1, 3, 19])
def test_levels_write_valid_frames(level: int | None) -> None:
    _, new, positions, masks = random_change(5, 20_000, 4, 300)
    enc, dec = FrameEncoder2(level), FrameDecoder2()
    pos, got = dec.sparse2(enc.xor_sparse2(positions, masks), 20_000, 4, 300)
    np.testing.assert_array_equal(pos, positions)
    np.testing.assert_array_equal(got, masks)
    out = np.empty_like(new)
    dec.planes_into(enc.raw_planes(new), out)
    np.testing.assert_array_equal(out, new)


# --- raw-planes --------------------------------------------------------------------------------


@FAST
@given(size=st.sampled_from(SIZES), n=st.integers(0, 300_000), seed=SEEDS, small=st.booleans())
@example(size=1, n=(1 << 20) + 3, seed=0, small=False)  # more than one 1 MiB chunk per plane
@example(size=8, n=(1 << 17) + 1, seed=1, small=False)
def test_raw_planes_round_trip(size: int, n: int, seed: int, small: bool) -> None:
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 256, n * size, dtype=np.uint8).view(word_dtype(size))
    chunk = 1000 if small else codecs_v2.CHUNK_BYTES
    with mock.patch.object(codecs_v2, "CHUNK_BYTES", chunk):
        data = FrameEncoder2().raw_planes(words)
        dec = FrameDecoder2()
        out = np.empty_like(words)
        dec.planes_into(data, out)
        np.testing.assert_array_equal(out, words)
        if n:
            np.testing.assert_array_equal(chunked(dec, data, n, size), words)
    # the layout: plane j holds byte j of every word
    assert content(data) == words.view(np.uint8).reshape(n, size).T.tobytes()
    assert len(data) <= stored_bound(RAW_PLANES, n, size, n)


def test_raw_planes_of_bf16_weights_compress_better_than_raw() -> None:
    rng = np.random.default_rng(0)
    weights = (rng.normal(0, 0.02, 1 << 18).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16
    )
    planes = FrameEncoder2().raw_planes(weights)
    raw = zstd(weights.tobytes(), level=1)
    assert len(planes) < 0.72 * weights.nbytes < len(raw)


def test_planes_into_needs_contiguous_output() -> None:
    data = FrameEncoder2().raw_planes(np.arange(10, dtype=np.uint16))
    with pytest.raises(ValueError, match="contiguous"):
        FrameDecoder2().planes_into(data, np.empty(20, np.uint16)[::2])


# --- stored frames -----------------------------------------------------------------------------


def test_stored_frames_follow_section_8_1() -> None:
    """One zstd frame, content size in the header, no dictionary, window within 2^27."""
    enc = FrameEncoder2()
    old, new, positions, masks = random_change(2, 1 << 21, 2, 20_000)
    for data in (enc.xor_sparse2(positions, masks), enc.raw_planes(new), enc.xor_dense(old)):
        params = zstandard.get_frame_parameters(data)
        assert params.content_size != zstandard.CONTENTSIZE_UNKNOWN
        assert params.dict_id == 0
        assert params.window_size <= 1 << DEFAULT_PARAMS.window_log <= MAX_WINDOW_SIZE
        assert frame_length(data) == len(data)


# --- hostile frames ------------------------------------------------------------------------------

GARBAGE = [
    b"",
    b"\x00",
    b"\x28\xb5\x2f\xfd",
    b"not a zstd frame at all, just text",
    bytes(64),
    struct.pack("<II", 0x184D2A50, 16) + bytes(16),  # a skippable frame
]


@pytest.mark.parametrize("data", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_is_refused(data: bytes) -> None:
    dec = FrameDecoder2()
    assert_frame_error(dec.sparse2, data, 8, 2, 1)
    assert_frame_error(dec.planes_into, data, np.empty(8, np.uint16))
    assert_frame_error(dec.planes_chunks, data, 8, 2)


@pytest.mark.parametrize("size", SIZES)
def test_truncated_and_extended_frames_are_refused(size: int) -> None:
    _, new, positions, masks = random_change(7, 50_000, size, 700)
    enc, dec = FrameEncoder2(), FrameDecoder2()
    sparse = enc.xor_sparse2(positions, masks)
    planes = enc.raw_planes(new)
    for cut in (len(sparse) // 2, len(sparse) - 1, 6):
        assert_frame_error(dec.sparse2, sparse[:cut], 50_000, size, 700)
    for cut in (len(planes) // 2, len(planes) - 1, 6):
        assert_frame_error(dec.planes_into, planes[:cut], np.empty(50_000, word_dtype(size)))
        assert_frame_error(dec.planes_chunks, planes[:cut], 50_000, size)
    for extra in (b"\0", sparse):  # a byte, or a second frame, after the frame
        err = assert_frame_error(dec.sparse2, sparse + extra, 50_000, size, 700)
        assert "exactly one zstd frame" in str(err)
    err = assert_frame_error(dec.planes_into, planes + planes, np.empty(50_000, word_dtype(size)))
    assert "exactly one zstd frame" in str(err)
    # the decoder recovers after the errors
    pos, got = dec.sparse2(sparse, 50_000, size, 700)
    np.testing.assert_array_equal(pos, positions)
    np.testing.assert_array_equal(got, masks)
    out = np.empty(50_000, word_dtype(size))
    dec.planes_into(planes, out)
    np.testing.assert_array_equal(out, new)


def test_content_sizes_outside_the_bounds_are_refused_before_decompressing() -> None:
    _, _, positions, masks = random_change(3, 10_000, 2, 100)
    data = FrameEncoder2().xor_sparse2(positions, masks)
    # the manifest implies other bounds: fewer or more changes, another dtype
    for n, size, changed in ((10_000, 2, 20), (10_000, 2, 400), (10_000, 8, 100)):
        err = refused_before_decompressing(FrameDecoder2.sparse2, data, n, size, changed)
        assert "outside" in str(err)
    # a huge declared size (a zstd bomb) is refused from the header alone
    bomb = zstd(bytes(50 << 20))
    assert len(bomb) < 5000
    refused_before_decompressing(FrameDecoder2.sparse2, bomb, 1 << 20, 2, 100)
    refused_before_decompressing(FrameDecoder2.planes_into, bomb, np.empty(1 << 20, np.uint16))
    refused_before_decompressing(FrameDecoder2.planes_chunks, bomb, 1 << 20, 2)
    # a size within the bounds that no (w, e) produces
    lo, _ = sparse2_bounds(10_000, 2, 100)
    odd = zstd(bytes(lo + 1))
    err = refused_before_decompressing(FrameDecoder2.sparse2, odd, 10_000, 2, 100)
    assert "not a size" in str(err)
    # raw-planes: exactly n * s
    planes = FrameEncoder2().raw_planes(np.arange(100, dtype=np.uint16))
    for n in (99, 101):
        refused_before_decompressing(FrameDecoder2.planes_into, planes, np.empty(n, np.uint16))
    refused_before_decompressing(FrameDecoder2.planes_chunks, planes, 100, 4)


def test_frame_header_rules_are_enforced() -> None:
    body = sparse2_content([3], [9], 1, 0)
    dec = FrameDecoder2()
    assert dec.sparse2(zstd(body), 10, 1, 1)[0].tolist() == [3]
    # no content size
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(body)
    assert "content" in str(assert_frame_error(dec.sparse2, no_size, 10, 1, 1))
    # a window larger than the reader allows
    big = handmade_zstd(body, len(body), 28)
    assert "window" in str(assert_frame_error(dec.sparse2, big, 10, 1, 1))
    pos, _ = FrameDecoder2(max_window_size=1 << 28).sparse2(big, 10, 1, 1)
    assert pos.tolist() == [3]
    # a dictionary ID
    named = handmade_zstd(body, len(body), 20, dict_id=7)
    assert "dictionary" in str(assert_frame_error(dec.sparse2, named, 10, 1, 1))
    # a header that declares more content than the blocks hold
    assert_frame_error(dec.sparse2, handmade_zstd(body, len(body) + 4, 20), 10, 1, 1)
    planes = np.arange(64, dtype=np.uint8).tobytes()
    assert_frame_error(dec.planes_into, handmade_zstd(planes, 128, 20), np.empty(128, np.uint8))
    assert_frame_error(dec.planes_chunks, handmade_zstd(planes, 128, 20), 128, 1)


def test_content_checksum_is_verified() -> None:
    rng = np.random.default_rng(0)
    words = rng.integers(0, 1 << 16, 4096).astype(np.uint16)  # incompressible: raw blocks
    body = words.view(np.uint8).reshape(-1, 2).T.tobytes()
    data = bytearray(zstd(body, write_checksum=True))
    dec = FrameDecoder2()
    out = np.empty_like(words)
    dec.planes_into(bytes(data), out)
    np.testing.assert_array_equal(out, words)
    data[len(data) // 2] ^= 0x10  # inside a raw block: other content, same length
    assert_frame_error(dec.planes_into, bytes(data), out)
    assert_frame_error(dec.planes_chunks, bytes(data), 4096, 2)
    sparse = bytearray(zstd(sparse2_content([3, 1], [9, 8], 1, 0), write_checksum=True))
    sparse[-6] ^= 0x01  # the last mask byte, in the raw block before the checksum
    assert_frame_error(dec.sparse2, bytes(sparse), 10, 1, 2)


@pytest.mark.parametrize(
    ("body", "n", "size", "changed", "words"),
    [
        # k and the manifest's changed disagree
        (sparse2_content([0, 1, 2], [1, 2, 3], 2, 0), 10, 2, 9, "outside"),
        (sparse2_content([0, 1, 2], [1, 2, 3], 2, 0), 10, 2, 2, "not a size"),
        (sparse2_content([0, 1], [1, 2], 2, 0, k=3), 10, 2, 2, "holds 3 changes"),
        # sizes that do not match the header's L and e
        (sparse2_content([0, 1], [1, 2], 2, 0, extra=b"\0" * 4), 10, 2, 2, "holds 2 changes"),
        (sparse2_content([0, 1], [1, 2], 2, 0, e=1), 1000, 2, 2, "holds 2 changes"),
        # header fields out of range
        (sparse2_content([0], [1], 2, 0, reserved=b"\0\0\x01"), 10, 2, 1, "reserved 000001"),
        (with_byte(sparse2_content([0], [1], 1, 31), 8, 32), 10, 1, 1, "L=32"),
        (sparse2_content([0], [1], 2, 0, e=2, extra=b"\0" * 8), 1000, 2, 1, "2 escapes of 1"),
        # escapes and escape tokens disagree
        (sparse2_content([0, 1], [1, 2], 1, 0, e=1, extra=b"\0" * 4), 1000, 1, 2, "escape"),
        (
            sparse2_content([0, 1], [1, 2], 1, 0, token_override={0: 255}),
            300,
            1,
            2,
            "escape tokens and no escapes",
        ),
        # a low part that does not fit its L bits
        (sparse2_content([0, 1], [1, 2], 1, 3, low_override={1: 8}), 100, 1, 2, "3 bits"),
        (
            sparse2_content([0, 1], [1, 2], 1, 12, low_override={0: 1 << 12}),
            1 << 14,
            1,
            2,
            "12 bits",
        ),
        # positions past the end: one gap, and gaps adding up past the end
        (sparse2_content([10], [1], 2, 0), 10, 2, 1, "past the end"),
        (sparse2_content([5, 4], [1, 1], 2, 0), 10, 2, 2, "past the frame"),
        (sparse2_content([3, 3, 3], [1, 1, 1], 4, 1), 11, 4, 3, "past the frame"),
        (sparse2_content([70_000], [9], 1, 0), 70_000, 1, 1, "past the end"),
        (sparse2_content([(1 << 32) - 2, 0], [1, 1], 1, 4), (1 << 32) - 1, 1, 2, "past the frame"),
        # zero masks
        (sparse2_content([0], [0], 2, 0), 10, 2, 1, "zero mask"),
        (sparse2_content([0, 3, 0], [5, 0, 7], 8, 2), 10, 8, 3, "zero mask"),
        # frame sizes the codec cannot have
        (sparse2_content([0], [1], 1, 0), 0, 1, 1, "1 to 2^32 - 1"),
        (sparse2_content([0], [1], 1, 0), 1 << 32, 1, 1, "1 to 2^32 - 1"),
        (sparse2_content([0, 1], [1, 1], 1, 0), 1, 1, 2, "at most as many"),
    ],
)
def test_invalid_xor_sparse2_is_refused(
    body: bytes, n: int, size: int, changed: int, words: str
) -> None:
    err = assert_frame_error(FrameDecoder2().sparse2, zstd(body), n, size, changed)
    assert words in str(err)


def test_hand_built_frames_are_valid() -> None:
    """The builder above writes frames the decoder and the spec reading accept."""
    dec = FrameDecoder2()
    body = sparse2_content([3, 3, 2], [1, 2, 3], 4, 1)
    assert spec_decode(body, 11, 4) == ([3, 7, 10], [1, 2, 3])
    pos, masks = dec.sparse2(zstd(body), 11, 4, 3)
    assert pos.tolist() == [3, 7, 10] and masks.tolist() == [1, 2, 3]
    body = sparse2_content([69_999], [9], 1, 0)  # one escape: 69_999 - 255
    assert body[4] == 1
    assert dec.sparse2(zstd(body), 70_000, 1, 1)[0].tolist() == [69_999]
    body = sparse2_content([(1 << 32) - 2], [1], 1, 4)
    assert dec.sparse2(zstd(body), (1 << 32) - 1, 1, 1)[0].tolist() == [(1 << 32) - 2]
    body = sparse2_content([(1 << 13) + 5, 1], [1, 2], 1, 12)  # two low-byte planes
    assert dec.sparse2(zstd(body), 1 << 14, 1, 2)[0].tolist() == [8197, 8199]


@settings(FAST, max_examples=150)
@given(
    seed=SEEDS,
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4),
    cut=st.integers(0, 10**6),
)
def test_damaged_frames_fail_only_with_frame_error(
    seed: int, flips: list[tuple[int, int]], cut: int
) -> None:
    """Damage is a FrameError, or decodes to changes that keep the codec's invariants (a
    damaged mask byte in a raw block cannot be told from another valid frame without the
    Adler-32 checks of spec section 10.2); never another exception."""
    _, new, positions, masks = random_change(seed, 3000, 2, 200)
    enc, dec = FrameEncoder2(), FrameDecoder2()

    def damage(data: bytes) -> bytes:
        out = bytearray(data)
        for at, bits in flips:
            out[at % len(out)] ^= bits
        return bytes(out[: len(out) - cut % 3] if cut % 2 else out)

    try:
        pos, got = dec.sparse2(damage(enc.xor_sparse2(positions, masks)), 3000, 2, 200)
    except FrameError:
        pass
    else:
        assert pos.size == 200 and got.all()
        assert (np.diff(pos) > 0).all() and pos[0] >= 0 and pos[-1] < 3000
    out = np.empty_like(new)
    with contextlib.suppress(FrameError):
        dec.planes_into(damage(enc.raw_planes(new)), out)
    # the decoder still decodes undamaged frames
    pos, got = dec.sparse2(enc.xor_sparse2(positions, masks), 3000, 2, 200)
    np.testing.assert_array_equal(pos, positions)
    np.testing.assert_array_equal(got, masks)


# --- the worked examples of spec section 8.2.4 and 8.2.5 ----------------------------------------

SPEC = (Path(__file__).parent.parent / "docs" / "spec" / "format-v1.md").read_text()


def spec_hex_blocks(section: str) -> list[bytes]:
    """The hex content of each fenced block of a spec section (text before the first
    two-space gap of a line is hex; what follows is commentary)."""
    start = SPEC.index(f"#### {section}")
    end = SPEC.index("\n#### ", start + 1) if "\n#### " in SPEC[start + 1 :] else len(SPEC)
    text = SPEC[start:end]
    blocks = text.split("```")[1::2]
    out = []
    for block in blocks:
        rows = [line.split("   ")[0] for line in block.strip().splitlines()]
        if all(all(c in "0123456789abcdef " for c in row) for row in rows):
            out.append(bytes.fromhex("".join(rows)))
    return out


def test_spec_worked_examples_decode_and_are_what_the_writer_writes() -> None:
    """The two hex contents of the xor-sparse2 example (the writer's L = 5, and L = 0 with two
    escapes) decode, through the one dispatch, to the example's changes; the writer's frame
    decompresses to the first one byte for byte; the raw-planes example too."""
    positions = np.array([3, 300, 301, 999], dtype=np.int64)
    masks = np.array([0x0001, 0x0003, 0x0001, 0x007F], dtype=np.uint16)
    chosen, with_escapes = spec_hex_blocks("8.2.4")
    assert (len(chosen), len(with_escapes)) == (28, 32)
    dec = FrameDecoder()
    for content in (chosen, with_escapes):
        frame = zstandard.ZstdCompressor(write_content_size=True).compress(content)
        (ch,) = dec.changes(XOR_SPARSE2, frame, 1000, 2, 4)
        assert ch.positions is not None and ch.positions.tolist() == positions.tolist()
        assert ch.words.tolist() == masks.tolist()
    written = FrameEncoder2().xor_sparse2(positions, masks)
    assert zstandard.ZstdDecompressor().decompress(written) == chosen
    assert sparse2_bounds(1000, 2, 4) == (24, 52)  # the example's accepted content sizes
    example = SPEC.split("`raw-planes` content of the four")[1].split("\n\n")[0]
    planes = bytes.fromhex(example.split("`")[-2])
    words = np.array([0x3F80, 0xBC23, 0x0000, 0x3C24], dtype=np.uint16)
    frame = FrameEncoder2().raw_planes(words)
    assert zstandard.ZstdDecompressor().decompress(frame) == planes
    out = np.empty(4, np.uint16)
    dec.decode_into(RAW_PLANES, frame, out)
    assert out.tolist() == words.tolist()
