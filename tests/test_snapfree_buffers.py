"""The snapshot-free publisher's per-chunk fast paths: torch's bf16 cast into a reused buffer
(bit-identical to the numpy reference ``bf16_words``), the reused chunk buffers, the
reconstruction written into caller buffers, candidates gathered for many positions at once."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deltastore.publish.reconstruct import (  # noqa: E402
    Coefficients,
    Inversion,
    StepScalars,
    bf16_words,
    step_coefficients,
)
from deltastore.publish.snapfree import (  # noqa: E402
    CANONICAL_NAN,
    ScratchPool,
    cast_words,
    new_words,
    torch_cast_exact,
)


def _adversarial_bits() -> np.ndarray:
    """fp32 bit patterns: every sign and exponent with random mantissas, exact ties (odd and
    even words), one ulp off each tie, subnormals, zeros, infinities, NaNs (quiet, signalling,
    negative)."""
    rng = np.random.default_rng(7)
    random = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    ties = (
        rng.integers(0, 1 << 16, size=1 << 16, dtype=np.uint64).astype(np.uint32) << 16
    ) | 0x8000
    sub = rng.integers(0, 1 << 23, size=1 << 16, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,
         1, 0x80000001, 0x7FFFFF, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000],
        dtype=np.uint32,
    )  # fmt: skip
    return np.concatenate([special, random, ties, ties - 1, ties + 1, sub, sub | 0x80000000])


def test_torch_cast_is_bit_identical_to_bf16_words() -> None:
    bits = _adversarial_bits()
    x = bits.view(np.float32)
    ref = bf16_words(x)
    buf = torch.empty(x.size + 5, dtype=torch.bfloat16)
    got = cast_words(torch.from_numpy(x), buf)
    assert got.dtype == np.dtype("<u2") and got.size == x.size
    assert np.array_equal(got, ref), bits[np.flatnonzero(got != ref)[:8]]
    # the cases that differ on some paths, checked by value
    assert set(got[np.isnan(x)].tolist()) == {CANONICAL_NAN}
    words = dict(zip(bits[:15].tolist(), got[:15].tolist(), strict=True))
    assert words[0x80000000] == 0x8000  # -0 keeps its sign
    assert words[0x7F800000] == 0x7F80 and words[0xFF800000] == 0xFF80
    assert words[1] == 0 and words[0x807FFFFF] == 0x8080  # subnormals round, not flushed
    assert words[0x7F7FFFFF] == 0x7F80  # rounds up to infinity, as torch does
    assert torch_cast_exact()


def test_new_words_with_and_without_a_buffer() -> None:
    x = torch.from_numpy(_adversarial_bits().view(np.float32).copy())
    buf = torch.empty(1 << 20, dtype=torch.bfloat16)
    a, b = 3, x.numel() - 2
    assert np.array_equal(new_words(x, a, b, buf), new_words(x, a, b))
    assert np.array_equal(new_words(x, a, b), bf16_words(x.numpy()[a:b]))


def test_scratch_pool_reuses_buffers() -> None:
    pool = ScratchPool()
    first = pool.take(1000)
    pool.give(first)
    assert pool.take(800) is first  # reused, not reallocated
    pool.give(first)
    bigger = pool.take(5000)  # too small: replaced by a larger one
    assert bigger is not first and bigger.size == 5000
    other = pool.take(10)  # taken while the first is out: a second one
    assert other is not bigger


def test_inversion_chunk_into_buffers_and_batched_candidates() -> None:
    g = torch.Generator().manual_seed(3)
    n = 50_000
    p, m = torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) * 1e-6
    coef = step_coefficients(StepScalars(3e-4, 0.9, 0.999, 1e-8, 0.1, 5))
    assert isinstance(coef, Coefficients)
    inv = Inversion(p, m, v, coef)
    ref = inv.chunk(100, 40_000)
    words = np.full(60_000, 0xABCD, dtype="<u2")
    certain = np.zeros(60_000, dtype=np.bool_)
    got = inv.chunk(100, 40_000, out=(words, certain))
    assert np.shares_memory(got.words, words) and np.shares_memory(got.certain, certain)
    assert np.array_equal(got.words.view(np.int16), ref.words.view(np.int16))
    assert np.array_equal(got.certain, ref.certain)
    # candidates of scattered positions at once == one position at a time
    at = np.array([7, 123, 4096, 4097, 39_999, 200], dtype=np.int64)
    lo, hi, zero = inv.candidates(at)
    for i, k in enumerate(at.tolist()):
        lo1, hi1, zero1 = inv.candidates(np.array([k], dtype=np.int64))
        assert (lo[i], hi[i], zero[i]) == (lo1[0], hi1[0], zero1[0])
    assert all(c.size == 0 for c in inv.candidates(np.empty(0, dtype=np.int64)))
