"""Readers and anchor copies as the spec states them (format v1, sections 3.2, 4.3, 9.4, 10.1,
11.1, 12), and the local store's delete path.

- A usable anchor copy whose frames fail (a missing data object, an XXH3-64 or Adler-32
  mismatch) is not fatal while the chain exists: the reader falls back to it (section 9.4).
- A copy is usable only beside a good manifest of its version; a damaged manifest below a
  usable copy does not stop a reader that starts from the copy (section 10.1).
- A copy has no ``parent``; its ``writer`` and ``created`` are its own (section 9.4).
- The key grammars and limits of sections 3.2 and 12 are the code's.
- Retention makes anchor copies mandatory for readers of a pruned store (section 4.3).
- ``gc`` leaves no empty folder in a local store, and a publish during a gc commits.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltastore import LocalStore, Publisher, Subscriber
from deltastore.catalog.chain import ChainReader
from deltastore.errors import ChainError, IntegrityError, ManifestError, ObjectNotFoundError
from deltastore.format import keys, lease
from deltastore.format.chain import State
from deltastore.format.keys import anchor_key, data_prefix, manifest_key
from deltastore.format.manifest import Parent, parse_manifest
from deltastore.maintenance.retention import DEFAULT_LEASE_GRACE_S, retain
from deltastore.maintenance.verify import CHAIN, MANIFEST, XXH3, verify_checkout, verify_store
from deltastore.store import local as local_store
from deltastore_cli import app

SPEC = Path(__file__).resolve().parents[1] / "docs" / "spec" / "format-v1.md"
Tensors = Mapping[str, torch.Tensor]


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(300, generator=g).to(torch.bfloat16),
    }


def step(w: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A few elements of every tensor change."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for n, t in w.items():
        flat = t.clone().reshape(-1)
        idx = torch.randint(0, flat.numel(), (8,), generator=g)
        flat[idx] = torch.randn(8, generator=g).to(t.dtype)
        out[n] = flat.reshape(t.shape)
    return out


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.int16).numpy()


def assert_bit_exact(expected: Tensors, got: Tensors | None) -> None:
    assert got is not None and set(got) == set(expected)
    for n, t in expected.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert np.array_equal(bits(got[n]), bits(t)), n


def publish(root: Path, n: int, policy: str = "every:2") -> tuple[LocalStore, list[dict]]:
    """Versions 1..n (1 an anchor, the rest deltas; anchor copies by ``policy``)."""
    store = LocalStore(root)
    pub = Publisher(store, anchor_policy=policy)
    w = weights(0)
    states = []
    for v in range(1, n + 1):
        if v > 1:
            w = step(w, v)
        pub.publish(w, version=v)
        states.append({k: t.clone() for k, t in w.items()})
    return store, states


def copies(root: Path) -> list[int]:
    return sorted(int(p.stem) for p in (root / "anchors").glob("*.json"))


def copy_objects(root: Path, v: int) -> list[Path]:
    c = json.loads((root / anchor_key(v)).read_text())
    objs = {f["object"] for e in c["tensors"].values() for f in e["frames"]}
    return [root / o for o in sorted(objs)]


def flip_byte(path: Path, at: int = 20) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def break_frame_adler(root: Path, v: int) -> None:
    """Give one frame of the copy of ``v`` a wrong Adler-32 (the copy still parses and
    validates: frame checksums are checked while applying, section 10.2)."""
    path = root / anchor_key(v)
    c = json.loads(path.read_text())
    f = next(iter(c["tensors"].values()))["frames"][0]
    f["adler32"] = (f["adler32"] + 1) % (1 << 32)
    path.write_text(json.dumps(c, indent=1) + "\n")
    parse_manifest(path.read_bytes(), key=anchor_key(v))  # still a valid manifest


DAMAGE = {
    "missing-object": lambda root, v: [p.unlink() for p in copy_objects(root, v)],
    "xxh3": lambda root, v: flip_byte(copy_objects(root, v)[0]),
    "adler32": break_frame_adler,
}


# --- point: a failed copy falls back to the chain (sections 9.4, 10.1) ---------------------


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_failed_anchor_copy_falls_back_to_the_chain(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    store, states = publish(root, 4)
    assert copies(root) == [3]  # every:2: a copy at version 3, the anchor at 1
    DAMAGE[damage](root, 3)
    sub = Subscriber(store, lease_ttl=None)
    with caplog.at_level(logging.WARNING):
        report = sub.sync()
    assert report.version == 4 and report.applied == (1, 2, 3, 4)  # from the anchor version
    assert_bit_exact(states[-1], sub.tensors)
    assert any(anchor_key(3) in r.getMessage() for r in caplog.records), caplog.text
    # the copy is not tried again by this reader: the next sync of a newer version goes on
    assert ChainReader(store).plan(4, None).copy == 3  # a fresh reader would still try it
    assert sub.sync().kind == "none"


def test_a_failed_copy_falls_back_for_a_folder_pull(tmp_path: Path) -> None:
    root = tmp_path / "store"
    publish(root, 4)
    flip_byte(copy_objects(root, 3)[0])
    dest = tmp_path / "ckpt"
    result = CliRunner().invoke(app, ["pull", str(root), str(dest)])
    assert result.exit_code == 0, result.output
    report = verify_checkout(dest, root)
    assert report.ok and report.versions == (4,), report.problems


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        ("missing-object", ObjectNotFoundError),
        ("xxh3", IntegrityError),
        ("adler32", IntegrityError),
    ],
)
def test_a_failed_copy_with_no_chain_raises_and_writes_nothing(
    tmp_path: Path, damage: str, error: type[Exception]
) -> None:
    """Held 1, versions 1 and 2 pruned: the copy of 3 is the only path, and its frames are
    checked before anything is written (staged against the held tensors)."""
    root = tmp_path / "store"
    store, _ = publish(root, 4)
    held = Subscriber(store, lease_ttl=None)
    held.sync(1)
    before = {n: t.clone() for n, t in (held.tensors or {}).items()}
    for v in (1, 2):  # pruned as retention does: only the copy of 3 leads on
        (root / manifest_key(v)).unlink()
    DAMAGE[damage](root, 3)
    with pytest.raises(error):
        held.sync(4)
    assert held.version == 1
    assert_bit_exact(before, held.tensors)


def test_a_held_reader_whose_copy_fails_applies_the_deltas_from_its_version(
    tmp_path: Path,
) -> None:
    """Every element changes per version, so the copy of 3 and the delta 4 cost less than the
    deltas 2-4: the plan from version 1 takes the copy; its frames fail; the deltas follow."""
    root = tmp_path / "store"
    store = LocalStore(root)
    pub = Publisher(store, anchor_policy="every:2")
    states = [weights(v) for v in range(1, 5)]
    for v, w in enumerate(states, start=1):
        pub.publish(w, version=v)
    held = Subscriber(store, lease_ttl=None)
    held.sync(1)
    assert ChainReader(store).plan(4, State.of(held.manifest(1))).copy == 3
    break_frame_adler(root, 3)
    report = held.sync(4)
    assert report.path == "deltas" and report.applied == (2, 3, 4)
    assert_bit_exact(states[-1], held.tensors)


def test_verify_names_the_failed_anchor_copy(tmp_path: Path) -> None:
    root = tmp_path / "store"
    publish(root, 4)
    flip_byte(copy_objects(root, 3)[0])
    report = verify_store(root)
    bad = [p for p in report.problems if p.kind == XXH3]
    assert bad and all(anchor_key(3) in p.message for p in bad), report.problems


# --- point: a damaged manifest next to a usable copy (sections 9.4, 10.1) ------------------


def damage_manifest(root: Path, v: int) -> None:
    path = root / manifest_key(v)
    path.write_bytes(path.read_bytes()[:-40])  # cut short: no JSON


def test_a_damaged_manifest_makes_its_own_copy_unusable(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, _ = publish(root, 4)
    damage_manifest(root, 3)
    with pytest.raises(ManifestError, match=re.escape(manifest_key(3))):
        Subscriber(store, lease_ttl=None).sync()  # through version 3 only: fails
    with pytest.raises(ManifestError, match=re.escape(manifest_key(3))):
        Subscriber(store, lease_ttl=None).sync(3)  # the copy of 3 is not used either
    report = verify_store(root)
    assert {(p.kind, p.version) for p in report.problems} >= {(MANIFEST, 3), (CHAIN, 4)}


def test_a_damaged_manifest_below_a_usable_copy_is_not_crossed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    store, states = publish(root, 6)  # copies at 3 and 5
    assert copies(root) == [3, 5]
    held = Subscriber(store, lease_ttl=None)
    held.sync(2)
    damage_manifest(root, 4)  # between the held version and the copy of 5
    with caplog.at_level(logging.WARNING):
        report = held.sync()
    assert report.applied == (5, 6) and report.path == "anchor"
    assert_bit_exact(states[-1], held.tensors)
    assert any(manifest_key(4) in r.getMessage() for r in caplog.records), caplog.text
    found = verify_store(root, deep=True)
    kinds = {(p.kind, p.version) for p in found.problems}
    assert (MANIFEST, 4) in kinds and (CHAIN, 6) not in kinds, found.problems


# --- point: an anchor copy's parent, created and writer (section 9.4) ----------------------


def test_an_anchor_copy_has_no_parent_and_its_own_writer_and_time(tmp_path: Path) -> None:
    root = tmp_path / "store"
    publish(root, 3)
    m = parse_manifest((root / manifest_key(3)).read_bytes())
    c = parse_manifest((root / anchor_key(3)).read_bytes())
    assert m.kind == "delta" and m.parent is not None
    assert c.kind == "anchor" and c.version == 3 and c.parent is None
    assert c.state_digest == m.state_digest
    assert all(e.parent_adler32 is None and e.changed == e.numel for e in c.tensors.values())
    assert c.writer == m.writer  # the writer that committed 3 wrote the copy
    assert c.created >= m.created  # written after the commit (same clock)
    pattern = re.compile(keys.ANCHOR_OBJECT_PATTERN)
    prefix = f"{data_prefix(3)}{c.writer.token[:12]}-anchor-"
    for o in c.objects:
        assert pattern.fullmatch(o) and o.startswith(prefix), o


def test_a_copy_with_a_parent_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "store"
    store, states = publish(root, 4)
    path = root / anchor_key(3)
    c = parse_manifest(path.read_bytes())
    m = parse_manifest((root / manifest_key(3)).read_bytes())
    assert m.parent is not None
    with_parent = c.model_copy(
        update={"parent": Parent(version=2, state_digest=m.parent.state_digest)}
    )
    path.write_bytes(with_parent.to_bytes())
    parse_manifest(path.read_bytes(), key=anchor_key(3))  # a valid anchor manifest
    with caplog.at_level(logging.WARNING):
        plan = ChainReader(store).plan(4, None)
    assert plan.copy is None and [s.version for s in plan.steps] == [1, 2, 3, 4]
    assert "has a parent" in caplog.text
    sub = Subscriber(store, lease_ttl=None)
    assert sub.sync().applied == (1, 2, 3, 4)
    assert_bit_exact(states[-1], sub.tensors)
    found = verify_store(root)
    assert [(p.kind, p.version, p.key) for p in found.problems] == [(MANIFEST, 3, anchor_key(3))], (
        found.problems
    )
    assert "has a parent" in found.problems[0].message


def test_a_copy_written_at_another_time_by_another_writer_is_used(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, states = publish(root, 4)
    path = root / anchor_key(3)
    c = parse_manifest(path.read_bytes())
    other = c.model_copy(
        update={
            "created": "2031-01-02T03:04:05Z",
            "writer": c.writer.model_copy(update={"token": "f" * 32, "library": "other 9"}),
        }
    )
    path.write_bytes(other.to_bytes())
    sub = Subscriber(store, lease_ttl=None)
    assert sub.sync().applied == (3, 4)
    assert_bit_exact(states[-1], sub.tensors)


# --- point: key grammars and limits (sections 3.2, 11.1, 12) -------------------------------


def spec_section(number: str) -> str:
    text = SPEC.read_text()
    start = text.index(f"\n## {number}. ")
    return text[start : text.index("\n## ", start + 1)]


def test_the_spec_states_the_key_grammars_and_limits_the_code_uses() -> None:
    limits = spec_section("12")
    grammars = dict(re.findall(r"^([A-Z_]+_PATTERN) += (\S+)$", limits, re.M))
    assert set(grammars) == {
        "MANIFEST_KEY_PATTERN",
        "ANCHOR_KEY_PATTERN",
        "READER_ID_PATTERN",
        "LEASE_KEY_PATTERN",
        "DATA_OBJECT_PATTERN",
        "ANCHOR_OBJECT_PATTERN",
    }
    for name, pattern in grammars.items():
        assert getattr(keys, name) == pattern, name
    rows = {m[0]: m[1] for m in re.findall(r"^\| `?([^|`]+?)`? \| ([^|]+?) \|", limits, re.M)}
    assert rows["MAX_LEASE_BYTES"] == str(lease.MAX_LEASE_BYTES)
    grace = re.match(r"(\d+) seconds", rows["LEASE_GRACE_S"])
    assert grace and float(grace.group(1)) == lease.LEASE_GRACE_S == DEFAULT_LEASE_GRACE_S
    assert "1..250 characters" in rows["reader id"]
    assert "`-anchor-`" in spec_section("3") or "-anchor-<seq:06d>.dsz" in spec_section("3")
    assert f"`LEASE_GRACE_S` = {int(lease.LEASE_GRACE_S)} seconds" in spec_section("11")


@pytest.mark.parametrize(
    ("key", "anchor", "reader"),
    [
        ("anchors/00000000000000000042.json", 42, None),
        ("anchors/09223372036854775808.json", None, None),  # above MAX_VERSION: not a copy
        ("anchors/42.json", None, None),
        ("anchors/00000000000000000042.json\n", None, None),
        ("leases/trainer-0.json", None, "trainer-0"),
        ("leases/" + "r" * 250 + ".json", None, "r" * 250),
        ("leases/" + "r" * 251 + ".json", None, None),
        ("leases/.hidden.json", None, None),
        ("leases/a/b.json", None, None),
    ],
)
def test_key_functions_follow_the_spec_grammars(
    key: str, anchor: int | None, reader: str | None
) -> None:
    assert keys.version_of_anchor_key(key) == anchor
    assert keys.reader_of_lease_key(key) == reader
    digits = re.fullmatch(keys.ANCHOR_KEY_PATTERN, key)
    assert (anchor is not None) == bool(digits and int(key[8:28]) <= keys.MAX_VERSION)
    assert (reader is not None) == bool(re.fullmatch(keys.LEASE_KEY_PATTERN, key))
    if reader is not None:
        assert keys.lease_key(reader) == key and len(key) <= 262


def test_written_objects_match_the_spec_names(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, _ = publish(root, 3)
    sub = Subscriber(store, reader_id="r1")
    sub.sync()
    listed = store.list()
    objects = [k for k in listed if k.startswith("versions/")]
    assert any(re.fullmatch(keys.ANCHOR_OBJECT_PATTERN, k) for k in objects)
    for k in objects:
        one = bool(re.fullmatch(keys.DATA_OBJECT_PATTERN, k))
        assert one != bool(re.fullmatch(keys.ANCHOR_OBJECT_PATTERN, k)), k  # exactly one
    assert [k for k in listed if k.startswith("anchors/")] == [anchor_key(3)]
    assert re.fullmatch(keys.ANCHOR_KEY_PATTERN, anchor_key(3))
    assert re.fullmatch(keys.LEASE_KEY_PATTERN, keys.lease_key("r1")) and "leases/r1.json" in listed


# --- point: retention makes anchor copies mandatory (section 4.3) --------------------------


def test_a_pruned_store_is_read_through_its_anchor_copy_only(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, states = publish(root, 8, policy="every:3")
    assert copies(root) == [4, 7]
    report = retain(store, 2)
    assert report.kept == (7, 8) and copies(root) == [7]
    sub = Subscriber(store, lease_ttl=None)
    got = sub.sync()
    assert got.applied == (7, 8) and got.path == "anchor"
    assert_bit_exact(states[-1], sub.tensors)
    with pytest.raises(ChainError):  # a reader that skips copies cannot read the pruned store
        ChainReader(store).plan(8, None, copies=set())
    assert "Retention makes anchor copies mandatory for readers" in spec_section("4")
    assert "MUST therefore read anchor copies" in spec_section("4")


# --- point: gc leaves no empty folder (section 2) ------------------------------------------


def empty_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_dir() and not any(p.iterdir()))


def test_gc_leaves_no_empty_folders(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, _ = publish(root, 8, policy="every:3")
    lease = Subscriber(store, reader_id="old", lease_ttl=0.001)
    lease.sync(8)
    result = CliRunner().invoke(app, ["gc", str(root), "--keep", "2", "--lease-grace", "0"])
    assert result.exit_code == 0, result.output
    assert sorted(int(p.name) for p in (root / "versions").iterdir()) == [7, 8]
    assert empty_folders(root) == []
    assert not (root / "leases").exists()  # its last (expired) lease removed: folder gone
    assert verify_store(root).ok


def test_a_writer_makes_its_folder_again_when_a_delete_removed_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of a delete that empties a folder with a writer that just made it: the
    writer's temp file create finds the folder gone, makes it again, and commits."""
    store = LocalStore(tmp_path / "store")
    real = open
    removed: list[Path] = []

    def racing_open(path: Path, mode: str = "r") -> object:
        folder = Path(path).parent
        if Path(path).name.startswith(".tmp-") and not removed:
            folder.rmdir()  # a delete emptied it and removed it, right after the writer's mkdir
            removed.append(folder)
        return real(path, mode)

    monkeypatch.setattr(local_store, "open", racing_open, raising=False)
    store.put_if_absent("versions/00000000000000000001/abc-000000.dsz", b"data")
    assert removed and store.get("versions/00000000000000000001/abc-000000.dsz") == b"data"


def test_publishes_commit_while_gc_deletes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store, anchor_policy="every:2")
    w = weights(0)
    pub.publish(w, version=1)
    errors: list[BaseException] = []
    done = threading.Event()

    def gc_loop() -> None:
        try:
            while not done.is_set():
                retain(LocalStore(store.root), 1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=gc_loop)
    thread.start()
    try:
        for v in range(2, 22):
            w = step(w, v)
            pub.publish(w, version=v)  # every publish commits
    finally:
        done.set()
        thread.join()
    assert errors == []
    retain(store, 1)
    assert empty_folders(store.root) == []
    assert ChainReader(store).versions()[-1] == 21
    sub = Subscriber(store, lease_ttl=None)
    sub.sync()
    assert_bit_exact(w, sub.tensors)
