"""Several writers, one version: ShardWriter parts, commit_parts, finish, attach, failures."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from deltastore import (
    ChainError,
    Layout,
    ManifestError,
    RowSlice,
    ShardWriter,
    Subscriber,
    TensorMismatchError,
    VersionExistsError,
    VersionNotCommittedError,
    WrongParentError,
    commit_parts,
    shard,
)
from deltastore.format.manifest import Manifest, manifest_key, parse_latest, parse_manifest
from deltastore.publish.runs import new_run_id
from deltastore.publish.sharded import abort_key, part_key, parts_prefix
from deltastore.store import LocalStore

SCHEMA = json.loads(
    (Path(__file__).parent.parent / "manifests/schema/manifest.v1.schema.json").read_text()
)
WORLD = 2
OPTIONS: dict[str, Any] = {"max_frame_bytes": 256, "max_object_bytes": 2048}  # 128-element frames
SHAPES = {
    "embed.weight": (101, 24),
    "attn.q.weight": (24, 24),
    "attn.k.weight": (12, 24),
    "mlp.up.weight": (40, 24),
    "mlp.down.weight": (24, 40),
    "head.weight": (37, 24),
    "norm.weight": (24,),  # 1-D: owned entirely by writer 1
}
Tensors = dict[str, torch.Tensor]


def model(seed: int) -> Tensors:
    g = torch.Generator().manual_seed(seed)
    out = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    out["scale"] = torch.tensor(3.5, dtype=torch.float32)  # 0-dim: owned by writer 0
    out["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)  # no rows: two empty slices
    return out


def step(tensors: Tensors, seed: int, frac: float = 0.015, *, rank0_only: bool = False) -> Tensors:
    """Flip low bits in ``frac`` of the bytes of every tensor (``rank0_only``: only in what
    writer 0 owns: the first rows of 2-D tensors, and the 0-dim one)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        part = t[: cut_of(t.shape[0]) if t.dim() == 2 else 0] if rank0_only and t.dim() else t
        words = part.reshape(-1).view(torch.uint8)
        k = max(1, int(frac * words.numel())) if words.numel() else 0
        idx = torch.randperm(words.numel(), generator=g)[:k]
        words[idx] ^= torch.randint(1, 8, (k,), generator=g, dtype=torch.uint8)
        out[name] = t
    return out


def cut_of(rows: int) -> int:
    return rows * 2 // 5  # uneven: 101 rows -> 40 + 61


def slices(full: Tensors, rank: int, *, shift: int = 0) -> dict[str, RowSlice]:
    """Writer ``rank``'s slices: rows ``[0, cut)`` / ``[cut, n)`` of 2-D tensors (the cut moved
    by ``shift`` for writer 1 where there are rows), the 0-dim one for writer 0, the 1-D one
    for writer 1."""
    out: dict[str, RowSlice] = {}
    for name, t in full.items():
        if t.dim() != 2:
            if rank == (0 if t.dim() == 0 else WORLD - 1):
                out[name] = RowSlice.whole(t)
            continue
        cut = cut_of(t.shape[0])
        a, b = (0, cut) if rank == 0 else (cut + (shift if cut else 0), t.shape[0])
        out[name] = RowSlice(t[a:b], tuple(t.shape), a)
    return out


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def assert_bit_exact(expected: Tensors, got: Tensors | None) -> None:
    assert got is not None and set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert np.array_equal(bits(got[name]), bits(t)), name


def writers(store: Path, **options: Any) -> list[ShardWriter]:
    return [ShardWriter(store, rank, WORLD, **(OPTIONS | options)) for rank in range(WORLD)]


def publish_round(
    store: Path, ws: list[ShardWriter], full: Tensors, version: int, **kw: Any
) -> Manifest:
    reports = [w.publish(slices(full, w.rank), version=version, **kw) for w in ws]
    manifest = commit_parts(store, version=version, world=WORLD, timeout_s=10)
    for w in ws:
        assert w.finish(version, timeout_s=10) == manifest
        assert w.version == version
    assert sum(r.changed_elements for r in reports) == manifest.changed_elements
    assert sum(r.payload_bytes for r in reports) == manifest.payload_bytes
    return manifest


def check_committed(store: Path, full: Tensors, version: int) -> Manifest:
    """The manifest is a valid v1 manifest (schema and model) with the tensors' Adler-32."""
    data = (store / manifest_key(version)).read_bytes()
    jsonschema.validate(json.loads(data), SCHEMA)
    manifest = parse_manifest(data, key=manifest_key(version))
    assert set(manifest.tensors) == set(full)
    for name, t in full.items():
        assert manifest.tensors[name].adler32 == zlib.adler32(bits(t).tobytes()), name
    assert LocalStore(store).list(parts_prefix(version)) == []  # parts deleted after commit
    assert parse_latest((store / "LATEST").read_bytes()).version == version
    return manifest


def delta_reaches_a_new_subscriber(
    store: Path, ws: list[ShardWriter], full: Tensors, version: int, parent: int
) -> None:
    """Commit ``full`` as ``version``, a delta on ``parent``; a new subscriber gets it exactly."""
    manifest = publish_round(store, ws, full, version)
    assert manifest.kind == "delta" and manifest.parent is not None
    assert manifest.parent.version == parent
    check_committed(store, full, version)
    sub = Subscriber(store)
    sub.sync()
    assert sub.version == version
    assert_bit_exact(full, sub.tensors)


def tp2_layout() -> Layout:
    """Both ranks of a TP-2 engine in one process: column shards on dim 0 (padded blocks for odd
    row counts), a row-parallel shard on dim 1, replicated 1-D/0-dim/empty tensors."""
    parts: dict[str, Any] = {}
    for r in range(2):
        for name, (rows, _) in ((n, s) for n, s in SHAPES.items() if len(s) == 2):
            parts[f"tp{r}.{name}"] = (
                shard(name, 1, r, 2)
                if name == "mlp.down.weight"
                else shard(name, 0, r, 2, block=-(-rows // 2))
            )
        for name in ("norm.weight", "scale", "empty"):
            parts[f"tp{r}.{name}"] = name
    return Layout(parts)


def assert_tp2_exact(full: Tensors, got: Tensors | None) -> None:
    """The TP-2 tensors equal a re-sharding of ``full`` by plain torch ops (padding zero)."""
    assert got is not None
    for r in range(2):
        for name, t in full.items():
            if name == "mlp.down.weight":
                want = t.chunk(2, 1)[r]
            elif t.dim() == 2:
                block = -(-t.shape[0] // 2)
                want = torch.zeros(block, t.shape[1], dtype=t.dtype)
                rows = t[r * block : (r + 1) * block]
                want[: rows.shape[0]] = rows
            else:
                want = t
            assert np.array_equal(bits(got[f"tp{r}.{name}"]), bits(want)), (r, name)


def no_commit(store: Path, version: int) -> None:
    assert not (store / manifest_key(version)).exists()
    assert (store / abort_key(version)).exists()


# --- in-process writers --------------------------------------------------------------------


def test_two_writers_anchor_then_deltas_bit_exact(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ws = writers(store)
    sub = Subscriber(store)
    tp2 = Subscriber(store, layout=tp2_layout())
    states = [model(0)]
    for v in range(1, 6):
        if v > 1:
            states.append(step(states[-1], seed=v))
        published = publish_round(store, ws, states[-1], version=v)
        manifest = check_committed(store, states[-1], v)
        assert manifest == published
        assert manifest.kind == ("anchor" if v == 1 else "delta")
        assert (manifest.parent.version if manifest.parent else None) == (v - 1 if v > 1 else None)
        if v > 1:
            prev = states[-2]
            flipped = sum(
                int((bits(states[-1][n]) != bits(prev[n])).sum()) for n in prev if prev[n].numel()
            )
            assert 0 < manifest.changed_elements <= flipped  # element, not byte, counts
            assert manifest.payload_bytes < 0.5 * manifest.dense_bytes
        report = sub.sync()
        assert report.version == v and report.applied == (v,)
        assert_bit_exact(states[-1], sub.tensors)
        assert tp2.sync().applied == (v,)
        assert_tp2_exact(states[-1], tp2.tensors)
        # every writer's frames sit under the version's data prefix, named with its token
        objects = {f.object for e in manifest.tensors.values() for f in e.frames}
        assert {o.split("/")[-1][:12] for o in objects} == {w.token[:12] for w in ws}
    fresh = Subscriber(store)
    fresh.sync()
    assert_bit_exact(states[-1], fresh.tensors)
    # a frame of writer 1 starts at its slice's first global element, not on a global grid
    embed = parse_manifest((store / manifest_key(1)).read_bytes()).tensors["embed.weight"]
    assert 40 * 24 in [f.start for f in embed.frames]


def test_a_failed_writer_leaves_the_version_uncommitted_and_a_retry_works(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ws = writers(store)
    v1 = model(1)
    v2 = step(v1, seed=2)
    publish_round(store, ws, v1, version=1)
    publish_round(store, ws, v2, version=2)
    v3 = step(v2, seed=3)

    def die(_: object) -> None:
        raise RuntimeError("rank 1 crashed while encoding")

    ws[0].publish(slices(v3, 0), version=3)
    with pytest.raises(RuntimeError, match="crashed"):
        ws[1].publish(slices(v3, 1), version=3, progress=die)  # raises before writing its part
    with pytest.raises(VersionNotCommittedError, match=r"1 of 2 writers \(rank 1\)"):
        commit_parts(store, version=3, world=WORLD, timeout_s=0.2, poll_s=0.02)
    no_commit(store, 3)
    with pytest.raises(VersionNotCommittedError, match="aborted"):
        ws[0].finish(3, timeout_s=30)  # the abort marker ends the wait at once
    assert [w.version for w in ws] == [2, 2]
    with pytest.raises(VersionNotCommittedError, match="aborted"):
        commit_parts(store, version=3, world=WORLD, timeout_s=0.2)  # never committed later
    delta_reaches_a_new_subscriber(store, ws, v3, 4, parent=2)


def test_republishing_a_crashed_runs_version_says_what_is_there(tmp_path: Path) -> None:
    """A writer restarted without a run id finds its own uncommitted part of the version it
    crashed in: the error says so (not that another writer committed the version), and a
    writer with a new run id publishes that version again."""
    store = tmp_path / "store"
    v1 = model(1)
    publish_round(store, writers(store), v1, version=1)
    v2 = step(v1, seed=2)
    writers(store)[0].publish(slices(v2, 0), version=2)  # then the process dies
    restarted = writers(store)
    for w in restarted:
        w.attach(slices(v1, w.rank))
    with pytest.raises(VersionExistsError, match="uncommitted part of rank 0 for version 2"):
        restarted[0].publish(slices(v2, 0), version=2)
    run = new_run_id()
    fresh = writers(store, run=run)
    for w in fresh:
        w.attach(slices(v1, w.rank))
        w.publish(slices(v2, w.rank), version=2)
    commit_parts(store, version=2, world=WORLD, run=run, timeout_s=10)
    for w in fresh:
        w.finish(2, timeout_s=10)
    sub = Subscriber(store)
    sub.sync()
    assert_bit_exact(v2, sub.tensors)


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("overlap", ManifestError, r"rows \[39, 101\) of rank 1 overlap those of rank 0"),
        ("gap", ManifestError, r"leave rows \[40, 41\) without a writer"),
        ("dtype", ManifestError, "rank 1 has a float16"),
        ("parents", ChainError, "writers disagree on the parent"),
        ("extra field", ManifestError, "malformed.*Extra inputs"),
        ("frame outside", ManifestError, "malformed.*out of order or of the slice"),
        ("wrong rank", ManifestError, "is the part of rank 0"),
    ],
)
def test_bad_parts_commit_nothing(
    tmp_path: Path, case: str, error: type[Exception], match: str
) -> None:
    store = tmp_path / "store"
    ws = writers(store)
    v1 = model(4)
    publish_round(store, ws, v1, version=1)
    v2 = step(v1, seed=5)
    mine = [slices(v2, 0), slices(v2, 1)]
    if case in ("overlap", "gap"):
        mine[1] = slices(v2, 1, shift=-1 if case == "overlap" else 1)
        ws = writers(store)  # other rows than the ones held: both publish anchors
    if case == "dtype":
        t = mine[1]["embed.weight"]
        mine[1]["embed.weight"] = RowSlice(
            t.tensor.view(torch.float16), t.global_shape, t.row_start
        )
        ws = writers(store)
    if case == "parents":
        ws[1] = ShardWriter(store, 1, WORLD, **OPTIONS)  # a new writer: no parent, an anchor
    for w in ws:
        w.publish(mine[w.rank], version=2)
    key = part_key(2, 1, WORLD)
    part = json.loads((store / key).read_bytes())
    if case == "extra field":
        part["extra"] = 1
    if case == "frame outside":
        embed = part["tensors"]["embed.weight"]
        embed["frames"][0]["start"] = embed["start"] - 1
    if case == "wrong rank":
        part["rank"] = 0
    LocalStore(store).put(key, json.dumps(part).encode())
    with pytest.raises(error, match=match):
        commit_parts(store, version=2, world=WORLD, timeout_s=5)
    no_commit(store, 2)
    with pytest.raises(VersionNotCommittedError, match=error.__name__):
        ws[0].finish(2, timeout_s=30)
    assert ws[0].version in (1, None)
    sub = Subscriber(store)
    sub.sync()
    assert sub.version == 1
    assert_bit_exact(v1, sub.tensors)


def test_an_out_of_date_writer_snapshot_is_a_wrong_parent(tmp_path: Path) -> None:
    store, state = tmp_path / "store", tmp_path / "state"
    ws = [
        ShardWriter(store, rank, WORLD, snapshot="disk", state_dir=state / f"rank{rank}", **OPTIONS)
        for rank in range(WORLD)
    ]
    v1 = model(6)
    publish_round(store, ws, v1, version=1)
    shutil.copytree(state / "rank1", tmp_path / "stale")  # rank 1's snapshot at version 1
    v2 = step(v1, seed=7)
    m2 = publish_round(store, ws, v2, version=2)
    # rank 1 restarts from a stale copy of its state folder that claims to hold version 2
    meta = json.loads((tmp_path / "stale" / "state.json").read_text())
    meta |= {"version": 2, "state_digest": m2.state_digest}
    (tmp_path / "stale" / "state.json").write_text(json.dumps(meta))
    shutil.rmtree(state / "rank1")
    shutil.copytree(tmp_path / "stale", state / "rank1")
    stale = ShardWriter(store, 1, WORLD, snapshot="disk", state_dir=state / "rank1", **OPTIONS)
    restarted = ShardWriter(store, 0, WORLD, snapshot="disk", state_dir=state / "rank0", **OPTIONS)
    assert (stale.version, restarted.version) == (2, 2)
    v3 = step(v2, seed=8)
    restarted.publish(slices(v3, 0), version=3)
    stale.publish(slices(v3, 1), version=3)
    with pytest.raises(WrongParentError, match="snapshot is out of date"):
        commit_parts(store, version=3, world=WORLD, timeout_s=5)
    no_commit(store, 3)
    # recovery: attach rank 1 to the newest version; version 4 is a delta on 2
    fixed = ShardWriter(store, 1, WORLD, snapshot="disk", state_dir=state / "rank1", **OPTIONS)
    assert fixed.attach(slices(v2, 1)) == 2
    delta_reaches_a_new_subscriber(store, [restarted, fixed], v3, 4, parent=2)


def test_attach_checks_slices_back_along_the_chain(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ws = writers(store)
    v1 = model(9)
    publish_round(store, ws, v1, version=1)
    v2 = step(v1, seed=10, rank0_only=True)  # writer 1's slices do not change
    m2 = publish_round(store, ws, v2, version=2)
    head = m2.tensors["head.weight"]
    assert head.frames and all(f.stop <= cut_of(37) * 24 for f in head.frames)
    fresh = [ShardWriter(store, rank, WORLD, **OPTIONS) for rank in range(WORLD)]
    # writer 1's 2-D rows were last stored by the anchor: attach reads back to version 1
    assert [w.attach(slices(v2, w.rank)) for w in fresh] == [2, 2]
    bad = slices(v2, 1)
    tampered = bad["head.weight"].tensor.clone()
    tampered.view(torch.int16)[3, 3] ^= 1
    bad["head.weight"] = RowSlice(tampered, (37, 24), cut_of(37))
    with pytest.raises(TensorMismatchError, match=r"head\.weight"):
        ShardWriter(store, 1, WORLD, **OPTIONS).attach(bad)
    with pytest.raises(TensorMismatchError, match="align"):  # resharded: frames do not align
        ShardWriter(store, 1, WORLD, **OPTIONS).attach(slices(v2, 1, shift=1))
    with pytest.raises(ChainError, match="not the store's newest"):
        ShardWriter(store, 1, WORLD, **OPTIONS).attach(slices(v1, 1), version=1)
    delta_reaches_a_new_subscriber(store, fresh, step(v2, seed=11), 3, parent=2)


def test_writer_call_order_and_slice_checks(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ws = writers(store)
    v1 = model(12)
    with pytest.raises(TensorMismatchError, match="not a row range"):
        ws[0].publish({"w": RowSlice(torch.zeros(3, 4), (10, 5), 0)}, version=1)
    with pytest.raises(TensorMismatchError, match="not a row range"):
        ws[0].publish({"w": RowSlice(torch.zeros(3, 4), (10, 4), 8)}, version=1)
    with pytest.raises(ValueError, match="rank"):
        ShardWriter(store, 2, 2)
    with pytest.raises(ChainError, match="no unfinished part"):
        ws[0].finish(1)
    with pytest.raises(ChainError, match="cannot publish a delta"):
        ws[0].publish(slices(v1, 0), version=1, anchor=False)
    for w in ws:
        w.publish(slices(v1, w.rank), version=1)
    commit_parts(store, version=1, world=WORLD, timeout_s=5)
    with pytest.raises(ChainError, match=r"call finish\(1\)"):
        ws[0].publish(slices(v1, 0), version=2)
    ws[0].finish(1)
    assert ws[0].version == 1
    ws[0].publish(slices(v1, 0), version=2)
    with pytest.raises(VersionNotCommittedError, match="not committed within"):
        ws[0].finish(2, timeout_s=0.1, poll_s=0.02)
    assert ws[0].version == 1


# --- two processes -------------------------------------------------------------------------


def rank1_main(store: str, out: Any) -> None:
    """Writer 1 in a process of its own: its part of version 1, then it dies."""
    writer = ShardWriter(store, 1, WORLD, **OPTIONS)
    writer.publish(slices(model(13), 1), version=1)
    writer.finish(1, timeout_s=60)
    out.put(writer.version)
    os._exit(3)  # the process dies: no part of version 2


def test_two_processes_publish_one_version(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    other = ctx.Process(target=rank1_main, args=(str(store), out))
    other.start()
    writer = ShardWriter(store, 0, WORLD, **OPTIONS)  # writer 0 (and the coordinator) is this one
    v1 = model(13)
    writer.publish(slices(v1, 0), version=1)
    manifest = commit_parts(store, version=1, world=WORLD, timeout_s=60)  # waits for writer 1
    assert writer.finish(1) == manifest
    other.join(60)
    assert other.exitcode == 3 and out.get() == 1  # writer 1 finished version 1, then died
    check_committed(store, v1, 1)
    sub = Subscriber(store)
    sub.sync()
    assert sub.version == 1
    assert_bit_exact(v1, sub.tensors)
    tp2 = Subscriber(store, layout=tp2_layout())  # an engine at TP 2 applies it bit-exact
    tp2.sync()
    assert_tp2_exact(v1, tp2.tensors)
    writer.publish(slices(step(v1, seed=14), 0), version=2)
    with pytest.raises(VersionNotCommittedError, match=r"rank 1\)"):
        commit_parts(store, version=2, world=WORLD, timeout_s=0.3)
    no_commit(store, 2)
    with pytest.raises(VersionNotCommittedError, match="aborted"):
        writer.finish(2)
    assert writer.version == 1
    assert sub.sync().kind == "none"


def test_rows_cast_frame_by_frame_publish_the_cast(tmp_path: Path) -> None:
    """``RowSlice(..., dtype=torch.bfloat16)`` on float32 rows publishes their bf16 cast (cast a
    frame at a time by the writer), as deltas and after an attach; a snapshot-free writer
    refuses such a slice."""
    store = tmp_path / "store"
    g = torch.Generator().manual_seed(3)
    master = torch.randn(101, 24, generator=g)  # float32 master weights

    def cast_slices(rank: int) -> dict[str, RowSlice]:
        a, b = (0, 40) if rank == 0 else (40, 101)
        return {"w": RowSlice(master[a:b], (101, 24), a, dtype=torch.bfloat16)}

    ws = writers(store)
    for version in (1, 2, 3):
        if version > 1:
            master[::7] += 0.01 * version
        reports = [w.publish(cast_slices(w.rank), version=version) for w in ws]
        commit_parts(store, version=version, world=WORLD, timeout_s=10)
        for w in ws:
            w.finish(version, timeout_s=10)
        assert [r.kind for r in reports] == ["anchor" if version == 1 else "delta"] * 2
        sub = Subscriber(store)
        sub.sync()
        assert_bit_exact({"w": master.to(torch.bfloat16)}, sub.tensors)
    again = writers(store)
    for w in again:
        w.attach(cast_slices(w.rank))  # checked against the published bf16 words
    master[1::5] -= 0.02
    for w in again:
        assert w.publish(cast_slices(w.rank), version=4).kind == "delta"
    commit_parts(store, version=4, world=WORLD, timeout_s=10)
    sub = Subscriber(store)
    sub.sync()
    assert_bit_exact({"w": master.to(torch.bfloat16)}, sub.tensors)
    opt = torch.optim.AdamW([torch.nn.Parameter(master.clone())], lr=1e-3)
    free = ShardWriter(tmp_path / "other", 0, 1, snapshot="none", optimizer=opt)
    with pytest.raises(TensorMismatchError, match=r"RowSlice\.dtype is for memory-snapshot"):
        free.publish({"w": RowSlice(master, (101, 24), 0, dtype=torch.bfloat16)}, version=1)
