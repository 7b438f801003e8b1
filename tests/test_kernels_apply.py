"""The receiver's native kernel (deltastore.kernels.apply) against the numpy reference path.

``stage_frame(native=True)`` (the default: one native pass that decodes, gathers and sums) and
``stage_frame(native=False)`` (the numpy reference) must stage the same frame to the same
Adler-32 sums and frame checksum, and their writes must leave bit-identical tensors; damaged
content must fail both with a FrameError. Hypothesis draws the changes: word sizes of 1, 2, 4
and 8 bytes, frames at an offset inside their tensor, empty frames, changes at the first and the
last element, dense and escaped (long-gap) frames.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore.errors import FrameError
from deltastore.format.checksum import adler32, delta_sums
from deltastore.format.codecs import FrameDecoder
from deltastore.format.codecs.v2 import XOR_SPARSE2, FrameEncoder2, decode_positions
from deltastore.format.manifest import Frame, TensorEntry
from deltastore.kernels import apply as kernel
from deltastore.sync.fetch import FrameTask
from deltastore.sync.stage import frame_changes, stage_frame
from deltastore.tensors import words

DTYPES = {1: "uint8", 2: "bfloat16", 4: "float32", 8: "float64"}


@st.composite
def frames(draw: st.DrawFn) -> tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray]:
    """(size, start, n, tensor words, frame-local positions, masks)."""
    size = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 5000))
    start = draw(st.integers(0, 300))
    after = draw(st.integers(0, 50))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shape = draw(st.sampled_from(["random", "dense", "ends", "sparse", "empty"]))
    if shape == "empty":
        pos = np.empty(0, dtype=np.int64)
    elif shape == "dense":
        pos = np.flatnonzero(rng.random(n) < 0.9)
    elif shape == "ends":  # the first and the last element, and a few in between
        pos = np.unique(np.r_[0, n - 1, rng.integers(0, n, size=min(n, 3))])
    elif shape == "sparse":  # long gaps: escapes at small L
        pos = np.unique(rng.integers(0, n, size=max(1, n // 1000)))
    else:
        pos = np.unique(rng.integers(0, n, size=draw(st.integers(1, n))))
    wdt = np.dtype(f"<u{size}")
    top = (1 << (8 * size)) - 1
    masks = rng.integers(1, top, size=pos.size, dtype=wdt, endpoint=True)
    local = rng.integers(0, top, size=start + n + after, dtype=wdt, endpoint=True)
    return size, start, n, local, pos.astype(np.int64), masks


def _task(
    size: int, start: int, n: int, local: np.ndarray, pos: np.ndarray, data: bytes
) -> FrameTask:
    """A FrameTask for the frame (its parent checksum from ``local``; its own checksum is set
    by :func:`_with_adler`)."""
    seg = local[start : start + n]
    frame = Frame(
        start=start,
        stop=start + n,
        codec=XOR_SPARSE2,
        object="versions/1/data",
        offset=0,
        length=len(data),
        xxh3="0" * 16,
        changed=int(pos.size),
        adler32=1,
        parent_adler32=adler32(seg),
    )
    entry = TensorEntry(
        dtype=DTYPES[size],
        shape=[local.size],
        adler32=1,
        parent_adler32=None,
        changed=int(pos.size),
        frames=[frame],
    )
    return FrameTask("t", entry, frame)


def _with_adler(task: FrameTask, value: int) -> FrameTask:
    frame = task.frame.model_copy(update={"adler32": value})
    return FrameTask(task.name, task.entry.model_copy(update={"frames": [frame]}), frame)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames(), st.booleans())
def test_native_stage_matches_reference(
    case: tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray], low_zero: bool
) -> None:
    size, start, n, local, pos, masks = case
    data = FrameEncoder2().xor_sparse2(pos, masks, low_bits=0 if low_zero else None)
    expect = local[start : start + n].copy()
    expect[pos] ^= masks
    task = _with_adler(_task(size, start, n, local, pos, data), adler32(expect))
    dec = FrameDecoder()
    ref = stage_frame(local.copy(), task, data, dec, True, native=False)
    before = local.copy()
    got = stage_frame(local, task, data, dec, True)
    assert np.array_equal(local, before)  # staging only reads
    assert got.sums == ref.sums and got.frame_adler == ref.frame_adler == task.frame.adler32
    upd = got.update
    assert upd.xor and not upd.dense and upd.positions.dtype == np.int32
    assert np.array_equal(upd.positions, pos + start) and np.array_equal(upd.old, masks)
    # the write, and its undo, bit for bit
    write = words.Write(local, upd.positions, upd.old, upd.new, upd.dense, upd.xor)
    words.write_all([write])
    assert np.array_equal(local[start : start + n], expect)
    assert np.array_equal(local[:start], before[:start])
    assert np.array_equal(local[start + n :], before[start + n :])
    words.restore_all([write])
    assert np.array_equal(local, before)
    # the routed receivers' decode: the reference's positions and masks
    (ch,) = list(frame_changes(dec, XOR_SPARSE2, data, n, size, int(pos.size)))
    assert ch.positions is not None and ch.positions.dtype == np.int64
    assert np.array_equal(ch.positions, pos) and np.array_equal(ch.words, masks)
    assert ch.words.dtype == masks.dtype


@settings(max_examples=60, deadline=None)
@given(frames())
def test_sums_match_delta_sums(
    case: tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """The kernel's Adler-32 contribution is delta_sums' at the tensor's byte offsets, also for
    a tensor declared larger than the words the frame lands in."""
    size, start, n, local, pos, masks = case
    data = FrameEncoder2().xor_sparse2(pos, masks)
    raw, k, e, low = FrameDecoder().sparse2_content(data, n, size, int(pos.size))
    nbytes = local.nbytes + 12345 * size
    status, got_pos, got_masks, sums = kernel.stage_sparse2(raw, k, e, low, n, local, start, nbytes)
    assert status == kernel.OK
    at = pos + start
    old = local[at]
    assert sums == delta_sums(at, old, old ^ masks, nbytes)
    assert np.array_equal(got_pos, at) and np.array_equal(got_masks, masks)


def _content(k: int, e: int, low: int, body: bytes) -> bytes:
    return struct.pack("<IIB3s", k, e, low, b"\0\0\0") + body


@pytest.mark.parametrize(
    ("raw", "n", "problem"),
    [
        # k=2, L=0: tokens 3, 1 -> positions 3, 5; n=5 puts the second past the end
        (_content(2, 0, 0, bytes([3, 1, 7, 9])), 5, kernel.PAST_END),
        # a zero mask
        (_content(2, 0, 0, bytes([3, 1, 7, 0])), 10, kernel.ZERO_MASK),
        # L=2: a low part of 4 does not fit 2 bits
        (_content(1, 0, 2, bytes([0, 4, 9])), 100, kernel.LOW_TOO_WIDE),
        # an escape token and no escapes
        (_content(1, 0, 0, bytes([255, 9])), 1000, kernel.ESCAPES_DISAGREE),
        # one escape declared, none used
        (_content(1, 1, 0, bytes([1, 0, 0, 0, 0, 9])), 1000, kernel.ESCAPES_DISAGREE),
        # an escape whose high part lands past the end
        (_content(1, 1, 0, bytes([255, 250, 0, 0, 0, 9])), 400, kernel.PAST_END),
    ],
)
def test_damaged_content(raw: bytes, n: int, problem: int) -> None:
    """Each damage is caught, named, and the reference decoder rejects the same content."""
    k, e, low = struct.unpack_from("<IIB", raw)
    local = np.zeros(n, dtype=np.uint8)
    assert kernel.stage_sparse2(raw, k, e, low, n, local, 0, n)[0] == problem
    assert kernel.decode_sparse2(raw, k, e, low, n, 1)[0] == problem
    if problem != kernel.ZERO_MASK:  # the reference checks masks elsewhere
        with pytest.raises(FrameError):
            decode_positions(raw, n, k, e, low, XOR_SPARSE2)


def test_damaged_frame_stages_nothing() -> None:
    """A frame whose decoded changes do not give the manifest's checksum fails with nothing
    written (staging only reads)."""
    rng = np.random.default_rng(3)
    local = rng.integers(0, 2**16, size=4096, dtype=np.uint16)
    pos = np.array([0, 17, 4095])
    masks = np.array([1, 2, 3], dtype=np.uint16)
    data = FrameEncoder2().xor_sparse2(pos, masks)
    task = _with_adler(_task(2, 0, 4096, local, pos, data), 12345)
    before = local.copy()
    with pytest.raises(Exception, match="Adler-32"):
        stage_frame(local, task, data, FrameDecoder(), True)
    assert np.array_equal(local, before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_xor_writes_all_or_nothing(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sparse XOR writes spread over threads land bit for bit; one that cannot be written (a
    tensor with no host memory) leaves every tensor as it was."""
    import torch

    monkeypatch.setattr(words, "PARALLEL_WORDS", 1)
    rng = np.random.default_rng(7)
    tensors = [rng.integers(0, 2**16, size=50_000, dtype=np.uint16) for _ in range(5)]
    before = [t.copy() for t in tensors]
    writes = []
    for t in tensors:
        pos = np.unique(rng.integers(0, t.size, size=rng.integers(1, 5000))).astype(np.int32)
        masks = rng.integers(1, 2**16, size=pos.size, dtype=np.uint16)
        writes.append(words.Write(t, pos, masks, masks, False, True))
    words.write_all(writes, threads=threads)
    for t, b, w in zip(tensors, before, writes, strict=True):
        expect = b.copy()
        expect[w.positions] ^= w.new
        assert np.array_equal(t, expect)
    words.restore_all(writes)
    assert all(np.array_equal(t, b) for t, b in zip(tensors, before, strict=True))
    bad = words.Write(
        torch.empty(10, dtype=torch.int16, device="meta"),
        writes[0].positions[:1],
        writes[0].new[:1],
        writes[0].new[:1],
        False,
        True,
    )
    with pytest.raises(TypeError):
        words.write_all([*writes[:2], bad, *writes[2:]], threads=threads)
    assert all(np.array_equal(t, b) for t, b in zip(tensors, before, strict=True))


def test_subscriber_threads_option(tmp_path: Path) -> None:
    """``Subscriber(threads=1)`` syncs bit-exactly, as the default does; ``threads=0`` is
    refused with a message."""
    import torch

    from deltastore import Publisher, Subscriber

    url = str(tmp_path / "store")
    rng = np.random.default_rng(5)
    w = {
        f"t{i}": torch.from_numpy(rng.standard_normal(20_000).astype(np.float32)) for i in range(3)
    }
    w = {k: v.to(torch.bfloat16) for k, v in w.items()}
    pub = Publisher(url)
    pub.publish(w, version=1)
    for t in w.values():
        t.view(torch.int16)[torch.from_numpy(rng.choice(t.numel(), 300, replace=False))] ^= 5
    pub.publish(w, version=2)
    for threads in (None, 1, 2):
        sub = Subscriber(url, threads=threads)
        sub.sync()
        got = sub.tensors
        assert got is not None and sub.version == 2
        for k, v in w.items():
            assert torch.equal(got[k].view(torch.int16), v.view(torch.int16))
    with pytest.raises(ValueError, match="threads"):
        Subscriber(url, threads=0)


def _batch_case(
    rng: np.random.Generator, sizes: list[int]
) -> tuple[list[np.ndarray], list[FrameTask], bytes, list[int]]:
    """Frames of ``len(sizes)`` tensors (word sizes ``sizes``), two frames each (the second a
    dense ``xor-dense`` or ``raw`` one now and then), packed back to back in one buffer."""
    from deltastore.format.codecs import FrameEncoder

    enc, buf, offsets, tasks, tensors = FrameEncoder(codecs="v2"), b"", [], [], []
    for t, size in enumerate(sizes):
        wdt = np.dtype(f"<u{size}")
        local = rng.integers(0, 2 ** (8 * size), size=6000, dtype=wdt, endpoint=False)
        tensors.append(local)
        for start, n in ((0, 3000), (3000, 3000)):
            k = int(rng.integers(0, 400)) if start == 0 else int(rng.integers(0, 3000))
            pos = np.sort(rng.choice(n, k, replace=False))
            masks = rng.integers(1, 2 ** (8 * size), size=k, dtype=wdt, endpoint=False)
            seg = local[start : start + n]
            new = seg.copy()
            new[pos] ^= masks
            codec, data = enc.encode_delta(seg, new, pos.astype(np.uint32), masks=masks)
            import xxhash

            frame = Frame(
                start=start, stop=start + n, codec=codec, object="versions/1/data",
                offset=0, length=len(data), xxh3=xxhash.xxh3_64_hexdigest(data), changed=k,
                adler32=adler32(new), parent_adler32=adler32(seg),
            )  # fmt: skip
            entry = TensorEntry(
                dtype=DTYPES[size], shape=[6000], adler32=1, parent_adler32=None, changed=k,
                frames=[frame],
            )  # fmt: skip
            tasks.append(FrameTask(f"t{t}", entry, frame))
            offsets.append(len(buf))
            buf += data
    return tensors, tasks, buf, offsets


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4))
def test_batch_matches_frame_by_frame(seed: int, sizes: list[int]) -> None:
    """stage_batch (native runs of xor-sparse2 frames, frame by frame for the others) stages
    what stage_frame stages, frame for frame."""
    from deltastore.sync.stage import stage_batch

    rng = np.random.default_rng(seed)
    tensors, tasks, buf, offsets = _batch_case(rng, sizes)
    dec = FrameDecoder()
    locals_ = [tensors[int(t.name[1:])] for t in tasks]
    got = stage_batch(locals_, tasks, buf, offsets, dec, True)
    for local, task, at, staged in zip(locals_, tasks, offsets, got, strict=True):
        data = buf[at : at + task.frame.length]
        ref = stage_frame(local, task, data, dec, True, native=False)
        assert staged.sums == ref.sums and staged.frame_adler == ref.frame_adler
        if staged.update.xor and not staged.update.dense:  # positions and masks
            assert np.array_equal(staged.update.positions, ref.update.positions)
            assert np.array_equal(staged.update.new, ref.update.old ^ ref.update.new)
        else:
            assert np.array_equal(staged.update.new, ref.update.new)


@pytest.mark.parametrize("native", [True, False])
def test_batch_errors(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Damaged stored bytes fail as the frame-by-frame path fails: an XXH3 mismatch is an
    IntegrityError, content that does not match its manifest entry a FrameError; without
    zstd's and xxhash's C functions the frames go frame by frame, with the same errors."""
    from deltastore.errors import IntegrityError
    from deltastore.kernels import clib
    from deltastore.sync.stage import stage_batch

    if not native:
        monkeypatch.setattr(clib, "functions", lambda: None)
    rng = np.random.default_rng(11)
    tensors, tasks, buf, offsets = _batch_case(rng, [2, 2])
    locals_ = [tensors[int(t.name[1:])] for t in tasks]
    dec = FrameDecoder()
    bad = bytearray(buf)
    bad[offsets[1] + 8] ^= 0x40
    with pytest.raises(IntegrityError, match="xxh3"):
        stage_batch(locals_, tasks, bytes(bad), offsets, dec, True)
    # the manifest says one change more than the frame holds (its XXH3 is right)
    f = tasks[0].frame
    wrong = f.model_copy(update={"changed": f.changed + 1})
    entry = tasks[0].entry.model_copy(update={"frames": [wrong], "changed": f.changed + 1})
    with pytest.raises(FrameError):
        stage_batch(locals_, [FrameTask("t0", entry, wrong), *tasks[1:]], buf, offsets, dec, True)
    # a frame whose tensor is not at its parent: the checksum says so, nothing is written
    at, mask = next(  # a changed element's masked bits (what its frame checksum covers)
        (int(s.update.positions[0]), s.update.new[0])
        for s, t in zip(stage_batch(locals_, tasks, buf, offsets, dec, True), tasks, strict=True)
        if t.name == "t0" and s.update.positions.size and not s.update.dense
    )
    tensors[0][at] ^= mask
    before = [t.copy() for t in tensors]
    with pytest.raises(IntegrityError, match="Adler-32"):
        stage_batch(locals_, tasks, buf, offsets, dec, True)
    assert all(np.array_equal(a, b) for a, b in zip(tensors, before, strict=True))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("paused", [False, True])
def test_write_threads_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, paused: bool
) -> None:
    """Without a pause hook the write threads run at the subscriber's priority (whatever runs
    beside the sync keeps running); with one, at the calling thread's (nothing else runs)."""
    import torch

    from deltastore import Publisher, Subscriber
    from deltastore.sync.priority import thread_priority

    monkeypatch.setattr(words, "PARALLEL_WORDS", 1)
    seen: list[object] = []
    xor_all = words.xor_all

    def record(writes: Any) -> None:
        seen.append(thread_priority())
        xor_all(writes)

    monkeypatch.setattr(words, "xor_all", record)
    url = str(tmp_path / "store")
    rng = np.random.default_rng(2)
    w = {f"t{i}": torch.from_numpy(rng.standard_normal(9000)).to(torch.bfloat16) for i in range(4)}
    pub = Publisher(url)
    pub.publish(w, version=1)
    for t in w.values():
        t.view(torch.int16)[torch.from_numpy(rng.choice(t.numel(), 90, replace=False))] ^= 3
    pub.publish(w, version=2)
    sub = Subscriber(url, priority=17, threads=2, pause=(lambda: None) if paused else None)
    sub.sync(1)
    before = thread_priority()
    sub.sync(2)
    assert seen and all(p == (before if paused else 17) for p in seen), (seen, before)
    assert sub.tensors is not None
    assert all(
        torch.equal(sub.tensors[k].view(torch.int16), v.view(torch.int16)) for k, v in w.items()
    )
