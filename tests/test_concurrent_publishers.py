"""Concurrent publishers (docs/guide.md, Several publishers), on a local store.

- Two publishers racing one version, released together at the commit point (a barrier in
  the store): exactly one commits, the other gets :class:`VersionExistsError`; the loser's
  data objects are orphans that gc removes, the winner's version stays whole.
- A *zombie* publisher, paused in the middle of a publish while another publisher commits,
  commits nothing: its head check right before the manifest create raises
  :class:`ChainError` (or :class:`VersionExistsError` / :class:`VersionOrderError`).
- The window that remains (a commit between that check and the create) is shown as it is:
  both versions are committed on the same parent, ``LATEST`` does not move backwards, and
  subscribers follow the newest version.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from deltastore import (
    ChainError,
    LocalStore,
    PublishReport,
    Subscriber,
    VersionExistsError,
    VersionOrderError,
)
from deltastore.format.manifest import LATEST_KEY, manifest_key, parse_latest, parse_manifest
from deltastore.maintenance.orphans import find_orphans, gc
from deltastore.testing.conformance import race
from deltastore.testing.faults import FaultyStore, Op
from tests.test_crash_publish import check_store, publisher, v1, written
from tests.test_publisher import nudge, same_bits

Tensors = dict[str, torch.Tensor]


def test_two_publishers_racing_one_version(tmp_path: Path) -> None:
    expected = {1: v1()}
    publisher(tmp_path).publish(expected[1], version=1)
    for rnd in range(3):
        race_round(tmp_path, expected, seed=100 * rnd)


def race_round(root: Path, expected: dict[int, Tensors], seed: int) -> None:
    """Two publishers at the head race for the next version; check the winner and gc."""
    head = max(expected)
    at_commit = threading.Barrier(2, timeout=30)

    def hook(op: Op) -> None:
        if op.name == "put_if_absent":  # both have passed every check: race the create
            at_commit.wait()

    stores = [FaultyStore(LocalStore(root), hook=hook) for _ in range(2)]
    pubs = [publisher(s) for s in stores]
    for p in pubs:
        p.attach(expected[head])
    candidates = [nudge(expected[head], seed + i) for i in range(2)]
    outcomes = race(2, lambda i: pubs[i].publish(candidates[i], version=head + 1))
    winners = [i for i, o in enumerate(outcomes) if isinstance(o, PublishReport)]
    assert len(winners) == 1, outcomes
    win, lose = winners[0], 1 - winners[0]
    assert isinstance(outcomes[lose], VersionExistsError), outcomes[lose]
    assert (pubs[win].version, pubs[lose].version) == (head + 1, head)
    expected[head + 1] = candidates[win]
    assert check_store(root, expected) == head + 1
    # The loser's objects (in the same version folder as the winner's) are the orphans.
    lost = written(stores[lose].ops)
    assert lost and all(k.startswith(f"versions/{head + 1:020d}/") for k in lost)
    assert all(o.kept for o in find_orphans(root))  # young: a publish may be running
    assert {o.key for o in find_orphans(root, min_age_s=0)} == lost
    assert set(gc(root, orphans=True, min_age_s=0).removed) == lost
    assert check_store(root, expected) == head + 1


class Pause:
    """A store hook that stops the calling thread at its next ``name`` operation once armed,
    after letting ``skip`` of them pass."""

    def __init__(self, name: str, skip: int = 0) -> None:
        self.name = name
        self.skip = skip
        self.armed = False
        self.reached = threading.Event()
        self.resume = threading.Event()

    def __call__(self, op: Op) -> None:
        if self.armed and op.name == self.name:
            if self.skip:
                self.skip -= 1
                return
            self.armed = False
            self.reached.set()
            assert self.resume.wait(30)


class Zombie:
    """Publisher A at version 5, paused at its next ``at`` operation during a publish in a
    thread, while the test lets another publisher commit."""

    def __init__(self, root: Path, at: str, skip: int = 0) -> None:
        self.v5 = v1()
        self.pause = Pause(at, skip)
        self.store = FaultyStore(LocalStore(root), hook=self.pause)
        self.pub = publisher(self.store)
        self.pub.publish(self.v5, version=5)
        self.outcome: object = None

    def start(self, tensors: Tensors, version: int, anchor: bool | None = None) -> None:
        def run() -> None:
            try:
                self.outcome = self.pub.publish(tensors, version=version, anchor=anchor)
            except Exception as exc:  # the test inspects it
                self.outcome = exc

        self.store.reset()
        self.pause.armed = True
        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.pause.reached.wait(30)

    def finish(self) -> object:
        self.pause.resume.set()
        self.thread.join(30)
        return self.outcome


def other_publisher(root: Path, parent: Tensors, tensors: Tensors, version: int) -> None:
    b = publisher(root)
    assert b.attach(parent) == 5
    b.publish(tensors, version=version)


def latest(root: Path) -> int:
    return parse_latest((root / LATEST_KEY).read_bytes()).version


@pytest.mark.parametrize(
    ("a_version", "anchor", "b_version", "error"),
    [
        (7, None, 6, ChainError),  # its parent 5 is no longer the head
        (7, True, 6, ChainError),  # an anchor naming a parent that is no longer the head
        (6, None, 6, VersionExistsError),  # the other took its version
        (6, None, 8, VersionOrderError),  # the other committed a higher version
    ],
)
def test_zombie_publisher_commits_nothing(
    tmp_path: Path, a_version: int, anchor: bool | None, b_version: int, error: type
) -> None:
    # paused after its uploads, before its head check (the first listing is the version
    # check before encoding: the manifests after its own head)
    zombie = Zombie(tmp_path, at="list_after", skip=1)
    va, vb = nudge(zombie.v5, 1), nudge(zombie.v5, 2)
    zombie.start(va, a_version, anchor)
    other_publisher(tmp_path, zombie.v5, vb, b_version)
    assert isinstance(zombie.finish(), error), zombie.outcome
    assert zombie.pub.version == 5
    assert latest(tmp_path) == b_version
    assert check_store(tmp_path, {5: zombie.v5, b_version: vb}) == b_version
    orphans = written(zombie.store.ops)
    assert orphans and {o.key for o in find_orphans(tmp_path, min_age_s=0)} == orphans
    assert set(gc(tmp_path, orphans=True, min_age_s=0).removed) == orphans
    assert check_store(tmp_path, {5: zombie.v5, b_version: vb}) == b_version
    # The zombie cannot go on from its stale state; attached to the head, it can.
    with pytest.raises(ChainError):
        zombie.pub.publish(va, version=b_version + 1)
    zombie.pub.attach(vb)
    assert zombie.pub.publish(va, version=b_version + 1).parent == b_version


def test_the_remaining_window_forks_but_latest_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A commit between the zombie's head check and its manifest create is not seen: both
    versions are committed on parent 5 (a fork, as docs/guide.md says), LATEST stays at the
    newer one and subscribers follow it; one holding the side branch goes back to the newest
    anchor (with a warning) and follows it too."""
    zombie = Zombie(tmp_path, at="put_if_absent")  # paused after its head check
    va, vb = nudge(zombie.v5, 1), nudge(zombie.v5, 2)
    zombie.start(va, 7)
    other_publisher(tmp_path, zombie.v5, vb, 8)
    assert isinstance(zombie.finish(), PublishReport)
    assert latest(tmp_path) == 8  # never moved back to 7
    for v in (7, 8):
        manifest = parse_manifest((tmp_path / manifest_key(v)).read_bytes())
        assert manifest.parent is not None and manifest.parent.version == 5
    assert check_store(tmp_path, {5: zombie.v5, 7: va, 8: vb}) == 8
    side = {n: t.clone() for n, t in va.items()}
    sub = Subscriber(tmp_path, tensors=side, version=7)
    with caplog.at_level("WARNING", logger="deltastore"):
        assert sub.sync().version == 8
    assert "descends from 5, not from the held version 7" in caplog.text
    assert same_bits(vb, side)  # rebuilt in place from the anchor
