"""Multi-rank engines over torch.distributed (gloo): real processes, one store, one engine.

Each test publishes its versions first (saving the trainer's full tensors as safetensors),
then spawns ``world`` processes that each hold one tensor-parallel rank of the model and sync
version by version as one process group. The workers check their local tensors bit-wise
against a reference re-sharding written with plain torch ops, and report the bytes they
fetched and the errors they saw to JSON files the test then checks across ranks.

Every worker also reports the gloo threads left after ``destroy_process_group()``: a
process group that outlives it (something still references it) keeps them running into
interpreter shutdown, where a late one aborts the process (see ``deltastore.sync.group``).
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from deltastore import IntegrityError, LocalStore, Publisher, RankError, Store, Subscriber
from deltastore.format.manifest import manifest_key, parse_manifest
from deltastore.layout.boxes import Layout, fuse, shard
from deltastore.store import open_store
from tests.test_stores_e2e import CountingStore, s3

VOCAB, HIDDEN, PADDED = 1000, 64, 1024
#: Rendezvous and collective timeout: long enough for a rank that spawns late on a loaded
#: machine, short enough that a lost rank fails the test instead of hanging it for 30 minutes.
TIMEOUT = timedelta(minutes=5)
SHAPES = {
    "embed": (VOCAB, HIDDEN),
    "q": (128, HIDDEN),
    "k": (32, HIDDEN),
    "v": (32, HIDDEN),
    "o": (HIDDEN, 128),
    "up": (256, HIDDEN),
    "down": (HIDDEN, 256),
    "norm": (HIDDEN,),
}


def layout(rank: int, world: int) -> Layout:
    """The engine's layout at ``rank`` of ``world`` (declared with layout primitives)."""
    return Layout(
        {
            "embed_tokens": shard("embed", 0, rank, world, block=PADDED // world),
            "qkv_proj": fuse([shard(n, 0, rank, world) for n in ("q", "k", "v")]),
            "o_proj": shard("o", 1, rank, world),
            "up_proj": shard("up", 0, rank, world),
            "down_proj": shard("down", 1, rank, world),
            "norm": "norm",
        }
    )


def reference(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """The same layout by plain torch ops, independent of the box code."""
    block = PADDED // world
    embed = torch.zeros(block, HIDDEN, dtype=torch.bfloat16)
    rows = full["embed"][rank * block : min((rank + 1) * block, VOCAB)]
    embed[: rows.shape[0]] = rows
    return {
        "embed_tokens": embed,
        "qkv_proj": torch.cat([full[n].chunk(world)[rank] for n in ("q", "k", "v")]),
        "o_proj": full["o"].chunk(world, 1)[rank],
        "up_proj": full["up"].chunk(world)[rank],
        "down_proj": full["down"].chunk(world, 1)[rank],
        "norm": full["norm"],
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def versions(count: int) -> list[dict[str, torch.Tensor]]:
    """An anchor and deltas flipping ~2% of the elements; the last one changes only the first
    rows of ``embed`` (held by rank 0 alone)."""
    g = torch.Generator().manual_seed(0)
    cur = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    out = [cur]
    for i in range(1, count):
        cur = {n: t.clone() for n, t in cur.items()}
        if i == count - 1:
            bits(cur["embed"])[:10] ^= 3
        else:
            for t in cur.values():
                flat = bits(t).view(-1)
                flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 50]] ^= 1
        out.append(cur)
    return out


def _init(rank: int, world: int, cfg: dict[str, Any]) -> None:
    faulthandler.enable(all_threads=True)  # an abort prints every thread's Python stack
    dist.init_process_group(
        "gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=world, timeout=TIMEOUT
    )


def _gloo_threads_left() -> list[str]:
    """This process's gloo threads, once those that are ending have ended (2 s at most):
    after ``destroy_process_group()`` a live one means the group was not destroyed."""
    task = Path("/proc/self/task")
    if not task.is_dir():  # not Linux: nothing to look at
        return []
    deadline = time.monotonic() + 2.0
    while True:
        names = []
        for t in task.iterdir():
            try:
                names.append((t / "comm").read_text().strip())
            except OSError:  # ended meanwhile
                continue
        left = sorted(n for n in names if "gloo" in n)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    _init(rank, world, cfg)
    try:
        _run(rank, world, cfg)
    finally:
        dist.destroy_process_group()
    Path(cfg["dir"], f"threads{rank}.json").write_text(json.dumps(_gloo_threads_left()))


def _run(rank: int, world: int, cfg: dict[str, Any]) -> None:
    store = open_store(cfg["url"], cfg["options"])
    counter = CountingStore(store)
    calls: list[str] = []
    sub = Subscriber(
        store,
        layout=layout(rank, world),
        group=dist.group.WORLD,
        max_frame_bytes=1 << 20,
        pause=lambda: calls.append("pause"),
        resume=lambda: calls.append("resume"),
    )
    out: dict[str, Any] = {"fetched": [], "changed": [], "errors": {}}
    for v in range(cfg["versions"]):
        before = counter.fetched
        report = sub.sync(version=v)
        out["fetched"].append(counter.fetched - before)
        out["changed"].append(report.changed_elements)
        want = reference(load_file(f"{cfg['dir']}/v{v}.safetensors"), rank, world)
        assert sub.tensors is not None and set(sub.tensors) == set(want)
        for name, t in want.items():
            assert torch.equal(bits(sub.tensors[name]), bits(t)), f"rank {rank} v{v} {name}"
    if cfg.get("corrupt") is not None:
        before_bits = {n: bits(t).clone() for n, t in (sub.tensors or {}).items()}
        try:
            sub.sync(version=cfg["corrupt"])
        except (IntegrityError, RankError) as exc:
            out["errors"]["corrupt"] = type(exc).__name__
        assert sub.version == cfg["versions"] - 1
        assert all(torch.equal(bits(sub.tensors[n]), b) for n, b in before_bits.items())
    if cfg.get("identity"):  # no layout: every rank holds the whole model, frames still split
        whole = Subscriber(store, group=dist.group.WORLD)
        before = counter.fetched
        whole.sync()
        out["whole_fetched"] = counter.fetched - before
        last = load_file(f"{cfg['dir']}/v{cfg['versions'] - 1}.safetensors")
        assert whole.tensors is not None
        assert all(torch.equal(bits(whole.tensors[n]), bits(t)) for n, t in last.items())
    out["calls"] = calls
    Path(cfg["dir"], f"rank{rank}.json").write_text(json.dumps(out))


def _publish(
    store: Store, states: list[dict[str, torch.Tensor]], folder: Path
) -> tuple[Publisher, list[int]]:
    pub = Publisher(store, max_frame_bytes=8 << 10, max_object_bytes=64 << 10)
    payload = []
    for v, state in enumerate(states):
        save_file(state, str(folder / f"v{v}.safetensors"))
        payload.append(pub.publish(state, version=v).payload_bytes)
    return pub, payload


def _spawn(world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, cfg), nprocs=world, join=True)
    results = [json.loads(Path(cfg["dir"], f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        res["threads"] = json.loads(Path(cfg["dir"], f"threads{r}.json").read_text())
    return results


def _corrupt_first_frame(store: LocalStore, version: int, name: str) -> None:
    """Flip a byte in the middle of the first stored frame of ``name`` at ``version``."""
    frame = parse_manifest(store.get(manifest_key(version))).tensors[name].frames[0]
    path = store.root / frame.object
    blob = bytearray(path.read_bytes())
    blob[frame.offset + frame.length // 2] ^= 0xFF
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("world", [2, 4])
def test_engine_ranks_sync_bit_exact_fetching_each_frame_once(tmp_path: Path, world: int) -> None:
    store = LocalStore(tmp_path / "store")
    states = versions(6)
    pub, payload = _publish(store, states, tmp_path)
    # version 6: a delta whose first frame of "up" is corrupted in the store
    damaged = {n: t.clone() for n, t in states[-1].items()}
    bits(damaged["up"]).view(-1)[::7] ^= 1
    pub.publish(damaged, version=6)
    _corrupt_first_frame(store, 6, "up")

    results = _spawn(
        world,
        {
            "init": str(tmp_path / "pg"),
            "url": str(tmp_path / "store"),
            "options": None,
            "dir": str(tmp_path),
            "versions": 6,
            "corrupt": 6,
        },
    )
    for v in range(6):  # one copy of the payload per engine, not one per rank
        assert sum(r["fetched"][v] for r in results) == payload[v]
    # version 5 changed rows only rank 0 holds: the other ranks had nothing and completed
    assert results[0]["changed"][5] == 10 * HIDDEN
    # the corrupted frame was seen by one rank; every rank aborted, tensors unchanged
    kinds = sorted(r["errors"]["corrupt"] for r in results)
    assert kinds == ["IntegrityError"] + ["RankError"] * (world - 1)
    for r in results:  # pause/resume around each delta's write phase, in order
        assert r["calls"] == ["pause", "resume"] * (len(r["calls"]) // 2)
        assert len(r["calls"]) >= 2 * 5
    # the rank that met the damaged frame still destroyed its group (and gloo's threads)
    assert [r["threads"] for r in results] == [[]] * world


def test_engine_ranks_over_s3(tmp_path: Path, s3_endpoint: str) -> None:
    store = s3(s3_endpoint)
    states = versions(4)
    _, payload = _publish(store, states, tmp_path)
    opts = {"key": "testing", "secret": "testing", "endpoint_url": s3_endpoint}
    results = _spawn(
        2,
        {
            "init": str(tmp_path / "pg"),
            "url": store.url,
            "options": opts,
            "dir": str(tmp_path),
            "versions": 4,
            "identity": True,
        },
    )
    for v in range(4):
        assert sum(r["fetched"][v] for r in results) == payload[v]
    # a whole-model replica per rank: anchor + 3 deltas, each frame fetched by one rank
    assert sum(r["whole_fetched"] for r in results) == sum(payload)
    assert [r["threads"] for r in results] == [[], []]


def _failing_worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """An engine rank whose sync fails and that keeps what an engine keeps afterwards (its
    Subscriber and the last error) across ``destroy_process_group()``. The last rank spawns
    late; with ``leave``, it then raises before the sync the others are already in."""
    if rank == world - 1:
        time.sleep(cfg["late"])
    _init(rank, world, cfg)
    kept: list[Any] = []
    out: dict[str, Any] = {}
    try:
        sub = Subscriber(open_store(cfg["url"]), group=dist.group.WORLD)
        kept.append(sub)
        if cfg["leave"] and rank == world - 1:
            raise SystemExit(3)
        try:
            sub.sync(version=0)
            sub.sync(version=1)  # a damaged frame
        except Exception as exc:
            kept.append(exc)
            out["error"] = type(exc).__name__
    finally:
        dist.destroy_process_group()
    out["threads"] = _gloo_threads_left()
    Path(cfg["dir"], f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.parametrize("leave", [False, True], ids=["failed-sync", "rank-leaves-early"])
def test_ranks_exit_cleanly_after_a_failure(tmp_path: Path, leave: bool) -> None:
    """No rank dies of a signal: each destroys its group (joining gloo's threads) before the
    interpreter exits, even when a failed sync's error and Subscriber outlive the group; a rank
    that leaves while the others are in a collective gives them an error, not a hang."""
    store = LocalStore(tmp_path / "store")
    states = versions(2)
    pub, _ = _publish(store, states[:1], tmp_path)
    damaged = {n: t.clone() for n, t in states[1].items()}
    bits(damaged["up"]).view(-1)[::7] ^= 1
    pub.publish(damaged, version=1)
    _corrupt_first_frame(store, 1, "up")
    world = 2
    cfg = {
        "init": str(tmp_path / "pg"),
        "url": str(tmp_path / "store"),
        "dir": str(tmp_path),
        "late": 2.0,
        "leave": leave,
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_failing_worker, args=(r, world, cfg)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=TIMEOUT.total_seconds() / 2)
    for p in procs:  # a rank still running is a hang
        if p.exitcode is None:
            p.kill()
            p.join()
    # exit codes, not signals: no abort ("terminate called without an active exception")
    assert [p.exitcode for p in procs] == ([0, 3] if leave else [0, 0])
    results = [
        json.loads(Path(tmp_path, f"rank{r}.json").read_text())
        for r in range(world - 1 if leave else world)
    ]
    assert [r["threads"] for r in results] == [[]] * len(results)
    if leave:  # the rank left behind got the transport's error
        assert results[0]["error"] not in ("IntegrityError", "RankError")
    else:
        assert sorted(r["error"] for r in results) == ["IntegrityError", "RankError"]
