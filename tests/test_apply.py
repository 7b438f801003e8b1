"""The apply pipeline shared by the local and the layout paths (deltastore.sync.apply): staging
against local words, Adler-32 contributions and their shifts, per-tensor verification, and the
all-or-nothing write phase with its hooks and its agreement between ranks."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

import deltastore.tensors.words as words_module
from deltastore import Publisher
from deltastore.errors import IntegrityError, RankError
from deltastore.format.manifest import manifest_key, parse_manifest
from deltastore.sync.apply import (
    Hooks,
    Sums,
    Totals,
    Update,
    contribution,
    frame_totals,
    stage_at,
    stage_run,
    verify_tensors,
    write_phase,
    writes_of,
)
from deltastore.sync.fetch import frame_tasks
from deltastore.tensors.words import Write


def adler32(buf: np.ndarray | bytes) -> int:
    """zlib's Adler-32 of the actual bytes (little-endian words): the reference every sum the
    code combines or updates is checked against, never deltastore's own checksum code."""
    data = buf if isinstance(buf, bytes) else np.ascontiguousarray(buf).astype("<u2").tobytes()
    return zlib.adler32(data)


def words_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 16, n, dtype=np.uint16)


def test_stage_gathers_old_words_and_computes_new_ones() -> None:
    local = torch.from_numpy(words_of(1, 100).view(np.int16).copy())
    base = local.numpy().view(np.uint16).copy()
    at = np.array([3, 50, 99], dtype=np.int64)
    masks = np.array([1, 2, 0x8000], dtype=np.uint16)
    old, new = stage_at(local, at, masks, xor=True)
    assert np.array_equal(old, base[at]) and np.array_equal(new, base[at] ^ masks)
    old, new = stage_at(local, at, masks, xor=False)
    assert np.array_equal(new, masks)
    old, new = stage_run(local, 10, masks, xor=True)
    assert np.array_equal(old, base[10:13]) and np.array_equal(new, base[10:13] ^ masks)
    assert np.array_equal(local.numpy().view(np.uint16), base)  # staging only reads


def test_contributions_shift_from_a_frame_to_its_tensor() -> None:
    """A frame's sums shifted to the tensor equal the sums computed on the tensor directly,
    and applied to the tensor's Adler-32 give the Adler-32 of the changed tensor."""
    tensor = words_of(2, 10_000)
    start, stop = 2_000, 6_000
    pos = np.sort(np.random.default_rng(3).choice(stop - start, 300, replace=False))
    new_tensor = tensor.copy()
    new_tensor[pos + start] ^= np.uint16(0x0101)
    old, new = tensor[pos + start], new_tensor[pos + start]
    frame = contribution(pos, old, new, (stop - start) * 2)
    assert frame.applied_to(adler32(tensor[start:stop])) == adler32(new_tensor[start:stop])
    shifted = frame.shift((stop - start) * 2, start * 2, tensor.nbytes)
    assert shifted == contribution(pos + start, old, new, tensor.nbytes)
    assert shifted.applied_to(adler32(tensor)) == adler32(new_tensor)


def test_sums_from_zeros_and_weights() -> None:
    buf = words_of(4, 777)
    assert Sums.from_zeros(adler32(buf), buf.nbytes).applied_to(adler32(bytes(buf.nbytes))) == (
        adler32(buf)
    )
    half = Sums(10, 20).weighted(pow(2, 65519, 65521))  # the inverse of 2 copies
    assert half + half == Sums(10, 20)


def test_totals_add_up_per_tensor() -> None:
    a, b = words_of(5, 1000), words_of(6, 500)
    a2, b2 = a.copy(), b.copy()
    a2[[1, 900]] ^= np.uint16(7)
    b2[[0]] ^= np.uint16(1)
    totals = Totals(2)
    for at in (1, 900):
        totals.add(0, contribution(np.array([at]), a[[at]], a2[[at]], a.nbytes))
    totals.add(1, contribution(np.array([0]), b[[0]], b2[[0]], b.nbytes))
    assert totals.adler(0, adler32(a)) == adler32(a2)
    assert totals.adler(1, adler32(b)) == adler32(b2)
    assert totals.adler(0, adler32(a), totals.vector * 65522) == adler32(a2)  # read mod 65521


def test_frame_totals_combine_an_anchors_frames(tmp_path: Path) -> None:
    """Each frame's Adler-32 computed by zlib from the tensor's own bytes, combined by
    ``frame_totals``, equals zlib's Adler-32 of the whole tensor (and so does the manifest's,
    which the publisher combined from its frames)."""
    a = np.random.default_rng(8).integers(0, 1 << 16, 3000, dtype=np.uint16)
    tensors = {
        "a": torch.from_numpy(a.view(np.int16).copy()),
        "e": torch.zeros(0, dtype=torch.int16),
    }
    Publisher(tmp_path, max_frame_bytes=1024).publish(tensors, version=1)
    m = parse_manifest((tmp_path / manifest_key(1)).read_bytes())
    tasks = frame_tasks(m)
    assert len(tasks) == 6 and {t.name for t in tasks} == {"a"}
    frames = [adler32(a[t.frame.start : t.frame.stop]) for t in tasks]
    assert frames == [t.frame.adler32 for t in tasks]
    got = frame_totals(m, tasks, frames)
    assert got == {"a": adler32(a), "e": zlib.adler32(b"")}
    assert m.tensors["a"].adler32 == adler32(a)
    verify_tensors(m, got, "nothing was written")
    with pytest.raises(IntegrityError, match=r"version 1: 1 tensor\(s\) .*a \(.*nothing was"):
        verify_tensors(m, {**got, "a": got["a"] ^ 1}, "nothing was written")


# --- the write phase ---------------------------------------------------------------------------


def phase_fixture() -> tuple[torch.Tensor, list[Write], np.ndarray]:
    local = torch.from_numpy(words_of(7, 64).view(np.int16).copy())
    before = local.numpy().view(np.uint16).copy()
    writes = []
    for k in range(4):
        pos = np.array([k, 10 + k, 40 + k], dtype=np.int64)
        writes.append(Write(local, pos, before[pos], before[pos] ^ np.uint16(0xFFFF)))
    return local, writes, before


def test_write_phase_writes_between_the_hooks() -> None:
    local, writes, before = phase_fixture()
    events: list[str] = []

    def pause() -> None:
        events.append("pause")
        assert np.array_equal(local.numpy().view(np.uint16), before)

    write_phase(writes, Hooks(pause, lambda: events.append("resume")))
    assert events == ["pause", "resume"]
    after = local.numpy().view(np.uint16)
    for w in writes:
        assert np.array_equal(after[w.positions], w.new)


def test_a_scatter_failing_halfway_is_rolled_back_and_resume_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local, writes, before = phase_fixture()
    real, calls = words_module.scatter, [0]

    def flaky(t: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
        calls[0] += 1
        if calls[0] == 3:
            real(t, positions[:1], values[:1])
            raise OSError("device lost")
        real(t, positions, values)

    monkeypatch.setattr(words_module, "scatter", flaky)
    events: list[str] = []
    with pytest.raises(OSError, match="device lost"):
        write_phase(writes, Hooks(lambda: events.append("pause"), lambda: events.append("resume")))
    assert events == ["pause", "resume"]
    assert np.array_equal(local.numpy().view(np.uint16), before)


def test_ranks_agree_on_the_write_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    local, writes, before = phase_fixture()
    told: list[bool] = []

    def other_rank_failed(failed_here: bool) -> Sequence[int]:
        told.append(failed_here)
        return [1]

    with pytest.raises(RankError, match=r"rank\(s\) \[1\] failed to write"):
        write_phase(writes, Hooks(), other_rank_failed)
    assert told == [False]
    assert np.array_equal(local.numpy().view(np.uint16), before)  # restored here too

    def boom(t: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
        raise OSError("this rank failed")

    monkeypatch.setattr(words_module, "scatter", boom)
    told.clear()
    with pytest.raises(OSError, match="this rank failed"):
        write_phase(writes, Hooks(), lambda failed_here: told.append(failed_here) or [0])
    assert told == [True]  # entered the agreement before raising its own error


def test_writes_of_skip_updates_without_changes() -> None:
    tensors = {"w": torch.zeros(10, dtype=torch.bfloat16)}
    empty = np.zeros(0, dtype=np.int64)
    none = np.zeros(0, dtype=np.uint16)
    updates = [
        Update("w", 4, np.array([1, 2]), np.zeros(2, np.uint16), np.ones(2, np.uint16)),
        Update("w", 0, empty, none, none),
    ]
    (write,) = writes_of(tensors, updates)
    write_phase([write], Hooks())
    assert tensors["w"].view(torch.int16).tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]
