"""Frame codecs: round trips, codec choice, decoder limits, and end-to-end bit-exactness.

Arrays come from numpy generators seeded by hypothesis (fast for 100k+ elements); sizes,
densities, seeds and element sizes are drawn. Tensors are always compared through integer
views, never with float equality.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deltastore import Publisher, Subscriber
from deltastore.errors import DeltastoreError, FrameError
from deltastore.format import codecs
from deltastore.format.codecs import (
    CHUNK_BYTES,
    MAX_WINDOW_SIZE,
    RAW,
    RAW_PLANES,
    SPARSE_HEADER,
    XOR_DENSE,
    XOR_PATCH,
    XOR_SPARSE,
    XOR_SPARSE2,
    FrameDecoder,
    FrameEncoder,
)
from deltastore.format.codecs.v2 import FrameEncoder2, sparse2_bounds
from deltastore.format.dtypes import word_dtype

SIZES = [1, 2, 4, 8]
SEEDS = st.integers(0, 2**32 - 1)
# derandomize: the same examples on every run (deterministic CI); bounded for speed.
FAST = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --- helpers -------------------------------------------------------------------------------


def random_change(
    seed: int, n: int, size: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(old, new, sorted positions, masks): k distinct positions of n words change."""
    rng = np.random.default_rng(seed)
    wdt = word_dtype(size)
    old = rng.integers(0, 256, n * size, dtype=np.uint8).view(wdt)
    positions = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
    masks = rng.integers(0, 256, k * size, dtype=np.uint8).view(wdt)
    masks[masks == 0] = 1  # a change is a non-zero XOR mask
    new = old.copy()
    new[positions] ^= masks
    return old, new, positions, masks


@st.composite
def change_params(draw: st.DrawFn, max_n: int = 20_000) -> tuple[int, int, int, int]:
    """(size, n, k, seed) with 0 < k <= n and densities from one change to all elements."""
    size = draw(st.sampled_from(SIZES))
    n = draw(st.one_of(st.integers(1, 64), st.integers(1, max_n)))
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.06, 0.07, 0.3, 1.0]))
    k = draw(st.one_of(st.just(max(1, round(n * density))), st.integers(1, n)))
    return size, n, k, draw(SEEDS)


def chunked(dec: FrameDecoder, data: bytes, n: int, size: int) -> np.ndarray:
    """Reassemble the chunks of a dense frame, checking their order and sizes."""
    parts, expect = [], 0
    for first, words in dec.chunks(data, n, size):
        assert first == expect
        assert words.dtype == word_dtype(size)
        assert 0 < words.nbytes <= codecs.CHUNK_BYTES
        parts.append(words.copy())  # the yielded array is a reused buffer
        expect += words.size
    assert expect == n
    return np.concatenate(parts) if parts else np.zeros(0, word_dtype(size))


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=True).compress(data)


def sparse_frame(
    gaps: list[int],
    masks: list[int],
    size: int,
    *,
    width: int = 1,
    k: int | None = None,
    reserved: bytes = b"\0\0\0",
    extra: bytes = b"",
) -> bytes:
    """Hand-built xor-sparse frame (see the codecs module docstring for the layout)."""
    k = len(gaps) if k is None else k
    header = k.to_bytes(4, "little") + bytes([width]) + reserved
    gap_bytes = width if width in (1, 2, 4, 8) else 1
    g = np.array(gaps, dtype=word_dtype(gap_bytes))
    m = np.array(masks, dtype=word_dtype(size))
    body = g.view(np.uint8).reshape(-1, gap_bytes).T.tobytes()
    body += m.view(np.uint8).reshape(-1, size).T.tobytes()
    return zstd(header + body + extra)


def handmade_zstd(payload: bytes, content_size: int, window_log: int) -> bytes:
    """A zstd frame with one raw block, a 4-byte content size and an explicit window
    descriptor (not single-segment), so the window can be chosen independently of the size.
    zstd itself shrinks the window to the input size whenever the size is known, so a frame
    that both declares its content size and asks for a huge window has to be written by hand.
    """
    out = struct.pack("<I", 0xFD2FB528)
    out += bytes([2 << 6])  # frame header descriptor: 4-byte content size, no single segment
    out += bytes([(window_log - 10) << 3])  # window descriptor: exponent, mantissa 0
    out += struct.pack("<I", content_size)
    out += ((len(payload) << 3) | 1).to_bytes(3, "little")  # last block, raw, its size
    return out + payload


# --- xor-sparse ----------------------------------------------------------------------------


@FAST
@given(p=change_params(max_n=200_000))
@example(p=(1, 1, 1, 0))
@example(p=(8, 200_000, 2, 3))  # gaps above 65535: 4-byte gap plane
@example(p=(2, 70_000, 200, 4))  # gaps above 255: 2-byte gap plane
@example(p=(4, 3000, 3000, 5))  # every element changed: all gaps 0
def test_xor_sparse_round_trip(p: tuple[int, int, int, int]) -> None:
    size, n, k, seed = p
    old, new, positions, masks = random_change(seed, n, size, k)
    data = FrameEncoder().xor_sparse(positions, masks)
    got_pos, got_masks = FrameDecoder().sparse(data, n, size, k)
    assert got_pos.dtype == np.int64
    assert got_masks.dtype == word_dtype(size)
    np.testing.assert_array_equal(got_pos, positions)
    np.testing.assert_array_equal(got_masks, masks)
    # applying the decoded change to old gives new, bit for bit
    rebuilt = old.copy()
    rebuilt[got_pos] ^= got_masks
    np.testing.assert_array_equal(rebuilt, new)


@pytest.mark.parametrize(
    ("last", "width"), [(255, 1), (256, 2), (65535, 2), (65536, 4), (2**20, 4)]
)
def test_xor_sparse_gap_width_boundaries(last: int, width: int) -> None:
    positions = np.array([last], dtype=np.int64)
    masks = np.array([0x8001], dtype=np.uint16)
    data = FrameEncoder().xor_sparse(positions, masks)
    raw = zstandard.ZstdDecompressor().decompress(data)
    assert raw[4] == width
    assert len(raw) == SPARSE_HEADER + width + 2
    got_pos, got_masks = FrameDecoder().sparse(data, last + 1, 2, 1)
    assert got_pos.tolist() == [last] and got_masks.tolist() == [0x8001]
    with pytest.raises(FrameError):  # one element fewer: the position is past the end
        FrameDecoder().sparse(data, last, 2, 1)


def test_xor_sparse_empty() -> None:
    data = FrameEncoder().xor_sparse(np.zeros(0, np.int64), np.zeros(0, np.uint32))
    pos, masks = FrameDecoder().sparse(data, 10, 4, 0)
    assert pos.size == 0 and masks.size == 0


# --- raw and xor-dense ---------------------------------------------------------------------


@FAST
@given(p=change_params(max_n=50_000), small_chunks=st.booleans())
def test_dense_codecs_round_trip(p: tuple[int, int, int, int], small_chunks: bool) -> None:
    """``into`` and ``chunks`` reproduce raw and xor-dense frames; with ``small_chunks`` the
    chunk size is lowered to 4 KiB so frames span many chunks at random boundaries."""
    size, n, k, seed = p
    old, new, _, _ = random_change(seed, n, size, k)
    enc = FrameEncoder()
    raw, dense = enc.raw(new), enc.xor_dense(old ^ new)
    chunk = 4096 if small_chunks else CHUNK_BYTES
    with mock.patch.object(codecs, "CHUNK_BYTES", chunk):
        dec = FrameDecoder()
        out = np.empty(n, word_dtype(size))
        dec.into(raw, out)
        np.testing.assert_array_equal(out, new)
        dec.into(dense, out)
        np.testing.assert_array_equal(out ^ old, new)
        np.testing.assert_array_equal(chunked(dec, raw, n, size), new)
        np.testing.assert_array_equal(chunked(dec, dense, n, size) ^ old, new)
        # a 2-D output buffer is filled in C order
        if n % 2 == 0:
            out2 = np.empty((2, n // 2), word_dtype(size))
            dec.into(raw, out2)
            np.testing.assert_array_equal(out2.reshape(-1), new)


@pytest.mark.parametrize("size", SIZES)
def test_dense_frames_larger_than_a_chunk(size: int) -> None:
    """Frames of ~2.5 chunks (not a multiple of the chunk size) decode bit-exactly."""
    n = (5 * CHUNK_BYTES // 2) // size + 3
    old, new, _, _ = random_change(size, n, size, n // 50)
    enc, dec = FrameEncoder(), FrameDecoder()
    raw, dense = enc.raw(new), enc.xor_dense(old ^ new)
    firsts = [first for first, _ in dec.chunks(raw, n, size)]
    assert len(firsts) == 3
    assert firsts == [0, CHUNK_BYTES // size, 2 * CHUNK_BYTES // size]
    np.testing.assert_array_equal(chunked(dec, raw, n, size), new)
    np.testing.assert_array_equal(chunked(dec, dense, n, size) ^ old, new)
    out = np.empty(n, word_dtype(size))
    dec.into(dense, out)
    np.testing.assert_array_equal(out ^ old, new)
    # nonzero() of a chunk bigger than its reused buffer still finds every change
    np.testing.assert_array_equal(dec.nonzero(old ^ new), np.flatnonzero(old != new))


# --- codec choice --------------------------------------------------------------------------


@FAST
@given(p=change_params(max_n=30_000))
@example(p=(2, 1600, 100, 1))  # exactly 1/16 changed: only xor-sparse is tried
@example(p=(2, 1600, 101, 1))
@example(p=(1, 1000, 1000, 2))
def test_encode_delta_reproduces_new(p: tuple[int, int, int, int]) -> None:
    size, n, k, seed = p
    old, new, positions, masks = random_change(seed, n, size, k)
    enc = FrameEncoder()
    codec, data = enc.encode_delta(old, new, positions)
    assert codec in codecs.CODECS_V1
    dec = FrameDecoder()
    out = old.copy()
    if codec == XOR_SPARSE:
        pos, got_masks = dec.sparse(data, n, size, k)
        out[pos] ^= got_masks
    elif codec == XOR_DENSE:
        dec.into(data, out)
        out ^= old
    else:
        dec.into(data, out)
    np.testing.assert_array_equal(out, new)
    # the choice is the smallest candidate; dense codecs only above 1/16 changed
    sizes = {XOR_SPARSE: len(enc.xor_sparse(positions, masks))}
    if k * 16 > n:
        sizes[XOR_DENSE] = len(enc.xor_dense(old ^ new))
        sizes[RAW] = len(enc.raw(new))
    assert len(data) == min(sizes.values())
    assert codec in sizes


# --- decoder limits ------------------------------------------------------------------------


def assert_frame_error(call: object, *args: object) -> FrameError:
    assert callable(call)

    def run() -> None:
        result = call(*args)
        if isinstance(result, Iterator):  # chunks() is a generator: consume it
            list(result)

    with pytest.raises(FrameError) as info:
        run()
    assert isinstance(info.value, DeltastoreError)
    assert str(info.value)
    return info.value


def test_content_size_must_match_declared_size() -> None:
    words = np.arange(100, dtype=np.uint16)
    data = FrameEncoder().raw(words)
    dec = FrameDecoder()
    for n in (99, 101):
        err = assert_frame_error(dec.into, data, np.empty(n, np.uint16))
        assert "200" in str(err)
        assert_frame_error(dec.chunks, data, n, 2)
    # the same bytes read as another element size disagree too
    assert_frame_error(dec.chunks, data, 100, 4)
    # xor-sparse: content larger than its n elements can hold, or smaller than k changes need
    sparse = FrameEncoder().xor_sparse(np.arange(50, dtype=np.int64), np.ones(50, np.uint16))
    assert_frame_error(dec.sparse, sparse, 10, 2, 10)
    assert_frame_error(dec.sparse, sparse, 100, 2, 60)
    # the decoder is still usable after the errors
    out = np.empty(100, np.uint16)
    dec.into(data, out)
    np.testing.assert_array_equal(out, words)


def test_frame_without_content_size_is_refused() -> None:
    words = np.arange(1000, dtype=np.uint32)
    data = zstandard.ZstdCompressor(write_content_size=False).compress(words.tobytes())
    assert zstandard.get_frame_parameters(data).content_size == zstandard.CONTENTSIZE_UNKNOWN
    dec = FrameDecoder()
    err = assert_frame_error(dec.into, data, np.empty(1000, np.uint32))
    assert "content" in str(err)
    assert_frame_error(dec.chunks, data, 1000, 4)
    pos = np.arange(3, dtype=np.int64)
    header = (3).to_bytes(4, "little") + b"\x01\0\0\0"
    body = header + bytes(3) + np.ones(3, np.uint32).view(np.uint8).reshape(3, 4).T.tobytes()
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(body)
    assert_frame_error(dec.sparse, no_size, 10, 4, 3)
    # the same body with a content size decodes
    got, _ = dec.sparse(zstd(body), 10, 4, 3)
    np.testing.assert_array_equal(got, pos)


@pytest.mark.parametrize("window_log", [28, 31])
def test_huge_window_is_refused(window_log: int) -> None:
    payload = bytes(range(256)) * 4
    data = handmade_zstd(payload, len(payload), window_log)
    params = zstandard.get_frame_parameters(data)
    assert params.content_size == len(payload)
    assert params.window_size == 1 << window_log > MAX_WINDOW_SIZE
    dec = FrameDecoder()
    err = assert_frame_error(dec.into, data, np.empty(len(payload), np.uint8))
    assert "window" in str(err)
    assert_frame_error(dec.chunks, data, len(payload) // 4, 4)
    sparse_payload = (1).to_bytes(4, "little") + b"\x01\0\0\0" + b"\x05\x07"
    big = handmade_zstd(sparse_payload, len(sparse_payload), window_log)
    assert_frame_error(dec.sparse, big, 10, 1, 1)
    # the hand-made frame is valid: the window limit is the only reason for the refusal
    ok = FrameDecoder(max_window_size=1 << window_log)
    out = np.empty(len(payload), np.uint8)
    ok.into(data, out)
    assert out.tobytes() == payload
    pos, masks = ok.sparse(big, 10, 1, 1)
    assert pos.tolist() == [5] and masks.tolist() == [7]
    # zstandard itself writes a 2**31 window only when streaming, without a content size
    cparams = zstandard.ZstdCompressionParameters.from_level(1, window_log=31)
    cobj = zstandard.ZstdCompressor(compression_params=cparams).compressobj()
    streamed = cobj.compress(payload) + cobj.flush()
    assert zstandard.get_frame_parameters(streamed).window_size == 1 << 31
    assert_frame_error(dec.into, streamed, np.empty(len(payload), np.uint8))
    # and a window at the limit is accepted by the default decoder
    at_limit = handmade_zstd(payload, len(payload), MAX_WINDOW_SIZE.bit_length() - 1)
    dec.into(at_limit, out)
    assert out.tobytes() == payload


def test_lying_content_size_is_refused() -> None:
    """A header that declares more bytes than the blocks hold: zstd's corruption check."""
    payload = bytes(range(200))
    data = handmade_zstd(payload, 400, 20)
    dec = FrameDecoder()
    assert_frame_error(dec.into, data, np.empty(400, np.uint8))
    assert_frame_error(dec.chunks, data, 200, 2)
    sparse_payload = (1).to_bytes(4, "little") + b"\x01\0\0\0" + b"\x05\x07"
    assert_frame_error(dec.sparse, handmade_zstd(sparse_payload, 12, 20), 10, 1, 1)


GARBAGE = [
    b"",
    b"\x00",
    b"\x28\xb5\x2f\xfd",  # magic only
    b"not a zstd frame at all, just text",
    bytes(64),
    struct.pack("<II", 0x184D2A50, 16) + bytes(16),  # a skippable frame
]


@pytest.mark.parametrize("data", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_is_refused(data: bytes) -> None:
    dec = FrameDecoder()
    assert_frame_error(dec.into, data, np.empty(8, np.uint16))
    assert_frame_error(dec.chunks, data, 8, 2)
    assert_frame_error(dec.sparse, data, 8, 2, 1)


@pytest.mark.parametrize("size", SIZES)
def test_truncated_frames_are_refused(size: int) -> None:
    _, new, positions, masks = random_change(7, 5000, size, 700)
    enc, dec = FrameEncoder(), FrameDecoder()
    raw = enc.raw(new)
    sparse = enc.xor_sparse(positions, masks)
    for cut in (len(raw) // 2, len(raw) - 1, 6):
        assert_frame_error(dec.into, raw[:cut], np.empty(5000, word_dtype(size)))
        assert_frame_error(dec.chunks, raw[:cut], 5000, size)
    for cut in (len(sparse) // 2, len(sparse) - 1, 6):
        assert_frame_error(dec.sparse, sparse[:cut], 5000, size, 700)
    # the decoder recovers after the errors
    out = np.empty(5000, word_dtype(size))
    dec.into(raw, out)
    np.testing.assert_array_equal(out, new)


@pytest.mark.parametrize(
    ("frame", "n", "size", "changed", "words"),
    [
        # header count disagrees with the manifest's count
        (sparse_frame([0, 1, 2], [1, 2, 3], 2), 10, 2, 2, "declares 2"),
        (sparse_frame([0, 1, 2], [1, 2, 3], 2), 10, 2, 4, "outside the [20, 68]"),
        # header count disagrees with the body length
        (sparse_frame([0, 1, 2], [1, 2, 3], 2, k=2), 10, 2, 2, "declares 2"),
        (sparse_frame([0, 1], [1, 2], 2, extra=b"\x01"), 10, 2, 2, "holds 2"),
        # zero masks
        (sparse_frame([0], [0], 2), 10, 2, 1, "zero mask"),
        (sparse_frame([0, 3, 0], [5, 0, 7], 8), 10, 8, 3, "zero mask"),
        # positions past the end: a single gap, and gaps adding up past the end
        (sparse_frame([10], [1], 2), 10, 2, 1, "past the end"),
        (sparse_frame([5, 4], [1, 1], 2), 10, 2, 2, "past the frame"),
        (sparse_frame([3, 3, 3], [1, 1, 1], 4), 11, 4, 3, "past the frame"),
        (sparse_frame([70_000], [9], 1, width=4), 70_000, 1, 1, "past the end"),
        # bad gap widths and reserved bytes
        (sparse_frame([0], [1], 2, width=0), 10, 2, 1, "gap width 0"),
        (sparse_frame([0], [1], 2, width=3), 10, 2, 1, "gap width 3"),
        (sparse_frame([0], [1], 2, width=8), 10, 2, 1, "gap width 8"),
        (sparse_frame([0], [1], 2, reserved=b"\0\x01\0"), 10, 2, 1, "gap width 1"),
    ],
)
def test_invalid_xor_sparse_is_refused(
    frame: bytes, n: int, size: int, changed: int, words: str
) -> None:
    err = assert_frame_error(FrameDecoder().sparse, frame, n, size, changed)
    assert words in str(err)


def test_hand_built_sparse_frame_is_valid() -> None:
    """The helper used above builds frames the decoder accepts when they are well-formed."""
    pos, masks = FrameDecoder().sparse(sparse_frame([3, 3, 2], [1, 2, 3], 4), 11, 4, 3)
    assert pos.tolist() == [3, 7, 10] and masks.tolist() == [1, 2, 3]
    pos, masks = FrameDecoder().sparse(sparse_frame([69_999], [9], 1, width=4), 70_000, 1, 1)
    assert pos.tolist() == [69_999] and masks.tolist() == [9]


# --- end to end: Publisher -> local store -> Subscriber ------------------------------------

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _hex(patterns: str) -> list[int]:
    return [int(p, 16) for p in patterns.split()]


#: Bit patterns worth round-tripping: signed zeros, infinities, NaNs with different payloads
#: and signs, subnormals, extremes. Float equality would confuse +0/-0 and miss NaN changes.
SPECIALS: dict[str, list[int]] = {
    # +0 -0 +inf -inf qNaN -qNaN sNaN-payload max-payload-NaN all-ones subnormals min-normal max
    "bfloat16": _hex("0000 8000 7F80 FF80 7FC0 FFC0 7F81 7FFF FFFF 0001 8001 007F 807F 0080 7F7F"),
    "float16": _hex("0000 8000 7C00 FC00 7E00 FE00 7C01 7FFF FFFF 0001 8001 03FF 83FF 0400 7BFF"),
    "float32": _hex(
        "00000000 80000000 7F800000 FF800000 7FC00000 FFC00000 7F800001 7FFFFFFF FFFFFFFF "
        "00000001 80000001 007FFFFF 00800000 7F7FFFFF"
    ),
    "float64": _hex(
        "0 8000000000000000 7FF0000000000000 FFF0000000000000 7FF8000000000000 "
        "FFF8000000000000 7FF0000000000001 7FFFFFFFFFFFFFFF FFFFFFFFFFFFFFFF "
        "1 8000000000000001 000FFFFFFFFFFFFF 0010000000000000 7FEFFFFFFFFFFFFF"
    ),
    # e4m3fn: no infinities; 7F/FF are NaN, 01-07 subnormal
    "float8_e4m3fn": _hex("00 80 7F FF 01 81 07 87 08 7E FE"),
    "int8": _hex("00 80 7F FF 01"),
    "uint8": _hex("00 80 7F FF 01"),
    "int64": _hex("0 8000000000000000 7FFFFFFFFFFFFFFF FFFFFFFFFFFFFFFF 1"),
    "bool": [0, 1],
}
E2E_DTYPES = list(SPECIALS)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's memory (what 'bit-wise equal' means in these tests)."""
    return t.detach().contiguous().view(INT_VIEW[t.element_size()])


def assert_bit_equal(expected: dict[str, torch.Tensor], got: Any) -> None:
    assert got is not None
    assert set(got) == set(expected)
    for name, t in expected.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(bits(g), bits(t)), name


def tensor_of(words: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    size = words.dtype.itemsize
    signed = np.dtype(f"<i{size}") if size > 1 else np.dtype(np.uint8)
    return torch.from_numpy(words.view(signed).copy()).view(dtype).reshape(shape)


def random_words(rng: np.random.Generator, name: str, count: int, special: float) -> np.ndarray:
    size = getattr(torch, name).itemsize
    wdt = word_dtype(size)
    if name == "bool":
        words = rng.integers(0, 2, count, dtype=np.uint8)
    else:
        words = rng.integers(0, 256, count * size, dtype=np.uint8).view(wdt)
    pick = rng.random(count) < special
    choices = np.array(SPECIALS[name], dtype=wdt)
    words[pick] = rng.choice(choices, int(pick.sum()))
    return words


def forced_codecs() -> Any:
    """A replacement for FrameEncoder.encode_delta that cycles through every codec."""
    order = itertools.cycle([XOR_DENSE, RAW, XOR_SPARSE])

    def encode_delta(
        self: FrameEncoder,
        old: np.ndarray,
        new: np.ndarray,
        positions: np.ndarray,
        *,
        masks: np.ndarray | None = None,
        sparse2: object = None,
    ) -> tuple[str, bytes]:
        codec = next(order)
        if codec == XOR_SPARSE:
            return codec, self.xor_sparse(positions, old[positions] ^ new[positions])
        if codec == XOR_DENSE:
            return codec, self.xor_dense(old ^ new)
        return codec, self.raw(new)

    return encode_delta


@st.composite
def e2e_cases(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "seed": draw(SEEDS),
        "n": draw(st.integers(1, 3000)),
        "rows": draw(st.integers(1, 40)),
        "versions": draw(st.integers(2, 4)),
        "density": draw(st.sampled_from([0.0, 0.002, 0.03, 0.2, 1.0])),
        "special": draw(st.sampled_from([0.0, 0.3, 1.0])),
        "frames": draw(st.sampled_from([1, 2, 7, 40])),  # frames per tensor, at most
        "force_codecs": draw(st.booleans()),
    }


@pytest.mark.parametrize("dtype_name", E2E_DTYPES)
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=e2e_cases())
def test_publish_subscribe_is_bit_exact(
    dtype_name: str, case: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    rng = np.random.default_rng(case["seed"])
    dtype = getattr(torch, dtype_name)
    n, rows = int(case["n"]), int(case["rows"])
    shapes = {"flat": (n,), "matrix": (rows, n % 7 + 1), "scalar": (), "empty": (0,)}
    words = {
        name: random_words(rng, dtype_name, int(np.prod(shape)), float(case["special"]))
        for name, shape in shapes.items()
    }
    store = tmp_path_factory.mktemp("e2e")
    frame_bytes = max(8, -(-n // case["frames"]) * dtype.itemsize)
    pub = Publisher(store, max_frame_bytes=frame_bytes)
    states: list[dict[str, torch.Tensor]] = []
    for v in range(1, int(case["versions"]) + 1):
        if v > 1:
            for name, w in words.items():
                w = w.copy()
                hit = rng.random(w.size) < float(case["density"])
                w[hit] = random_words(rng, dtype_name, int(hit.sum()), 0.5)
                words[name] = w
        states.append({name: tensor_of(words[name], dtype, shapes[name]) for name in shapes})
        if case["force_codecs"]:
            with mock.patch.object(FrameEncoder, "encode_delta", forced_codecs()):
                report = pub.publish(states[-1], version=v)
        else:
            report = pub.publish(states[-1], version=v)
        assert report.kind == ("anchor" if v == 1 else "delta")

    # a long-lived subscriber follows every version
    follower = Subscriber(store, max_workers=2)
    for v, state in enumerate(states, start=1):
        assert follower.sync(v).version == v
        assert_bit_equal(state, follower.tensors)
    # a fresh subscriber bootstraps from the anchor and replays to the newest version
    fresh = Subscriber(store)
    assert fresh.sync().version == len(states)
    assert_bit_equal(states[-1], fresh.tensors)
    # a subscriber handed tensors at v1 applies every delta in place
    mine = {name: t.clone() for name, t in states[0].items()}
    attached = Subscriber(store, tensors=mine, version=1)
    attached.sync()
    assert attached.tensors is mine
    assert_bit_equal(states[-1], mine)


@pytest.mark.parametrize("dtype_name", [d for d in E2E_DTYPES if "float" in d])
def test_float_equal_changes_are_published(dtype_name: str, tmp_path: Path) -> None:
    """Changes that float comparison cannot see (+0 <-> -0, one NaN payload to another)
    are detected, published and applied bit-exactly."""
    dtype = getattr(torch, dtype_name)
    size = dtype.itemsize
    wdt = word_dtype(size)
    specials = np.array(SPECIALS[dtype_name], dtype=wdt)
    v1_words = np.tile(specials, 50)
    v2_words = np.roll(v1_words, 1)  # every element changes to another special value
    assert (v1_words != v2_words).all()
    v1 = {"w": tensor_of(v1_words, dtype, (v1_words.size,))}
    v2 = {"w": tensor_of(v2_words, dtype, (v2_words.size,))}
    pub = Publisher(tmp_path, max_frame_bytes=64)
    pub.publish(v1, version=1)
    report = pub.publish(v2, version=2)
    assert report.kind == "delta"
    assert report.changed_elements == v1_words.size
    mine = {"w": v1["w"].clone()}
    sub = Subscriber(tmp_path, tensors=mine, version=1)
    sub.sync()
    assert_bit_equal(v2, mine)
    # a signed-zero-only change: +0 -> -0 is one changed element
    zeros = np.zeros(16, dtype=wdt)
    neg = zeros.copy()
    neg[5] = 1 << (8 * size - 1)
    pub2 = Publisher(tmp_path / "zeros")
    pub2.publish({"z": tensor_of(zeros, dtype, (16,))}, version=1)
    assert pub2.publish({"z": tensor_of(neg, dtype, (16,))}, version=2).changed_elements == 1
    sub2 = Subscriber(tmp_path / "zeros")
    sub2.sync()
    assert bits(sub2.tensors["z"]).numpy().view(wdt).tolist() == neg.tolist()


@pytest.mark.parametrize("codec_set", ["v1", "v2"])
def test_delta_codec_choice_end_to_end(tmp_path: Path, codec_set: str) -> None:
    """The publisher's own choice: few changes -> xor-sparse (``"v2"``: or xor-sparse2), a
    tensor that becomes one constant -> raw (``"v2"``: raw-planes); both decode bit-exactly.
    ``codecs="v1"`` writes only the 0.1.0 codecs, anchor included."""
    rng = np.random.default_rng(11)
    n = 20_000
    v1_words = {k: rng.integers(0, 1 << 16, n, dtype=np.uint16) for k in ("s", "r")}
    v2_words = {k: w.copy() for k, w in v1_words.items()}
    v2_words["s"][rng.choice(n, 50, replace=False)] ^= 0x0101
    v2_words["r"][:] = 0x7FC0  # every element becomes the same NaN
    v1 = {k: tensor_of(w, torch.bfloat16, (n,)) for k, w in v1_words.items()}
    v2 = {k: tensor_of(w, torch.bfloat16, (n,)) for k, w in v2_words.items()}
    pub = Publisher(tmp_path, max_frame_bytes=8192, codecs=codec_set)  # type: ignore[arg-type]
    pub.publish(v1, version=1)
    report = pub.publish(v2, version=2)
    manifest = Subscriber(tmp_path).manifest(2)
    sparse = {f.codec for f in manifest.tensors["s"].frames}
    replaced = {f.codec for f in manifest.tensors["r"].frames}
    anchor = {f.codec for t in Subscriber(tmp_path).manifest(1).tensors.values() for f in t.frames}
    if codec_set == "v1":
        assert set(report.codecs) == {XOR_SPARSE, RAW}
        assert sparse == {XOR_SPARSE} and replaced == {RAW} and anchor == {RAW}
    else:
        assert sparse <= {XOR_SPARSE, XOR_SPARSE2} and replaced == {RAW_PLANES}
        # random 16-bit words hardly shrink: raw-planes only where it is smaller, else raw
        assert anchor <= {RAW, RAW_PLANES}
    mine = {k: t.clone() for k, t in v1.items()}
    Subscriber(tmp_path, tensors=mine, version=1).sync()
    assert_bit_equal(v2, mine)


def test_every_codec_in_one_delta(tmp_path: Path) -> None:
    """Frames of one delta forced through raw, xor-dense and xor-sparse in turn, over many
    frames of several dtypes: the subscriber reproduces every version bit-exactly."""
    rng = np.random.default_rng(12)
    dtypes = {"bf": torch.bfloat16, "f32": torch.float32, "f8": torch.float8_e4m3fn}
    words = {k: random_words(rng, str(dt).split(".")[1], 5000, 0.2) for k, dt in dtypes.items()}
    states = [{k: tensor_of(words[k], dt, (50, 100)) for k, dt in dtypes.items()}]
    pub = Publisher(tmp_path, max_frame_bytes=1024)
    pub.publish(states[0], version=1)
    with mock.patch.object(FrameEncoder, "encode_delta", forced_codecs()):
        for v in (2, 3):
            for k, dt in dtypes.items():
                w = words[k].copy()
                hit = rng.random(w.size) < 0.05
                w[hit] = random_words(rng, str(dt).split(".")[1], int(hit.sum()), 0.5)
                words[k] = w
            states.append({k: tensor_of(words[k], dt, (50, 100)) for k, dt in dtypes.items()})
            report = pub.publish(states[-1], version=v)
            assert set(report.codecs) == {RAW, XOR_DENSE, XOR_SPARSE}
    follower = Subscriber(tmp_path)
    for v, state in enumerate(states, start=1):
        follower.sync(v)
        assert_bit_equal(state, follower.tensors)


# --- the codec dispatch: FrameDecoder.changes / decode_into / content_bound -----------------


def apply_changes(
    dec: FrameDecoder, codec: str, data: bytes, old: np.ndarray, changed: int
) -> np.ndarray:
    """``old`` with every :class:`codecs.Changes` of the frame applied (a copy)."""
    out = old.copy()
    for ch in dec.changes(codec, data, old.size, old.dtype.itemsize, changed):
        if ch.positions is not None:
            assert ch.first == 0 and ch.positions.dtype == np.int64
            if ch.xor:
                out[ch.positions] ^= ch.words
            else:
                out[ch.positions] = ch.words
        elif ch.xor:
            out[ch.first : ch.first + ch.words.size] ^= ch.words
        else:
            out[ch.first : ch.first + ch.words.size] = ch.words
    return out


@FAST
@given(change_params(max_n=(CHUNK_BYTES >> 1) + 1000))
def test_changes_of_every_codec_rebuild_the_new_words(params: tuple[int, int, int, int]) -> None:
    size, n, k, seed = params
    old, new, positions, masks = random_change(seed, n, size, k)
    enc, dec = FrameEncoder(), FrameDecoder()
    v2 = FrameEncoder2()
    frames = {
        RAW: enc.raw(new),
        XOR_DENSE: enc.xor_dense(old ^ new),
        XOR_SPARSE: enc.xor_sparse(positions, masks),
        XOR_SPARSE2: v2.xor_sparse2(positions, masks),
        RAW_PLANES: v2.raw_planes(new),
        # every other change sent as its absolute new word
        XOR_PATCH: enc.xor_patch(
            positions,
            np.where(np.arange(k) % 2 == 1, new[positions], masks),
            np.arange(k) % 2 == 1,
        ),
    }
    assert set(frames) == set(codecs.CODECS)
    for codec, data in frames.items():
        assert np.array_equal(apply_changes(dec, codec, data, old, k), new), codec
    for codec in codecs.NEW_WORDS_CODECS:
        out = np.empty_like(new)
        dec.decode_into(codec, frames[codec], out)
        assert np.array_equal(out, new), codec


def test_changes_are_sparse_for_xor_sparse_and_dense_runs_otherwise() -> None:
    old, new, positions, masks = random_change(7, 5000, 2, 40)
    enc, dec = FrameEncoder(), FrameDecoder()
    v2 = FrameEncoder2()
    for codec, data in (
        (XOR_SPARSE, enc.xor_sparse(positions, masks)),
        (XOR_SPARSE2, v2.xor_sparse2(positions, masks)),
    ):
        (sparse,) = dec.changes(codec, data, 5000, 2, 40)
        assert sparse.positions is not None and np.array_equal(sparse.positions, positions)
        assert np.array_equal(sparse.words, masks) and sparse.xor
    for codec, data, xor in (
        (RAW, enc.raw(new), False),
        (XOR_DENSE, enc.xor_dense(old ^ new), True),
        (RAW_PLANES, v2.raw_planes(new), False),
    ):
        runs = [
            (ch.first, ch.words.copy(), ch.xor, ch.positions)
            for ch in dec.changes(codec, data, 5000, 2, 40)
        ]
        assert [r[0] for r in runs] == [0] and all(r[2] is xor and r[3] is None for r in runs)
        assert np.array_equal(runs[0][1], old ^ new if xor else new)


def test_an_unknown_codec_is_a_frame_error_at_once() -> None:
    dec = FrameDecoder()
    data = FrameEncoder().raw(np.arange(10, dtype=np.uint16))
    with pytest.raises(FrameError, match=r"unknown frame codec 'xor-planes'.*upgrade deltastore"):
        dec.changes("xor-planes", data, 10, 2, 10)
    with pytest.raises(FrameError, match=r"unknown frame codec.*upgrade deltastore"):
        codecs.content_bound("xor-planes", 10, 2)
    with pytest.raises(FrameError, match=r"unknown frame codec.*upgrade deltastore"):
        dec.decode_into("xor-planes", data, np.empty(10, np.uint16))


def test_decode_into_takes_only_frames_of_new_words() -> None:
    words = np.arange(100, dtype=np.uint32)
    enc, dec = FrameEncoder(), FrameDecoder()
    out = np.empty_like(words)
    dec.decode_into(RAW, enc.raw(words), out)
    assert np.array_equal(out, words)
    out2 = np.empty_like(words)
    dec.decode_into(RAW_PLANES, FrameEncoder2().raw_planes(words), out2)
    assert np.array_equal(out2, words)
    for codec, data in (
        (XOR_DENSE, enc.xor_dense(words)),
        (XOR_SPARSE, enc.xor_sparse(words[1:3].astype(np.int64), words[1:3])),
        (XOR_SPARSE2, FrameEncoder2().xor_sparse2(words[1:3].astype(np.int64), words[1:3])),
    ):
        with pytest.raises(FrameError, match="no new words"):
            dec.decode_into(codec, data, out)


def test_content_bound_is_the_largest_content_of_each_codec() -> None:
    assert codecs.content_bound(RAW, 1000, 2) == codecs.content_bound(XOR_DENSE, 1000, 2) == 2000
    assert codecs.content_bound(XOR_SPARSE, 1000, 2) == codecs.sparse_bound(1000, 2) == 8 + 6000
    assert codecs.content_bound(RAW_PLANES, 1000, 2) == 2000
    # xor-sparse2: the largest content of any changed count (all changed, L = 31, escapes)
    assert codecs.content_bound(XOR_SPARSE2, 1000, 2) == 12 + 1000 * 7 + 4 * 3
    for changed in (0, 1, 10, 500, 1000):
        assert sparse2_bounds(1000, 2, changed)[1] <= codecs.content_bound(XOR_SPARSE2, 1000, 2)


def test_changes_keep_the_decoder_limits() -> None:
    """The dispatch checks the content size against the manifest's bound before decompressing:
    a frame claiming more than ``n * size`` (dense) or too few changes (sparse) is refused."""
    enc, dec = FrameEncoder(), FrameDecoder()
    words = np.arange(64, dtype=np.uint16)
    with pytest.raises(FrameError, match="content bytes"):
        list(dec.changes(RAW, enc.raw(words), 32, 2, 32))
    positions = np.arange(0, 64, 2, dtype=np.int64)
    with pytest.raises(FrameError):
        list(dec.changes(XOR_SPARSE, enc.xor_sparse(positions, words[positions] | 1), 64, 2, 40))
