"""The ``xor-patch`` codec (format edition 4): XOR entries and absolute new words in one frame.

Round trips over every word size, mixes and runs of absolute entries and escaped gaps; hostile
frames refused with :class:`FrameError` (before decompressing where the size is the problem);
its row of the codec table. The receivers that apply it are in ``tests/test_patch_receivers.py``.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore.errors import FrameError
from deltastore.format import codecs
from deltastore.format.codecs import (
    CODEC_TABLE,
    CODECS_V1,
    XOR_PATCH,
    FrameDecoder,
    FrameEncoder,
    codec_spec,
    content_bound,
    stored_bound,
)
from deltastore.format.codecs.patch import flag_bytes, patch_bounds, patch_size
from deltastore.format.codecs.v2 import byte_planes, position_gaps, position_parts
from deltastore.format.dtypes import word_dtype

FAST = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def entries(
    seed: int, n: int, size: int, k: int, p_abs: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(old words, positions, words, absolute): ``k`` distinct positions of ``n`` elements,
    a fraction ``p_abs`` of them absolute (new words, some equal to the old one), the others
    XOR masks (never zero)."""
    rng = np.random.default_rng(seed)
    dt = word_dtype(size)
    old = rng.integers(0, 256, n * size, dtype=np.uint8).view(dt)
    pos = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
    absolute = rng.random(k) < p_abs
    masks = rng.integers(0, 256, k * size, dtype=np.uint8).view(dt).copy()
    masks[masks == 0] = 1
    news = old[pos] ^ masks
    same = rng.random(k) < 0.25  # absolute entries that leave the element as it is
    news[same] = old[pos][same]
    words = np.where(absolute, news, masks)
    return old, pos, words, absolute


def apply(old: np.ndarray, dec: FrameDecoder, data: bytes, changed: int) -> np.ndarray:
    """``old`` with the frame's changes applied (a copy), checking the parts' order."""
    out: np.ndarray = old.copy()
    parts = list(dec.changes(XOR_PATCH, data, old.size, old.dtype.itemsize, changed))
    assert [p.xor for p in parts] in ([True], [False], [True, False])
    for p in parts:
        assert p.positions is not None and p.positions.dtype == np.int64 and p.first == 0
        assert bool(np.all(np.diff(p.positions) > 0))
        if p.xor:
            assert p.words.all()
            out[p.positions] ^= p.words
        else:
            out[p.positions] = p.words
    return out


def expected(
    old: np.ndarray, pos: np.ndarray, words: np.ndarray, absolute: np.ndarray
) -> np.ndarray:
    """What applying the entries must give: new words where absolute, else old XOR mask."""
    out: np.ndarray = old.copy()
    out[pos] = np.where(absolute, words, old[pos] ^ words)
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


@FAST
@given(
    size=st.sampled_from([1, 2, 4, 8]),
    n=st.one_of(st.integers(1, 64), st.integers(1, 20_000)),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.3, 1.0]),
    p_abs=st.sampled_from([0.0, 0.01, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_of_mixed_entries(
    size: int, n: int, density: float, p_abs: float, seed: int
) -> None:
    k = max(1, round(n * density))
    old, pos, words, absolute = entries(seed, n, size, k, p_abs)
    enc, dec = FrameEncoder(), FrameDecoder()
    data = enc.xor_patch(pos, words, absolute)
    assert len(data) <= stored_bound(XOR_PATCH, n, size, k)
    assert same_bits(apply(old, dec, data, k), expected(old, pos, words, absolute))
    # the same bytes from a "v2" encoder and at another zstd level decode the same
    for other in (FrameEncoder(codecs="v2"), FrameEncoder(level=3)):
        again = other.xor_patch(pos, words, absolute)
        assert same_bits(apply(old, dec, again, k), expected(old, pos, words, absolute))


def test_an_all_absolute_block_costs_little_more_than_its_words() -> None:
    """A block whose old words are unknown: positions 0..n-1, all absolute. The positions and
    flags compress to almost nothing: within 1% of a ``raw`` frame of the same words."""
    rng = np.random.default_rng(3)
    n = 1 << 16
    new = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    enc, dec = FrameEncoder(codecs="v2"), FrameDecoder()
    data = enc.xor_patch(np.arange(n), new, np.ones(n, np.bool_))
    assert len(data) <= 1.01 * len(enc.raw(new))
    (part,) = dec.changes(XOR_PATCH, data, n, 2, n)
    assert not part.xor and part.positions is not None
    assert np.array_equal(part.positions, np.arange(n)) and same_bits(part.words, new)


def header_of(data: bytes) -> tuple[int, int, int]:
    k, e, low_bits, _ = struct.unpack_from("<IIB3s", zstandard.ZstdDecompressor().decompress(data))
    return k, e, low_bits


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_escaped_gaps_round_trip(size: int) -> None:
    """Dense entries then far ones: ``L`` is small and the far gaps exceed ``255 << L``."""
    n = 3_000_000
    pos = np.concatenate([np.arange(2000), [2_500_000, 2_999_999]]).astype(np.int64)
    k = pos.size
    rng = np.random.default_rng(size)
    old = rng.integers(0, 256, n * size, dtype=np.uint8).view(word_dtype(size))
    absolute = np.arange(k) % 3 == 0
    words = rng.integers(1, 256, k).astype(word_dtype(size))
    data = FrameEncoder().xor_patch(pos, words, absolute)
    hk, e, low_bits = header_of(data)
    assert (hk, e) == (k, 2) and (2_499_999 - 2000) >> low_bits >= 255
    assert same_bits(apply(old, FrameDecoder(), data, k), expected(old, pos, words, absolute))


def test_changes_yield_only_the_parts_that_have_entries() -> None:
    dec, enc = FrameDecoder(), FrameEncoder()
    pos = np.array([2, 5, 9])
    words = np.array([1, 2, 3], np.uint16)
    for absolute, kinds in (
        (np.zeros(3, np.bool_), [True]),
        (np.ones(3, np.bool_), [False]),
        (np.array([True, False, True]), [True, False]),
    ):
        parts = list(dec.changes(XOR_PATCH, enc.xor_patch(pos, words, absolute), 10, 2, 3))
        assert [p.xor for p in parts] == kinds
        got: dict[int, tuple[bool, int]] = {}
        for c in parts:
            assert c.positions is not None
            got |= {int(p): (c.xor, int(w)) for p, w in zip(c.positions, c.words, strict=True)}
        assert got == {2: (not absolute[0], 1), 5: (not absolute[1], 2), 9: (not absolute[2], 3)}


# --- the codec table and the writer's choice ---------------------------------------------------


def test_table_row_and_codec_sets() -> None:
    spec = codec_spec(XOR_PATCH)
    assert spec.needs_parent and spec.sparse and not spec.new_words and spec.into is None
    assert spec.codec_set is None  # in no codec set: written on request only
    assert CODECS_V1 == ("raw", "xor-dense", "xor-sparse")
    assert XOR_PATCH in CODEC_TABLE and XOR_PATCH not in codecs.NEW_WORDS_CODECS
    assert content_bound(XOR_PATCH, 1000, 2) == 12 + 1000 * 7 + 4 * 3 + 125
    for changed in (1, 7, 8, 9, 500, 1000):
        lo, hi = patch_bounds(1000, 2, changed)
        assert (
            lo == 12 + changed * 3 + flag_bytes(changed) <= hi <= content_bound(XOR_PATCH, 1000, 2)
        )
    with pytest.raises(FrameError, match="holds no new words"):
        FrameDecoder().decode_into(XOR_PATCH, b"", np.zeros(4, np.uint16))


@pytest.mark.parametrize("codec_set", ["v1", "v2"])
@pytest.mark.parametrize("k", [1, 40, 900, 4000])
def test_encode_delta_never_picks_xor_patch(codec_set: str, k: int) -> None:
    rng = np.random.default_rng(k)
    old = rng.integers(0, 1 << 16, 4000, dtype=np.uint16)
    new = old.copy()
    pos = np.sort(rng.choice(4000, size=k, replace=False))
    new[pos] ^= 1
    codec, _ = FrameEncoder(codecs=codec_set).encode_delta(old, new, pos)  # type: ignore[arg-type]
    assert codec != XOR_PATCH


def test_the_encoder_refuses_what_no_reader_accepts() -> None:
    enc = FrameEncoder()
    w = np.array([1, 2], np.uint16)
    for pos, words, absolute, msg in (
        (np.array([3, 3]), w, np.zeros(2, np.bool_), "strictly increasing"),
        (np.array([4, 3]), w, np.zeros(2, np.bool_), "strictly increasing"),
        (np.array([-1, 3]), w, np.zeros(2, np.bool_), r"\[0, 2\^32 - 1\)"),
        (np.array([1, 3]), np.array([0, 2], np.uint16), np.zeros(2, np.bool_), "non-zero"),
        (np.array([1]), w, np.zeros(2, np.bool_), "differ in length"),
        (np.array([], np.int64), w[:0], np.zeros(0, np.bool_), "at least one entry"),
    ):
        with pytest.raises(ValueError, match=msg):
            enc.xor_patch(pos, words, absolute)
    # a zero word is fine as an absolute entry (the new word is 0)
    enc.xor_patch(np.array([1, 3]), np.array([0, 2], np.uint16), np.array([True, False]))


# --- hostile frames ------------------------------------------------------------------------


def content(
    pos: np.ndarray,
    words: np.ndarray,
    absolute: np.ndarray,
    *,
    k: int | None = None,
    flags: bytes | None = None,
    reserved: bytes = b"\0\0\0",
) -> bytes:
    """Decompressed content built by hand (no encoder checks), with optional damage."""
    p, gaps = position_gaps(pos, XOR_PATCH)
    header, parts = position_parts(p, gaps)
    kk, e, low_bits, _ = struct.unpack("<IIB3s", header)
    header = struct.pack("<IIB3s", kk if k is None else k, e, low_bits, reserved)
    packed = np.packbits(absolute, bitorder="little").tobytes() if flags is None else flags
    return header + b"".join(parts) + packed + b"".join(byte_planes(words))


def zstd(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=True).compress(raw)


POS = np.array([1, 4, 6, 9, 10], np.int64)
WORDS = np.array([3, 7, 0, 9, 2], np.uint16)
ABS = np.array([False, True, True, False, False])


def decode(data: bytes, n: int = 16, size: int = 2, changed: int = 5) -> list[codecs.Changes]:
    return list(FrameDecoder().changes(XOR_PATCH, data, n, size, changed))


def test_a_hand_built_frame_decodes() -> None:
    """The hand builder agrees with the encoder (so the damaged variants below differ from a
    valid frame only by their damage)."""
    raw = content(POS, WORDS, ABS)
    assert len(raw) == patch_size(5, 2, 0, 0)
    assert zstandard.ZstdDecompressor().decompress(FrameEncoder().xor_patch(POS, WORDS, ABS)) == raw
    assert len(decode(zstd(raw))) == 2


@pytest.mark.parametrize(
    ("raw", "n", "changed", "msg"),
    [
        (content(POS, WORDS, ABS, k=4), 16, 4, "outside|not a size"),
        (content(POS, WORDS, ABS, k=4), 16, 5, "holds 4 entries"),
        (content(POS, WORDS, ABS), 16, 4, "outside|not a size"),
        (content(POS, WORDS, ABS, flags=bytes([0b0000_0110 | 0x20])), 16, 5, "padding"),
        (content(POS, WORDS, ABS, flags=bytes([0b0000_0010])), 16, 5, "zero XOR mask"),
        (content(POS, WORDS, ABS, reserved=b"\0\1\0"), 16, 5, "header is invalid"),
        (content(POS, WORDS, ABS), 10, 5, "past the frame"),
        (content(POS, WORDS, ABS)[:-1], 16, 5, "outside"),
        (content(POS, WORDS, ABS) + b"\0", 16, 5, "not a size"),
    ],
    ids=[
        "k-below-changed",
        "k-mismatch",
        "changed-mismatch",
        "flag-padding",
        "zero-xor-mask",
        "reserved",
        "position-out-of-range",
        "short-content",
        "long-content",
    ],
)
def test_damaged_content_is_refused(raw: bytes, n: int, changed: int, msg: str) -> None:
    with pytest.raises(FrameError, match=msg):
        decode(zstd(raw), n=n, changed=changed)


def test_truncated_and_trailing_bytes_are_refused() -> None:
    data = FrameEncoder().xor_patch(POS, WORDS, ABS)
    for bad in (data[:-1], data[: len(data) // 2], data + b"\0", b""):
        with pytest.raises(FrameError):
            decode(bad)


def test_changed_must_be_one_to_n() -> None:
    data = FrameEncoder().xor_patch(POS, WORDS, ABS)
    for n, changed in ((16, 0), (4, 5)):
        with pytest.raises(FrameError, match="1 to as many entries"):
            decode(data, n=n, changed=changed)


def test_a_decompression_bomb_is_refused_before_decompressing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frame declaring 64 MiB of content for a 5-entry manifest entry: refused from its
    header; the decompressor is never called."""
    bomb = zstd(content(POS, WORDS, ABS) + bytes(64 << 20))
    assert len(bomb) < 1 << 16
    dec = FrameDecoder()

    def never(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("decompressed a frame whose declared size is over the bound")

    monkeypatch.setattr(dec._v2, "_dctx", type("D", (), {"decompress": never})())
    with pytest.raises(FrameError, match="outside"):
        list(dec.changes(XOR_PATCH, bomb, 16, 2, 5))
