"""``deltastore mirror``: a store's versions replicated into another store, byte for byte.

Sources are small (6000 bf16 elements, frames of at most 2 KiB, one frame per data object),
so a version is several data objects; ``anchor_policy="every:2"`` writes anchor copies at
versions 3, 5, 7, ... Every check is bit-wise: the destination's manifests, anchor copies and
data objects are the source's bytes, and subscribers of the destination reach each version's
tensors bit for bit (their words compared as integers). What is checked:

- a pass copies every version, a second copies nothing (no write on the destination), a later
  one only the new versions; ``since`` / ``anchor_first`` start a fresh destination at the
  right anchor copy;
- signed sources mirror under the trusted keys; a forged manifest raises
  :class:`SignatureError`, a frame only its BLAKE3 catches :class:`IntegrityError`, and
  nothing of that version reaches the destination;
- a destination written by another writer (a fork: :class:`ForkError`), and a damaged
  destination data object of a version not yet committed there (copied again);
- a corrupted frame stops the mirror before its version (:class:`IntegrityError` or
  :class:`FrameError`), and ``watch`` skips past it once the source has a newer anchor; a
  version read damaged once is read again by the next pass;
- retention at the source deleting versions the mirror has not copied: the mirror jumps to
  the newest anchor copy; a live mirror's lease keeps them;
- two mirrors of one source into one destination at once; the CLI and its exit codes.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from typer.testing import CliRunner

from deltastore import (
    Ed25519Key,
    ForkError,
    FrameError,
    IntegrityError,
    LocalStore,
    PublicKey,
    Publisher,
    SignatureError,
    Store,
    Subscriber,
)
from deltastore.format.keys import ANCHOR_PREFIX, DATA_PREFIX, LATEST_KEY, anchor_key, data_prefix
from deltastore.format.manifest import (
    MANIFEST_PREFIX,
    manifest_key,
    parse_latest,
    parse_manifest,
    version_of_key,
)
from deltastore.format.signing import sign_manifest
from deltastore.maintenance.mirror import Mirror, MirrorReport, mirror
from deltastore.maintenance.retention import retain
from deltastore.testing.faults import FaultyStore, Op
from deltastore_cli import app
from tests.test_publisher import model, nudge, same_bits

Tensors = dict[str, torch.Tensor]

#: Small frames and objects: a version is several frames in several data objects.
OPTIONS: dict[str, Any] = {"max_frame_bytes": 2048, "max_object_bytes": 100}
KEY = Ed25519Key("trainer-ed", bytes(range(32)))
TRUST = [KEY.public_key()]
#: What a mirror copies; LATEST and leases/ are each store's own.
COPIED = (MANIFEST_PREFIX, ANCHOR_PREFIX, DATA_PREFIX)


def state(v: int) -> Tensors:
    """The tensors of version ``v`` of every source here (version 1: a seeded model; each
    next one flips the low bit of ~1% of the weights)."""
    t = model(0, n=6000)
    for i in range(2, v + 1):
        t = nudge(t, i)
    return t


@dataclass
class Source:
    """A source store and its publisher (publishes ``state(v)`` as version ``v``)."""

    root: Path
    pub: Publisher
    states: dict[int, Tensors] = field(default_factory=dict)

    def publish(self, *versions: int, anchor: bool | None = None) -> Source:
        for v in versions:
            self.states[v] = state(v)
            self.pub.publish(self.states[v], version=v, anchor=anchor)
        return self


def source(
    root: Path, upto: int, *, policy: str = "every:2", key: Ed25519Key | None = None
) -> Source:
    pub = Publisher(root, anchor_policy=policy, signing_key=key, **OPTIONS)
    return Source(root, pub).publish(*range(1, upto + 1))


def contents(root: Path | Store, prefixes: tuple[str, ...] = COPIED) -> dict[str, bytes]:
    """Every object under ``prefixes``, with its bytes."""
    s = root if isinstance(root, Store) else LocalStore(root)
    return {k: s.get(k) for p in prefixes for k in s.list(p)}


def versions_at(root: Path) -> list[int]:
    """The committed versions of a store (its manifests), ascending."""
    keys = LocalStore(root).list(MANIFEST_PREFIX)
    return sorted(v for k in keys if (v := version_of_key(k)) is not None)


def of_versions(objects: Mapping[str, bytes], versions: set[int]) -> dict[str, bytes]:
    """The manifests, anchor copies and data objects of ``versions`` among ``objects``."""
    keys = {manifest_key(v) for v in versions} | {f"{ANCHOR_PREFIX}{v:020d}.json" for v in versions}
    prefixes = tuple(data_prefix(v) for v in versions)
    return {k: b for k, b in objects.items() if k in keys or k.startswith(prefixes)}


def assert_complete(root: Path) -> None:
    """Every manifest and anchor copy of the store has each frame's bytes (XXH3-64)."""
    s = LocalStore(root)
    for key in s.list(MANIFEST_PREFIX) + s.list(ANCHOR_PREFIX):
        m = parse_manifest(s.get(key))
        for entry in m.tensors.values():
            for f in entry.frames:
                data = s.get_range(f.object, f.offset, f.length)
                assert len(data) == f.length, (key, f.object)
                assert xxhash.xxh3_64_hexdigest(data) == f.xxh3, (key, f.object)


def assert_readable(
    root: Path,
    states: Mapping[int, Tensors],
    *,
    behind: int | None = None,
    trust: list[PublicKey] | None = None,
) -> int:
    """A fresh subscriber of the store reaches its newest version bit-exact, and so does one
    already at ``behind``; returns the newest version."""
    newest = versions_at(root)[-1]
    fresh = Subscriber(root, trusted_keys=trust, lease_ttl=None)
    assert fresh.sync().version == newest
    assert same_bits(states[newest], dict(fresh.tensors or {}))
    if behind is not None:
        mine = {n: t.clone() for n, t in states[behind].items()}
        sub = Subscriber(root, tensors=mine, version=behind, trusted_keys=trust, lease_ttl=None)
        assert sub.sync().version == newest
        assert same_bits(states[newest], mine)
    return newest


def data_puts(ops: list[Op]) -> list[str]:
    """The data objects written (done) among ``ops``."""
    return [op.key for op in ops if op.name == "put" and op.done and op.key.startswith(DATA_PREFIX)]


def latest_at(root: Path) -> int:
    return parse_latest(LocalStore(root).get(LATEST_KEY)).version


# --- copying ---------------------------------------------------------------------------------


def test_a_pass_copies_every_version_byte_for_byte(tmp_path: Path) -> None:
    src = source(tmp_path / "src", 5)
    assert versions_at(src.root) == [1, 2, 3, 4, 5]
    assert sorted(LocalStore(src.root).list(ANCHOR_PREFIX)) == [
        f"{ANCHOR_PREFIX}{v:020d}.json" for v in (3, 5)
    ]
    dst = FaultyStore(LocalStore(tmp_path / "dst"))
    report = mirror(src.root, dst)
    assert isinstance(report, MirrorReport)
    objects = contents(src.root)
    data = {k: b for k, b in objects.items() if k.startswith(DATA_PREFIX)}
    assert len(data) > 5 * 3  # several objects a version
    assert report.copied == (1, 2, 3, 4, 5) and report.newest == 5 and report.jumped == ()
    assert report.objects_copied == len(data) and report.objects_skipped == 0
    assert report.bytes_copied == sum(len(b) for b in data.values())
    assert sorted(data_puts(dst.ops)) == sorted(data)  # each object once
    assert contents(tmp_path / "dst") == objects  # byte-identical
    assert latest_at(tmp_path / "dst") == 5
    assert LocalStore(src.root).list("leases/") == []  # mirror() closed: its lease released
    assert_complete(tmp_path / "dst")
    sub = Subscriber(tmp_path / "dst", lease_ttl=None)
    for v in range(1, 6):  # every version, one after the other
        assert sub.sync(v).version == v
        assert same_bits(src.states[v], dict(sub.tensors or {}))
    assert_readable(tmp_path / "dst", src.states, behind=1)

    dst.reset()
    again = mirror(src.root, dst)
    assert again.copied == () and again.newest == 5
    assert again.objects_copied == 0 and again.bytes_copied == 0
    assert [op for op in dst.ops if op.writes] == []  # nothing written at all

    src.publish(6, 7)
    dst.reset()
    m = Mirror(src.root, dst)
    try:
        later = m.run_once()
    finally:
        m.close()
    assert later.copied == (6, 7) and later.newest == 7
    new = of_versions(contents(src.root), {6, 7})
    new_data = sorted(k for k in new if k.startswith(DATA_PREFIX))
    assert sorted(data_puts(dst.ops)) == new_data and later.objects_copied == len(new_data)
    assert contents(tmp_path / "dst") == contents(src.root)
    assert latest_at(tmp_path / "dst") == 7
    assert_readable(tmp_path / "dst", src.states, behind=5)


@pytest.mark.parametrize(
    ("options", "start"),
    [({"since": 4}, 3), ({"since": 2}, 1), ({"since": 5}, 5), ({"anchor_first": True}, 7)],
)
def test_a_fresh_destination_starts_at_the_right_anchor(
    tmp_path: Path, options: dict[str, Any], start: int
) -> None:
    """Anchor copies at 3, 5, 7 (and the anchor 1): ``since`` starts at the newest anchor
    or copy at or below it, ``anchor_first`` at the newest one."""
    src = source(tmp_path / "src", 8)
    dst = tmp_path / "dst"
    report = mirror(src.root, dst, **options)
    assert versions_at(dst) == list(range(start, 9))
    assert report.copied == tuple(range(start, 9)) and report.newest == 8
    assert contents(dst) == of_versions(contents(src.root), set(range(start, 9)))
    assert_complete(dst)
    assert_readable(dst, src.states, behind=start)
    sub = Subscriber(dst, lease_ttl=None)  # the start itself, from its anchor (copy)
    assert sub.sync(start).version == start
    assert same_bits(src.states[start], dict(sub.tensors or {}))


# --- signatures -------------------------------------------------------------------------------


def test_a_signed_source_mirrors_and_a_forged_manifest_is_refused(tmp_path: Path) -> None:
    src = source(tmp_path / "src", 3, key=KEY)
    dst = tmp_path / "dst"
    report = mirror(src.root, dst, trusted_keys=TRUST)
    assert report.copied == (1, 2, 3)
    assert contents(dst) == contents(src.root)
    assert_readable(dst, src.states, behind=1, trust=TRUST)

    src.publish(4, 5)
    s = LocalStore(src.root)  # version 4 re-signed by another key under the same id
    forged = sign_manifest(
        parse_manifest(s.get(manifest_key(4))), Ed25519Key.generate("trainer-ed")
    )
    s.put(manifest_key(4), forged.to_bytes())
    m = Mirror(src.root, dst, trusted_keys=TRUST)
    try:
        with pytest.raises(SignatureError):
            m.run_once()
    finally:
        m.close()
    assert versions_at(dst) == [1, 2, 3] and latest_at(dst) == 3
    assert LocalStore(dst).list(data_prefix(4)) == []  # nothing of version 4
    assert LocalStore(dst).list(data_prefix(5)) == []
    assert contents(dst) == of_versions(contents(src.root), {1, 2, 3})
    assert_readable(dst, src.states, behind=1, trust=TRUST)


def test_an_unsigned_source_is_refused_under_trusted_keys(tmp_path: Path) -> None:
    src = source(tmp_path / "src", 2)
    with pytest.raises(SignatureError):
        mirror(src.root, tmp_path / "dst", trusted_keys=TRUST)
    assert not (tmp_path / "dst").exists() or versions_at(tmp_path / "dst") == []


def test_a_frame_only_blake3_catches_is_refused(tmp_path: Path) -> None:
    """A signed source whose version 3 has a forged frame and a manifest re-signed by the
    real key with the forged frame's XXH3-64 (a second preimage): only the BLAKE3 the
    signature binds tells. The mirror refuses version 3 and writes nothing of it."""
    src = source(tmp_path / "src", 3, key=KEY)
    s = LocalStore(src.root)
    m = parse_manifest(s.get(manifest_key(3)))
    frame = next(f for e in m.tensors.values() for f in e.frames if f.length > 8)
    assert frame.blake3 is not None
    path = src.root / frame.object
    data = bytearray(path.read_bytes())
    end = frame.offset + frame.length
    data[frame.offset : end] = bytes(b ^ 0x5A for b in data[frame.offset : end])
    path.write_bytes(bytes(data))
    forged_xxh3 = xxhash.xxh3_64_hexdigest(bytes(data[frame.offset : end]))
    tensors = {
        n: e.model_copy(
            update={
                "frames": [
                    f.model_copy(update={"xxh3": forged_xxh3}) if f is frame else f
                    for f in e.frames
                ]
            }
        )
        for n, e in m.tensors.items()
    }
    s.put(manifest_key(3), sign_manifest(m.model_copy(update={"tensors": tensors}), KEY).to_bytes())
    dst = tmp_path / "dst"
    with pytest.raises(IntegrityError):
        mirror(src.root, dst, trusted_keys=TRUST)
    assert versions_at(dst) == [1, 2] and not (dst / anchor_key(3)).exists()
    assert frame.object not in contents(dst)
    assert_readable(dst, src.states, behind=1, trust=TRUST)


# --- destinations written by someone else -----------------------------------------------------


def test_a_destination_forked_by_another_writer_raises_fork_error(tmp_path: Path) -> None:
    src = source(tmp_path / "src", 2)
    dst = tmp_path / "dst"
    mirror(src.root, dst)
    intruder = Publisher(dst, **OPTIONS)  # someone publishes into the mirror
    intruder.attach(src.states[2])
    intruder.publish(nudge(src.states[2], 99), version=3)
    src.publish(3, 4)
    with pytest.raises(ForkError):
        mirror(src.root, dst)
    res = runner.invoke(app, ["mirror", str(src.root), str(dst)])
    assert res.exit_code == 6, res.output


def test_a_destination_object_of_another_size_is_copied_again(tmp_path: Path) -> None:
    src = source(tmp_path / "src", 3)
    dst = tmp_path / "dst"
    mirror(src.root, dst)
    src.publish(4)
    key = sorted(k for k in contents(src.root) if k.startswith(data_prefix(4)))[0]
    (dst / key).parent.mkdir(parents=True)
    (dst / key).write_bytes((src.root / key).read_bytes()[:10])  # a torn copy
    report = mirror(src.root, dst)
    assert report.copied == (4,) and report.objects_skipped == 0
    assert contents(dst) == contents(src.root)
    assert_complete(dst)
    assert_readable(dst, src.states, behind=3)


# --- damaged sources --------------------------------------------------------------------------


def corrupt(root: Path, version: int, how: str) -> str:
    """Damage the first frame of ``version``'s manifest in its data object: flip its bytes
    (same length), or cut the object in the middle of the frame. Returns the object's key."""
    m = parse_manifest(LocalStore(root).get(manifest_key(version)))
    f = next(f for e in m.tensors.values() for f in e.frames if f.length > 8)
    path = root / f.object
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[f.offset : f.offset + f.length] = bytes(
            b ^ 0x5A for b in data[f.offset : f.offset + f.length]
        )
    else:
        del data[f.offset + f.length // 2 :]
    path.write_bytes(bytes(data))
    return f.object


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_corrupted_frame_stops_the_mirror_and_watch_skips_to_a_newer_anchor(
    tmp_path: Path, how: str
) -> None:
    src = source(tmp_path / "src", 4, policy="never")
    bad = corrupt(src.root, 3, how)
    dst = tmp_path / "dst"
    m = Mirror(src.root, dst, reader_id="mirror-test")
    try:
        with pytest.raises((IntegrityError, FrameError)) as err:
            m.run_once()
        assert "3" in str(err.value) and bad.rsplit("/", 1)[-1] in str(err.value)
        assert versions_at(dst) == [1, 2] and latest_at(dst) == 2
        assert not (dst / manifest_key(3)).exists()
        at_dst = contents(dst)
        partial = {k: b for k, b in at_dst.items() if k.startswith(data_prefix(3))}
        assert bad not in partial  # a frame that fails its checks is never written
        assert all(b == (src.root / k).read_bytes() for k, b in partial.items())
        assert {k: b for k, b in at_dst.items() if k not in partial} == of_versions(
            contents(src.root), {1, 2}
        )
        assert_complete(dst)
        assert_readable(dst, src.states, behind=1)
        with pytest.raises((IntegrityError, FrameError)):  # still stuck: nothing newer
            mirror(src.root, dst)

        src.publish(5, anchor=True)
        reports: list[MirrorReport] = []
        stop = threading.Event()

        def seen(report: MirrorReport) -> None:
            reports.append(report)
            if report.newest == 5:
                stop.set()

        guard = threading.Timer(60.0, stop.set)  # a hung watch fails below, not forever
        guard.start()
        try:
            m.watch(stop=stop, interval=0.01, max_interval=0.05, on_report=seen)
        finally:
            guard.cancel()
    finally:
        m.close()
    assert reports and reports[-1].newest == 5, reports
    assert reports[-1].copied == (5,) and reports[-1].jumped == (5,)
    assert versions_at(dst) == [1, 2, 5] and latest_at(dst) == 5
    assert (dst / manifest_key(5)).read_bytes() == (src.root / manifest_key(5)).read_bytes()
    assert_complete(dst)
    assert_readable(dst, src.states, behind=2)


def test_a_version_that_read_damaged_once_is_retried(tmp_path: Path) -> None:
    """A frame damaged on one read (a bad response) and fine on the next: the same mirror's
    next pass copies the version."""
    src = source(tmp_path / "src", 4, policy="never")
    path = src.root / corrupt(src.root, 3, "flip")
    dst = tmp_path / "dst"
    flipped = path.read_bytes()
    corrupt(src.root, 3, "flip")  # flipped twice: the original bytes
    good = path.read_bytes()
    path.write_bytes(flipped)
    with Mirror(src.root, dst) as m:
        with pytest.raises(IntegrityError):
            m.run_once()
        path.write_bytes(good)
        report = m.run_once()
    assert report.copied == (3, 4) and report.jumped == ()
    assert contents(dst) == contents(src.root)
    assert_readable(dst, src.states, behind=2)


def test_retention_at_the_source_the_mirror_jumps_to_the_newest_anchor_copy(
    tmp_path: Path,
) -> None:
    src = source(tmp_path / "src", 2)
    dst = tmp_path / "dst"
    assert mirror(src.root, dst).copied == (1, 2)
    src.publish(3, 4, 5, 6, 7, 8)  # anchor copies at 3, 5, 7
    deleted = retain(LocalStore(src.root), keep=1)  # the mirror is closed: no lease
    assert versions_at(src.root) == [7, 8], deleted
    report = mirror(src.root, dst)
    assert report.copied == (7, 8) and report.jumped == (7,) and report.newest == 8
    assert versions_at(dst) == [1, 2, 7, 8] and latest_at(dst) == 8
    assert of_versions(contents(dst), {7, 8}) == contents(src.root)
    assert_complete(dst)
    assert_readable(dst, src.states, behind=2)


def test_a_live_mirrors_lease_keeps_what_it_still_needs(tmp_path: Path) -> None:
    src = source(tmp_path / "src", 2)
    dst = tmp_path / "dst"
    m = Mirror(src.root, dst, reader_id="replica-1")
    try:
        assert m.run_once().copied == (1, 2)
        assert LocalStore(src.root).list("leases/") == ["leases/replica-1.json"]
        src.publish(3, 4, 5, 6, 7, 8)
        retain(LocalStore(src.root), keep=1)
        assert versions_at(src.root)[0] <= 3  # the lease keeps version 3 on
        report = m.run_once()
        assert report.copied == (3, 4, 5, 6, 7, 8) and report.jumped == ()
    finally:
        m.close()
    assert LocalStore(src.root).list("leases/") == []
    assert contents(dst) == of_versions(contents(src.root), set(range(1, 9)))
    assert_readable(dst, src.states, behind=1)


# --- two mirrors at once ----------------------------------------------------------------------


def test_two_mirrors_into_one_destination_at_once(tmp_path: Path) -> None:
    src = source(tmp_path / "src", 5)
    dst = tmp_path / "dst"
    meet = threading.Barrier(2, timeout=5)
    met: list[Op] = []

    def hook(op: Op) -> None:  # both at the first manifest create together, when both get there
        if op.name == "put_if_absent" and op.key == manifest_key(1):
            with contextlib.suppress(threading.BrokenBarrierError):
                meet.wait()
                met.append(op)

    reports: dict[int, MirrorReport] = {}
    errors: dict[int, BaseException] = {}

    def run(i: int) -> None:
        try:
            store = FaultyStore(LocalStore(dst), hook=hook)
            reports[i] = mirror(src.root, store, reader_id=f"replica-{i}")
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(met) == 2  # both created manifest 1 at the same moment: one found it there
    assert all(r.newest == 5 for r in reports.values()), reports
    assert set(reports[0].copied) | set(reports[1].copied) == {1, 2, 3, 4, 5}
    assert contents(dst) == contents(src.root)
    assert latest_at(dst) == 5
    assert_complete(dst)
    assert_readable(dst, src.states, behind=1)


# --- the CLI ----------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_mirror(tmp_path: Path) -> None:
    src = source(tmp_path / "src", 3)
    dst = tmp_path / "dst"
    res = runner.invoke(app, ["mirror", str(src.root), str(dst), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["copied"] == [1, 2, 3] and out["newest"] == 3
    assert out["objects_copied"] == len(
        [k for k in contents(src.root) if k.startswith(DATA_PREFIX)]
    )
    assert contents(dst) == contents(src.root)
    res = runner.invoke(app, ["mirror", str(src.root), str(dst), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["copied"] == []

    src.publish(4, 5)
    corrupt(src.root, 4, "flip")
    res = runner.invoke(app, ["mirror", str(src.root), str(dst), "--json"])
    assert res.exit_code == 5, res.output
    assert versions_at(dst) == [1, 2, 3]
    assert_readable(dst, src.states, behind=1)

    fresh = tmp_path / "fresh"  # --anchor-first skips the bad version 4: copy at 5
    res = runner.invoke(app, ["mirror", str(src.root), str(fresh), "--anchor-first", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["copied"] == [5] and versions_at(fresh) == [5]
    assert_readable(fresh, src.states)


def test_mirrors_chain(tmp_path: Path) -> None:
    """region -> cluster -> rack: a mirror of a mirror is a store like any other."""
    src = source(tmp_path / "src", 4)
    region, rack = tmp_path / "region", tmp_path / "rack"
    assert mirror(src.root, region).copied == (1, 2, 3, 4)
    assert mirror(region, rack).copied == (1, 2, 3, 4)
    src.publish(5)
    assert mirror(src.root, region).copied == (5,)
    assert mirror(region, rack).copied == (5,)
    assert contents(rack) == contents(src.root)
    sub = Subscriber(rack, lease_ttl=None)
    assert sub.sync().version == 5 and same_bits(src.states[5], dict(sub.tensors or {}))
