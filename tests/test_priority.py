"""Sync worker threads at a lower CPU priority (deltastore.sync.priority): the threads really
get it (read back from the kernel), the option's bounds, and the plumbing through Fetcher and
Subscriber. No timing assertions."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import deltastore.sync.subscriber as subscriber_module
from deltastore import Publisher, Subscriber
from deltastore.format.codecs import FrameDecoder
from deltastore.format.manifest import manifest_key, parse_manifest
from deltastore.store import open_store
from deltastore.sync.fetch import Fetcher, FrameTask, Timer, frame_tasks
from deltastore.sync.priority import (
    Priority,
    check_priority,
    lower_current_thread,
    lowered,
    restore_current_thread,
    thread_priority,
)

linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread priorities are Linux only"
)


def kernel_nice(tid: int) -> int:
    """The nice value of thread ``tid`` of this process, as /proc says (field 19 of stat)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[16])


def in_thread(fn, *args):  # type: ignore[no-untyped-def]
    """``fn(*args)`` on a fresh thread; its result (priorities stick to the thread)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


@pytest.mark.parametrize("good", [0, 1, 10, 19, "idle", "19", " 5 "])
def test_check_priority_accepts_nice_values_and_idle(good: object) -> None:
    got = check_priority(good)
    assert got == ("idle" if good == "idle" else int(str(good)))


@pytest.mark.parametrize("bad", [-1, 20, 100, "-5", "low", "", None, 1.5, True, [10]])
def test_check_priority_rejects_out_of_bounds(bad: object) -> None:
    with pytest.raises(ValueError, match="priority="):
        check_priority(bad)


@linux
@pytest.mark.parametrize("nice", [5, 19])
def test_lowered_thread_has_that_nice_in_the_kernel(nice: int) -> None:
    main_before = kernel_nice(threading.get_native_id())

    def body() -> tuple[int, object, int]:
        tid = threading.get_native_id()
        lower_current_thread(nice)
        return (
            kernel_nice(tid),
            thread_priority(tid),
            kernel_nice(threading.main_thread().native_id or 0),
        )

    got, reported, main_after = in_thread(body)
    assert got == max(nice, main_before)
    assert reported == got
    assert main_after == main_before  # only the calling thread changed


@linux
def test_idle_thread_runs_under_sched_idle_and_is_restored() -> None:
    def body() -> tuple[int, int]:
        tid = threading.get_native_id()
        with lowered("idle"):
            inside = os.sched_getscheduler(tid)
        return inside, os.sched_getscheduler(tid)

    inside, after = in_thread(body)
    assert inside == os.SCHED_IDLE
    assert after == os.SCHED_OTHER  # leaving SCHED_IDLE needs no privilege
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


@linux
def test_zero_keeps_the_thread_as_it_was_and_higher_nice_is_not_lowered() -> None:
    def body() -> tuple[int, int]:
        tid = threading.get_native_id()
        lower_current_thread(12)
        lower_current_thread(3)  # lower than it is: left alone
        kept = kernel_nice(tid)
        lower_current_thread(0)
        return kept, kernel_nice(tid)

    base = kernel_nice(threading.get_native_id())
    assert in_thread(body) == (max(12, base), max(12, base))


@linux
def test_restore_gives_back_nice_where_allowed() -> None:
    def body() -> tuple[int, int]:
        tid = threading.get_native_id()
        before = lower_current_thread(15)
        low = kernel_nice(tid)
        restore_current_thread(before)
        return low, kernel_nice(tid)

    base = kernel_nice(threading.get_native_id())
    low, after = in_thread(body)
    assert low == max(15, base)
    # without CAP_SYS_NICE / RLIMIT_NICE the kernel refuses to lower nice again: kept low
    assert after in (base, low)


def chain(tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Versions 0 (anchor) and 1 (a delta) of three tensors in many small frames."""
    rng = np.random.default_rng(0)
    v0 = {
        f"t{i}": torch.from_numpy(rng.standard_normal(20_000).astype(np.float32)) for i in range(3)
    }
    v1 = {k: v + (torch.rand(v.shape) < 0.2) * 0.5 for k, v in v0.items()}
    pub = Publisher(tmp_path, max_frame_bytes=8192)
    pub.publish(v0, version=0)
    pub.publish(v1, version=1)
    return v0, v1


def seen_on_workers(
    tmp_path: Path, fetcher_priority: Priority, caller: Priority
) -> tuple[set[object], object]:
    """The priorities of the Fetcher's worker threads while they work on version 0, with
    :meth:`Fetcher.run` called from a thread lowered to ``caller``; and the caller's own."""
    chain(tmp_path)
    tasks = frame_tasks(parse_manifest((tmp_path / manifest_key(0)).read_bytes()))
    seen: set[object] = set()
    lock = threading.Lock()
    caller_after: list[object] = []

    def work(task: FrameTask, data: bytes, dec: FrameDecoder) -> int:
        with lock:
            seen.add(thread_priority())
        return len(data)

    def run() -> None:
        lower_current_thread(caller)
        Fetcher(open_store(tmp_path), 3, 1 << 20, fetcher_priority).run(tasks, work, Timer())
        caller_after.append(thread_priority())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(tasks) > 6
    return seen, caller_after[0]


@linux
@pytest.mark.parametrize("priority", [7, 19, "idle"])
def test_fetcher_workers_run_at_the_priority(tmp_path: Path, priority: Priority) -> None:
    seen, caller = seen_on_workers(tmp_path, priority, 0)
    base = kernel_nice(threading.get_native_id())
    assert seen == {priority if priority == "idle" else max(priority, base)}
    assert caller == base  # the calling thread keeps its own


@linux
def test_fetcher_workers_inherit_the_callers_priority(tmp_path: Path) -> None:
    seen, caller = seen_on_workers(tmp_path, 0, "idle")
    assert seen == {"idle"} and caller == "idle"


@linux
def test_subscriber_stages_on_low_priority_threads_and_applies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v0, v1 = chain(tmp_path)
    seen: set[object] = set()
    lock = threading.Lock()

    def spying(original):  # type: ignore[no-untyped-def]
        def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            with lock:
                seen.add((threading.get_native_id(), thread_priority()))
            return original(*args, **kwargs)

        return spy

    # frame by frame, and a job's frames at once (the native batch path)
    for name in ("stage_frame", "stage_batch"):
        monkeypatch.setattr(subscriber_module, name, spying(getattr(subscriber_module, name)))
    local = {k: v.clone() for k, v in v0.items()}
    before = thread_priority()
    sub = Subscriber(tmp_path, tensors=local, version=0, max_workers=2, priority="idle",
                     lease_ttl=None)  # fmt: skip
    sub.sync(1)
    assert {p for _, p in seen} == {"idle"}
    assert threading.get_native_id() not in {tid for tid, _ in seen}
    assert thread_priority() == before  # the caller of sync is not lowered
    for k in v1:
        assert torch.equal(local[k].view(torch.int32), v1[k].view(torch.int32)), k


@pytest.mark.parametrize("bad", [20, -3, "background"])
def test_subscriber_rejects_a_priority_out_of_bounds(tmp_path: Path, bad: object) -> None:
    chain(tmp_path)
    with pytest.raises(ValueError, match="priority="):
        Subscriber(tmp_path, priority=bad, lease_ttl=None)  # type: ignore[arg-type]


@linux
def test_engine_gate_gives_the_priority_back_for_the_write_phase() -> None:
    from deltastore.engines.vllm_worker import _Gate

    gate = _Gate()
    gate.armed = True
    gate.go.set()  # the driver committed: generation is paused

    def body() -> tuple[object, object]:
        gate.priority = lower_current_thread("idle")
        lowered_to = thread_priority()
        gate.pause()  # the write phase starts
        return lowered_to, thread_priority()

    assert in_thread(body) == ("idle", thread_priority())
