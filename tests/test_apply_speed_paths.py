"""Behaviour of the receiver's fast paths: narrow staged positions widened in steps
by the scatter, frame sums derived from tensor sums, frames worked on in batches by the
Fetcher; every path bit-exact, verified before writing, all or nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import deltastore.sync.fetch as fetch_module
import deltastore.tensors.words as words_module
from deltastore import Publisher, Subscriber
from deltastore.errors import IntegrityError
from deltastore.format.codecs import FrameDecoder
from deltastore.format.manifest import manifest_key, parse_manifest
from deltastore.store import open_store
from deltastore.sync.apply import Hooks, Sums, contribution, write_phase
from deltastore.sync.fetch import BATCH_BYTES, Fetcher, FrameTask, Timer, batches, frame_tasks
from deltastore.tensors.words import INT32_MAX, Write, compact, narrow, scatter


def words_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 16, n, dtype=np.uint16)


@pytest.mark.parametrize("form", ["int64", "int32", "gaps"])
def test_scatter_widens_narrow_positions_in_steps(
    monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    monkeypatch.setattr(words_module, "STEP", 7)  # many steps, a partial last one
    base = words_of(1, 1000)
    pos = np.sort(np.random.default_rng(2).choice(1000, 101, replace=False)).astype(np.int64)
    values = words_of(3, 101)
    forms: dict[str, np.ndarray] = {
        "int64": pos,
        "int32": pos.astype(np.int32),
        "gaps": compact(pos),
    }
    stored: np.ndarray = forms[form]
    local = torch.from_numpy(base.view(np.int16).copy())
    scatter(local, stored, values)
    expect = base.copy()
    expect[pos] = values
    assert np.array_equal(local.numpy().view(np.uint16), expect)


def test_narrow_keeps_int64_only_where_int32_cannot_hold_the_positions() -> None:
    pos = np.array([0, 5, 1 << 20], dtype=np.int64)
    assert narrow(pos, 1 << 21).dtype == np.int32
    assert np.array_equal(narrow(pos, 1 << 21), pos)
    assert narrow(pos, INT32_MAX).dtype == np.int32
    assert narrow(pos, INT32_MAX + 1).dtype == np.int64


def test_a_write_of_int32_positions_failing_halfway_is_rolled_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(words_module, "STEP", 5)
    local = torch.from_numpy(words_of(4, 500).view(np.int16).copy())
    before = local.numpy().view(np.uint16).copy()
    writes = []
    for k in range(3):
        pos = np.arange(k, 500, 13, dtype=np.int32)
        writes.append(Write(local, pos, before[pos], before[pos] ^ np.uint16(0x00FF)))
    real, calls = words_module.scatter, [0]

    def flaky(t: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
        calls[0] += 1
        if calls[0] == 2:
            real(t, positions[:17], values[:17])
            raise OSError("device lost")
        real(t, positions, values)

    monkeypatch.setattr(words_module, "scatter", flaky)
    with pytest.raises(OSError, match="device lost"):
        write_phase(writes, Hooks())
    assert np.array_equal(local.numpy().view(np.uint16), before)


def test_frame_sums_follow_from_tensor_sums() -> None:
    """Sums.within undoes Sums.shift: a frame's sums are those of its tensor, moved back."""
    tensor = words_of(5, 5000)
    start, stop = 1200, 3100
    pos = np.sort(np.random.default_rng(6).choice(stop - start, 150, replace=False))
    old = tensor[pos + start]
    new = old ^ np.uint16(0x0300)
    frame = contribution(pos, old, new, (stop - start) * 2)
    outer = contribution(pos + start, old, new, tensor.nbytes)
    assert outer.within((stop - start) * 2, start * 2, tensor.nbytes) == frame
    assert frame.shift((stop - start) * 2, start * 2, tensor.nbytes) == outer
    assert Sums(0, 0).within(10, 2, 20) == Sums(0, 0)


@pytest.mark.parametrize("group", [[], [0], [0, 1, 2, 3, 4]])
@pytest.mark.parametrize("sizes", [[10, 10, 10, 10, 10], [BATCH_BYTES, 1, BATCH_BYTES - 1, 5, 5]])
def test_batches_cut_a_read_into_runs_of_consecutive_frames(
    group: list[int], sizes: list[int]
) -> None:
    class F:
        def __init__(self, length: int) -> None:
            self.length = length

    class T:
        def __init__(self, length: int) -> None:
            self.frame = F(length)

    tasks = [T(n) for n in sizes]
    runs = batches(tasks, group)  # type: ignore[arg-type]
    assert [i for run in runs for i in run] == group
    for run in runs[:-1]:
        assert sum(sizes[i] for i in run) >= BATCH_BYTES
        assert sum(sizes[i] for i in run[:-1]) < BATCH_BYTES


def versions(seed: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    v0 = {
        "big": torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, 40_000, dtype=np.int16)),
        "small": torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, 300, dtype=np.int16)),
        "same": torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, 64, dtype=np.int16)),
    }
    out = [{k: v.view(torch.bfloat16).clone() for k, v in v0.items()}]
    for step in range(2):
        nxt = {k: v.clone() for k, v in out[-1].items()}
        for name, density in (("big", 0.01 + 0.2 * step), ("small", 0.05)):
            words = nxt[name].view(torch.int16).numpy()
            hit = rng.random(words.size) < density
            words[hit] ^= rng.integers(1, 1 << 15, int(hit.sum()), dtype=np.int16)
        out.append(nxt)
    return out


def bits(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.view(torch.int16).numpy().tobytes() for k, v in tensors.items()}


@pytest.mark.parametrize("codecs", ["v1", "v2"])
@pytest.mark.parametrize("batch", [1, 1 << 30])
def test_many_frames_sync_bit_exact_in_any_batching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codecs: str, batch: int
) -> None:
    """Multi-frame tensors (sparse and dense frames), one frame per job or all in one job,
    with one and several workers: every version lands bit-exact."""
    monkeypatch.setattr(fetch_module, "BATCH_BYTES", batch)
    states = versions(7)
    pub = Publisher(tmp_path, max_frame_bytes=4096, codecs=codecs)  # type: ignore[arg-type]
    for v, state in enumerate(states):
        pub.publish(state, version=v)
    for workers in (1, 3):
        local = {k: v.clone() for k, v in states[0].items()}
        sub = Subscriber(tmp_path, tensors=local, version=0, max_workers=workers)
        for v in range(1, len(states)):
            assert sub.sync(v).version == v
            assert bits(local) == bits(states[v])


def test_a_damaged_frame_in_a_batch_fails_the_sync_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch_module, "BATCH_BYTES", 1 << 30)  # every frame in one job
    states = versions(8)
    pub = Publisher(tmp_path, max_frame_bytes=4096)
    for v, state in enumerate(states[:2]):
        pub.publish(state, version=v)
    m = parse_manifest((tmp_path / manifest_key(1)).read_bytes())
    tasks = frame_tasks(m)
    assert len(tasks) > 3
    victim = tasks[len(tasks) // 2].frame
    path = tmp_path / victim.object
    data = bytearray(path.read_bytes())
    data[victim.offset + victim.length // 2] ^= 0x40
    path.write_bytes(bytes(data))
    local = {k: v.clone() for k, v in states[0].items()}
    sub = Subscriber(tmp_path, tensors=local, version=0, max_workers=2)
    with pytest.raises(IntegrityError, match="corrupted"):
        sub.sync(1)
    assert sub.version == 0 and bits(local) == bits(states[0])


def test_fetcher_returns_results_in_task_order_across_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch_module, "BATCH_BYTES", 300)
    states = versions(9)
    Publisher(tmp_path, max_frame_bytes=2048).publish(states[0], version=0)
    m = parse_manifest((tmp_path / manifest_key(0)).read_bytes())
    tasks = frame_tasks(m)

    def work(task: FrameTask, data: bytes, dec: FrameDecoder) -> tuple[str, int]:
        return task.name, task.frame.start

    got = Fetcher(open_store(tmp_path), 3, 1 << 20).run(tasks, work, Timer())
    assert got == [(t.name, t.frame.start) for t in tasks]
