"""The chain reader (``deltastore.catalog.chain.ChainReader``) and the chain-link rule
(``deltastore.format.chain``).

The reader is the one place that lists ``manifests/``: listing and version keys, the manifest
cache, the ``LATEST`` hint (lies, forks, the token cache), reading a whole store for verify and
gc, and planning a sync (the held state fits, or the plan recovers to the newest anchor). The
rule says whether a version fits a state of its parent: version, state digest, tensor table,
per-tensor parent Adler-32. Manifests are built by hand here (no tensor data is needed: the
reader reads manifests only), so each case names exactly what differs.
"""

from __future__ import annotations

import hashlib
import logging
import math
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from deltastore.catalog.chain import ChainReader, Damaged
from deltastore.errors import (
    ChainError,
    ManifestError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    WrongParentError,
)
from deltastore.format.chain import (
    PARENT_ADLER32,
    PARENT_DIGEST,
    PARENT_TABLE,
    PARENT_VERSION,
    State,
    link_misfits,
)
from deltastore.format.keys import LATEST_KEY, manifest_key
from deltastore.format.manifest import (
    Frame,
    Latest,
    Manifest,
    Parent,
    TensorEntry,
    Writer,
    state_digest,
)
from deltastore.format.signing import SignatureError, SigningKey, sign_manifest
from deltastore.maintenance import verify
from deltastore.store import LocalStore
from deltastore.testing.faults import FaultyStore

#: name -> (dtype, shape, adler32, parent_adler32)
Spec = dict[str, tuple[str, list[int], int, int | None]]

BASE: Spec = {"w": ("float32", [2, 3], 11, None), "b": ("bfloat16", [4], 22, None)}


def make(
    version: int,
    kind: str,
    parent: Manifest | Parent | None,
    spec: Mapping[str, tuple[str, list[int], int, int | None]],
) -> Manifest:
    """A valid manifest of ``spec``: one raw frame per tensor (its data is never read)."""
    entries = {}
    for name, (dtype, shape, adler, parent_adler) in spec.items():
        n = math.prod(shape)
        frame = Frame(
            start=0,
            stop=n,
            codec="raw",
            object=f"versions/{version:020d}/data",
            offset=0,
            length=4 * n,
            xxh3="0" * 16,
            changed=n,
            adler32=adler,
            parent_adler32=parent_adler,
        )
        entries[name] = TensorEntry(
            dtype=dtype,
            shape=shape,
            adler32=adler,
            parent_adler32=parent_adler,
            changed=n,
            frames=[frame],
        )
    if isinstance(parent, Manifest):
        parent = Parent(version=parent.version, state_digest=parent.state_digest)
    return Manifest(
        format_version=1,
        version=version,
        kind=kind,  # type: ignore[arg-type]
        parent=parent,
        state_digest=state_digest((n, e.dtype, e.shape, e.adler32) for n, e in entries.items()),
        created="2024-05-01T12:00:00Z",
        writer=Writer(token="0" * 32, library="test"),
        tensors=entries,
    )


def step(parent: Manifest, version: int, bump: int = 1, kind: str = "delta") -> Manifest:
    """The next version of ``parent``'s tensors, every Adler-32 moved by ``bump``."""
    spec = {
        n: (e.dtype, list(e.shape), e.adler32 + bump, e.adler32) for n, e in parent.tensors.items()
    }
    return make(version, kind, parent, spec)


def put(store: LocalStore, *manifests: Manifest) -> None:
    for m in manifests:
        store.put(manifest_key(m.version), m.to_bytes())


def put_latest(store: LocalStore, version: int, sha256: str | None = None) -> None:
    body = store.get(manifest_key(version))
    hint = Latest(
        format_version=1,
        version=version,
        manifest=manifest_key(version),
        sha256=sha256 or hashlib.sha256(body).hexdigest(),
    )
    store.put(LATEST_KEY, hint.model_dump_json().encode())


@pytest.fixture
def v1() -> Manifest:
    return make(1, "anchor", None, BASE)


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def names(store: FaultyStore) -> list[str]:
    return [op.name for op in store.ops]


# --- the chain-link rule ----------------------------------------------------------------------


def test_a_delta_fits_the_state_of_its_parent(v1: Manifest) -> None:
    v2 = step(v1, 2)
    assert State.of(v1).misfits(v2) == [] and State.of(v1).fits(v2)
    held = State(1, v1.state_digest, {"w": 11, "b": 22})  # a receiver's state: no table
    assert held.fits(v2)


def test_another_parent_version_is_the_only_misfit_reported(v1: Manifest) -> None:
    v2, v3 = step(v1, 2), step(step(v1, 2), 3)
    misfits = State.of(v1).misfits(v3)
    assert [x.kind for x in misfits] == [PARENT_VERSION]
    assert misfits[0].message == "names parent 2, not version 1"
    assert State.of(v2).fits(v3)
    assert [x.kind for x in State.of(v1).misfits(v1)] == [PARENT_VERSION]  # no parent


def test_another_state_digest(v1: Manifest) -> None:
    forged = Parent(version=1, state_digest="ab" * 32)
    v2 = make(2, "delta", forged, {n: (d, s, a + 1, a) for n, (d, s, a, _) in BASE.items()})
    misfits = State.of(v1).misfits(v2)
    assert [x.kind for x in misfits] == [PARENT_DIGEST]
    assert misfits[0].message == (
        f"names parent 1 with state digest {'ab' * 8}…, the parent's is {v1.state_digest[:16]}…"
    )


def test_a_delta_with_another_table_does_not_fit_and_adler32_is_not_compared(
    v1: Manifest,
) -> None:
    spec: Spec = {"w": ("float32", [3, 2], 12, 999), "b": ("bfloat16", [4], 23, 22)}
    spec["new"] = ("int8", [1], 1, 1)
    v2 = make(2, "delta", v1, spec)
    misfits = State.of(v1).misfits(v2)
    assert [(x.kind, x.tensors) for x in misfits] == [(PARENT_TABLE, ("new",))]
    assert misfits[0].message == "names other tensors, dtypes or shapes than its parent 1"
    del spec["new"]  # names equal: the reshaped tensor is named
    assert [x.tensors for x in State.of(v1).misfits(make(2, "delta", v1, spec))] == [("w",)]
    # an anchor may change the table: nothing to report, and its Adler-32 are not compared
    assert State.of(v1).misfits(make(2, "anchor", v1, spec)) == []
    # a receiver's state without a table: tensors it does not hold are not compared
    held = State(1, v1.state_digest, {"b": 22})
    assert held.fits(make(2, "delta", v1, spec))


def test_a_wrong_parent_adler32_names_the_tensor(v1: Manifest) -> None:
    spec: Spec = {"w": ("float32", [2, 3], 12, 11), "b": ("bfloat16", [4], 23, 0xABC)}
    misfits = State.of(v1).misfits(make(2, "delta", v1, spec))
    assert [(x.kind, x.tensors) for x in misfits] == [(PARENT_ADLER32, ("b",))]
    assert misfits[0].message == "parent_adler32 00000abc, the parent 1 says 00000016"
    # an anchor's null parent_adler32 is not compared; a set one is (verify reports it)
    spec["w"] = ("float32", [2, 3], 12, None)
    anchor = make(2, "anchor", v1, {"w": spec["w"]} | {"b": ("bfloat16", [4], 23, None)})
    assert State.of(v1).misfits(anchor) == []
    assert [x.tensors for x in State.of(v1).misfits(make(2, "anchor", v1, spec))] == [("b",)]


def test_link_misfits_of_a_version_not_yet_built(v1: Manifest) -> None:
    """The sharded commit checks entries before a manifest exists: a delta tensor without a
    parent Adler-32 does not fit."""
    v2 = step(v1, 2)
    parent = Parent(version=1, state_digest=v1.state_digest)
    entries = dict(v2.tensors)
    assert link_misfits(State.of(v1), kind="delta", parent=parent, tensors=entries) == []
    entries["b"] = entries["b"].model_copy(update={"parent_adler32": None})
    misfits = link_misfits(State.of(v1), kind="delta", parent=parent, tensors=entries)
    assert [(x.kind, x.tensors) for x in misfits] == [(PARENT_ADLER32, ("b",))]
    assert "parent_adler32 null" in misfits[0].message


def test_verify_reports_misfits_under_the_rules_kinds() -> None:
    assert (verify.PARENT_DIGEST, verify.PARENT_TABLE, verify.PARENT_ADLER32) == (
        PARENT_DIGEST,
        PARENT_TABLE,
        PARENT_ADLER32,
    )


# --- listing and manifests --------------------------------------------------------------------


def test_versions_are_the_manifest_keys_only(store: LocalStore, v1: Manifest) -> None:
    reader = ChainReader(store)
    assert reader.versions() == [] and reader.newest() is None and reader.latest() is None
    v2 = step(v1, 2)
    put(store, v1, v2, step(v2, 10))
    store.put("manifests/schema/manifest.v1.schema.json", b"{}")  # not versions
    store.put("manifests/00000000000000000003.json.bak", b"{}")
    store.put(f"manifests/{2**63:020d}.json", b"{}")  # over MAX_VERSION
    assert reader.versions() == [1, 2, 10]
    assert reader.versions_after(1) == [2, 10] and reader.versions_after(10) == []
    assert reader.newest() == 10


def test_manifests_are_cached_and_forgotten(store: LocalStore, v1: Manifest) -> None:
    v2 = step(v1, 2)
    v3 = step(v2, 3)
    put(store, v1, v2, v3)
    counted = FaultyStore(store)
    reader = ChainReader(counted, cache=2)
    assert reader.manifest(1) == v1 and reader.manifest(1) == v1
    assert names(counted) == ["get"]
    reader.manifest(2)
    reader.manifest(3)  # the oldest read (1) leaves the cache
    counted.reset()
    assert reader.manifest(3) == v3 and reader.manifest(2) == v2 and names(counted) == []
    reader.manifest(1)
    assert names(counted) == ["get"]
    reader.forget(1)
    reader.manifest(1)
    reader.forget(None)
    reader.manifest(3)
    assert names(counted) == ["get"] * 3
    with pytest.raises(ValueError, match="cache"):
        ChainReader(store, cache=-1)


def test_a_manifest_is_checked_before_it_is_used(store: LocalStore, v1: Manifest) -> None:
    reader = ChainReader(store)
    with pytest.raises(ManifestNotFoundError, match="version 1 is not committed in store"):
        reader.manifest(1)
    store.put(manifest_key(1), make(7, "anchor", None, BASE).to_bytes())
    with pytest.raises(ManifestError, match=r"00000000000000000001\.json claims version 7"):
        reader.manifest(1)
    store.put(manifest_key(2), b'{"format_version": 1')
    with pytest.raises(ManifestError, match="not valid JSON"):
        reader.manifest(2)
    key = SigningKey("k1", b"s" * 16)
    put(store, v1)
    with pytest.raises(SignatureError, match="not signed"):
        ChainReader(store, keys=[key]).manifest(1)
    put(store, sign_manifest(v1, key))
    assert ChainReader(store, keys=[key]).manifest(1).signature is not None
    assert ChainReader(store).manifest(1).signature is not None  # no keys: not checked


# --- LATEST ------------------------------------------------------------------------------------


@pytest.mark.parametrize("consistent", [True, False], ids=["object-store", "folder"])
def test_latest_reads_the_hint_once_then_polls_with_one_listing(
    store: LocalStore, v1: Manifest, consistent: bool
) -> None:
    v2 = step(v1, 2)
    put(store, v1, v2)
    put_latest(store, 2)
    counted = FaultyStore(store)
    counted.consistent_listing = consistent  # an object store's listings never lag
    reader = ChainReader(counted)
    assert reader.latest() == 2
    assert names(counted) == ["get", "get", "list_after"]  # LATEST, v2, listed after it
    assert [op.key for op in counted.ops[:2]] == [LATEST_KEY, manifest_key(2)]
    counted.reset()
    assert reader.manifest(2) == v2 and names(counted) == []  # read with the hint: cached
    assert reader.latest() == 2
    # a poll: one listing after the newest seen; where listings may lag (NFS), LATEST too
    # (its manifest only when LATEST changed)
    assert names(counted) == (["list_after"] if consistent else ["get", "list_after"])
    put(store, step(v2, 3))  # committed, LATEST not advanced (it is only a hint)
    assert reader.latest() == 3
    put(store, step(step(v2, 3), 4))
    put_latest(store, 4)
    counted.reset()
    assert reader.latest() == 4
    assert names(counted) == (["list_after"] if consistent else ["get", "get", "list_after"])
    counted.reset()
    noted = ChainReader(counted)
    noted.note(4)  # a reader handed tensors at version 4 lists only after it
    assert noted.latest() == 4
    assert names(counted) == (["list_after"] if consistent else ["get", "get", "list_after"])


def test_a_hint_that_lies_is_ignored(store: LocalStore, v1: Manifest) -> None:
    v2 = step(v1, 2)
    put(store, v1, v2)
    put_latest(store, 1)  # behind: the listing after it finds 2
    assert ChainReader(store).latest() == 2
    store.put(LATEST_KEY, b"not json")
    assert ChainReader(store).latest() == 2
    store.put(manifest_key(5), b"{")  # damaged, named with its own SHA-256
    put_latest(store, 5)
    reader = ChainReader(store)
    assert reader.latest() == 5  # listed: committed, though it cannot be read
    with pytest.raises(ManifestError):
        reader.manifest(5)


def test_a_hint_naming_another_sha256_warns_of_a_fork_once(
    store: LocalStore, v1: Manifest, caplog: pytest.LogCaptureFixture
) -> None:
    v2 = step(v1, 2)
    put(store, v1, v2)
    put_latest(store, 2, sha256="f" * 64)
    reader = ChainReader(store)
    with caplog.at_level(logging.WARNING, logger="deltastore"):
        assert reader.latest() == 2 and reader.latest() == 2  # found by listing
    forks = [r for r in caplog.records if "possible fork: two publishers" in r.getMessage()]
    assert len(forks) == 1 and "version 2 of store" in forks[0].getMessage()


# --- reading a whole store (verify, gc) ---------------------------------------------------------


def no_damage(damaged: Damaged) -> None:
    pytest.fail(f"reported as damaged: {damaged}")


class PhantomStore(LocalStore):
    """Lists a manifest that is gone when read."""

    def list(self, prefix: str = "") -> list[str]:
        return sorted([*super().list(prefix), manifest_key(4)])


def test_read_all_reports_each_damaged_manifest(tmp_path: Path, v1: Manifest) -> None:
    store = PhantomStore(tmp_path / "s")
    v2 = step(v1, 2)
    put(store, v1, v2)
    store.put(manifest_key(3), b"[]")
    store.put(manifest_key(5), make(6, "anchor", None, BASE).to_bytes())
    found: list[Damaged] = []
    chain = ChainReader(store).read_all(found.append)
    assert chain.listed == {1, 2, 3, 4, 5} and set(chain.manifests) == {1, 2}
    assert chain.manifests[2] == v2
    assert chain.sha256[1] == hashlib.sha256(store.get(manifest_key(1))).hexdigest()
    assert [(d.version, d.key) for d in found] == [(v, manifest_key(v)) for v in (3, 4, 5)]
    assert "a manifest is a JSON object" in found[0].message
    assert isinstance(found[0].error, ManifestError)
    assert found[1].message == "listed, but gone when read"
    assert isinstance(found[1].error, ObjectNotFoundError)
    assert found[2].message == "claims version 6"
    assert "claims version 6; the store is damaged" in str(found[2].error)


def test_read_all_skips_versions_and_stops_when_told(store: LocalStore, v1: Manifest) -> None:
    v2 = step(v1, 2)
    put(store, v1, v2)
    counted = FaultyStore(store)
    chain = ChainReader(counted).read_all(no_damage, skip={1})
    assert chain.listed == {1, 2} and set(chain.manifests) == {2}
    assert names(counted) == ["list", "get", "list"]  # the manifests, one, the anchor copies
    store.put(manifest_key(1), b"{")

    def refuse(d: Damaged) -> None:
        raise d.error

    with pytest.raises(ManifestError):
        ChainReader(store).read_all(refuse)


def test_check_latest(store: LocalStore, v1: Manifest) -> None:
    put(store, v1, step(v1, 2))
    reader = ChainReader(store)
    assert reader.check_latest(reader.read_all(no_damage)) is None  # none: only a hint
    put_latest(store, 2)
    assert reader.check_latest(reader.read_all(no_damage)) is None
    put_latest(store, 2, sha256="e" * 64)
    bad = reader.check_latest(reader.read_all(no_damage))
    assert bad is not None and (bad.version, bad.key) == (2, LATEST_KEY)
    assert "another SHA-256 than its manifest's (possible fork" in bad.message
    store.put(manifest_key(9), b"{")
    put_latest(store, 9)
    bad = reader.check_latest(reader.read_all(lambda d: None))
    assert bad is not None and bad.message == f"names {manifest_key(9)}, not a good manifest"
    store.put(LATEST_KEY, b"[]")
    bad = reader.check_latest(reader.read_all(lambda d: None))
    assert bad is not None and bad.version is None and "LATEST is malformed" in bad.message


# --- planning ----------------------------------------------------------------------------------


@pytest.fixture
def chain(store: LocalStore, v1: Manifest) -> list[Manifest]:
    """1 anchor, 2-3 deltas, 4 an anchor on 3, 5 a delta on 4."""
    v2 = step(v1, 2)
    v3 = step(v2, 3)
    v4 = step(v3, 4, kind="anchor")
    v5 = step(v4, 5)
    put(store, v1, v2, v3, v4, v5)
    return [v1, v2, v3, v4, v5]


def held(m: Manifest) -> State:
    """A receiver's state at ``m`` (receivers do not keep the table)."""
    return State(m.version, m.state_digest, {n: e.adler32 for n, e in m.tensors.items()})


def versions(plan_steps: tuple[Manifest, ...]) -> list[int]:
    return [m.version for m in plan_steps]


def test_plan_from_the_held_state_or_the_newest_anchor(
    store: LocalStore, chain: list[Manifest]
) -> None:
    reader = ChainReader(store)
    plan = reader.plan(3, None)
    assert versions(plan.steps) == [1, 2, 3] and plan.why is None
    assert versions(reader.plan(3, held(chain[0])).steps) == [2, 3]
    assert versions(reader.plan(5, held(chain[0])).steps) == [4, 5]  # an anchor is met first
    assert reader.plan(3, held(chain[2])).steps == ()
    with pytest.raises(ManifestNotFoundError):
        reader.plan(6, None)


def test_a_held_state_off_the_chain_recovers_from_the_newest_anchor(
    store: LocalStore, chain: list[Manifest]
) -> None:
    reader = ChainReader(store)
    other = State(2, "cd" * 32, {"w": 1, "b": 2})  # version 2, another state
    plan = reader.plan(3, other)
    assert versions(plan.steps) == [1, 2, 3]
    assert plan.why == "version 3 is a delta on another state of version 2 than the held version 2"
    plan = reader.plan(2, other)
    assert versions(plan.steps) == [1, 2]
    assert plan.why == "version 2 in the store is another state than the held version 2"
    put(store, step(chain[0], 6))  # 6: a delta on 1, skipping 2 (held) and 3
    plan = reader.plan(6, held(chain[1]))
    assert versions(plan.steps) == [1, 6]
    assert plan.why == "version 6 descends from 1, not from the held version 2"


def test_no_reachable_anchor_fails_and_describes_the_chain(
    store: LocalStore, chain: list[Manifest]
) -> None:
    store.delete(manifest_key(2))
    with pytest.raises(
        ChainError, match=r"version 2, parent of 3, is missing\): publish an anchor"
    ):
        ChainReader(store).plan(3, None)
    put(store, step(chain[0], 2, bump=7))  # 3 names another state of 2
    with pytest.raises(WrongParentError, match="version 3 is a delta on a state of version 2"):
        ChainReader(store).plan(3, None)


def test_a_stale_cached_parent_is_read_again(store: LocalStore, chain: list[Manifest]) -> None:
    """After a publisher race the store's manifest of a version may change: the planner
    drops the cached one when a child names another state, and reads it again."""
    reader = ChainReader(store)
    assert reader.manifest(2) == chain[1]  # cached
    v2b = step(chain[0], 2, bump=5)
    put(store, v2b, step(v2b, 3))
    plan = reader.plan(3, None)
    assert versions(plan.steps) == [1, 2, 3] and plan.steps[1] == v2b


# --- users of the reader -------------------------------------------------------------------------


def test_the_reader_and_the_rule_import_no_torch() -> None:
    code = (
        "import sys, deltastore.catalog.chain, deltastore.format.chain, "
        "deltastore.maintenance.history; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sharded_commit_checks_the_parent_with_the_rule(
    store: LocalStore, chain: list[Manifest]
) -> None:
    from deltastore.publish.parts import _check_parent

    head = chain[4]
    parent = Parent(version=5, state_digest=head.state_digest)
    ok = step(head, 6)
    _check_parent(store, 6, parent, ok.tensors)
    with pytest.raises(ChainError, match="the store's newest version is 5"):
        _check_parent(store, 6, Parent(version=4, state_digest=chain[3].state_digest), ok.tensors)
    with pytest.raises(WrongParentError, match="the writers hold another version 5"):
        _check_parent(store, 6, Parent(version=5, state_digest="0" * 64), ok.tensors)
    fewer = {"w": ok.tensors["w"]}
    with pytest.raises(ManifestError, match=r"1 differ \(b\)"):
        _check_parent(store, 6, parent, fewer)
    stale = dict(ok.tensors)
    stale["w"] = stale["w"].model_copy(update={"parent_adler32": 1})
    with pytest.raises(WrongParentError, match=r"slices of 1 tensors \(w\)"):
        _check_parent(store, 6, parent, stale)
