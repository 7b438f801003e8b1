"""Long runs: anchor copies by cost, cheapest catch-up, retention with reader leases.

The acceptance run publishes 300 real AdamW versions of a small model with the default anchor
policy and runs ``gc --keep 10`` every 25 versions, with three followers (one always current,
one that sleeps for 50 versions holding a lease, one that joins fresh at version 250), all
checked bit-wise at every version they reach. Fault points: every delete of a gc, raised
before it or after it (a gc killed there), never leaves a committed manifest naming a missing
object and never strands a leased reader.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltastore import LocalStore, Publisher, Subscriber
from deltastore.errors import ObjectNotFoundError
from deltastore.format.keys import anchor_key, data_prefix, lease_key, manifest_key
from deltastore.format.lease import Lease, parse_lease
from deltastore.maintenance.orphans import find_orphans, gc
from deltastore.maintenance.retention import retain
from deltastore.maintenance.verify import MISSING_OBJECT, TRUNCATED, verify_store
from deltastore.publish.policy import AnchorCosts, AnchorPolicy
from deltastore.store import Store
from deltastore.testing.faults import FaultyStore, InjectedFault
from deltastore.testing.synthetic import AdamWTrajectory, ModelConfig
from deltastore_cli import app
from tests.test_soak import SPEC  # ~200K elements over 20 tensors (GQA)

Tensors = Mapping[str, torch.Tensor]
#: ~30K elements: for the fault matrix, which copies the store once per fault point.
MINI = ModelConfig(
    vocab=256, hidden=32, layers=1, intermediate=64, heads=2, kv_heads=1, head_dim=16
)
#: ~1.2M elements over 12 tensors: payload, not manifests, makes most of a version's bytes.
LONGRUN = ModelConfig(
    vocab=4000, hidden=128, layers=1, intermediate=256, heads=4, kv_heads=2, head_dim=32
)
LONG = 4 * 3600.0  # a lease that outlives the test


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.int16).numpy()


def assert_bit_exact(expected: Tensors, got: Tensors | None) -> None:
    assert got is not None
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert np.array_equal(bits(got[name]), bits(t)), name


class Counting(LocalStore):
    """A local store that counts the bytes read (objects and ranges)."""

    read = 0

    def get(self, key: str) -> bytes:
        data = super().get(key)
        self.read += len(data)
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = super().get_range(key, start, length)
        self.read += len(data)
        return data


class Recording(LocalStore):
    """A local store that records the key and length of every data read (whole or ranged)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int]] = []

    def get(self, key: str) -> bytes:
        data = super().get(key)
        self.reads.append((key, len(data)))
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = super().get_range(key, start, length)
        self.reads.append((key, len(data)))
        return data

    def data_read(self) -> dict[int, tuple[str, ...]]:
        """Per version, the names of the data objects read under ``versions/<v>/``."""
        out: dict[int, set[str]] = {}
        for key, _ in self.reads:
            if key.startswith("versions/"):
                _, v, name = key.split("/")
                out.setdefault(int(v), set()).add(name)
        return {v: tuple(sorted(n)) for v, n in sorted(out.items())}


def store_bytes(root: Path) -> int:
    """Bytes of every object in the store's folder (manifests, copies, data, leases, LATEST)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name[0] != ".")


def version_bytes(root: Path, v: int) -> tuple[int, int]:
    """(anchor bytes, delta bytes) stored for version ``v``: its anchor copy (manifest and
    data) and the rest (the version's manifest and data; all of it for an anchor version)."""
    anchor = sum(p.stat().st_size for p in (root / data_prefix(v)).glob("*-anchor-*"))
    copy = root / anchor_key(v)
    anchor += copy.stat().st_size if copy.exists() else 0
    rest = (
        sum(p.stat().st_size for p in (root / data_prefix(v)).iterdir())
        + (root / manifest_key(v)).stat().st_size
    )
    return anchor, rest + (copy.stat().st_size if copy.exists() else 0) - anchor


def committed(root: Path) -> set[int]:
    return {int(p.stem) for p in (root / "manifests").glob("*.json")}


def test_300_versions_with_gc_and_three_followers(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = LocalStore(root)
    traj = AdamWTrajectory(LONGRUN)
    pub = Publisher(store)
    current = Subscriber(store, reader_id="current", lease_ttl=LONG)
    sleeper = Subscriber(store, reader_id="sleeper", lease_ttl=LONG)
    late: Subscriber | None = None
    anchors: list[int] = []
    deltas: list[int] = []
    copies: list[int] = []
    kept: dict[int, Tensors] = {}
    sleep_from, sleep_to, join, last = 100, 150, 250, 300
    weights = traj.bf16()
    for v in range(1, last + 1):
        report = pub.publish(weights, version=v)
        a, d = version_bytes(root, v)
        if report.kind == "anchor":
            anchors.append(a + d)
            assert report.anchor_reason == "first version"
        else:
            deltas.append(d)
            if report.anchor_copy_bytes is not None:
                anchors.append(a)
                copies.append(v)
                assert str(report.anchor_reason).startswith("cost: ")
        if v >= last - 3:
            kept[v] = {n: t.clone() for n, t in weights.items()}

        got = current.sync()
        assert got.applied == (v,) and got.path == ("anchor" if v == 1 else "deltas")
        assert_bit_exact(weights, current.tensors)
        if not sleep_from < v <= sleep_to:
            got = sleeper.sync()
            assert_bit_exact(weights, sleeper.tensors)
            if v == sleep_to + 1:  # woke up: every version it slept through is still there
                assert got.path == "deltas"
                assert got.applied == tuple(range(sleep_from + 1, v + 1))
        if v == join:
            late = Subscriber(store, reader_id="late", lease_ttl=LONG)
            got = late.sync()
            assert got.path == "anchor" and got.applied[0] == max(copies)
            assert got.kind == "anchor"
        elif late is not None:
            assert late.sync().path == "deltas"
        if late is not None:
            assert_bit_exact(weights, late.tensors)

        if v % 25 == 0:
            out = gc(store, keep=10).retention
            assert out is not None
            have = committed(root)
            if sleep_from <= v <= sleep_to:  # the sleeper's lease holds its versions
                assert set(range(sleep_from, v + 1)) <= have
                if v - 9 > sleep_from:  # older than the newest 10: kept for the lease
                    assert "lease of sleeper" in str(out.oldest_kept_because)
            assert set(range(v - 9, v + 1)) <= have
            bound = 1.5 * (2 * statistics.median(anchors) + 10 * statistics.median(deltas))
            assert store_bytes(root) < bound, (v, store_bytes(root), bound)
            assert verify_store(store).ok
        weights = traj.step()

    assert len(copies) >= 2  # the cost rule wrote several anchor copies over the run
    assert min(committed(root)) > 1  # the first anchor and old deltas are gone
    # a fresh replica at 300: at most 2.2 anchors of bytes, counted at the store
    counting = Counting(root)
    fresh = Subscriber(counting, lease_ttl=None)
    got = fresh.sync()
    assert got.version == last and got.path == "anchor"
    newest_anchor = pub.store.get(anchor_key(max(copies)))
    assert counting.read <= 2.2 * anchors[-1], (counting.read, anchors[-1], len(newest_anchor))
    assert_bit_exact(kept[last], fresh.tensors)
    # a replica 3 versions behind fetches those 3 deltas and nothing else
    counting = Counting(root)
    behind = Subscriber(
        counting,
        tensors={n: t.clone() for n, t in kept[last - 3].items()},
        version=last - 3,
        lease_ttl=None,
    )
    behind.verify()
    counting.read = 0
    got = behind.sync()
    assert got.applied == (last - 2, last - 1, last) and got.path == "deltas"
    steps = [behind.manifest(u) for u in got.applied]
    frames = sum(m.payload_bytes for m in steps)
    manifests = sum((root / manifest_key(u)).stat().st_size for u in got.applied)
    assert got.payload_bytes == frames
    latest = (root / "LATEST").stat().st_size  # a local folder's poll reads it (NFS)
    assert counting.read == frames + manifests + latest  # no anchor: those versions only
    assert_bit_exact(kept[last], behind.tensors)


# --- anchor policy ----------------------------------------------------------------------


def publish_run(
    root: Path, n: int, policy: str | None, config: ModelConfig = MINI
) -> list[Tensors]:
    pub = Publisher(LocalStore(root), anchor_policy=policy)
    traj = AdamWTrajectory(config)
    out = [traj.bf16()]
    pub.publish(out[0], version=1)
    for v in range(2, n + 1):
        out.append(traj.step())
        pub.publish(out[-1], version=v)
    return out


def copy_versions(root: Path) -> list[int]:
    return sorted(int(p.stem) for p in (root / "anchors").glob("*.json"))


def test_every_n_writes_a_copy_every_n_versions_and_followers_fetch_deltas(tmp_path: Path) -> None:
    states = publish_run(tmp_path, 25, "every:8")
    assert copy_versions(tmp_path) == [9, 17, 25]
    store = LocalStore(tmp_path)
    for v in (9, 17, 25):  # the version itself stays a delta; the copy holds the same state
        m = json.loads((tmp_path / manifest_key(v)).read_bytes())
        c = json.loads((tmp_path / anchor_key(v)).read_bytes())
        assert m["kind"] == "delta" and c["kind"] == "anchor"
        assert m["state_digest"] == c["state_digest"]
    follower = Subscriber(store, tensors={n: t.clone() for n, t in states[7].items()}, version=8)
    got = follower.sync(9)
    assert got.path == "deltas" and got.kind == "delta"  # no anchor bytes for a follower
    assert got.payload_bytes == follower.manifest(9).payload_bytes
    assert_bit_exact(states[8], follower.tensors)
    assert verify_store(store, deep=True).ok


def test_never_writes_no_copy_and_forced_anchor_says_so(tmp_path: Path) -> None:
    pub = Publisher(LocalStore(tmp_path), anchor_policy="never")
    traj = AdamWTrajectory(MINI)
    assert pub.publish(traj.bf16(), version=1).anchor_reason == "first version"
    for v in range(2, 6):
        report = pub.publish(traj.step(), version=v)
        assert report.anchor_reason is None and report.anchor_copy_bytes is None
    forced = pub.publish(traj.step(), version=6, anchor=True)
    assert forced.kind == "anchor" and forced.anchor_reason == "forced"
    assert not (tmp_path / "anchors").exists()


def test_the_cost_rule_bounds_fresh_catch_up(tmp_path: Path) -> None:
    publish_run(tmp_path, 60, None, SPEC)
    copies = copy_versions(tmp_path)
    assert len(copies) >= 2  # the default policy wrote some
    anchor = {v: version_bytes(tmp_path, v)[0] for v in copies}
    anchor[1] = sum(version_bytes(tmp_path, 1))
    delta = max(version_bytes(tmp_path, v)[1] for v in range(2, 61))
    for target in (copies[0] - 1, copies[0], copies[1] - 1, 60):
        counting = Counting(tmp_path)
        got = Subscriber(counting, lease_ttl=None).sync(target)
        newest = max(c for c in [1, *copies] if c <= target)
        assert got.applied[0] == newest and got.path == "anchor"
        # k = 1: the anchor, at most one anchor's worth of deltas, one estimate's error
        assert counting.read <= 2 * anchor[newest] + delta, target


def test_a_restarted_publisher_keeps_the_account(tmp_path: Path) -> None:
    straight = publish_run(tmp_path / "a", 30, "cost:0.02", MINI)
    pub = Publisher(LocalStore(tmp_path / "b"), anchor_policy="cost:0.02")
    for v, state in enumerate(straight[:12], start=1):
        pub.publish(state, version=v)
    again = Publisher(LocalStore(tmp_path / "b"), anchor_policy="cost:0.02")
    again.attach(straight[11], version=12)  # reads the chain back to its newest anchor
    for v, state in enumerate(straight[12:], start=13):
        again.publish(state, version=v)
    assert copy_versions(tmp_path / "a") == copy_versions(tmp_path / "b")
    assert len(copy_versions(tmp_path / "a")) >= 2


def test_policy_parse_and_account() -> None:
    assert AnchorPolicy.parse(None) == AnchorPolicy.parse("cost") == AnchorPolicy()
    assert AnchorPolicy.parse("cost:2.5").k == 2.5
    assert AnchorPolicy.parse("every:10").every == 10
    assert AnchorPolicy.parse("never").never
    assert str(AnchorPolicy.parse("every:3")) == "every:3"
    for bad in ("every:0", "cost:-1", "cost:nan", "every:x", "sometimes", "never:2"):
        with pytest.raises(ValueError, match=r"anchor policy|must be"):
            AnchorPolicy.parse(bad)
    costs = AnchorCosts()
    assert costs.reason(AnchorPolicy(), 10) is not None  # nothing known: write one
    costs.anchored(1, 1000)
    assert costs.reason(AnchorPolicy(), 500) is None
    costs.delta(600)
    assert costs.reason(AnchorPolicy(), 500) is not None  # 1100 > 1 x 1000
    assert costs.reason(AnchorPolicy(k=2), 500) is None
    assert costs.reason(AnchorPolicy(every=2), 0) == "every 2 versions"
    assert costs.reason(AnchorPolicy(never=True), 10**9) is None


# --- cheapest catch-up ------------------------------------------------------------------


def test_far_behind_takes_the_copy_when_it_is_smaller(tmp_path: Path) -> None:
    """Held 2 of 80 with a copy at 71: the copy and 9 deltas cost less than 78 deltas (a copy
    weighs about 55 deltas here), so the copy is taken, and the reads prove it (the copy's
    data, then the deltas after it, no data of 3-70); held 68 the deltas cost less, and no
    copy data is read."""
    states = publish_run(tmp_path, 80, "every:70")  # a copy at 71
    store = Recording(tmp_path)
    old = Subscriber(
        store, tensors={n: t.clone() for n, t in states[1].items()}, version=2, lease_ttl=None
    )
    near = Subscriber(  # held 68: the copy at 71 is above it, but 12 deltas cost less
        store, tensors={n: t.clone() for n, t in states[67].items()}, version=68, lease_ttl=None
    )
    deltas = sum(old.manifest(v).payload_bytes for v in range(3, 81))
    copy = sum(
        f["length"]
        for e in json.loads((tmp_path / anchor_key(71)).read_bytes())["tensors"].values()
        for f in e["frames"]
    )
    after = sum(old.manifest(v).payload_bytes for v in range(72, 81))
    assert copy + after < deltas, "the workload no longer makes the copy the cheaper path"
    copy_objects = tuple(sorted(p.name for p in (tmp_path / data_prefix(71)).glob("*-anchor-*")))
    assert copy_objects
    store.reads.clear()
    got = old.sync()
    assert got.path == "anchor" and got.applied == tuple(range(71, 81))
    assert got.path_bytes == copy + after
    read = store.data_read()
    assert sorted(read) == list(range(71, 81))  # nothing of versions 3-70
    assert read[71] == copy_objects  # the copy's data objects, not version 71's delta
    assert all("-anchor-" not in n for v in range(72, 81) for n in read[v])
    assert anchor_key(71) in {k for k, _ in store.reads}
    data_bytes = sum(n for k, n in store.reads if k.startswith("versions/"))
    assert data_bytes == copy + after
    assert_bit_exact(states[79], old.tensors)
    store.reads.clear()
    got = near.sync()
    assert got.path == "deltas" and got.applied == tuple(range(69, 81))
    assert got.other_bytes == copy + after > got.path_bytes
    assert sorted(store.data_read()) == list(range(69, 81))
    assert all("-anchor-" not in n for names in store.data_read().values() for n in names)
    assert_bit_exact(states[79], near.tensors)


# --- leases -----------------------------------------------------------------------------


def test_lease_model_round_trip_and_expiry() -> None:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    lease = Lease.new("node-1.rank0", 42, 600, now=now)
    back = parse_lease(lease.to_bytes(), key=lease_key("node-1.rank0"))
    assert back == lease and back.version == 42
    assert not back.expired(now + timedelta(seconds=599))
    assert back.expired(now + timedelta(seconds=601))
    assert not back.expired(now + timedelta(seconds=601), grace_s=60)
    for bad in (
        b"{",
        b'{"format_version":1}',
        lease.to_bytes().replace(b"2026-12-01", b"2026-02-30"),
    ):
        with pytest.raises(ValueError, match=r"malformed|JSON"):
            parse_lease(bad)
    for bad_id in ("", ".hidden", "a/b", "x" * 251):
        with pytest.raises(ValueError, match="reader id"):
            lease_key(bad_id)


def test_subscriber_writes_renews_and_releases_its_lease(tmp_path: Path) -> None:
    states = publish_run(tmp_path, 3, "never")
    sub = Subscriber(tmp_path, reader_id="r1", lease_ttl=600)
    sub.sync(2)
    lease = parse_lease((tmp_path / lease_key("r1")).read_bytes())
    assert lease.reader == "r1" and lease.version == 2
    sub.sync()
    assert parse_lease((tmp_path / lease_key("r1")).read_bytes()).version == 3
    assert_bit_exact(states[2], sub.tensors)
    sub.close()
    assert not (tmp_path / lease_key("r1")).exists()
    off = Subscriber(tmp_path, reader_id="r2", lease_ttl=None)
    off.sync()
    assert not (tmp_path / lease_key("r2")).exists()
    assert sub.reader_id == "r1" and Subscriber(tmp_path).reader_id  # a default id


def test_a_lease_that_cannot_be_written_changes_nothing(tmp_path: Path) -> None:
    states = publish_run(tmp_path, 3, "never")
    faulty = FaultyStore(LocalStore(tmp_path), fail_at=1, only=["put"])
    sub = Subscriber(faulty, reader_id="r", lease_ttl=600)
    got = sub.sync()
    assert got.version == 3 and faulty.fault is not None and faulty.fault.key == lease_key("r")
    assert_bit_exact(states[2], sub.tensors)


def test_an_expired_lease_is_ignored_and_its_reader_recovers(tmp_path: Path) -> None:
    states = publish_run(tmp_path, 30, "every:8")
    store = LocalStore(tmp_path)
    old = Subscriber(store, reader_id="old", lease_ttl=600)
    old.sync(5)
    live = Subscriber(store, reader_id="live", lease_ttl=LONG)
    live.sync(12)
    out = retain(store, 3, now=datetime.now(timezone.utc) + timedelta(hours=1))
    assert lease_key("old") in out.expired_removed
    assert not (tmp_path / lease_key("old")).exists()
    assert min(committed(tmp_path)) == 9  # the live lease at 12 needs the copy at 9
    assert "anchor of version 12" in str(out.oldest_kept_because)
    got = old.sync()  # its deltas are gone: from the newest anchor copy instead
    assert got.path == "anchor" and got.applied[0] == 25
    assert_bit_exact(states[29], old.tensors)
    got = live.sync()
    assert got.path == "deltas" and got.applied == tuple(range(13, 31))
    assert_bit_exact(states[29], live.tensors)


def test_a_sync_whose_versions_vanish_midway_plans_again(tmp_path: Path) -> None:
    states = publish_run(tmp_path, 20, "every:8")
    store = LocalStore(tmp_path)
    reader = Subscriber(store, lease_ttl=None)
    reader.sync(4)
    deleted = False

    class Vanishing(LocalStore):
        def get_range(self, key: str, start: int, length: int) -> bytes:
            nonlocal deleted
            if not deleted and key.startswith(data_prefix(6)):
                deleted = True  # a gc that ignores this reader deletes 1..16 now
                retain(store, 4)
            return super().get_range(key, start, length)

    reader = Subscriber(
        Vanishing(tmp_path), tensors=dict(reader.tensors or {}), version=4, lease_ttl=None
    )
    got = reader.sync()
    assert deleted and got.version == 20 and got.applied[-4:] == (17, 18, 19, 20)
    assert_bit_exact(states[19], reader.tensors)


# --- gc ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def leased(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Tensors]]:
    """40 versions (copies every 8), a reader leasing version 20, and the weights."""
    root = tmp_path_factory.mktemp("leased")
    states = publish_run(root, 40, "every:8")
    Subscriber(root, reader_id="reader", lease_ttl=LONG).sync(20)
    return root, states


def test_gc_keeps_what_the_newest_and_the_leases_need(
    leased: tuple[Path, list[Tensors]], tmp_path: Path
) -> None:
    root = tmp_path / "s"
    shutil.copytree(leased[0], root)
    dry = gc(LocalStore(root), keep=5, dry_run=True).retention
    assert dry is not None and committed(root) == set(range(1, 41))  # nothing deleted
    versions = [d for d in dry.deleted if d.kind != "anchor copy"]
    assert [d.version for d in versions] == list(range(1, 17))
    assert dry.kept == tuple(range(17, 41))  # the lease at 20 needs the copy at 17
    # fresh readers of 36-40 start at the copy at 33; nobody starts at 25's
    assert [d.version for d in dry.deleted if d.kind == "anchor copy"] == [25]
    counted = FaultyStore(LocalStore(root))
    out = gc(counted, keep=5, orphans=True, min_age_s=0)
    assert out.retention is not None and out.retention.deleted == dry.deleted
    deletes = [op.key for op in counted.ops if op.name == "delete"]
    assert deletes == [k for d in dry.deleted for k in d.keys]  # oldest first
    for d in versions:  # each version: manifest, then copy, then its data
        assert d.keys[0] == manifest_key(d.version)
        assert all(k.startswith(data_prefix(d.version)) for k in d.keys[1 + d.copy :])
        assert not list((root / data_prefix(d.version)).glob("*.dsz"))
    assert copy_versions(root) == [17, 33]
    assert not list((root / data_prefix(25)).glob("*-anchor-*"))  # the delta's data stays
    assert committed(root) == set(range(17, 41))
    assert verify_store(LocalStore(root), deep=True).ok
    assert not find_orphans(LocalStore(root), min_age_s=0)
    again = gc(LocalStore(root), keep=5).retention  # nothing more while the lease lives
    assert again is not None and again.deleted == ()


@pytest.mark.parametrize("mode", ["raise", "lost-response"])
def test_gc_killed_at_every_delete(
    leased: tuple[Path, list[Tensors]], tmp_path: Path, mode: str
) -> None:
    base, states = leased
    clean = FaultyStore(LocalStore(tmp_path / "clean"))
    shutil.copytree(base, tmp_path / "clean")
    gc(clean, keep=5)
    n = sum(op.name == "delete" for op in clean.ops)
    assert n >= 30
    for k in range(1, n + 1):
        root = tmp_path / f"k{k}"
        shutil.copytree(base, root)
        with pytest.raises(InjectedFault):
            gc(FaultyStore(LocalStore(root), fail_at=k, only=["delete"], mode=mode), keep=5)
        report = verify_store(LocalStore(root))
        assert not {MISSING_OBJECT, TRUNCATED} & set(report.kinds), (k, report.summary())
        assert all(p.version is None or p.version < 17 for p in report.problems), k
        reader = Subscriber(
            root, tensors={n: t.clone() for n, t in states[19].items()}, version=20, lease_ttl=None
        )
        got = reader.sync()
        assert got.path == "deltas" and got.applied == tuple(range(21, 41)), k
        assert_bit_exact(states[39], reader.tensors)
        gc(LocalStore(root), keep=5, orphans=True, min_age_s=0)  # the next run finishes
        assert committed(root) == set(range(17, 41)), k
        assert verify_store(LocalStore(root)).ok, k
        shutil.rmtree(root)


def test_gc_refuses_to_guess_when_a_kept_chain_is_damaged(
    leased: tuple[Path, list[Tensors]], tmp_path: Path
) -> None:
    root = tmp_path / "s"
    shutil.copytree(leased[0], root)
    (root / manifest_key(18)).write_bytes(b"{")
    with pytest.raises(ValueError, match="retention deletes nothing"):
        gc(LocalStore(root), keep=5)
    assert committed(root) == set(range(1, 41))


def test_gc_needs_something_to_collect(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to collect"):
        gc(LocalStore(tmp_path))
    with pytest.raises(ValueError, match="keep"):
        retain(LocalStore(tmp_path), 0)


def test_cli_gc_keep_and_publish_policy(leased: tuple[Path, list[Tensors]], tmp_path: Path) -> None:
    runner = CliRunner()
    root = tmp_path / "s"
    shutil.copytree(leased[0], root)
    result = runner.invoke(app, ["gc", str(root), "--keep", "5", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert (
        "would delete v1 (anchor" in result.stdout and "would delete 16 versions" in result.stdout
    )
    assert "lease reader: v20" in result.stdout
    result = runner.invoke(app, ["gc", str(root), "--keep", "5", "--orphans", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    deleted = out["retention"]["deleted"]
    assert [d["version"] for d in deleted if d["kind"] != "anchor copy"] == list(range(1, 17))
    assert [d["version"] for d in deleted if d["kind"] == "anchor copy"] == [25]
    assert out["retention"]["deleted_bytes"] > 0
    assert committed(root) == set(range(17, 41))
    result = runner.invoke(app, ["gc", str(root)])
    assert result.exit_code == 2 and "nothing to collect" in result.output
    result = runner.invoke(app, ["pull", str(root), str(tmp_path / "f"), "--reader-id", "a/b"])
    assert result.exit_code == 2 and "reader id" in result.output


def test_anchor_copies_of_deleted_data_are_reported(tmp_path: Path) -> None:
    publish_run(tmp_path, 10, "every:4")
    store: Store = LocalStore(tmp_path)
    victim = next((tmp_path / data_prefix(5)).glob("*-anchor-*"))
    victim.unlink()
    report = verify_store(store)
    assert MISSING_OBJECT in report.kinds
    # the copy's data is lost, the chain is not: a reader falls back to it (spec section 9.4)
    assert Subscriber(store, lease_ttl=None).sync(5).applied == (1, 2, 3, 4, 5)
    for v in range(1, 5):  # once the chain below is gone too, the copy's error is raised
        (tmp_path / manifest_key(v)).unlink()
    with pytest.raises(ObjectNotFoundError):
        Subscriber(store, lease_ttl=None).sync(5)
