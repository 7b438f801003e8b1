"""Crash consistency of ``deltastore mirror`` on the destination.

The source holds versions 1-3 (version 3 a delta with an anchor copy: several data objects
each); the destination is a mirror of versions 1-2. A clean mirror of version 3 is recorded
operation by operation on the destination through :class:`FaultyStore` (one worker, so the
order is the same in every run): the data objects of the delta and of the anchor copy, then
``anchors/3.json``, ``manifests/3.json``, then ``LATEST``, as the API documents. Then, for
every destination operation i, a fresh copy of the destination gets the same mirror with the
i-th operation failing: raised before it is done, done with its response lost, or (in a child
process) the process killed with SIGKILL before or after it, for every write. After each:

- the anchor copy and the manifest are at the destination exactly when their create was done;
  a mirror that returned without error wrote version 3;
- no manifest or anchor copy at the destination misses a frame (XXH3-64 of each frame);
- a fresh subscriber of the destination, and one already at version 2, reach the
  destination's newest version bit-exact;
- a restarted mirror completes version 3 byte for byte, writing only the data objects the
  destination did not hold yet (its data PUTs counted), and ``LATEST`` names 3.

With the default worker pool, a fault at each data object PUT checks the resume count too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from deltastore import DeltastoreError, LocalStore
from deltastore.format.keys import LATEST_KEY, anchor_key, data_prefix
from deltastore.format.manifest import manifest_key, parse_latest
from deltastore.maintenance.mirror import MirrorReport, mirror
from deltastore.testing.faults import FaultyStore, InjectedFault, Op
from tests.test_mirror import (
    Source,
    assert_complete,
    assert_readable,
    contents,
    data_puts,
    of_versions,
    source,
)

ROOT = Path(__file__).parent.parent
K = 3  # the version mirrored


@dataclass(frozen=True)
class Base:
    """A source at version K and a destination mirrored up to K - 1."""

    src: Source
    dst: Path

    def objects(self) -> dict[str, int]:
        """Version K's data objects at the source (its delta's and its copy's), with sizes."""
        prefix = data_prefix(K)
        return {k: len(b) for k, b in contents(self.src.root, (prefix,)).items()}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    tmp = tmp_path_factory.mktemp("mirror-crash")
    src = source(tmp / "src", K - 1)
    dst = tmp / "dst"
    assert mirror(src.root, dst).copied == tuple(range(1, K))
    src.publish(K)
    assert (src.root / anchor_key(K)).exists()  # every:2: version 3 has an anchor copy
    return Base(src, dst)


@dataclass(frozen=True)
class CleanRun:
    names: list[str]
    keys: list[str]

    @property
    def n(self) -> int:
        return len(self.names)

    def at(self, key: str, name: str) -> int:
        """1-based position of the operation ``name`` on ``key``."""
        return next(
            i + 1
            for i, (n, k) in enumerate(zip(self.names, self.keys, strict=True))
            if (n, k) == (name, key)
        )

    @property
    def writes(self) -> list[int]:
        return [
            i + 1 for i, n in enumerate(self.names) if n in ("put", "put_if_absent", "put_if_match")
        ]


def fresh_dst(base: Base, root: Path) -> Path:
    shutil.copytree(base.dst, root)
    return root


def clean_run(base: Base, tmp: Path) -> CleanRun:
    store = FaultyStore(LocalStore(fresh_dst(base, tmp / "clean")))
    report = mirror(base.src.root, store, max_workers=1)
    objects = base.objects()
    assert report.copied == (K,) and report.newest == K
    assert report.objects_copied == len(objects) >= 6 and report.objects_skipped == 0
    ops = store.ops
    assert all(op.done and not op.fault for op in ops)
    writes = [(op.name, op.key) for op in ops if op.writes]
    # the documented order: data objects (each once), the anchor copy, the manifest, LATEST
    n = len(objects)
    assert sorted(writes[:n]) == sorted(("put", k) for k in objects), writes
    assert writes[n:] == [
        ("put_if_absent", anchor_key(K)),
        ("put_if_absent", manifest_key(K)),
        ("put_if_match", LATEST_KEY),
    ], writes
    return CleanRun([op.name for op in ops], [op.key for op in ops])


def latest_ok(root: Path) -> int:
    """The version ``LATEST`` names, checked: its manifest is there, with its SHA-256."""
    latest = parse_latest((root / LATEST_KEY).read_bytes())
    body = (root / manifest_key(latest.version)).read_bytes()
    assert hashlib.sha256(body).hexdigest() == latest.sha256
    return latest.version


@dataclass
class Attempt:
    root: Path
    k: int
    mode: str
    ops: list[Op]
    error: BaseException | None = None
    report: MirrorReport | None = None


def attempt(base: Base, tmp: Path, k: int, mode: str) -> Attempt:
    root = fresh_dst(base, tmp / f"{mode}-{k}")
    store = FaultyStore(LocalStore(root), fail_at=k, mode=mode)  # type: ignore[arg-type]
    a = Attempt(root, k, mode, [])
    try:
        a.report = mirror(base.src.root, store, max_workers=1)
    except DeltastoreError as exc:
        a.error = exc
    a.ops = store.ops
    return a


def done_at(k: int, mode: str, op: int) -> bool:
    """Whether operation ``op`` (of a run like the clean one) was done when the ``k``-th
    failed in ``mode``."""
    return op < k or (op == k and mode in ("lost-response", "kill-after"))


def check_attempt(base: Base, a: Attempt, clean: CleanRun) -> None:
    in_process = a.mode in ("raise", "lost-response")
    if in_process:  # one worker: the same operations as the clean run up to the fault
        names = [op.name for op in a.ops]
        assert names[: a.k] == clean.names[: a.k], (a.mode, a.k, a.ops)
        assert [op.index for op in a.ops if op.fault] == [a.k]
        assert a.error is None or isinstance(a.error, InjectedFault), a.error
    case = (a.mode, a.k, clean.names[a.k - 1], clean.keys[a.k - 1])
    committed = (a.root / manifest_key(K)).exists()
    fault_before_commit = not done_at(a.k, a.mode, clean.at(manifest_key(K), "put_if_absent"))
    tolerated = in_process and a.error is None  # a fault on a hint read: the pass went on
    if tolerated:  # a read of a hint, the LATEST write (a hint), a create read back
        ok = {"get", "get_with_token", "head_token", "put_if_match"}
        ok |= {"put_if_absent"} if a.mode == "lost-response" else set()
        assert clean.names[a.k - 1] in ok, case
        assert committed and a.report is not None and a.report.newest == K, case
        assert (a.root / anchor_key(K)).exists(), case
    else:
        assert committed == (not fault_before_commit), case
        copy_done = done_at(a.k, a.mode, clean.at(anchor_key(K), "put_if_absent"))
        assert (a.root / anchor_key(K)).exists() == copy_done, case
    src_objects = base.objects()
    held = {
        k: len(b)
        for k, b in contents(a.root, (data_prefix(K),)).items()
        if src_objects.get(k) == len(b)
    }
    for key in held:  # what is there is the source's bytes
        assert (a.root / key).read_bytes() == (base.src.root / key).read_bytes(), (case, key)
    assert_complete(a.root)
    head = assert_readable(a.root, base.src.states, behind=K - 1)
    assert head == (K if committed else K - 1), case

    # a restarted mirror finishes version K and copies only what is missing
    missing = sorted(set(src_objects) - set(held))
    restart = FaultyStore(LocalStore(a.root))
    report = mirror(base.src.root, restart, max_workers=1)
    assert sorted(data_puts(restart.ops)) == missing, case
    assert report.objects_copied == len(missing) and report.newest == K, (case, report)
    if not committed:
        assert report.copied == (K,), (case, report)
        assert report.objects_skipped == len(held), (case, report)
    assert contents(a.root) == of_versions(contents(base.src.root), set(range(1, K + 1))), case
    # LATEST is a hint: a crash between the manifest and LATEST may leave it one behind
    assert latest_ok(a.root) in (K - 1, K), case
    if not committed:  # this pass wrote the manifest: and LATEST after it
        assert latest_ok(a.root) == K, case
    assert_complete(a.root)
    assert assert_readable(a.root, base.src.states, behind=K - 1) == K


@pytest.mark.parametrize("mode", ["raise", "lost-response"])
def test_a_fault_at_every_destination_operation(base: Base, tmp_path: Path, mode: str) -> None:
    clean = clean_run(base, tmp_path)
    for k in range(1, clean.n + 1):
        check_attempt(base, attempt(base, tmp_path, k, mode), clean)
    print(f"mirror fault points covered ({mode}): {clean.n}")


def test_a_fault_at_each_data_put_with_parallel_copies(base: Base, tmp_path: Path) -> None:
    """Default workers: which objects were written when one PUT failed varies; a restart
    writes exactly the others."""
    objects = base.objects()
    for j in range(1, len(objects) + 1):
        root = fresh_dst(base, tmp_path / f"parallel-{j}")
        store = FaultyStore(LocalStore(root), fail_at=j, only=["put"])
        with pytest.raises(DeltastoreError):
            mirror(base.src.root, store)
        assert not (root / manifest_key(K)).exists() and not (root / anchor_key(K)).exists()
        held = set(contents(root, (data_prefix(K),)))
        assert held == set(data_puts(store.ops)), j  # nothing written after it returned
        assert_readable(root, base.src.states, behind=K - 1)
        restart = FaultyStore(LocalStore(root))
        report = mirror(base.src.root, restart)
        assert sorted(data_puts(restart.ops)) == sorted(set(objects) - held), j
        assert report.objects_skipped == len(held) and report.copied == (K,)
        assert contents(root) == contents(base.src.root)
        assert_readable(root, base.src.states, behind=K - 1)


# --- mirror processes killed at an operation ---------------------------------------------------


def _child(spec_path: str) -> None:
    """Run in a child process: for each case, fork a mirror that is SIGKILLed at its k-th
    destination operation; print each exit status as JSON. (One interpreter start for all.)"""
    spec = json.loads(Path(spec_path).read_text())
    statuses = []
    for root, k, mode in spec["cases"]:
        pid = os.fork()
        if pid == 0:  # the mirror process
            code = 1
            try:
                store = FaultyStore(LocalStore(root), fail_at=k, mode=mode)
                mirror(spec["src"], store, max_workers=1, reader_id=f"killed-{mode}-{k}")
                code = 0
            finally:
                os._exit(code)
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(json.dumps(statuses))


def test_mirror_processes_killed_before_and_after_every_write(base: Base, tmp_path: Path) -> None:
    """Before and after each data object PUT, the anchor copy, the manifest and LATEST."""
    clean = clean_run(base, tmp_path)
    cases = []
    for mode in ("kill", "kill-after"):
        for k in clean.writes:
            root = fresh_dst(base, tmp_path / f"killed-{mode}-{k}")
            cases.append((str(root), k, mode))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"src": str(base.src.root), "cases": cases}))
    out = subprocess.run(
        [sys.executable, "-m", "tests.test_mirror_crash", str(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    statuses = json.loads(out.stdout.strip().splitlines()[-1])
    assert statuses == [-signal.SIGKILL] * len(cases), out.stderr
    for root, k, mode in cases:
        check_attempt(base, Attempt(Path(root), k, mode, []), clean)
    print(f"mirror fault points covered (killed processes): {len(cases)}")


if __name__ == "__main__":
    _child(sys.argv[1])
