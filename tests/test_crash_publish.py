"""Crash consistency of publish and ``deltastore gc --orphans`` (spec section 4.2).

A clean publish of version 2 (a delta, and an anchor) on a store at version 1 is recorded
operation by operation through :class:`FaultyStore`; then, for every operation k of it, a
fresh copy of the store at version 1 gets the same publish with the k-th operation failing:
raised before it is done, done with its response lost, or (in a child process) the process
killed with SIGKILL before or after it. A fault raised before operation k leaves the store as
a crash before k does, so these runs cover every state a publish can stop in. After each:

- the outcome follows the rule: a fault before the manifest create raises a typed error and
  commits nothing, but for the read ahead of ``LATEST`` (best effort: read again after the
  commit); a raised fault on the create commits nothing; a lost response on the create is read
  back and the publish succeeds; faults after it do not undo the commit (``LATEST`` is best
  effort);

Data objects are uploaded in parallel, and the head check runs at the same time as the read
ahead of ``LATEST``: the k-th operation is the k-th to start, and which one that is can differ
from the clean run within those groups (:func:`same_start`).
- every manifest under ``manifests/`` is complete (every frame's object exists, with the
  frame's XXH3-64) and subscribers (new, and one already at version 1) sync the old version or
  the new one, bit-exact;
- the objects the failed attempt wrote are exactly :func:`find_orphans`;
- a restarted publisher (``attach`` to the head's tensors) publishes the next version, which
  subscribers reach bit-exact;
- :func:`gc` removes exactly those orphans and nothing a manifest references.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from deltastore import DeltastoreError, LocalStore, ManifestError, Publisher, Subscriber
from deltastore.format.manifest import MANIFEST_PREFIX, manifest_key, parse_manifest, version_of_key
from deltastore.maintenance.orphans import find_orphans, gc
from deltastore.testing.faults import FaultyStore, InjectedFault, Op
from deltastore_cli import app
from tests.test_publisher import model, nudge, same_bits

Tensors = dict[str, torch.Tensor]

#: Small frames and objects: a version is several frames in several data objects.
OPTIONS = {"max_frame_bytes": 2048, "max_object_bytes": 100}
ROOT = Path(__file__).parent.parent


def v1() -> Tensors:
    return model(0, n=6000)


def v2() -> Tensors:
    return nudge(v1(), 1)


def publisher(store: LocalStore | FaultyStore | Path) -> Publisher:
    return Publisher(store, **OPTIONS)


def check_store(root: Path, expected: dict[int, Tensors]) -> int:
    """Every committed version is complete; subscribers reach the newest bit-exact (a new
    one, and one at the oldest version of ``expected``). Returns the newest version."""
    store = LocalStore(root)
    versions = sorted(
        v for k in store.list(MANIFEST_PREFIX) if (v := version_of_key(k)) is not None
    )
    assert versions and set(versions) <= set(expected), versions
    for v in versions:
        manifest = parse_manifest(store.get(manifest_key(v)), key=manifest_key(v))
        for entry in manifest.tensors.values():
            for f in entry.frames:
                data = store.get_range(f.object, f.offset, f.length)
                assert len(data) == f.length and xxhash.xxh3_64_hexdigest(data) == f.xxh3
    head = versions[-1]
    fresh = Subscriber(root)
    assert fresh.sync().version == head
    assert same_bits(expected[head], dict(fresh.tensors or {}))
    first = min(expected)
    behind = {n: t.clone() for n, t in expected[first].items()}
    Subscriber(root, tensors=behind, version=first).sync()
    assert same_bits(expected[head], behind)
    return head


def written(ops: list[Op]) -> set[str]:
    """Data objects an attempt wrote (done, or done before the response was lost)."""
    return {op.key for op in ops if op.name == "put" and op.done}


@dataclass
class Attempt:
    """A publish of version 2 on a copy of the base store, with one fault."""

    root: Path
    kind: str
    k: int
    mode: str
    ops: list[Op]
    error: DeltastoreError | None = None
    version: int | None = None  # where the failing publisher ended up (in-process runs)


@dataclass(frozen=True)
class CleanRun:
    """The operations of a fault-free publish, and where its manifest create is."""

    names: list[str]
    commit_at: int  # 1-based index of the manifest's put_if_absent

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def pair(self) -> tuple[int, int]:
        """1-based positions of the head check and the read ahead of LATEST (concurrent)."""
        return self.commit_at - 2, self.commit_at - 1


#: The two requests a publish makes at once right before its commit.
PAIR = ["get_with_token", "list_after"]


def same_start(names: list[str], clean: CleanRun, k: int) -> bool:
    """Whether the first ``k`` operation names are the clean run's, up to the order of the
    two concurrent requests before the commit (a fault may hit either of them first)."""
    got, want = names[:k], clean.names[:k]
    first, second = clean.pair
    if k == first:  # one of the pair started first
        return got[:-1] == want[:-1] and got[-1] in PAIR
    if k >= second:
        got = got[: first - 1] + sorted(got[first - 1 : second]) + got[second:]
        want = want[: first - 1] + sorted(want[first - 1 : second]) + want[second:]
    return got == want


def base_store(root: Path) -> Path:
    publisher(root).publish(v1(), version=1)
    return root


def clean_run(base: Path, kind: str, tmp: Path) -> CleanRun:
    root = tmp / f"clean-{kind}"
    shutil.copytree(base, root)
    store = FaultyStore(LocalStore(root))
    pub = publisher(store)
    pub.attach(v1())
    store.reset()
    pub.publish(v2(), version=2, anchor=kind == "anchor")
    names = [op.name for op in store.ops]
    return CleanRun(names, names.index("put_if_absent") + 1)


def attempt(base: Path, tmp: Path, kind: str, k: int, mode: str) -> Attempt:
    root = tmp / f"{kind}-{mode}-{k}"
    shutil.copytree(base, root)
    store = FaultyStore(LocalStore(root))
    pub = publisher(store)
    pub.attach(v1())
    store.reset(fail_at=k, mode=mode)
    error = None
    try:
        pub.publish(v2(), version=2, anchor=kind == "anchor")
    except DeltastoreError as exc:
        error = exc
    return Attempt(root, kind, k, mode, store.ops, error, pub.version)


def committed_after(clean: CleanRun, k: int, mode: str, name: str | None = None) -> bool:
    """The rule: whether version 2 is committed after a fault at operation ``k`` (named
    ``name``, when known)."""
    if name == "get_with_token" and k < clean.commit_at and mode in ("raise", "lost-response"):
        return True  # the read ahead of LATEST: the publish goes on without it
    if mode in ("raise", "kill"):  # the k-th operation was not done
        return k > clean.commit_at
    return k >= clean.commit_at  # lost-response, kill-after: it was done


def check_attempt(a: Attempt, clean: CleanRun) -> None:
    """Everything a fault must leave true, then a restarted publisher and gc."""
    in_process = a.mode in ("raise", "lost-response")
    committed = committed_after(clean, a.k, a.mode, a.ops[a.k - 1].name if in_process else None)
    assert (a.root / manifest_key(2)).exists() == committed, (a.kind, a.mode, a.k)
    if in_process:  # the publish's own outcome
        assert same_start([op.name for op in a.ops], clean, a.k), (a.k, a.ops, clean.names)
        assert [op.index for op in a.ops if op.fault] == [a.k]
        if committed:
            assert a.error is None and a.version == 2
        else:
            assert isinstance(a.error, InjectedFault) and a.version == 1, a.error
    expected = {1: v1(), 2: v2()}
    head = check_store(a.root, expected)
    assert head == (2 if committed else 1)
    orphans = set() if committed else written(a.ops)
    assert {o.key for o in find_orphans(a.root)} == orphans
    # A restarted publisher continues from the head; a failed version number is reused.
    nxt = head + 1 if committed else 2
    expected[nxt] = nudge(expected[head], 10 + a.k)
    restarted = publisher(a.root)
    assert restarted.attach(expected[head]) == head
    assert restarted.publish(expected[nxt], version=nxt).kind == "delta"
    referenced = _referenced_bytes(a.root)
    report = gc(a.root, orphans=True, min_age_s=0)
    assert set(report.removed) == orphans and not report.kept
    assert _referenced_bytes(a.root) == referenced
    assert find_orphans(a.root) == []
    assert check_store(a.root, expected) == nxt


def _referenced_bytes(root: Path) -> dict[str, bytes]:
    """Every object a committed manifest references, with its bytes."""
    store = LocalStore(root)
    keys = {
        f.object
        for k in store.list(MANIFEST_PREFIX)
        for e in parse_manifest(store.get(k)).tensors.values()
        for f in e.frames
    }
    return {k: store.get(k) for k in sorted(keys)}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return base_store(tmp_path_factory.mktemp("base"))


def fault_matrix(base: Path, tmp: Path, kind: str, modes: tuple[str, ...]) -> dict[str, int]:
    """Run and check a publish of ``kind`` with a fault at every operation in every mode;
    returns the counts (a summary of the fault points covered)."""
    clean = clean_run(base, kind, tmp)
    assert clean.names[clean.commit_at :] == ["put_if_match"]  # LATEST, its token read ahead
    assert sorted(clean.names[clean.pair[0] - 1 : clean.pair[1]]) == PAIR
    assert clean.names.count("put") >= 3  # several data objects
    for mode in modes:
        for k in range(1, clean.n + 1):
            check_attempt(attempt(base, tmp, kind, k, mode), clean)
    summary = {"operations": clean.n, "modes": len(modes), "fault_points": clean.n * len(modes)}
    print(f"publish fault points covered ({kind}, in-process): {summary}")
    return summary


@pytest.mark.parametrize("kind", ["delta", "anchor"])
def test_a_fault_at_every_operation_of_a_publish(base: Path, tmp_path: Path, kind: str) -> None:
    summary = fault_matrix(base, tmp_path, kind, ("raise", "lost-response"))
    assert summary["fault_points"] >= 2 * 8


# --- publisher processes killed at an operation ---------------------------------------


def _child(spec_path: str) -> None:
    """Run in a child process: for each case, fork a publisher that is SIGKILLed at its
    k-th store operation; print each exit status as JSON. (One interpreter start for all.)"""
    spec = json.loads(Path(spec_path).read_text())
    statuses = []
    for root, k, mode in spec["cases"]:
        pid = os.fork()
        if pid == 0:  # the publisher process
            code = 1
            try:
                store = FaultyStore(LocalStore(root))
                pub = publisher(store)
                pub.attach(load_file(spec["v1"]))
                store.reset(fail_at=k, mode=mode)
                pub.publish(load_file(spec["v2"]), version=2, anchor=spec["kind"] == "anchor")
                code = 0
            finally:
                os._exit(code)
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(json.dumps(statuses))


def test_publisher_processes_killed_at_every_operation(base: Path, tmp_path: Path) -> None:
    clean = clean_run(base, "delta", tmp_path)
    save_file(v1(), tmp_path / "v1.safetensors")
    save_file(v2(), tmp_path / "v2.safetensors")
    cases = []
    for mode in ("kill", "kill-after"):
        for k in range(1, clean.n + 1):
            root = tmp_path / f"killed-{mode}-{k}"
            shutil.copytree(base, root)
            cases.append((str(root), k, mode))
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "kind": "delta",
                "v1": str(tmp_path / "v1.safetensors"),
                "v2": str(tmp_path / "v2.safetensors"),
                "cases": cases,
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "tests.test_crash_publish", str(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    statuses = json.loads(out.stdout.strip().splitlines()[-1])
    assert statuses == [-signal.SIGKILL] * len(cases), out.stderr
    for root, k, mode in cases:
        ops = _puts_on_disk(Path(root))
        done = k if mode == "kill-after" else k - 1
        # uploads run in parallel (ones started after the k-th may be done or torn when it
        # ends), so only: nothing is uploaded before the first upload
        if clean.names[:done].count("put") == 0:
            assert ops == [], (mode, k)
        check_attempt(Attempt(Path(root), "delta", k, mode, ops), clean)
    print(f"publish fault points covered (killed processes): {len(cases)}")


def _puts_on_disk(root: Path) -> list[Op]:
    """The data objects a killed publisher wrote for version 2, as its put operations, with
    the temporary files of uploads it was killed in (collected by gc as orphans too)."""
    folder = root / "versions" / f"{2:020d}"
    keys = (
        sorted(p.relative_to(root).as_posix() for p in folder.glob("*")) if folder.exists() else []
    )
    return [Op(0, "put", key, done=True, fault=False) for key in keys]


# --- gc ----------------------------------------------------------------------------------


def failed_publish(root: Path) -> set[str]:
    """A store at version 1 with the data objects of a publish of version 2 that failed at
    its manifest create; returns their keys."""
    base_store(root)
    store = FaultyStore(LocalStore(root), fail_at=1, only=["put_if_absent"])
    pub = publisher(store)
    pub.attach(v1())
    with pytest.raises(InjectedFault):
        pub.publish(v2(), version=2)
    return written(store.ops)


def _age(root: Path, keys: Iterable[str], seconds: float) -> None:
    for key in keys:
        t = time.time() - seconds
        os.utime(root / key, (t, t))


def test_gc_keeps_young_orphans_and_temporaries_by_default(tmp_path: Path) -> None:
    orphans = failed_publish(tmp_path)
    temp = "versions/00000000000000000002/.tmp-x.dsz-0123"
    (tmp_path / temp).write_bytes(b"torn write")
    found = find_orphans(tmp_path)
    assert {o.key for o in found} == orphans | {temp}
    assert all(o.kept and "younger" in o.kept for o in found)
    assert [o.temporary for o in found if o.key == temp] == [True]
    assert gc(tmp_path, orphans=True).removed == ()
    _age(tmp_path, orphans | {temp}, 7200)
    dry = gc(tmp_path, orphans=True, dry_run=True)
    assert set(dry.removed) == orphans | {temp} and dry.dry_run
    assert {o.key for o in find_orphans(tmp_path)} == orphans | {temp}  # dry run removed none
    report = gc(tmp_path, orphans=True)
    assert set(report.removed) == orphans | {temp}
    assert report.removed_bytes == sum(o.size or 0 for o in report.orphans) > 0
    assert not (tmp_path / temp).exists()
    assert check_store(tmp_path, {1: v1()}) == 1


def test_gc_without_ages_keeps_versions_above_the_newest(tmp_path: Path) -> None:
    orphans = failed_publish(tmp_path)
    store = FaultyStore(LocalStore(tmp_path))  # not a LocalStore: no ages, no temp files
    found = find_orphans(store)
    assert {o.key for o in found} == orphans
    assert all(o.age_s is None and o.kept and "newest" in o.kept for o in found)
    assert gc(store, orphans=True).removed == ()
    # Once a newer version is committed, version 2's leftovers are below it: removed.
    pub = publisher(tmp_path)
    pub.attach(v1())
    pub.publish(nudge(v1(), 3), version=3)
    assert set(gc(store, orphans=True).removed) == orphans
    assert gc(store, orphans=True).orphans == ()


def test_gc_removes_nothing_when_a_manifest_is_damaged(tmp_path: Path) -> None:
    assert find_orphans(tmp_path / "empty") == []
    orphans = failed_publish(tmp_path)
    _age(tmp_path, orphans, 7200)
    (tmp_path / manifest_key(5)).write_bytes(b'{"format_version": 1, "version": 5}')
    with pytest.raises(ManifestError, match="gc removes nothing"):
        gc(tmp_path, orphans=True)
    assert all((tmp_path / k).exists() for k in orphans)
    with pytest.raises(ValueError, match="orphans=True"):
        gc(tmp_path)


runner = CliRunner()


def test_cli_gc(tmp_path: Path) -> None:
    orphans = failed_publish(tmp_path)
    res = runner.invoke(app, ["gc", str(tmp_path)])
    assert res.exit_code == 2, res.output  # nothing to collect without --orphans
    res = runner.invoke(app, ["gc", str(tmp_path), "--orphans"])
    assert res.exit_code == 0, res.output
    assert "removed 0 orphans" in res.stdout and "kept" in res.stdout
    res = runner.invoke(app, ["gc", str(tmp_path), "--orphans", "--min-age", "0", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert all(f"would remove {k}" in res.stdout for k in orphans)
    assert all((tmp_path / k).exists() for k in orphans)
    res = runner.invoke(app, ["gc", str(tmp_path), "--orphans", "--min-age", "0", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert set(report["removed"]) == orphans and report["dry_run"] is False
    assert not any((tmp_path / k).exists() for k in orphans)
    (tmp_path / manifest_key(7)).write_bytes(b"{")
    res = runner.invoke(app, ["gc", str(tmp_path), "--orphans"])
    assert res.exit_code == 5, res.output  # a damaged manifest: nothing removed


if __name__ == "__main__":
    _child(sys.argv[1])
