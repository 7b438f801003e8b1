"""Checkpoint folders, memory-mapped safetensors, and the publisher's disk snapshot.

Library-level tests of ``deltastore.checkpoint.safetensors``, ``deltastore.checkpoint.folders`` and
``deltastore.publish.snapshot``: sharded creation, bit-exact reading of files written by safetensors
itself, copy-on-write read maps, a publisher that survives restarts through ``state_dir``,
failed pulls that leave the folder at its last recorded version, ``watch_checkpoint`` with a
stop event, and progress callbacks. Tensors are compared bit-wise through integer views.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltastore import Publisher, Subscriber
from deltastore.checkpoint.folders import (
    SIDECAR,
    FolderSync,
    publish_checkpoint,
    pull_checkpoint,
    read_state,
    watch_checkpoint,
)
from deltastore.checkpoint.safetensors import (
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointError,
    MappedCheckpoint,
    checkpoint_files,
    create_checkpoint,
    locate,
    read_header,
    table_of,
)
from deltastore.errors import DeltastoreError, IntegrityError, ObjectNotFoundError
from deltastore.format.manifest import manifest_key, parse_manifest
from deltastore.progress import Progress
from deltastore.tensors.dtypes import DTYPES
from deltastore.testing.synthetic import TINY, AdamWTrajectory

Tensors = dict[str, torch.Tensor]
WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# --- helpers ------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(WORD[t.element_size()]).numpy()


def assert_bit_exact(expected: Tensors, got: Any) -> None:
    assert got is not None
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype, name
        assert tuple(got[name].shape) == tuple(t.shape), name
        assert np.array_equal(bits(got[name]), bits(t)), name


def load_folder(folder: Path) -> Tensors:
    out: Tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def tree(path: Path) -> dict[str, str]:
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def damage(store: Path, version: int) -> None:
    """Flip one byte in the middle of the version's first data object."""
    objs = sorted((store / "versions" / f"{version:020d}").glob("*.dsz"))
    assert objs, version
    flip_byte(objs[0], objs[0].stat().st_size // 2)


def adler_of(store: Path, version: int) -> dict[str, int]:
    m = parse_manifest((store / manifest_key(version)).read_bytes())
    return {n: e.adler32 for n, e in m.tensors.items()}


def wait_until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.02)


def folder_version(dest: Path) -> int | None:
    try:
        state = read_state(dest)
    except CheckpointError:
        return None
    return state.version if state is not None else None


def mixed(seed: int) -> Tensors:
    """One tensor of each interesting dtype (plus a scalar and an empty tensor)."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(257, generator=g)
    out = {
        "bf16": (torch.randn(33, 17, generator=g) * 0.02).to(torch.bfloat16),
        "f32": torch.randn(5, 7, generator=g),
        "f16": torch.randn(129, generator=g).to(torch.float16),
        "f64": torch.randn(3, generator=g).to(torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (11,), generator=g, dtype=torch.int64),
        "i32": torch.randint(-(2**31), 2**31 - 1, (9,), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (6,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (10,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(23, generator=g) > 0.5,
        "f8_e4m3fn": f.to(torch.float8_e4m3fn),
        "f8_e5m2": f.to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
    }
    # special float bit patterns must survive untouched
    out["f32"].view(torch.int32)[0] = 0x7FC00001  # NaN with payload
    out["f32"][1, 0] = -0.0
    out["bf16"].view(torch.int16)[0, 0] = 0x0001  # subnormal
    return out


def tiny_states(n: int, seed: int = 11) -> list[Tensors]:
    traj = AdamWTrajectory(TINY, lr=1e-6, seed=seed)
    out = [traj.bf16()]
    for _ in range(n - 1):
        out.append(traj.step())
    return out


@pytest.fixture(scope="module")
def states() -> list[Tensors]:
    return tiny_states(4)


@pytest.fixture(scope="module")
def pristine(states: list[Tensors], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with v1 (anchor) .. v4 (deltas) of the tiny model; copy it before damaging."""
    store = tmp_path_factory.mktemp("pristine") / "store"
    pub = Publisher(store, max_frame_bytes=512 << 10, max_object_bytes=4 << 20)
    kinds = [pub.publish(s, version=v).kind for v, s in enumerate(states, start=1)]
    assert kinds == ["anchor", "delta", "delta", "delta"]
    return store


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "store"))


# --- checkpoint.py ------------------------------------------------------------------------


TABLE = {
    "big": ("float32", (1000,)),
    "a": ("float32", (100,)),
    "b": ("bfloat16", (300,)),
    "c": ("int64", (10,)),
    "d": ("bool", (7,)),
    "e": ("float8_e4m3fn", (13,)),
    "f": ("uint8", (5,)),
    "g": ("float16", (3, 3)),
    "s": ("float64", ()),
    "z": ("bfloat16", (0, 4)),
}


def test_create_checkpoint_shards_with_index(tmp_path: Path) -> None:
    locs = create_checkpoint(tmp_path / "ck", TABLE, max_shard_bytes=512)
    folder = tmp_path / "ck"
    index = json.loads((folder / INDEX_NAME).read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (folder / SINGLE_NAME).exists()
    assert set(index["weight_map"]) == set(TABLE)
    assert set(index["weight_map"].values()) == set(shards)
    nbytes = {k: math.prod(s) * DTYPES[d].itemsize for k, (d, s) in TABLE.items()}
    assert index["metadata"]["total_size"] == sum(nbytes.values())
    assert set(locs) == set(TABLE)
    for name, loc in locs.items():
        dtype, shape = TABLE[name]
        assert loc.path.name == index["weight_map"][name]
        assert (loc.dtype, loc.shape) == (dtype, shape)
        assert loc.stop - loc.start == nbytes[name]
        assert loc.start % DTYPES[dtype].itemsize == 0, name  # every tensor aligned
    # no shard exceeds the limit unless it holds a single tensor
    for shard in shards:
        members = [k for k, f in index["weight_map"].items() if f == shard]
        assert sum(nbytes[k] for k in members) <= 512 or len(members) == 1
    # safetensors reads every shard; everything is zero-filled
    loaded = load_folder(folder)
    assert set(loaded) == set(TABLE)
    for name, (dtype, shape) in TABLE.items():
        assert loaded[name].dtype == DTYPES[dtype] and tuple(loaded[name].shape) == shape
        assert not bits(loaded[name]).any()
    # the folder locates to the same tensors (through the index)
    assert locate(folder) == locs
    assert checkpoint_files(folder) == [folder / s for s in shards]


def test_create_checkpoint_single_file_and_writable_maps(tmp_path: Path) -> None:
    src = mixed(1)
    folder = tmp_path / "ck"
    locs = create_checkpoint(folder, table_of(src))
    assert sorted(p.name for p in folder.iterdir()) == [SINGLE_NAME]
    ck = MappedCheckpoint(locs, writable=True)
    for name, t in src.items():
        assert ck.tensors[name].dtype == t.dtype and ck.tensors[name].shape == t.shape
        ck.tensors[name].copy_(t)
    ck.flush()
    assert_bit_exact(src, load_file(folder / SINGLE_NAME))
    assert_bit_exact(src, MappedCheckpoint(locate(folder)).tensors)


def test_mapped_checkpoint_reads_safetensors_files_bit_exact(tmp_path: Path) -> None:
    src = mixed(2)
    path = tmp_path / "m.safetensors"
    save_file(src, path)
    locs = locate(path)
    assert {n: (loc.dtype, loc.shape) for n, loc in locs.items()} == table_of(src)
    ck = MappedCheckpoint(locs)
    assert_bit_exact(src, ck.tensors)
    # zero-copy: the tensors are views of one mapping of the file
    raw = path.read_bytes()
    for name, loc in locs.items():
        if loc.stop > loc.start:
            assert bits(ck.tensors[name]).tobytes() == raw[loc.start : loc.stop]
    # and the same through an HF folder with a single model.safetensors
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(src, folder / SINGLE_NAME)
    assert_bit_exact(src, MappedCheckpoint(locate(folder)).tensors)


def test_read_only_maps_never_change_the_file(tmp_path: Path) -> None:
    src = mixed(3)
    path = tmp_path / "m.safetensors"
    save_file(src, path)
    before = path.read_bytes()
    ck = MappedCheckpoint(locate(path))
    for t in ck.tensors.values():
        if t.numel():
            flat = t.view(-1).view(WORD[t.element_size()])
            flat.bitwise_not_()
    ck.flush()
    del ck
    assert path.read_bytes() == before
    assert_bit_exact(src, MappedCheckpoint(locate(path)).tensors)
    # a writable map does write through (the contrast)
    rw = MappedCheckpoint(locate(path), writable=True)
    rw.tensors["i64"][0] = 7
    rw.flush()
    assert load_file(path)["i64"][0].item() == 7


def test_bad_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        locate(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError):
        locate(empty)
    dup = tmp_path / "dup"
    dup.mkdir()
    save_file({"x": torch.zeros(2)}, dup / "a.safetensors")
    save_file({"x": torch.ones(2)}, dup / "b.safetensors")
    with pytest.raises(CheckpointError, match="both"):
        locate(dup)
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing"):
        locate(idx)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError):
        read_header(junk)


# --- Publisher(snapshot="disk") -----------------------------------------------------------


def test_disk_snapshot_publisher_survives_restarts(tmp_path: Path, states: list[Tensors]) -> None:
    store, sd = tmp_path / "store", tmp_path / "state"
    opts: dict[str, Any] = {"snapshot": "disk", "state_dir": sd, "max_frame_bytes": 256 << 10}
    pub = Publisher(store, **opts)
    assert pub.version is None
    assert pub.publish(states[0], version=1).kind == "anchor"
    assert (sd / "snapshot.bin").is_file()
    del pub
    for v in (2, 3, 4):  # a new process each time: no attach, no re-reading of the parent
        pub = Publisher(store, **opts)
        assert pub.version == v - 1
        report = pub.publish(states[v - 1], version=v)
        assert (report.kind, report.parent) == ("delta", v - 1)
        assert 0 < report.changed_elements < 0.05 * report.total_elements
        saved = json.loads((sd / "state.json").read_text())
        assert (saved["dirty"], saved["version"]) == (False, v)
        del pub
    sub = Subscriber(store)
    for v in (1, 2, 3, 4):
        sub.sync(v)
        assert_bit_exact(states[v - 1], sub.tensors)


def corrupt_state_json(sd: Path, how: str) -> None:
    path = sd / "state.json"
    meta = json.loads(path.read_text())
    if how == "dirty":
        meta["dirty"] = True
    elif how == "garbage":
        path.write_text("{not json")
        return
    elif how == "format":
        meta["format"] = 99
    elif how == "missing-key":
        del meta["tensors"]
    elif how == "digest":
        meta["state_digest"] = "0" * 64
    elif how == "version":
        meta["version"] = 9
    elif how == "truncated-snapshot":
        with open(sd / "snapshot.bin", "r+b") as fh:
            fh.truncate(100)
        return
    elif how == "no-snapshot":
        (sd / "snapshot.bin").unlink()
        return
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "how",
    [
        "dirty",
        "garbage",
        "format",
        "missing-key",
        "digest",
        "version",
        "truncated-snapshot",
        "no-snapshot",
    ],
)
def test_unusable_saved_state_is_ignored(tmp_path: Path, how: str) -> None:
    states = [mixed(10), mixed(11)]
    store, sd = tmp_path / "store", tmp_path / "state"
    Publisher(store, snapshot="disk", state_dir=sd).publish(states[0], version=1)
    corrupt_state_json(sd, how)
    pub = Publisher(store, snapshot="disk", state_dir=sd)
    assert pub.version is None
    report = pub.publish(states[1], version=2)
    assert (report.kind, report.parent) == ("anchor", None)
    sub = Subscriber(store)
    sub.sync(2)
    assert_bit_exact(states[1], sub.tensors)
    # the state is rewritten clean: the next restart continues with a delta
    again = Publisher(store, snapshot="disk", state_dir=sd)
    assert again.version == 2
    assert again.publish(states[0], version=3).kind == "delta"
    sub.sync(3)
    assert_bit_exact(states[0], sub.tensors)


def test_state_of_another_store_or_frame_size_is_ignored(tmp_path: Path) -> None:
    v1, v2 = mixed(20), mixed(21)
    sd = tmp_path / "state"
    Publisher(tmp_path / "a", snapshot="disk", state_dir=sd).publish(v1, version=1)
    other = Publisher(tmp_path / "b", snapshot="disk", state_dir=sd)
    assert other.version is None
    assert other.publish(v2, version=5).kind == "anchor"
    assert json.loads((sd / "state.json").read_text())["store"] == str((tmp_path / "b").absolute())
    # the state now belongs to b: a publisher of a starts from nothing
    assert Publisher(tmp_path / "a", snapshot="disk", state_dir=sd).version is None
    # another max_frame_bytes cannot reuse the per-frame checksums
    assert Publisher(tmp_path / "b", snapshot="disk", state_dir=sd).version == 5
    assert (
        Publisher(tmp_path / "b", snapshot="disk", state_dir=sd, max_frame_bytes=64).version is None
    )


def test_snapshot_mode_needs_state_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="state_dir"):
        Publisher(tmp_path, snapshot="disk")
    with pytest.raises(ValueError, match="state_dir"):
        Publisher(tmp_path, state_dir=tmp_path / "s")


def test_resumed_publisher_never_commits_a_delta_from_a_damaged_snapshot(
    tmp_path: Path,
) -> None:
    states = tiny_states(2, seed=5)
    store, sd = tmp_path / "store", tmp_path / "state"
    Publisher(store, snapshot="disk", state_dir=sd).publish(states[0], version=1)
    flip_byte(sd / "snapshot.bin", 1000)  # state.json stays clean
    pub = Publisher(store, snapshot="disk", state_dir=sd)
    try:
        pub.publish(states[1], version=2)
    except DeltastoreError:
        assert not (store / manifest_key(2)).exists()
        return
    sub = Subscriber(store)
    sub.sync(2)
    assert_bit_exact(states[1], sub.tensors)


# --- publish_checkpoint / pull_checkpoint -------------------------------------------------


def test_publish_and_pull_checkpoint_mixed_dtypes(tmp_path: Path) -> None:
    v1, v2 = mixed(30), mixed(30)
    v2["f32"][2, 3] += 1.0
    v2["i64"][4] ^= 1
    v2["bool"][0] = ~v2["bool"][0]
    v2["f8_e4m3fn"].view(torch.uint8)[5] ^= 0x01
    save_file(v1, tmp_path / "v1.safetensors")
    save_file(v2, tmp_path / "v2.safetensors")
    store, sd, dest = str(tmp_path / "store"), tmp_path / "sd", tmp_path / "dest"
    r1 = publish_checkpoint(store, tmp_path / "v1.safetensors", version=1, state_dir=sd)
    r2 = publish_checkpoint(store, tmp_path / "v2.safetensors", version=2, state_dir=sd)
    assert (r1.kind, r2.kind, r2.parent, r2.changed_elements) == ("anchor", "delta", 1, 4)
    assert pull_checkpoint(store, dest, version=1).kind == "anchor"
    assert_bit_exact(v1, load_folder(dest))
    report = pull_checkpoint(store, dest)
    assert (report.kind, report.applied, report.changed_elements) == ("delta", (2,), 4)
    assert_bit_exact(v2, load_folder(dest))
    state = read_state(dest)
    assert state is not None and state.version == 2
    assert state.adler32 == adler_of(Path(store), 2)


def test_pull_into_a_non_empty_folder_without_sidecar(store: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    save_file({"x": torch.zeros(3)}, dest / SINGLE_NAME)
    before = tree(dest)
    with pytest.raises(CheckpointError, match="not empty"):
        pull_checkpoint(str(store), dest)
    assert tree(dest) == before


@pytest.mark.parametrize("text", ["{", '{"format": 2}', '{"format": 1}', "[]"])
def test_unreadable_sidecar_is_an_error(tmp_path: Path, text: str) -> None:
    (tmp_path / SIDECAR).write_text(text)
    with pytest.raises(CheckpointError):
        read_state(tmp_path)


@pytest.mark.parametrize("existed", [False, True])
def test_failed_bootstrap_leaves_no_files(store: Path, tmp_path: Path, existed: bool) -> None:
    damage(store, 1)  # the anchor's data
    dest = tmp_path / "dest"
    if existed:
        dest.mkdir()
    with pytest.raises(IntegrityError):
        pull_checkpoint(str(store), dest, version=1)
    if existed:
        assert list(dest.iterdir()) == []
    else:
        assert not dest.exists()
    # a missing data object is cleaned up the same way
    for obj in (store / "versions" / f"{1:020d}").glob("*.dsz"):
        obj.unlink()
    with pytest.raises(ObjectNotFoundError):
        pull_checkpoint(str(store), dest)
    assert (list(dest.iterdir()) == []) if existed else not dest.exists()


def test_failed_in_place_pull_leaves_the_folder_untouched(
    store: Path, states: list[Tensors], tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    pull_checkpoint(str(store), dest, version=1)
    damage(store, 2)
    before = tree(dest)
    sidecar = (dest / SIDECAR).read_bytes()
    for target in (2, None):
        with pytest.raises(IntegrityError):
            pull_checkpoint(str(store), dest, version=target)
        assert tree(dest) == before
        assert (dest / SIDECAR).read_bytes() == sidecar
    assert_bit_exact(states[0], load_folder(dest))
    assert sorted(p.name for p in dest.iterdir()) == sorted([SINGLE_NAME, SIDECAR])


@pytest.mark.parametrize("start", [None, 1])
def test_damaged_last_delta_leaves_the_last_good_version(
    store: Path, states: list[Tensors], tmp_path: Path, start: int | None
) -> None:
    dest = tmp_path / "dest"
    if start is not None:
        pull_checkpoint(str(store), dest, version=start)
    damage(store, 4)
    with pytest.raises(IntegrityError):
        pull_checkpoint(str(store), dest)
    state = read_state(dest)
    assert state is not None and state.version == 3
    assert state.adler32 == adler_of(store, 3)
    assert_bit_exact(states[2], load_folder(dest))
    # the folder is a valid v3: it opens, verifies and reports nothing to do for v3
    report = pull_checkpoint(str(store), dest, version=3)
    assert (report.kind, report.version) == ("none", 3)


def test_folder_sync_remembers_versions_a_failed_bootstrap_committed(
    store: Path, tmp_path: Path
) -> None:
    damage(store, 4)
    folder = FolderSync(str(store), tmp_path / "dest")
    with pytest.raises(IntegrityError):
        folder.pull()
    assert folder_version(tmp_path / "dest") == 3
    assert folder.version == 3


def test_retry_after_a_partly_failed_bootstrap_keeps_the_recorded_version(
    store: Path, states: list[Tensors], tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    damage(store, 4)
    folder = FolderSync(str(store), dest)
    with pytest.raises(IntegrityError):
        folder.pull()
    assert folder_version(dest) == 3
    damage(store, 1)  # e.g. the anchor's object went bad (or was deleted) meanwhile
    with pytest.raises(DeltastoreError):
        folder.pull()
    assert folder_version(dest) == 3
    assert_bit_exact(states[2], load_folder(dest))


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_pull_of_a_dtype_safetensors_cannot_store_is_a_checkpoint_error(
    tmp_path: Path, dtype: str
) -> None:
    store, dest = tmp_path / "store", tmp_path / "dest"
    tensors = {"w": torch.linspace(-1, 1, 10).to(DTYPES[dtype]), "b": torch.ones(3)}
    Publisher(store).publish(tensors, version=1)
    with pytest.raises(CheckpointError, match=dtype):
        pull_checkpoint(str(store), dest)
    assert not dest.exists()


# --- watch_checkpoint ---------------------------------------------------------------------


def test_watch_checkpoint_follows_and_stops_promptly(tmp_path: Path) -> None:
    versions = [mixed(40), mixed(41), mixed(42)]
    store, dest = str(tmp_path / "store"), tmp_path / "dest"
    pub = Publisher(store)
    pub.publish(versions[0], version=1)
    stop = threading.Event()
    reports: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            watch_checkpoint(store, dest, interval=0.05, stop=stop, on_report=reports.append)
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: folder_version(dest) == 1 or bool(errors))
        assert_bit_exact(versions[0], load_folder(dest))
        for v in (2, 3):  # published while the watcher runs
            pub.publish(versions[v - 1], version=v)
            wait_until(lambda v=v: folder_version(dest) == v or bool(errors))
            assert_bit_exact(versions[v - 1], load_folder(dest))
    finally:
        stop.set()
        t0 = time.monotonic()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert time.monotonic() - t0 < 2.0
    assert errors == []
    assert [(r.version, r.kind) for r in reports] == [(1, "anchor"), (2, "delta"), (3, "delta")]


def test_watch_checkpoint_waits_for_a_first_version_and_stops_mid_wait(tmp_path: Path) -> None:
    store, dest = str(tmp_path / "store"), tmp_path / "dest"
    stop = threading.Event()
    polls = threading.Event()
    thread = threading.Thread(
        target=watch_checkpoint,
        args=(store, dest),
        kwargs={"interval": 60.0, "stop": stop, "on_report": lambda r: polls.set()},
        daemon=True,
    )
    thread.start()
    time.sleep(0.3)  # inside its first 60 s wait, on an empty store
    assert thread.is_alive() and not polls.is_set()
    t0 = time.monotonic()
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert time.monotonic() - t0 < 2.0
    assert not dest.exists() or list(dest.iterdir()) == []


def test_watch_checkpoint_returns_at_once_when_stopped(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    t0 = time.monotonic()
    watch_checkpoint(str(tmp_path / "store"), tmp_path / "dest", interval=60.0, stop=stop)
    assert time.monotonic() - t0 < 1.0


# --- progress -----------------------------------------------------------------------------


def assert_progress(events: list[Progress], frames_total: int, bytes_total: int) -> None:
    assert events
    assert {(e.frames_total, e.bytes_total) for e in events} == {(frames_total, bytes_total)}
    assert [e.frames_done for e in events] == list(range(1, len(events) + 1))
    assert all(a.bytes_done <= b.bytes_done for a, b in itertools.pairwise(events))
    assert events[-1].frames_done == frames_total
    assert events[-1].bytes_done == bytes_total


def test_progress_of_publish_and_sync(tmp_path: Path, states: list[Tensors]) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=128 << 10)
    sub = Subscriber(tmp_path, max_workers=4, max_inflight_bytes=1 << 20)
    for v, state in enumerate(states[:3], start=1):
        events: list[Progress] = []
        report = pub.publish(state, version=v, progress=events.append)
        frames = sum(-(-t.numel() * 2 // (128 << 10)) for t in state.values())
        assert_progress(events, frames, report.dense_bytes)  # every frame, stored or not
        if v > 1:
            assert report.frames < frames
        got: list[Progress] = []
        sync = sub.sync(v, progress=got.append)
        assert_progress(got, sync.frames, sync.payload_bytes)
        assert sync.frames == report.frames
    # a multi-version sync counts the frames of every version applied
    fresh: list[Progress] = []
    sync = Subscriber(tmp_path).sync(3, progress=fresh.append)
    assert sync.applied == (1, 2, 3)
    assert_progress(fresh, sync.frames, sync.payload_bytes)
    # nothing to do: no call
    none: list[Progress] = []
    assert sub.sync(3, progress=none.append).kind == "none"
    assert none == []


def test_progress_of_publish_and_pull_checkpoint(
    tmp_path: Path, states: list[Tensors], store: Path
) -> None:
    src = tmp_path / "v1.safetensors"
    save_file(states[0], src)
    events: list[Progress] = []
    report = publish_checkpoint(
        str(tmp_path / "s2"), src, version=1, state_dir=tmp_path / "sd", progress=events.append
    )
    assert_progress(events, report.frames, report.dense_bytes)
    dest = tmp_path / "dest"
    for target in (2, 4):
        got: list[Progress] = []
        sync = pull_checkpoint(str(store), dest, version=target, progress=got.append)
        assert_progress(got, sync.frames, sync.payload_bytes)
        assert_bit_exact(states[target - 1], load_folder(dest))


def test_watch_stops_on_a_lost_data_object(store: Path, tmp_path: Path) -> None:
    (next((store / "versions" / f"{1:020d}").glob("*.dsz"))).unlink()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            watch_checkpoint(store, tmp_path / "dest", interval=0.05, max_interval=0.1)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "watch kept retrying a permanently missing object"
    assert len(outcome) == 1 and isinstance(outcome[0], ObjectNotFoundError)


def test_publish_that_cannot_save_its_state_still_reports_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, states: list[Tensors]
) -> None:
    from deltastore.publish.snapshot import DiskSnapshot

    pub = Publisher(tmp_path / "store", snapshot="disk", state_dir=tmp_path / "state")
    pub.publish(states[0], version=1)

    def broken(self: DiskSnapshot, state: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(DiskSnapshot, "commit", broken)
    report = pub.publish(states[1], version=2)  # committed: no exception
    assert report.kind == "delta" and pub.version == 2
    assert Subscriber(tmp_path / "store").latest() == 2
    monkeypatch.undo()
    restarted = Publisher(tmp_path / "store", snapshot="disk", state_dir=tmp_path / "state")
    assert restarted.version is None  # the dirty state is not trusted
    assert restarted.publish(states[2], version=3).kind == "anchor"
