"""Soak (docs/guide.md): one publisher and five followers under random faults for many
versions, with retention and reader leases, checked bit-exact against the trainer.

A trainer (AdamW steps of a small GQA model) publishes ``DELTASTORE_SOAK_VERSIONS`` versions
(default 120; version 1 an anchor, then deltas with an anchor copy every 12 versions,
``anchor_policy="every:12"``) through a :class:`FaultyStore` that fails one random
operation of ~8% of the publishes, raised or with its response lost: the version must be
committed exactly when ``publish`` returns; a failed publish is retried by the same publisher
or by a restarted one (``attach``). Followers, each on its own :class:`FaultyStore` and each
keeping a lease ``leases/<name>.json`` (an hour long, but for ``lapse``):

- ``plain``: a :class:`Subscriber` holding the whole tensors;
- ``tp2``: a :class:`Subscriber` with the layout of both ranks of a vLLM TP-2 engine in one
  process (``tests.test_presets.engine_layout``: fused qkv and gate_up, padded vocabulary);
- ``folder``: a :class:`FolderSync` checkpoint folder;
- ``tp4``: a TP-4 engine (each kv head held by two ranks) that joins at version 35, from the
  newest anchor copy, and sleeps (does not sync, keeps its lease) from version 40 to 70: it
  must then catch up by deltas only (all it needs was kept for its lease);
- ``lapse``: a :class:`Subscriber` with a 0.25 s lease that joins at version 72 and sleeps
  to version 102: its lease expires, gc removes it and deletes the versions after the one it
  holds; it must recover from an anchor (its first version applied is an anchor).

Retention: every 20 versions (before the followers sync) ``gc(keep=8, lease_grace_s=0)`` runs
on the store itself. Checked against the trainer's record of the chain (anchors, copies,
parents) and a listing before and after: it keeps exactly the newest 8 versions, every
version from the oldest live lease's up, and each kept version's chain down to its newest
anchor (version or copy); it deletes every other version whole (manifest first, then its
anchor copy, then every object of its folder, a failed publish's leftovers included), and
nothing else but anchor copies of kept versions, while every version left still reaches an
anchor and every object a kept manifest or copy names exists; every live lease is a
follower's (an hour-long one is live), and no follower with a live lease is ever stranded:
every version from its lease's up to the newest is kept, and it holds at least that version.

Faults, drawn from a seed (printed; ``DELTASTORE_SOAK_SEED`` overrides):

- transient read errors: each follower's store operations fail with ``InjectedFault`` (a
  ``StoreError``) at ``READ_FAULT_RATE``; the sync raises, the follower stays at the last
  version it applied whole and retries at the next version. Whether an operation fails is a
  hash of (seed, follower, attempt, operation, key, occurrence), not of thread timing, so a
  run is reproducible from its seed (up to how many more faults the other workers of a failed
  sync meet before they stop);
- write failures: ``deltastore.tensors.words.scatter`` (the scatter of every write phase) is
  wrapped and, in ~8% of the syncs of a follower that is behind, the n-th scatter writes half its
  words and raises: the version must be rolled back;
- killed pulls: at a few versions the folder's pull runs in a child forked by the helper of
  ``tests/test_crash_sync.py`` (with the folder's reader id: the same receiver), which
  SIGKILLs itself halfway through the n-th scatter of the write phase, or after the writes and
  before the sidecar is replaced; a new ``FolderSync`` (the restarted receiver) must repair
  the folder on its next pull;
- corrupted objects: a byte of a delta's data object is flipped right after its publish;
  followers get ``IntegrityError`` and stay put; the trainer republishes the same weights as
  an anchor and everybody catches up.

Checked: after every sync attempt, and in the pause/resume hooks around every write phase of
the in-memory followers, the tensors are exactly those of a committed version (the one the
follower reports; at ``resume`` that one or a newer one), by an XXH3-128 digest of all the
bits against each version's expected tensors (for the layouts, the re-sharding by plain torch
ops of ``tests.test_presets.engine_reference``); every error is of an injected kind; every 10
versions and at the end, each follower (caught up) equals the trainer's bf16 tensors element
for element; at the end the committed versions are exactly those retention kept, ``gc``
removes exactly the leftover objects of the faulted publishes that retention did not delete
with their version and that no kept manifest or anchor copy names, and
``verify_store(deep=True)`` finds nothing but the corrupted objects of the versions still
kept. Counts are printed (``pytest -s``). A sync that raises although its follower reached
the target (consistent there: a manifest re-read after the last write failed) is counted and
printed, not failed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

import deltastore.tensors.words
from deltastore import IntegrityError, LocalStore, Publisher, Subscriber
from deltastore.catalog.chain import ChainReader
from deltastore.checkpoint.folders import PENDING, FolderSync, read_state
from deltastore.checkpoint.safetensors import MappedCheckpoint, locate
from deltastore.errors import DeltastoreError
from deltastore.format.keys import LEASE_PREFIX, anchor_key, lease_key
from deltastore.format.lease import Lease, parse_lease, parse_time
from deltastore.format.manifest import DATA_PREFIX, Manifest, manifest_key
from deltastore.maintenance.orphans import find_orphans, gc
from deltastore.maintenance.retention import RetentionReport
from deltastore.maintenance.verify import verify_store
from deltastore.sync.subscriber import SyncReport
from deltastore.testing.faults import FaultyStore, InjectedFault, Op
from deltastore.testing.synthetic import AdamWTrajectory, ModelConfig
from tests.test_crash_sync import kill_server
from tests.test_presets import engine_layout, engine_reference, tp_ranks

ROOT = Path(__file__).parent.parent
SEED = int(os.environ.get("DELTASTORE_SOAK_SEED", "20260"))
VERSIONS = int(os.environ.get("DELTASTORE_SOAK_VERSIONS", "120"))
#: GQA (2 kv heads over 4 heads: at TP 4 each kv head is held by 2 ranks), q/k/v biases.
SPEC = ModelConfig(
    vocab=1000,
    hidden=64,
    layers=2,
    intermediate=128,
    heads=4,
    kv_heads=2,
    head_dim=16,
    qkv_bias=True,
)
ANCHOR_EVERY = 12  # an anchor copy every 12 versions (anchor_policy "every:12")
SAMPLE_EVERY = 10
GC_EVERY = 20  # gc(keep=KEEP) before the followers sync each 20th version
KEEP = 8
LEASE_TTL = 3600.0  # the followers' leases outlive the run
LAPSE_TTL = 0.25  # lapse's lease: it expires while lapse sleeps
SLEEP = 30  # versions tp4 and lapse sleep
READ_FAULT_RATE = 0.03  # per store operation of a follower
WRITE_FAULT_RATE = 0.08  # per sync of a follower that holds a version and is behind
PUBLISH_FAULT_RATE = 0.08  # per publish
CATCH_UP_TRIES = 40
KILLED = -signal.SIGKILL
Tensors = Mapping[str, torch.Tensor]
TOKEN = re.compile(r"/[0-9a-f]{12}-(?=[0-9]+\.dsz$)")
WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(WORD[t.element_size()]).numpy()


def digest(tensors: Tensors) -> str:
    """XXH3-128 of every tensor's name and bits, in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(np.ascontiguousarray(bits(tensors[name])))
    return h.hexdigest()


def mismatched(got: Tensors, want: Tensors) -> int:
    """Elements whose bits differ (a missing or extra tensor counts whole)."""
    bad = sum(want[n].numel() for n in set(want) - set(got))
    bad += sum(got[n].numel() for n in set(got) - set(want))
    for name in set(got) & set(want):
        a, b = bits(got[name]), bits(want[name])
        bad += int((a != b).sum()) if a.shape == b.shape else max(a.size, b.size)
    return bad


# --- the trainer's side: what every version must look like to each kind of follower --------

LAYOUTS = {"hf": None, "tp2": tp_ranks(2), "tp4": tp_ranks(4)}


def expected(full: Tensors, kind: str) -> dict[str, torch.Tensor]:
    ranks = LAYOUTS[kind]
    return dict(full) if ranks is None else engine_reference(dict(full), SPEC, ranks)


class Versions:
    """Digests of each committed version's tensors, per kind of follower."""

    def __init__(self) -> None:
        self.digest: dict[str, dict[int, str]] = {k: {} for k in LAYOUTS}
        self.by_digest: dict[str, dict[str, set[int]]] = {k: {} for k in LAYOUTS}
        self.latest = 0

    def add(self, version: int, full: Tensors) -> None:
        for kind in LAYOUTS:
            d = digest(expected(full, kind))
            self.digest[kind][version] = d
            self.by_digest[kind].setdefault(d, set()).add(version)
        self.latest = version


# --- fault injection ------------------------------------------------------------------------


class InjectedWriteError(OSError):
    """A write of the write phase failed (raised by :class:`FlakyScatter`)."""


class FlakyScatter:
    """Wraps ``deltastore.tensors.words.scatter``; once armed with n, the n-th call writes half
    of its words and raises :class:`InjectedWriteError`."""

    def __init__(self, real: Callable[..., None]) -> None:
        self.real, self.left, self.fired = real, 0, 0

    def arm(self, n: int) -> None:
        self.left = n

    def __call__(self, local: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
        if self.left > 0:
            self.left -= 1
            if self.left == 0:
                half = positions.size // 2
                self.real(local, positions[:half], values[:half])
                self.fired += 1
                raise InjectedWriteError(f"soak: write failed after {half} of {positions.size}")
        self.real(local, positions, values)


class ReadFaults:
    """A :class:`FaultyStore` hook failing ``rate`` of a follower's store operations. Whether
    an operation fails depends on (seed, follower, attempt, operation, key, occurrence of that
    operation and key in the attempt; keys without the publisher's random token), not on which
    worker thread gets there first."""

    def __init__(self, name: str, counts: Counter[str]) -> None:
        self.name, self.counts = name, counts
        self.lock = threading.Lock()
        self.attempt = 0
        self.seen: Counter[tuple[str, str]] = Counter()

    def next_attempt(self) -> None:
        with self.lock:
            self.attempt += 1
            self.seen.clear()

    def __call__(self, op: Op) -> None:
        with self.lock:
            self.counts["follower store operations"] += 1
            self.seen[op.name, op.key] += 1
            j = self.seen[op.name, op.key]
            where = TOKEN.sub("/", op.key)  # data object names hold a random publisher token
            key = f"{SEED}/{self.name}/{self.attempt}/{op.name}/{where}/{j}".encode()
        if xxhash.xxh64_intdigest(key) < READ_FAULT_RATE * 2**64:
            with self.lock:
                self.counts[f"read fault: {op.name}"] += 1
            raise InjectedFault(f"soak: transient failure of {op.name} {op.key}")


# --- followers ------------------------------------------------------------------------------


class Follower:
    """One receiver: ``sync()`` one attempt; ``reports()`` the version it claims to hold
    (None: none, or a killed pull is pending); ``tensors()`` what it holds now. Its lease is
    ``leases/<name>.json``, ``lease_ttl`` seconds long; ``applied`` lists the (version, kind)
    of every version it applied, in order."""

    kind = "hf"

    def __init__(
        self, name: str, store: Path, counts: Counter[str], lease_ttl: float = LEASE_TTL
    ) -> None:
        self.name, self.lease_ttl = name, lease_ttl
        self.faults = ReadFaults(name, counts)
        self.store = FaultyStore(LocalStore(store), hook=self.faults)
        self.applied: list[tuple[int, str]] = []
        self.last: SyncReport | None = None  # the report of the last attempt (None: it failed)

    def on_version(self, m: Manifest) -> None:
        self.applied.append((m.version, m.kind))

    def sync(self) -> SyncReport:
        raise NotImplementedError

    def reports(self) -> int | None:
        raise NotImplementedError

    def tensors(self) -> Tensors | None:
        raise NotImplementedError


class Memory(Follower):
    """A :class:`Subscriber` (whole tensors, or a layout); its pause/resume hooks check that
    the tensors are at a committed version right before and right after each write phase."""

    def __init__(
        self,
        name: str,
        store: Path,
        counts: Counter[str],
        versions: Versions,
        partial: list[str],
        kind: str = "hf",
        lease_ttl: float = LEASE_TTL,
    ) -> None:
        super().__init__(name, store, counts, lease_ttl)
        self.kind, self.versions, self.partial = kind, versions, partial
        self.counts = counts
        ranks = LAYOUTS[kind]
        self.sub = Subscriber(
            self.store,
            layout=None if ranks is None else engine_layout(SPEC, ranks),
            pause=self._pause,
            resume=self._resume,
            reader_id=name,
            lease_ttl=lease_ttl,
        )
        self._before: int | None = None

    def _pause(self) -> None:
        self._before = self.sub.version
        if self._before is not None:  # None: a fresh bootstrap, written while decoded
            self.counts["write phases watched"] += 1
            d = digest(self.tensors() or {})
            if d != self.versions.digest[self.kind][self._before]:
                self.partial.append(f"{self.name}: not at v{self._before} at pause()")

    def _resume(self) -> None:
        if self._before is not None:
            at = self.versions.by_digest[self.kind].get(digest(self.tensors() or {}), set())
            if not any(v >= self._before for v in at):
                self.partial.append(f"{self.name}: at no version >= v{self._before} at resume()")

    def sync(self) -> SyncReport:
        return self.sub.sync(on_version=self.on_version)

    def reports(self) -> int | None:
        return self.sub.version

    def tensors(self) -> Tensors | None:
        return self.sub.tensors


class Folder(Follower):
    """A :class:`FolderSync` over a checkpoint folder; read back from the files to check."""

    def __init__(self, name: str, store: Path, counts: Counter[str], dest: Path) -> None:
        super().__init__(name, store, counts)
        self.dest = dest
        self.reopen()

    def reopen(self) -> None:
        """A new FolderSync on the folder: the receiver restarted (with the same reader id)."""
        self.folder = FolderSync(
            self.store,  # type: ignore[arg-type]
            self.dest,
            reader_id=self.name,
            lease_ttl=self.lease_ttl,
        )

    def sync(self) -> SyncReport:
        return self.folder.pull()

    def pending(self) -> bool:
        return (self.dest / PENDING).exists()

    def killable(self) -> bool:
        """Whether a pull would write: the folder exists, is consistent, and is behind."""
        return self.reports() is not None

    def reports(self) -> int | None:
        state = read_state(self.dest)
        return None if state is None or self.pending() else state.version

    def tensors(self) -> Tensors | None:
        return MappedCheckpoint(locate(self.dest)).tensors if read_state(self.dest) else None


# --- the killed pulls: tests/test_crash_sync.py's helper process forks one child per case ---


@pytest.fixture
def killer() -> Iterator[Callable[..., int]]:
    with kill_server() as run:
        yield run


# --- the soak -------------------------------------------------------------------------------

POLICY = f"every:{ANCHOR_EVERY}"


@dataclass
class Nap:
    """A sleeping follower: the version it holds, when it wakes, and its ``applied`` length."""

    held: int
    until: int
    mark: int
    #: the gc versions at which versions were kept only for its lease
    protected: list[int]


class Soak:
    """The trainer, the followers, the fault schedule and the counts of one run."""

    def __init__(self, tmp: Path, killer: Callable[..., int], flaky: FlakyScatter) -> None:
        self.tmp, self.killer, self.flaky = tmp, killer, flaky
        self.path = tmp / "store"
        self.rng = random.Random(SEED)
        self.counts: Counter[str] = Counter()
        self.partial: list[str] = []
        self.unexpected: list[str] = []
        self.mismatches: list[str] = []
        self.versions = Versions()
        self.corrupted: dict[int, str] = {}  # version -> object key
        self.leftovers: set[str] = set()  # data objects written by the faulted publishes
        self.streak: Counter[str] = Counter()  # failed attempts since the last success
        self.traj = AdamWTrajectory(SPEC, lr=1e-6, seed=SEED)
        self.pstore = FaultyStore(LocalStore(self.path))
        self.pub = Publisher(self.pstore, anchor_policy=POLICY)
        # the chain as the trainer knows it: committed versions retention has not deleted,
        # anchor versions, versions whose anchor copy is in the store
        self.present: set[int] = set()
        self.anchors: set[int] = set()
        self.copies: set[int] = set()
        self.retired: set[str] = set()  # keys retention deleted
        self.retention: list[str] = []  # what retention did wrong
        self.leases_seen: set[str] = set()
        self.expired: list[str] = []  # expired leases gc removed
        self.asleep: dict[str, Nap] = {}
        self.woke: list[str] = []  # how each sleeper caught up
        self.committed: Tensors = {}  # the trainer's tensors at the newest committed version
        self.clean_ops = 0
        self.probe = Subscriber(LocalStore(self.path), signing_key=None)
        self.followers: list[Follower] = [
            Memory("plain", self.path, self.counts, self.versions, self.partial),
            Memory("tp2", self.path, self.counts, self.versions, self.partial, kind="tp2"),
            Folder("folder", self.path, self.counts, tmp / "folder"),
        ]
        self.kill_pending: set[str] = set()
        self.join = 0
        self.naps = False
        self.kept_corrupt: set[int] = set()

    # --- trainer ---------------------------------------------------------------------------

    def publish(self, version: int, full: Tensors, *, anchor: bool) -> None:
        kind = "anchor" if anchor or version == 1 else "delta"
        fault = self.clean_ops and self.rng.random() < PUBLISH_FAULT_RATE
        if fault:
            k, mode = (
                self.rng.randint(1, self.clean_ops),
                self.rng.choice(("raise", "lost-response")),
            )
            self.pstore.reset(fail_at=k, mode=mode)
            self.counts[f"publish fault: {mode}"] += 1
        else:
            self.pstore.reset()
        error: DeltastoreError | None = None
        try:
            report = self.pub.publish(full, version=version, anchor=anchor or None)
        except DeltastoreError as exc:
            error = exc
        if fault:  # what a faulted publish wrote may be left over (a copy that failed, too)
            self.leftovers |= {
                o.key
                for o in self.pstore.ops
                if o.name == "put" and o.done and o.key.startswith(DATA_PREFIX)
            }
        if error is not None:  # a publish that raises committed nothing: retry it
            op = self.pstore.fault
            assert fault and op is not None, error
            assert not self.pstore.inner.exists(manifest_key(version)), (op, error)
            self.counts["publishes failed and retried"] += 1
            self.pstore.reset()
            if self.rng.random() < 0.5:  # the trainer restarts: a new publisher attaches
                self.pub = Publisher(self.pstore, anchor_policy=POLICY)
                assert self.pub.attach(self.committed) == version - 1
                self.counts["publishers restarted (attach)"] += 1
            report = self.pub.publish(full, version=version, anchor=anchor or None)
        elif fault:
            self.counts["publishes committed despite the fault"] += 1
        else:
            self.clean_ops = len(self.pstore.ops)
        assert report.kind == kind and report.version == version
        assert kind == "anchor" or report.parent == version - 1
        assert self.pstore.inner.exists(manifest_key(version))
        self.present.add(version)
        if kind == "anchor":
            self.anchors.add(version)
        if report.anchor_copy_bytes is not None:
            self.copies.add(version)
            self.counts["anchor copies written"] += 1
        self.versions.add(version, full)
        self.committed = full

    def corrupt(self, version: int) -> None:
        """Flip one byte of the version's first data object."""
        m = self.probe.manifest(version)
        key = min(f.object for e in m.tensors.values() for f in e.frames)
        path = self.path / key
        data = bytearray(path.read_bytes())
        at = self.rng.randrange(len(data))
        data[at] ^= 0x5A
        path.write_bytes(bytes(data))
        self.corrupted[version] = key
        self.counts["corrupted objects"] += 1

    # --- followers -------------------------------------------------------------------------

    def check_consistent(self, f: Follower, when: str) -> None:
        v = f.reports()
        if v is None:
            return
        self.counts["consistency checks"] += 1
        if digest(f.tensors() or {}) != self.versions.digest[f.kind][v]:
            self.partial.append(f"{f.name}: reports v{v} but holds other bits ({when})")

    def attempt(self, f: Follower, *, write_faults: bool = True) -> str:
        """One sync of ``f``: "ok", or why it failed ("read", "write", "corrupt", "other")."""
        before, target = f.reports(), self.versions.latest
        behind = before is not None and before < target
        pending = isinstance(f, Folder) and f.pending()
        if write_faults and behind and not pending and self.rng.random() < WRITE_FAULT_RATE:
            self.flaky.arm(self.rng.randint(1, 4))
        f.faults.next_attempt()
        self.counts["sync attempts"] += 1
        outcome = "ok"
        try:
            f.last = f.sync()
        except InjectedFault:
            outcome = "read"
            self.counts["syncs failed: read fault"] += 1
        except InjectedWriteError:
            outcome = "write"
            self.counts["syncs failed: write failure"] += 1
            self.counts[f"write failures: {f.name}"] += 1
        except IntegrityError as exc:
            outcome = "corrupt"
            if self.versions.latest in self.corrupted:
                self.counts["syncs failed: corrupted object"] += 1
            else:
                self.unexpected.append(f"{f.name}: {type(exc).__name__}: {exc}")
        except Exception as exc:
            outcome = "other"
            self.unexpected.append(f"{f.name}: {type(exc).__name__}: {exc}")
        finally:
            if self.flaky.left:
                self.flaky.left = 0
                self.counts["write failures armed, not reached"] += 1
        if outcome != "ok":
            f.last = None
        self.check_consistent(f, "after a sync")
        after = f.reports()
        if outcome != "ok" and after == target != before:
            # a sync must not fail once its target is reached (nothing is read after the
            # last write): the caller would believe the follower is still at the old version
            self.counts["syncs that raised after reaching their target"] += 1
            self.unexpected.append(f"{f.name}: raised after reaching version {target}")
        if isinstance(f, Folder) and f.name in self.kill_pending and after is not None:
            self.kill_pending.discard(f.name)
            if f.folder.last_repair is None:
                self.unexpected.append(f"{f.name}: a killed pull was not repaired")
            self.counts["killed pulls repaired"] += 1
        if outcome == "ok":
            self.counts["syncs recovered"] += self.streak.pop(f.name, 0)
        else:
            self.counts["syncs failed"] += 1
            self.streak[f.name] += 1
        return outcome

    def kill(self, f: Folder) -> None:
        """Run the folder's pull to the newest version in a child killed in its write phase;
        then restart the receiver (a new FolderSync) and pull again."""
        state, target = read_state(f.dest), self.versions.latest
        assert state is not None and not f.pending() and state.version < target
        first = self.probe.manifest(target)  # the first version the pull applies
        while first.kind == "delta" and first.parent and first.parent.version > state.version:
            first = self.probe.manifest(first.parent.version)
        point = self.rng.choice(("write", "write", "record", "rename"))
        n = self.rng.randint(1, max(1, scatters(first))) if point == "write" else 1
        code = self.killer(
            self.path, f.dest, target, point, n, reader_id=f.name, lease_ttl=f.lease_ttl
        )
        if code == KILLED and f.pending():
            self.counts[f"pulls killed: {point}"] += 1
            self.kill_pending.add(f.name)
        elif code == 0:
            self.counts["pulls not killed (finished first)"] += 1
        else:
            self.unexpected.append(f"{f.name}: the pull to be killed exited with {code}")
        f.reopen()
        self.attempt(f, write_faults=False)

    def catch_up(self) -> None:
        for f in self.followers:
            if f.name in self.asleep:
                continue
            for _ in range(CATCH_UP_TRIES):
                if f.reports() == self.versions.latest:
                    break
                self.attempt(f)
            if f.reports() != self.versions.latest:
                self.unexpected.append(f"{f.name}: at v{f.reports()} after {CATCH_UP_TRIES} tries")

    def compare(self, full: Tensors) -> None:
        """Every follower (caught up) against the trainer's bf16 tensors."""
        for f in self.followers:
            if f.name in self.asleep:
                continue
            bad = mismatched(f.tensors() or {}, expected(full, f.kind))
            self.counts["bit-exact checks"] += 1
            self.counts["elements differing"] += bad
            if bad:
                self.mismatches.append(f"{f.name} at v{f.reports()}: {bad} elements differ")

    # --- sleepers -------------------------------------------------------------------------

    def lease(self, name: str) -> Lease | None:
        """The lease of ``name`` in the store (None: there is none)."""
        store = LocalStore(self.path)
        key = lease_key(name)
        return parse_lease(store.get(key), key=key) if store.exists(key) else None

    def doze(self, f: Follower, until: int) -> None:
        """Bring ``f`` to the newest version with its lease written there, then let it sleep
        (not sync) until version ``until``."""
        for _ in range(CATCH_UP_TRIES):
            lease = self.lease(f.name)
            if f.reports() == self.versions.latest and lease and lease.version == f.reports():
                break
            self.attempt(f)  # a sync at the target rewrites a lease whose last write failed
        held = f.reports()
        lease = self.lease(f.name)
        if held != self.versions.latest or lease is None or lease.version != held:
            self.unexpected.append(f"{f.name}: not at v{self.versions.latest} with its lease")
            return
        self.asleep[f.name] = Nap(held, until, len(f.applied), [])

    def wake(self, f: Follower) -> None:
        """Catch ``f`` up after its sleep: by deltas only when its lease was live all along
        (every version it needs was kept); from an anchor when its versions were deleted."""
        nap = self.asleep.pop(f.name)
        store = LocalStore(self.path)
        stranded = not store.exists(manifest_key(nap.held + 1))
        reports = []
        for _ in range(CATCH_UP_TRIES):
            if f.reports() == self.versions.latest:
                break
            if self.attempt(f) == "ok" and f.last is not None:
                reports.append(f.last)
        steps = f.applied[nap.mark :]
        at = f"{f.name} (asleep at v{nap.held}, woke at v{self.versions.latest})"
        if f.reports() != self.versions.latest or not steps:
            self.unexpected.append(f"{at}: did not catch up")
            return
        paths = sorted({r.path for r in reports if r.applied})
        if f.lease_ttl == LEASE_TTL:  # leased all along: nothing it needed was deleted
            if stranded:
                self.unexpected.append(f"{at}: v{nap.held + 1} was deleted under its lease")
            if not nap.protected:
                self.unexpected.append(f"{at}: no gc kept a version only for its lease")
            want = [(v, "delta") for v in range(nap.held + 1, self.versions.latest + 1)]
            if steps != want or paths != ["deltas"]:
                self.unexpected.append(f"{at}: caught up by {steps} (paths {paths}), not deltas")
            how = f"by {len(steps)} deltas"
        else:  # its lease expired: gc deleted the versions after the one it held
            if not stranded:
                self.unexpected.append(f"{at}: v{nap.held + 1} was not deleted (gc too rare?)")
            first = [r.path for r in reports if r.from_version == nap.held]
            if steps[0][1] != "anchor" or first[:1] not in ([], ["anchor"]):
                self.unexpected.append(f"{at}: recovered by {steps} (paths {paths}), no anchor")
            how = f"its v{nap.held + 1} deleted, recovered from anchor v{steps[0][0]}"
        self.woke.append(f"{f.name} slept v{nap.held}-v{self.versions.latest}, {how}")

    # --- retention -------------------------------------------------------------------------

    def needed(self, present: set[int], copies: set[int], floor: int) -> set[int]:
        """What retention must keep: every version from ``floor`` up, and for each, its chain
        down to its newest anchor (an anchor version or a version with an anchor copy)."""
        kept = {v for v in present if v >= floor}
        for v in sorted(kept, reverse=True):
            while v not in self.anchors and v not in copies:
                v -= 1  # a delta's parent is the version before (checked at publish)
                if v not in present or v in kept:
                    break
                kept.add(v)
        return kept

    def flag(self, message: str) -> None:
        self.retention.append(message)

    def collect(self, v: int) -> None:
        """``gc(keep=KEEP)`` on the store itself, while the followers hold leases; check what
        it kept and deleted against the trainer's record and a listing before and after."""
        store = LocalStore(self.path)
        for f in self.followers:  # a sleeping short lease must have run out: wait the rest
            lease = self.lease(f.name)
            if f.name in self.asleep and f.lease_ttl < LEASE_TTL and lease is not None:
                left = (parse_time(lease.expires) - datetime.now(timezone.utc)).total_seconds()
                time.sleep(max(0.0, left) + 0.01)
        leases = {}
        for key in store.list(LEASE_PREFIX):
            lease = parse_lease(store.get(key), key=key)
            leases[lease.reader] = lease
        chain = ChainReader(store, cache=0)
        before, copies = set(chain.versions()), set(chain.anchor_versions())
        if before != self.present or copies != self.copies:
            self.flag(
                f"v{v}: before gc the store holds versions {sorted(before ^ self.present)} and "
                f"copies {sorted(copies ^ self.copies)} that the trainer does not, or lacks them"
            )
        folders: dict[int, set[str]] = {}
        for key in store.list(DATA_PREFIX):
            folders.setdefault(int(key[len(DATA_PREFIX) :].split("/")[0]), set()).add(key)
        r = gc(store, keep=KEEP, lease_grace_s=0.0).retention
        assert isinstance(r, RetentionReport)
        self.counts["gc runs"] += 1
        got = {x.reader: x for x in r.leases}
        names = {f.name: f for f in self.followers}
        if set(got) != set(leases) or any(x.version != leases[n].version for n, x in got.items()):
            self.flag(f"v{v}: gc saw the leases {r.leases}, the store holds {leases}")
        for name, x in got.items():
            self.leases_seen.add(name)
            f = names.get(name)
            if f is None or x.problem is not None:
                self.flag(f"v{v}: lease {x} of no follower, or with a problem")
            elif f.lease_ttl == LEASE_TTL and not x.live:
                self.flag(f"v{v}: the hour-long lease of {name} is not live")
            elif f.lease_ttl < LEASE_TTL and name in self.asleep and x.live:
                self.flag(f"v{v}: the short lease of {name} is live after it ran out")
        live = {x.reader: x.version for x in r.leases if x.live and x.version is not None}
        ordered = sorted(before)
        top = ordered[-KEEP] if len(ordered) >= KEEP else ordered[0]
        floor = min([top, *live.values()])
        keep = self.needed(before, copies, floor)
        for name, nap in self.asleep.items():  # versions only a sleeper's lease kept
            if name in live:
                others = [lv for n, lv in live.items() if n != name]
                if nap.held not in self.needed(before, copies, min([top, *others])):
                    nap.protected.append(v)
        doomed = {d.version: d for d in r.deleted if manifest_key(d.version) in d.keys}
        dropped = [d for d in r.deleted if d.version not in doomed]
        if set(r.kept) != keep or set(doomed) != before - keep:
            self.flag(
                f"v{v}: gc kept {r.kept} and deleted {sorted(doomed)}, expected to keep "
                f"{sorted(keep)} (floor {floor}, leases {live})"
            )
        for u, d in doomed.items():  # the whole version, manifest first
            want = {manifest_key(u)} | ({anchor_key(u)} if u in copies else set())
            if d.keys[:1] != (manifest_key(u),) or set(d.keys) != want | folders.get(u, set()):
                self.flag(f"v{v}: deleting v{u} deletes {d.keys}, not its manifest, copy, folder")
        for d in dropped:  # an anchor copy no reader starts from, of a kept version
            objects = set(d.keys[1:])
            m = self.probe.manifest(d.version)
            own = {f.object for e in m.tensors.values() for f in e.frames}
            if (
                d.version not in keep
                or d.version not in copies
                or d.keys[:1] != (anchor_key(d.version),)
                or not objects <= folders.get(d.version, set()) - own
            ):
                self.flag(f"v{v}: gc deleted {d.keys} of kept v{d.version}")
        deleted = {k for d in r.deleted for k in d.keys}
        self.retired |= deleted
        self.counts["versions deleted by retention"] += len(doomed)
        self.counts["anchor copies dropped by retention"] += len(dropped)
        self.counts["leftovers deleted by retention"] += len(deleted & self.leftovers)
        for key in r.expired_removed:
            self.expired.append(key)
            if store.exists(key):
                self.flag(f"v{v}: the expired lease {key} is still there")
        for name in self.asleep:
            short = names[name].lease_ttl < LEASE_TTL
            if short and name in leases and lease_key(name) not in r.expired_removed:
                self.flag(f"v{v}: the expired lease of {name} was not removed")
        # the store now: the versions kept, each reaching an anchor, every object they need
        after, left = set(chain.versions()), set(chain.anchor_versions())
        objects = set(store.list(DATA_PREFIX))
        self.present, self.copies = after, left
        if after != keep or left != copies - set(doomed) - {d.version for d in dropped}:
            self.flag(f"v{v}: after gc the store holds {sorted(after)}, copies {sorted(left)}")
        if any(store.exists(k) for k in deleted if not k.startswith(DATA_PREFIX)) or (
            deleted & objects
        ):
            self.flag(f"v{v}: keys gc reported deleted are still there")
        for u in sorted(after):
            w = u
            while w not in self.anchors and w not in left and w - 1 in after:
                w -= 1
            if w not in self.anchors and w not in left:
                self.flag(f"v{v}: v{u} reaches no anchor (its chain ends at v{w})")
            names_of = [self.probe.manifest(u)] + ([chain.anchor_copy(u)] if u in left else [])
            missing = {f.object for m in names_of for e in m.tensors.values() for f in e.frames}
            if missing - objects:
                self.flag(f"v{v}: v{u} names missing objects {sorted(missing - objects)}")
        newest = max(after)
        for name, held in live.items():  # never strands a leased reader
            at = names[name].reports() if name in names else None
            if not set(range(held, newest + 1)) <= after or (at is not None and at < held):
                self.flag(f"v{v}: {name} (lease v{held}, at v{at}) is stranded")

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> None:
        n = VERSIONS
        join = self.join = min(35, max(3, n - 10))
        # tp4 sleeps from nap to wake, lapse joins at lapse and sleeps to its wake (no anchor
        # version on the way, so no corruption there); only in runs long enough for both
        nap, wake = n // 3, n // 3 + SLEEP
        lapse, lapse_wake = wake + 2, wake + 2 + SLEEP
        self.naps = naps = join < nap and lapse_wake + 4 <= n
        calm = range(nap - 1, lapse_wake + 2) if naps else range(0)
        middle = [v for v in range(4, n - 1) if v != join and v not in calm]
        # one corruption where no gc deletes it (the newest KEEP versions): verify finds it
        tail = [v for v in middle if v > n - KEEP]
        corrupt = set(self.rng.sample(tail, 1)) if tail else set()
        rest = [v for v in middle if v not in corrupt]
        corrupt |= set(self.rng.sample(rest, max(2, n // 30) - len(corrupt)))
        self.kept_corrupt = corrupt & set(tail)
        free = [v for v in middle if v not in corrupt and v - 1 not in corrupt]
        kills = set(self.rng.sample(free, max(4, n // 15)))
        full = self.traj.bf16()
        for v in range(1, n + 1):
            republish = v - 1 in corrupt
            if not republish:
                full = self.traj.step()
            self.publish(v, full, anchor=republish)
            if republish:
                self.counts["republished anchors"] += 1
            if v in corrupt:
                self.corrupt(v)
            if v % GC_EVERY == 0:
                self.collect(v)
            if v == join:
                late = Memory("tp4", self.path, self.counts, self.versions, self.partial, "tp4")
                self.followers.append(late)
            if naps and v == lapse:
                short = Memory(
                    "lapse", self.path, self.counts, self.versions, self.partial, "hf", LAPSE_TTL
                )
                self.followers.append(short)
            for f in self.followers:
                if f.name in self.asleep:
                    if v == self.asleep[f.name].until:
                        self.wake(f)
                    continue
                if v in kills and isinstance(f, Folder) and f.killable():
                    self.kill(f)
                    continue
                outcome = self.attempt(f)
                for _ in range(5):  # a corrupted version: retry until the follower meets it
                    if v not in corrupt or outcome not in ("read", "write"):
                        break
                    outcome = self.attempt(f, write_faults=False)
                if naps and (f.name, v) in (("tp4", nap), ("lapse", lapse)):
                    self.doze(f, wake if v == nap else lapse_wake)
            if v % SAMPLE_EVERY == 0 and v not in corrupt:
                self.catch_up()
                self.compare(self.traj.bf16())
                self.counts["sampled versions"] += 1
        self.catch_up()
        self.compare(self.traj.bf16())


def scatters(m: Manifest) -> int:
    """Scatters of the write phase of ``m`` on a folder at its parent: frames that change."""
    return sum(f.changed > 0 for e in m.tensors.values() for f in e.frames)


def test_soak(
    tmp_path: Path,
    killer: Callable[..., int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t0 = time.perf_counter()
    print(
        f"\nsoak: seed {SEED} (DELTASTORE_SOAK_SEED), {VERSIONS} versions "
        "(DELTASTORE_SOAK_VERSIONS)"
    )
    flaky = FlakyScatter(deltastore.tensors.words.scatter)
    monkeypatch.setattr(deltastore.tensors.words, "scatter", flaky)
    soak = Soak(tmp_path, killer, flaky)
    soak.run()
    c = soak.counts

    # the store: the versions retention kept, nothing damaged but their corrupted objects;
    # gc removes only the faulted publishes' leftovers that retention did not delete
    store = LocalStore(soak.path)
    chain = ChainReader(store, cache=0)
    orphans = {o.key for o in find_orphans(store, min_age_s=0)}
    kept = sorted(soak.present)
    copies = set(chain.anchor_versions())
    named = [soak.probe.manifest(v) for v in kept] + [chain.anchor_copy(v) for v in copies]
    referenced = {f.object for m in named for e in m.tensors.values() for f in e.frames}
    removed = set(gc(store, orphans=True, min_age_s=0).removed)
    report = verify_store(store, deep=True)
    stray = [
        p.line()
        for p in report.problems
        if p.version not in soak.corrupted or (p.key and p.key != soak.corrupted[p.version])
    ]
    damaged = set(soak.corrupted) & soak.present  # corrupted versions retention kept

    def part(prefix: str) -> tuple[int, str]:
        """Sum and breakdown of the counts whose key starts with ``prefix``."""
        got = {k[len(prefix) :]: n for k, n in sorted(c.items()) if k.startswith(prefix)}
        return sum(got.values()), ", ".join(f"{k} {n}" for k, n in got.items())

    reads, read_ops = part("read fault: ")
    kills, kill_points = part("pulls killed: ")
    failed, failed_by = part("syncs failed: ")
    _, writes_by = part("write failures: ")
    publish_faults, publish_modes = part("publish fault: ")
    lines = [
        f"soak: {VERSIONS} versions (anchor copy every {ANCHOR_EVERY}: "
        f"{c['anchor copies written']} written; {c['republished anchors']} "
        f"republished as anchors after a corruption), {len(soak.followers)} followers "
        f"({', '.join(f.name for f in soak.followers)}; tp4 from v{soak.join})",
        f"soak: faults injected: {reads} read faults in {c['follower store operations']} "
        f"follower store operations ({read_ops}); {flaky.fired} write failures "
        f"({writes_by}; {c['write failures armed, not reached']} more armed, not reached); "
        f"{kills} pulls killed ({kill_points}; "
        f"{c['pulls not killed (finished first)']} finished first); "
        f"{c['corrupted objects']} corrupted objects; {publish_faults} publish faults "
        f"({publish_modes}: {c['publishes failed and retried']} failed and retried, "
        f"{c['publishers restarted (attach)']} of them by a restarted publisher, "
        f"{c['publishes committed despite the fault']} committed)",
        f"soak: syncs: {c['sync attempts']} attempts, {failed} failed ({failed_by}), "
        f"{c['syncs recovered']} recovered; killed pulls repaired {c['killed pulls repaired']}; "
        f"{c['syncs that raised after reaching their target']} syncs raised after reaching "
        "their target",
        f"soak: checks: {c['consistency checks']} after syncs, {c['write phases watched']} "
        f"write phases watched, {c['bit-exact checks']} bit-exact comparisons at "
        f"{c['sampled versions']} sampled versions and the end",
        f"soak: bit mismatches {c['elements differing']} (elements, over all comparisons), "
        "partial versions seen "
        f"{len(soak.partial)}, unexpected errors {len(soak.unexpected)}",
        f"soak: retention: {c['gc runs']} gc runs (keep {KEEP}, every {GC_EVERY} versions): "
        f"{c['versions deleted by retention']} versions deleted (with "
        f"{c['leftovers deleted by retention']} leftovers of faulted publishes), "
        f"{c['anchor copies dropped by retention']} anchor copies of kept versions dropped, "
        f"v{kept[0]}-v{kept[-1]} kept ({len(kept)}); leases of {len(soak.leases_seen)} readers "
        f"seen ({', '.join(sorted(soak.leases_seen))}), {len(soak.expired)} expired removed; "
        f"{'; '.join(soak.woke) or 'no sleepers (run too short)'}",
        f"soak: verify_store(deep=True) after gc ({len(removed)} orphans removed): "
        f"{report.summary()}",
        f"soak: {time.perf_counter() - t0:.1f} s",
    ]
    print("\n".join(lines))
    problems = soak.mismatches + soak.partial + soak.unexpected + soak.retention + stray
    for problem in problems[:20]:
        print("soak: PROBLEM", problem)
    if len(problems) > 20:
        print(f"soak: ... {len(problems) - 20} more problems")

    assert not soak.mismatches
    assert not soak.partial
    assert not soak.retention
    assert copies == soak.copies  # those the publisher wrote, less those retention deleted
    # a retry reuses its own object names; retention deleted those of the versions it deleted
    assert orphans == soak.leftovers - soak.retired - referenced
    assert all(k.startswith(DATA_PREFIX) for k in orphans)
    assert removed == orphans
    assert report.versions == tuple(kept)
    assert report.orphans == 0
    assert not soak.unexpected
    assert not stray
    assert set(report.kinds) <= {"xxh3", "frame", "adler32"}
    assert {p.version for p in report.problems} == damaged >= soak.kept_corrupt
    assert c["gc runs"] == VERSIONS // GC_EVERY
    assert (c["versions deleted by retention"] > 0 and kept[0] > 1) or VERSIONS < GC_EVERY
    assert c["anchor copies written"] > 0 or VERSIONS <= ANCHOR_EVERY
    if soak.naps:  # a sleeper caught up by deltas, a lapsed one recovered from an anchor
        assert len(soak.woke) == 2 and lease_key("lapse") in soak.expired
    assert c["syncs recovered"] == failed  # every follower ended at the newest version
    assert not soak.kill_pending
    assert flaky.fired == c["syncs failed: write failure"]  # each surfaced as itself
    # every kind of fault happened
    assert c["syncs failed: read fault"] > 0
    assert c["syncs failed: write failure"] > 0
    assert c["syncs failed: corrupted object"] > 0
    assert c["killed pulls repaired"] > 0
    assert publish_faults > 0
