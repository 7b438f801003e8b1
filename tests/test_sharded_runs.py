"""Run ids and the fence: the parts of each trainer run apart, and older runs refused.

Two :class:`ShardWriter` s per run in one process. A run's parts live under
``versions/<v>/parts/<run>/``; :func:`commit_parts` with ``run=R`` takes only R's parts; once
a newer run is registered (:func:`register_run`) an older run's commit raises
:class:`SupersededRunError`; :func:`abandon_parts` writes abort records so that a late commit
of an abandoned (version, run) is refused as a crashed run's; ``gc(orphans=True)`` removes the
parts and data objects of aborted and superseded runs, on a local folder and on S3 (moto),
whatever their version, and nothing a committed manifest names nor the current run's parts in
flight. Two tests drive a one-rank :class:`ModuleWriter` (a gloo group in this process): its
``resume()`` abandons a crashed run's part (a late commit says "crashed"), and a writer left
running after a restart (a zombie) is fenced.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deltastore import ShardWriter, Subscriber, commit_parts
from deltastore.errors import SupersededRunError, VersionNotCommittedError
from deltastore.format.keys import data_prefix, manifest_key
from deltastore.format.manifest import Manifest, parse_manifest
from deltastore.maintenance.orphans import gc
from deltastore.maintenance.verify import verify_store
from deltastore.publish.parts import abandon_parts, current_run, register_run
from deltastore.store import LocalStore, Store
from tests.test_sharded_anchor_copies import (
    WORLD,
    Tensors,
    assert_bit_exact,
    initial,
    slices,
    step,
)
from tests.test_stores_e2e import s3

#: Large frames: few requests per version (the S3 case runs against a moto server).
OPTIONS: dict[str, Any] = {"max_frame_bytes": 1 << 16}
PART = re.compile(r"versions/([0-9]{20})/parts/([0-9a-f]{32})/([0-9]{6})-of-([0-9]{6})\.json")


def new_run() -> str:
    return uuid.uuid4().hex


def run_parts(version: int, run: str) -> str:
    return f"{data_prefix(version)}parts/{run}/"


def part_keys(store: Store, version: int, run: str) -> list[str]:
    return [k for k in store.list(run_parts(version, run)) if PART.fullmatch(k)]


def writers(store: Store, run: str | None) -> list[ShardWriter]:
    return [ShardWriter(store, rank, WORLD, run=run, **OPTIONS) for rank in range(WORLD)]


def commit(store: Store, ws: list[ShardWriter], full: Tensors, version: int, run: str) -> Manifest:
    for w in ws:
        w.publish(slices(full, w.rank), version=version)
    manifest = commit_parts(store, version=version, world=WORLD, run=run, timeout_s=10)
    for w in ws:
        assert w.finish(version, timeout_s=10) == manifest
    return manifest


def local(tmp_path: Path) -> Store:
    return LocalStore(tmp_path / "store")


@pytest.fixture(params=["local", "s3"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        return lambda: s3(endpoint)
    return lambda: local(tmp_path)


def test_a_runs_parts_live_under_it_and_a_newer_run_fences_the_older(tmp_path: Path) -> None:
    store = local(tmp_path)
    r1, r2 = new_run(), new_run()
    assert current_run(store) is None
    seq1 = register_run(store, r1, WORLD)
    assert current_run(store) == r1
    records = store.list("runs/")
    assert len(records) == 1 and records[0] == f"runs/{seq1:020d}.json"
    record = json.loads(store.get(records[0]))
    assert (record["run"], record["world"]) == (r1, WORLD)
    ws1 = writers(store, r1)
    states = [initial(3)]
    commit(store, ws1, states[0], 1, r1)
    assert store.list(run_parts(1, r1)) == []  # the run's parts are deleted after its commit
    # version 2: run 1's parts, under its run
    states.append(step(states[0], seed=4))
    for w in ws1:
        w.publish(slices(states[1], w.rank), version=2)
    assert part_keys(store, 2, r1) == [
        f"{run_parts(2, r1)}{rank:06d}-of-{WORLD:06d}.json" for rank in range(WORLD)
    ]
    assert [k for k in store.list(data_prefix(2)) if k.endswith(f"-of-{WORLD:06d}.json")] == (
        part_keys(store, 2, r1)
    )  # no part at the keys of the run-less protocol
    # a newer run is registered: run 1 can no longer commit
    seq2 = register_run(store, r2, WORLD)
    assert seq2 > seq1 and current_run(store) == r2
    with pytest.raises(SupersededRunError) as refused:
        commit_parts(store, version=2, world=WORLD, run=r1, timeout_s=5)
    assert isinstance(refused.value, VersionNotCommittedError)
    assert r1 in str(refused.value) and r2 in str(refused.value), refused.value
    assert not store.exists(manifest_key(2))
    with pytest.raises(VersionNotCommittedError):
        ws1[0].finish(2, timeout_s=0.5, poll_s=0.02)
    # run 2 publishes version 2 beside run 1's parts: its commit takes its own parts only
    ws2 = writers(store, r2)
    for w in ws2:
        assert w.attach(slices(states[0], w.rank)) == 1
    states[1] = step(states[0], seed=5)
    m2 = commit(store, ws2, states[1], 2, r2)
    assert m2.kind == "delta" and m2.parent is not None and m2.parent.version == 1
    sub = Subscriber(store, lease_ttl=None)
    assert sub.sync().version == 2
    assert_bit_exact(states[1], sub.tensors)
    # writers without a run cannot commit on a store that has runs
    for w in writers(store, None):
        w.attach(slices(states[1], w.rank))
        w.publish(slices(step(states[1], seed=6), w.rank), version=3)
    with pytest.raises(SupersededRunError, match=f"belongs to run {r2}.*without a run id"):
        commit_parts(store, version=3, world=WORLD, run=None, timeout_s=5)
    assert not store.exists(manifest_key(3))


def test_abandoned_parts_are_refused_as_a_crashed_runs(tmp_path: Path) -> None:
    store = local(tmp_path)
    r1, r2 = new_run(), new_run()
    register_run(store, r1, WORLD)
    ws = writers(store, r1)
    states = [initial(6)]
    commit(store, ws, states[0], 1, r1)
    states.append(step(states[0], seed=7))
    commit(store, ws, states[1], 2, r1)
    v3 = step(states[1], seed=8)
    for w in ws:  # both parts of version 3, then the job dies before the commit
        w.publish(slices(v3, w.rank), version=3)
    ws[0].publish(slices(step(v3, seed=9), 0), version=4)  # rank 0 ran ahead
    abandoned = abandon_parts(store, above=2, keep_run=r2, reason="the job was restarted")
    assert sorted(abandoned) == [(3, r1), (4, r1)]
    assert store.exists(f"{run_parts(3, r1)}abort.json")
    assert store.exists(f"{run_parts(4, r1)}abort.json")
    for version in (3, 4):
        with pytest.raises(VersionNotCommittedError) as refused:
            commit_parts(store, version=version, world=WORLD, run=r1, timeout_s=1)
        message = str(refused.value)
        assert not isinstance(refused.value, SupersededRunError)  # run 1 is still the current
        assert "the job was restarted" in message and r1 in message, message
        assert "another writer" not in message, message
        assert not store.exists(manifest_key(version))
    with pytest.raises(VersionNotCommittedError):
        ws[1].finish(3, timeout_s=10)
    # again (a second restart before run 1's parts are collected): the first markers stay
    abandon_parts(store, above=2, keep_run=r2, reason="again")
    marker = json.loads(store.get(f"{run_parts(3, r1)}abort.json"))
    assert marker["reason"] == "the job was restarted"
    sub = Subscriber(store, lease_ttl=None)
    assert sub.sync().version == 2
    assert_bit_exact(states[1], sub.tensors)


def test_gc_removes_the_parts_of_aborted_and_superseded_runs(
    make_store: Callable[[], Store],
) -> None:
    store = make_store()
    r1, r2 = new_run(), new_run()
    register_run(store, r1, WORLD)
    old = writers(store, r1)
    states = [initial(10)]
    commit(store, old, states[0], 1, r1)
    for v in (2, 3):
        states.append(step(states[-1], seed=10 + v))
        commit(store, old, states[-1], v, r1)
    crashed = step(states[-1], seed=20)
    for w in old:  # version 4: both parts, never committed
        w.publish(slices(crashed, w.rank), version=4)
    old[0].publish(slices(step(crashed, seed=21), 0), version=5)  # version 5: rank 0's part only
    # the restart: run 2 supersedes run 1 and abandons its leftovers
    register_run(store, r2, WORLD)
    assert sorted(abandon_parts(store, above=3, keep_run=r2, reason="restart")) == [
        (4, r1),
        (5, r1),
    ]
    new = writers(store, r2)
    for w in new:
        assert w.attach(slices(states[-1], w.rank)) == 3
    states.append(step(states[-1], seed=30))
    m4 = commit(store, new, states[-1], 4, r2)  # the abandoned version number, by the new run
    assert m4.parent is not None and m4.parent.version == 3
    # a zombie writer of run 1 writes a part of version 6 after the restart (superseded)
    zombie = ShardWriter(store, 1, WORLD, run=r1, **OPTIONS)
    zombie.publish(slices(step(crashed, seed=22), 1), version=6)
    leftovers = {v: part_keys(store, v, r1) for v in (4, 5, 6)}
    assert [len(leftovers[v]) for v in (4, 5, 6)] == [2, 1, 1]
    objects = {
        f["object"]
        for keys in leftovers.values()
        for k in keys
        for t in json.loads(store.get(k))["tensors"].values()
        for f in t["frames"]
    }
    assert objects and all(store.exists(o) for o in objects)
    referenced = {
        o
        for v in range(1, 5)
        for o in parse_manifest(store.get(manifest_key(v)), key=manifest_key(v)).objects
    }
    assert not objects & referenced
    # run 2's part of version 5 is in flight during the gc: kept, with its data objects
    nxt = step(states[-1], seed=31)
    for w in new:
        w.publish(slices(nxt, w.rank), version=5)
    inflight = set(part_keys(store, 5, r2))
    inflight |= {
        f["object"]
        for k in part_keys(store, 5, r2)
        for t in json.loads(store.get(k))["tensors"].values()
        for f in t["frames"]
    }
    assert len(inflight) > 2
    report = gc(store, orphans=True)  # the default min age: the fence, not age, decides
    removed = set(report.removed)
    assert not inflight & removed
    assert all(store.exists(k) for k in inflight)
    assert {k for keys in leftovers.values() for k in keys} <= removed
    assert objects <= removed
    assert not any(store.exists(k) for keys in leftovers.values() for k in keys)
    assert not any(store.exists(o) for o in objects)  # versions 5 and 6 are above the newest
    assert all(store.exists(o) for o in referenced)
    assert verify_store(store).ok
    fresh = Subscriber(store, lease_ttl=None)
    assert fresh.sync().version == 4
    assert_bit_exact(states[-1], fresh.tensors)
    # run 1 stays refused after the gc; run 2 goes on
    for v in (5, 6):
        with pytest.raises(VersionNotCommittedError):
            commit_parts(store, version=v, world=WORLD, run=r1, timeout_s=0.5, poll_s=0.05)
        assert not store.exists(manifest_key(v))
    states.append(nxt)
    m5 = commit_parts(store, version=5, world=WORLD, run=r2, timeout_s=10)
    for w in new:
        assert w.finish(5, timeout_s=10) == m5
    after = Subscriber(store, lease_ttl=None)
    assert after.sync().version == 5
    assert_bit_exact(states[-1], after.tensors)
    assert verify_store(store).ok


def test_run_arguments_are_checked(tmp_path: Path) -> None:
    store = local(tmp_path)
    for bad in ("", "XYZ", "0" * 31, "g" * 32):
        with pytest.raises((ValueError, TypeError)):
            register_run(store, bad, WORLD)
    assert current_run(store) is None


def test_resume_abandons_a_crashed_runs_parts_and_a_late_commit_says_so(tmp_path: Path) -> None:
    """A one-rank ModuleWriter (gloo, in this process) resumes after a run that died with its
    part of version 2 written: resume() abandons it, and that run's late commit is refused as
    the uncommitted parts of a crashed run."""
    import torch
    import torch.distributed as dist

    from deltastore import ModuleWriter, ResumeReport, RowSlice

    store = local(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(24, 12)
    r1 = new_run()
    register_run(store, r1, 1)
    old = ShardWriter(store, 0, 1, run=r1, **OPTIONS)
    params = {n: RowSlice.whole(p.detach()) for n, p in model.named_parameters()}
    old.publish(params, version=1)
    commit_parts(store, version=1, world=1, run=r1, timeout_s=5)
    old.finish(1)
    at_v1 = {n: t.clone() for n, t in model.state_dict().items()}
    with torch.no_grad():
        model.weight[3] += 0.5
    old.publish(params, version=2)  # then the job dies
    model.load_state_dict(at_v1)  # the restarted job rebuilds the state of version 1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        w = ModuleWriter(store, model, **OPTIONS)
        assert w.run != r1 and current_run(store) == w.run
        assert w.resume() == ResumeReport(head=1, kind="delta", abandoned=(2,), reason=None)
        with pytest.raises(VersionNotCommittedError) as refused:
            commit_parts(store, version=2, world=1, run=r1, timeout_s=1)
        message = str(refused.value)
        assert "crashed" in message and "another writer" not in message, message
        with torch.no_grad():
            model.weight[3] -= 0.25
        assert w.step().version == 2  # the abandoned number, by the new run
    finally:
        dist.destroy_process_group()
    sub = Subscriber(store, lease_ttl=None)
    assert sub.sync().version == 2
    assert sub.tensors is not None
    for name, p in model.named_parameters():
        assert torch.equal(sub.tensors[name], p.detach()), name


def test_a_zombie_module_writer_is_fenced_and_gc_collects_its_parts(tmp_path: Path) -> None:
    """Two ModuleWriters in one one-rank group: the first keeps running after the second
    (a restart) registered. The zombie's step is refused with SupersededRunError and
    commits nothing; the new run's step commits; gc removes the zombie's part and data."""
    import torch
    import torch.distributed as dist

    from deltastore import DeltastoreError, ModuleWriter

    store = local(tmp_path)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Linear(32, 8))
    kw: dict[str, Any] = {"timeout_s": 2.0, "poll_s": 0.02, **OPTIONS}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        zombie = ModuleWriter(store, model, **kw)
        first = zombie.resume()
        assert (first.head, first.kind, first.abandoned) == (None, "anchor", ())
        assert zombie.step().version == 1
        new = ModuleWriter(store, model, **kw)  # the restart, while the old job still runs
        assert current_run(store) == new.run != zombie.run
        assert (new.resume().head, new.version) == (1, 1)
        with torch.no_grad():
            model[0].weight[5] += 1.0
        with pytest.raises(SupersededRunError, match=zombie.run):
            zombie.step()
        assert not store.exists(manifest_key(2))
        left = part_keys(store, 2, zombie.run)
        assert len(left) == 1
        objects = {
            f["object"]
            for t in json.loads(store.get(left[0]))["tensors"].values()
            for f in t["frames"]
        }
        assert new.step().version == 2
        removed = set(gc(store, orphans=True).removed)
        assert {*left, *objects} <= removed
        with pytest.raises(DeltastoreError):  # still nothing from the zombie
            zombie.step()
        assert not store.exists(manifest_key(3))
    finally:
        dist.destroy_process_group()
    assert verify_store(store, deep=True).ok
    sub = Subscriber(store, lease_ttl=None)
    assert sub.sync().version == 2
    assert sub.tensors is not None
    for name, p in model.named_parameters():
        assert torch.equal(sub.tensors[name], p.detach()), name


def test_a_superseded_run_is_told_so_wherever_it_stands(tmp_path: Path) -> None:
    """The fence is the first thing an old run hears: a version number the new run committed
    already, its writers waiting in finish() (the refused commit gives the version up, so they
    stop at once), and its next publish."""
    store = local(tmp_path)
    r1, r2 = new_run(), new_run()
    register_run(store, r1, WORLD)
    old = writers(store, r1)
    v1 = initial(1)
    commit(store, old, v1, 1, r1)
    v2 = step(v1, 2)
    for w in old:
        w.publish(slices(v2, w.rank), version=2)
    register_run(store, r2, WORLD)  # a restart: the old processes are still alive
    new = writers(store, r2)
    for w in new:
        w.attach(slices(v1, w.rank))
    commit(store, new, v2, 2, r2)
    with pytest.raises(SupersededRunError, match=f"run {r1} was superseded by run {r2}"):
        commit_parts(store, version=2, world=WORLD, run=r1, timeout_s=1)  # committed by r2
    for w in old:
        with pytest.raises(SupersededRunError):
            w.finish(2, timeout_s=30)  # r2's manifest, not r1's parts: told at once
    v3 = step(v2, 3)
    for w in old:
        with pytest.raises(SupersededRunError):
            w.publish(slices(v3, w.rank), version=3)
    # an old writer waiting for a version nobody committed stops when the refusal gives it up
    for w in writers(store, r1):
        w.attach(slices(v2, w.rank))
        w.publish(slices(v3, w.rank), version=3)
        with pytest.raises(SupersededRunError):
            commit_parts(store, version=3, world=WORLD, run=r1, timeout_s=1)
        with pytest.raises(VersionNotCommittedError, match="aborted"):
            w.finish(3, timeout_s=30)
        break
    assert [r for v, r in abandon_parts(store, above=2, keep_run=r2, reason="x")] == []
    commit(store, new, v3, 3, r2)
    sub = Subscriber(store)
    sub.sync()
    assert_bit_exact(v3, sub.tensors)
