"""Soak (issue 7, item 7): one publisher and four followers under random faults for many
versions, checked bit-exact against the trainer.

A trainer (AdamW steps of a small GQA model) publishes ``DELTASTORE_SOAK_VERSIONS`` versions
(default 120; an anchor every 12) through a :class:`FaultyStore` that fails one random
operation of ~8% of the publishes, raised or with its response lost: the version must be
committed exactly when ``publish`` returns; a failed publish is retried by the same publisher
or by a restarted one (``attach``). Followers, each on its own :class:`FaultyStore`:

- ``plain``: a :class:`Subscriber` holding the whole tensors;
- ``tp2``: a :class:`Subscriber` with the layout of both ranks of a vLLM TP-2 engine in one
  process (``tests.test_presets.engine_layout``: fused qkv and gate_up, padded vocabulary);
- ``folder``: a :class:`FolderSync` checkpoint folder;
- ``tp4``: a TP-4 engine (each kv head held by two ranks) that joins at version 35, from the
  newest anchor.

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
  ``tests/test_crash_sync.py``, which SIGKILLs itself halfway through the n-th scatter of the
  write phase, or after the writes and before the sidecar is replaced; a new ``FolderSync``
  (the restarted receiver) must repair the folder on its next pull;
- corrupted objects: a byte of a delta's data object is flipped right after its publish;
  followers get ``IntegrityError`` and stay put; the trainer republishes the same weights as
  an anchor and everybody catches up.

Checked: after every sync attempt, and in the pause/resume hooks around every write phase of
the in-memory followers, the tensors are exactly those of a committed version (the one the
follower reports; at ``resume`` that one or a newer one), by an XXH3-128 digest of all the
bits against each version's expected tensors (for the layouts, the re-sharding by plain torch
ops of ``tests.test_presets.engine_reference``); every error is of an injected kind; every 10
versions and at the end, each follower (caught up) equals the trainer's bf16 tensors element
for element; at the end ``gc`` removes exactly the failed publishes' leftover objects and
``verify_store(deep=True)`` finds nothing but the corrupted objects. Counts are printed
(``pytest -s``). A sync that raises although its follower reached the target (consistent
there: a manifest re-read after the last write failed) is counted and printed, not failed.
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
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

import deltastore.tensors.words
from deltastore import IntegrityError, LocalStore, Publisher, Subscriber
from deltastore.checkpoint.folders import PENDING, FolderSync, read_state
from deltastore.checkpoint.safetensors import MappedCheckpoint, locate
from deltastore.errors import DeltastoreError
from deltastore.format.manifest import DATA_PREFIX, Manifest, manifest_key
from deltastore.maintenance.orphans import find_orphans, gc
from deltastore.maintenance.verify import verify_store
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
ANCHOR_EVERY = 12
SAMPLE_EVERY = 10
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
    (None: none, or a killed pull is pending); ``tensors()`` what it holds now."""

    kind = "hf"

    def __init__(self, name: str, store: Path, counts: Counter[str]) -> None:
        self.name = name
        self.faults = ReadFaults(name, counts)
        self.store = FaultyStore(LocalStore(store), hook=self.faults)

    def sync(self) -> None:
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
    ) -> None:
        super().__init__(name, store, counts)
        self.kind, self.versions, self.partial = kind, versions, partial
        self.counts = counts
        ranks = LAYOUTS[kind]
        self.sub = Subscriber(
            self.store,
            layout=None if ranks is None else engine_layout(SPEC, ranks),
            pause=self._pause,
            resume=self._resume,
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

    def sync(self) -> None:
        self.sub.sync()

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
        """A new FolderSync on the folder: the receiver restarted."""
        self.folder = FolderSync(self.store, self.dest)  # type: ignore[arg-type]

    def sync(self) -> None:
        self.folder.pull()

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
        self.failed_puts: set[str] = set()
        self.streak: Counter[str] = Counter()  # failed attempts since the last success
        self.traj = AdamWTrajectory(SPEC, lr=1e-6, seed=SEED)
        self.pstore = FaultyStore(LocalStore(self.path))
        self.pub = Publisher(self.pstore)
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
        if error is not None:  # a publish that raises committed nothing: retry it
            op = self.pstore.fault
            assert fault and op is not None, error
            assert not self.pstore.inner.exists(manifest_key(version)), (op, error)
            self.counts["publishes failed and retried"] += 1
            self.failed_puts |= {o.key for o in self.pstore.ops if o.name == "put" and o.done}
            self.pstore.reset()
            if self.rng.random() < 0.5:  # the trainer restarts: a new publisher attaches
                self.pub = Publisher(self.pstore)
                assert self.pub.attach(self.committed) == version - 1
                self.counts["publishers restarted (attach)"] += 1
            report = self.pub.publish(full, version=version, anchor=anchor or None)
        elif fault:
            self.counts["publishes committed despite the fault"] += 1
        else:
            self.clean_ops = len(self.pstore.ops)
        assert report.kind == kind and report.version == version
        assert self.pstore.inner.exists(manifest_key(version))
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
            f.sync()
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
        code = self.killer(self.path, f.dest, target, point, n)
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
            for _ in range(CATCH_UP_TRIES):
                if f.reports() == self.versions.latest:
                    break
                self.attempt(f)
            if f.reports() != self.versions.latest:
                self.unexpected.append(f"{f.name}: at v{f.reports()} after {CATCH_UP_TRIES} tries")

    def compare(self, full: Tensors) -> None:
        """Every follower (caught up) against the trainer's bf16 tensors."""
        for f in self.followers:
            bad = mismatched(f.tensors() or {}, expected(full, f.kind))
            self.counts["bit-exact checks"] += 1
            self.counts["elements differing"] += bad
            if bad:
                self.mismatches.append(f"{f.name} at v{f.reports()}: {bad} elements differ")

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> None:
        n = VERSIONS
        join = self.join = min(35, max(3, n - 10))
        middle = [v for v in range(4, n - 1) if v % ANCHOR_EVERY not in (0, 1) and v != join]
        corrupt = set(self.rng.sample(middle, max(2, n // 30)))
        free = [v for v in middle if v not in corrupt and v - 1 not in corrupt]
        kills = set(self.rng.sample(free, max(4, n // 15)))
        full = self.traj.bf16()
        for v in range(1, n + 1):
            republish = v - 1 in corrupt
            if not republish:
                full = self.traj.step()
            self.publish(v, full, anchor=republish or v % ANCHOR_EVERY == 1)
            if republish:
                self.counts["republished anchors"] += 1
            if v in corrupt:
                self.corrupt(v)
            if v == join:
                late = Memory("tp4", self.path, self.counts, self.versions, self.partial, "tp4")
                self.followers.append(late)
            for f in self.followers:
                if v in kills and isinstance(f, Folder) and f.killable():
                    self.kill(f)
                    continue
                outcome = self.attempt(f)
                for _ in range(5):  # a corrupted version: retry until the follower meets it
                    if v not in corrupt or outcome not in ("read", "write"):
                        break
                    outcome = self.attempt(f, write_faults=False)
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

    # the store: nothing damaged but the corrupted objects; gc removes only failed uploads
    orphans = {o.key for o in find_orphans(LocalStore(soak.path), min_age_s=0)}
    referenced = {
        f.object
        for v in range(1, VERSIONS + 1)
        for e in soak.probe.manifest(v).tensors.values()
        for f in e.frames
    }
    removed = set(gc(LocalStore(soak.path), orphans=True, min_age_s=0).removed)
    report = verify_store(LocalStore(soak.path), deep=True)
    stray = [
        p.line()
        for p in report.problems
        if p.version not in soak.corrupted or (p.key and p.key != soak.corrupted[p.version])
    ]

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
        f"soak: {VERSIONS} versions (anchor every {ANCHOR_EVERY}, {c['republished anchors']} "
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
        f"soak: verify_store(deep=True) after gc ({len(removed)} orphans removed): "
        f"{report.summary()}",
        f"soak: {time.perf_counter() - t0:.1f} s",
    ]
    print("\n".join(lines))
    problems = soak.mismatches + soak.partial + soak.unexpected + stray
    for problem in problems[:20]:
        print("soak: PROBLEM", problem)
    if len(problems) > 20:
        print(f"soak: ... {len(problems) - 20} more problems")

    assert not soak.mismatches
    assert not soak.partial
    assert orphans == soak.failed_puts - referenced  # a retry reuses its own object names
    assert all(k.startswith(DATA_PREFIX) for k in orphans)
    assert removed == orphans
    assert report.versions == tuple(range(1, VERSIONS + 1))
    assert report.orphans == 0
    assert not soak.unexpected
    assert not stray
    assert set(report.kinds) <= {"xxh3", "frame", "adler32"}
    assert {p.version for p in report.problems} == set(soak.corrupted)
    assert c["syncs recovered"] == failed  # every follower ended at the newest version
    assert not soak.kill_pending
    assert flaky.fired == c["syncs failed: write failure"]  # each surfaced as itself
    # every kind of fault happened
    assert c["syncs failed: read fault"] > 0
    assert c["syncs failed: write failure"] > 0
    assert c["syncs failed: corrupted object"] > 0
    assert c["killed pulls repaired"] > 0
    assert publish_faults > 0
