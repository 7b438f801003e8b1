"""The compiled AdamW inverse (``deltastore.publish.invert_kernel``) against the numpy reference
(``reconstruct.invert_chunk``, the specification of the certified rule): the words and the
certain mask are bit-identical, compared through integer views, on random bit patterns (NaN,
infinities, subnormals and signed zeros included), on adversarial values (zeros, values at and
next to bf16 rounding ties, tiny and huge magnitudes and learning rates) and on the results of
real ``torch.optim.AdamW`` steps; ``invert_and_diff``'s new words and positions equal the
reference's ``bf16_words`` and ``flatnonzero(old != new | ~certain)``; the chunk split across
threads changes nothing; ``Inversion.chunk`` uses the kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deltastore.publish import reconstruct
from deltastore.publish.reconstruct import (
    Coefficients,
    Gate,
    StepScalars,
    bf16_words,
    invert_chunk,
    step_coefficients,
)

kernel = pytest.importorskip("deltastore.publish.invert_kernel")

#: (lr, weight_decay, eps, step, device_scalars): ordinary, no decay, eps 0, lr 0, extremes.
HYPERS = [
    (1e-6, 0.1, 1e-8, 10, False),
    (3e-4, 0.0, 1e-8, 1, False),
    (1e-2, 0.1, 0.0, 3, False),
    (0.0, 0.1, 1e-8, 5, False),
    (1e-30, 0.1, 1e-30, 100, False),
    (0.4, 1.0, 1e-3, 2, True),
    (2e-5, 0.01, 1e-12, 100_000, False),
]


def coefficients(lr: float, wd: float, eps: float, step: int, dev: bool) -> Coefficients:
    coef = step_coefficients(StepScalars(lr, 0.9, 0.999, eps, wd, step, dev))
    assert not isinstance(coef, Gate)
    return coef


def nan_as_one(words: np.ndarray) -> np.ndarray:
    """bf16 words with every NaN as 0x7FC0: IEEE 754 leaves a NaN result's sign and payload
    to the order of operations (x86 returns the first NaN operand, or a negative default NaN
    for 0/0), which numpy's and the kernel's differ in."""
    w = words.view(np.uint16)
    return np.where((w & 0x7F80) == 0x7F80, np.where(w & 0x7F, 0x7FC0, w), w).astype(np.uint16)


def assert_same(p: np.ndarray, m: np.ndarray, v: np.ndarray, coef: Coefficients) -> None:
    """The kernel (one thread and split across three) equals the reference, bit for bit, but
    for the sign and payload of NaN words, which are never certain (only uncertain elements'
    words may be NaN, and their words are not used: they are sent as new words)."""
    ref_words, ref_certain = invert_chunk(p, m, v, coef)
    ref_nan = nan_as_one(ref_words) == 0x7FC0
    assert not (ref_certain & ref_nan).any()
    for threads in (1, 3):
        words, certain = kernel.invert_chunk(p, m, v, coef, threads=threads)
        assert words.dtype == np.dtype("<u2") and certain.dtype == np.bool_
        exact = np.flatnonzero(~ref_nan & (words.view(np.uint16) != ref_words.view(np.uint16)))
        bad = np.union1d(exact, np.flatnonzero(nan_as_one(words) != nan_as_one(ref_words)))
        assert bad.size == 0, (threads, p[bad[:3]], m[bad[:3]], v[bad[:3]])
        assert np.array_equal(certain, ref_certain), threads
        old, cert, new, positions = kernel.invert_and_diff(p, m, v, coef, threads=threads)
        assert np.array_equal(nan_as_one(old), nan_as_one(ref_words))
        assert np.array_equal(old.view(np.uint16)[~ref_nan], ref_words.view(np.uint16)[~ref_nan])
        assert np.array_equal(cert, ref_certain)
        assert np.array_equal(new.view(np.uint16), bf16_words(p).view(np.uint16))
        expected = np.flatnonzero((ref_words != new) | ~ref_certain)
        assert positions.dtype == np.int64 and np.array_equal(positions, expected)


def random_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("hyper", HYPERS)
def test_random_bit_patterns(hyper: tuple[float, float, float, int, bool]) -> None:
    """Any float32 at all (about 0.4% NaN, infinities, subnormals, both zeros)."""
    rng = np.random.default_rng(7)
    n = 1 << 18
    p, m, v = (random_bits(rng, n) for _ in range(3))
    assert_same(p, m, v, coefficients(*hyper))


def adversarial(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 values a kernel gets wrong first: zeros of both signs, subnormals, the
    smallest normals, NaN and infinities, huge values, and values at a bf16 tie and one ulp
    either side of it, with random signs."""
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754942e-38, 1.17549435e-38,
         2.0**-125, 2.0**-126, 3.4028235e38, 1e38, 1.0, -1.0, 65504.0],
        dtype=np.float32,
    )  # fmt: skip
    ties = rng.integers(0, 0xFF00, n, dtype=np.uint32) << 16 | 0x8000
    ties = ties + rng.integers(-1, 2, n).astype(np.uint32)  # the tie and its neighbours
    scale = np.float32(10.0) ** rng.uniform(-40, 38, n).astype(np.float32)
    pick = rng.integers(0, 3, n)
    with np.errstate(over="ignore"):
        normal = scale * rng.standard_normal(n, np.float32)
    out = np.where(
        pick == 0,
        special[rng.integers(0, special.size, n)],
        np.where(pick == 1, ties.view(np.float32), normal),
    )
    return out.astype(np.float32)


@pytest.mark.parametrize("hyper", HYPERS)
def test_adversarial_values(hyper: tuple[float, float, float, int, bool]) -> None:
    rng = np.random.default_rng(11)
    n = 1 << 18
    p, m = adversarial(rng, n), adversarial(rng, n)
    v = np.abs(adversarial(rng, n))
    v[::7] = -v[::7]  # negative second moments too (sqrt of a negative: NaN)
    assert_same(p, m, v, coefficients(*hyper))


@pytest.mark.parametrize(("lr", "wd"), [(1e-6, 0.1), (3e-4, 0.0), (1e-2, 0.1)])
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_real_adamw_steps(lr: float, wd: float, impl: str) -> None:
    """After real torch AdamW steps from weights at bf16 ties, zeros and tiny values, where
    the uncertain elements are."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    n = 1 << 17
    start = adversarial(rng, n)
    start[~np.isfinite(start)] = 0.0
    start = np.clip(start, -1e3, 1e3)
    param = torch.nn.Parameter(torch.from_numpy(start.copy()))
    opt = torch.optim.AdamW([param], lr=lr, weight_decay=wd, **{impl: True})
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-30, 3, (n,), generator=gen)
        grad[::5] = 0
        param.grad = grad
        opt.step()
        state = opt.state[param]
        coef = coefficients(lr, wd, 1e-8, step, False)
        p, m, v = (t.detach().numpy() for t in (param, state["exp_avg"], state["exp_avg_sq"]))
        assert_same(p, m, v, coef)


@settings(max_examples=60, deadline=None)
@example(  # a NaN parameter, 0/0 in the update: NaN words of another sign (found by hypothesis)
    bits=[0] * 8 + [0x7F800001] + [0] * 18, lr=0.0, wd=0.0, eps=0.0, step=1
)
@given(
    bits=st.lists(st.integers(0, 2**32 - 1), min_size=3, max_size=3 * 200).filter(
        lambda b: len(b) % 3 == 0
    ),
    lr=st.floats(0, 0.4),
    wd=st.sampled_from([0.0, 1e-4, 0.1, 1.0]),
    eps=st.sampled_from([0.0, 1e-30, 1e-8, 1e-3]),
    step=st.integers(1, 10**6),
)
def test_hypothesis(bits: list[int], lr: float, wd: float, eps: float, step: int) -> None:
    coef = step_coefficients(StepScalars(lr, 0.9, 0.999, eps, wd, step))
    if isinstance(coef, Gate):
        return
    arr = np.array(bits, dtype=np.uint32).view(np.float32).reshape(3, -1)
    assert_same(arr[0].copy(), arr[1].copy(), arr[2].copy(), coef)


def test_empty_and_length_mismatch() -> None:
    coef = coefficients(*HYPERS[0])
    empty = np.zeros(0, np.float32)
    words, certain = kernel.invert_chunk(empty, empty, empty, coef)
    assert words.size == 0 and certain.size == 0
    assert kernel.invert_and_diff(empty, empty, empty, coef)[3].size == 0
    with pytest.raises(ValueError, match="same length"):
        kernel.invert_chunk(np.zeros(3, np.float32), empty, empty, coef)


def test_out_buffers_are_reused() -> None:
    """Results written into caller buffers (longer than the chunk) equal fresh ones; wrong
    buffers are refused with what to pass."""
    rng = np.random.default_rng(8)
    coef = coefficients(*HYPERS[0])
    p, m, v = (random_bits(rng, 1000) for _ in range(3))
    words = np.full(1500, 0xAAAA, dtype="<u2")
    certain = np.ones(1500, dtype=np.bool_)
    got = kernel.invert_chunk(p, m, v, coef, out=(words, certain))
    ref_words, ref_certain = invert_chunk(p, m, v, coef)
    assert np.shares_memory(got[0], words) and np.shares_memory(got[1], certain)
    assert np.array_equal(got[0].view(np.uint16), ref_words.view(np.uint16))
    assert np.array_equal(got[1], ref_certain) and got[0].size == 1000
    assert (words[1000:] == 0xAAAA).all()
    with pytest.raises(ValueError, match="at least 1000"):
        kernel.invert_chunk(p, m, v, coef, out=(words[:999], certain))
    with pytest.raises(ValueError, match="bool"):
        kernel.invert_chunk(p, m, v, coef, out=(words, certain.view(np.uint8)))


def test_inversion_chunk_uses_the_kernel() -> None:
    assert reconstruct._fast_invert() is kernel.invert_chunk


def adamw_state(n: int, lr: float, wd: float) -> tuple[np.ndarray, ...]:
    """Parameter and moments after three real foreach AdamW steps of a normal(0, 0.02) weight."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(9)
    param = torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02)
    opt = torch.optim.AdamW([param], lr=lr, weight_decay=wd, foreach=True)
    for _ in range(3):
        param.grad = torch.randn(n, generator=gen)
        opt.step()
    state = opt.state[param]
    return tuple(t.detach().numpy().copy() for t in (param, state["exp_avg"], state["exp_avg_sq"]))


def test_the_filter_proves_most_elements_and_only_true_ones() -> None:
    """The float32 filter alone: on a trained weight it settles almost every element, and
    every element it settles is certain in the reference with the same word; on random bit
    patterns and adversarial values it never settles a wrong one."""
    numba = pytest.importorskip("numba")

    @numba.njit
    def fast_only(p, m, v, f, words, ok):  # type: ignore[no-untyped-def]
        for i in range(p.shape[0]):
            words[i], ok[i] = kernel._fast(p[i], m[i], v[i], f)

    rng = np.random.default_rng(4)
    coef = coefficients(1e-6, 0.1, 1e-8, 3, False)
    cases = [adamw_state(1 << 16, 1e-6, 0.1)]
    cases += [tuple(random_bits(rng, 1 << 16) for _ in range(3))]
    cases += [(adversarial(rng, 1 << 16), adversarial(rng, 1 << 16), adversarial(rng, 1 << 16))]
    for i, (p, m, v) in enumerate(cases):
        words = np.empty(p.size, dtype=np.uint32)
        ok = np.empty(p.size, dtype=np.bool_)
        f = kernel._scalars32(kernel._scalars(coef))
        fast_only(p, m, v, f, words, ok)
        ref_words, ref_certain = invert_chunk(p, m, v, coef)
        assert ref_certain[ok].all()
        assert np.array_equal(words[ok].astype(np.uint16), ref_words[ok].view(np.uint16))
        if i == 0:
            assert ok.mean() > 0.95, ok.mean()


def test_the_exact_path_alone_is_the_reference() -> None:
    """With float32 scalars that fail the filter everywhere (infinite), every element takes
    the exact path: still bit-identical."""
    rng = np.random.default_rng(5)
    coef = coefficients(3e-4, 0.1, 1e-8, 7, False)
    p, m, v = adamw_state(1 << 16, 3e-4, 0.1)
    p[::3] = random_bits(rng, p[::3].size)
    k = kernel._scalars(coef)
    f = np.full(9, np.inf, dtype=np.float32)
    words = np.empty(p.size, dtype="<u2")
    certain = np.empty(p.size, dtype=np.bool_)
    kernel._invert(p, m, v, k, f, words, certain)
    ref_words, ref_certain = invert_chunk(p, m, v, coef)
    assert np.array_equal(words.view(np.uint16), ref_words.view(np.uint16))
    assert np.array_equal(certain, ref_certain)


@pytest.mark.parametrize("n", [0, 1, 7, 2775, 2776, 2777, 5553, 70_001])
def test_cast_and_adler_in_one_pass(n: int) -> None:
    import zlib

    rng = np.random.default_rng(n)
    bits = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    bits[: min(n, 6)] = [0x7FC00000, 0xFFFFFFFF, 0x80000000, 1, 0x7F7FFFFF, 0x3F808000][
        : min(n, 6)
    ]  # NaNs, -0, a subnormal, rounding to infinity, a tie
    x = bits.view(np.float32)
    ref = bf16_words(x)
    out = np.full(n + 9, 0xABCD, dtype="<u2")
    assert np.array_equal(kernel.bf16_cast(x, out)[:n].view(np.int16), ref.view(np.int16))
    for value in (1, 0xFFF0FFF0, 0x12345678):
        out[:] = 0
        got = kernel.cast_adler(x, out, value)
        assert got == zlib.adler32(ref.tobytes(), value), (n, value)
        assert np.array_equal(out[:n].view(np.int16), ref.view(np.int16))
    with pytest.raises(ValueError, match="out"):
        kernel.bf16_cast(x, np.empty(max(0, n - 1), dtype="<u2") if n else np.empty(0, "<i2"))
