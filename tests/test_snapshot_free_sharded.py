"""Snapshot-free shard writers: two gloo processes, FSDP2-style DTensor parameters.

Each process holds dim-0 ``Shard`` DTensor parameters (row counts that do not divide by the
world included, so one rank's shard is shorter) and a ``Replicate`` one, steps a
``torch.optim.AdamW`` on them (its moments are DTensors too), and publishes its own rows with
``ShardWriter(snapshot="none", optimizer=opt)`` and ``RowSlice.of(param)``; rank 0 commits
each version and a Subscriber follows. Every version must equal, bit for bit (int16 views),
the bf16 cast of the full parameters (``full_tensor()``), for 50 steps, with no raw block and
no word held by either writer.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

WORLD = 2
STEPS = 50
SHAPES = {"embed": (37, 24), "up": (64, 24), "down": (24, 64), "gain": (24,)}
REPLICATED = "bias"
TIMEOUT = timedelta(minutes=5)


def _grads(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(10_000 + step)
    out = {n: torch.randn(s, generator=g) * 0.1 for n, s in SHAPES.items()}
    out[REPLICATED] = torch.randn(24, generator=g)
    if step % 7 == 0:
        out["gain"].zero_()  # an exactly zero gradient now and then
    return out


def _worker(rank: int, cfg: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from deltastore import ShardWriter, Subscriber, commit_parts
    from deltastore.publish.sharded import RowSlice

    dist.init_process_group(
        "gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=WORLD, timeout=TIMEOUT
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        g = torch.Generator().manual_seed(0)
        full = {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}
        full["gain"] = torch.ones(24)
        full[REPLICATED] = torch.zeros(24)
        params = {
            n: torch.nn.Parameter(
                distribute_tensor(t, mesh, [Replicate() if n == REPLICATED else Shard(0)])
            )
            for n, t in full.items()
        }
        opt = torch.optim.AdamW(list(params.values()), lr=3e-3, weight_decay=0.1, foreach=True)
        writer = ShardWriter(
            cfg["store"], rank, WORLD, snapshot="none", optimizer=opt, max_frame_bytes=512
        )
        sub = Subscriber(cfg["store"]) if rank == 0 else None
        results: dict[str, Any] = {"raw": 0, "uncertain": 0, "verified": 0, "reconstructed": 0}
        for version in range(1, STEPS + 2):
            if version > 1:
                grads = _grads(version)
                for n, p in params.items():
                    placement = Replicate() if n == REPLICATED else Shard(0)
                    p.grad = distribute_tensor(grads[n], mesh, [placement])
                opt.step()
                opt.zero_grad()
            slices = {n: s for n, p in params.items() if (s := RowSlice.of(p)) is not None}
            report = writer.publish(slices, version=version)
            stats = report.snapshot_free
            assert stats is not None
            assert report.kind == ("anchor" if version == 1 else "delta"), report
            assert not stats.absolute and not stats.snapshots, stats
            results["raw"] += stats.blocks_raw
            results["uncertain"] += stats.uncertain
            results["verified"] += stats.blocks_verified
            results["reconstructed"] += stats.reconstructed
            if rank == 0:
                commit_parts(cfg["store"], version=version, world=WORLD, timeout_s=60)
            writer.finish(version, timeout_s=60)
            truth = {n: p.full_tensor() for n, p in params.items()}  # collective: every rank
            if sub is not None:
                sub.sync()
                assert sub.version == version
                held = sub.tensors
                assert held is not None
                for n, t in truth.items():
                    want = t.to(torch.bfloat16).view(torch.int16).numpy()
                    got = held[n].contiguous().view(torch.int16).numpy()
                    assert np.array_equal(got, want), f"{n} differs at version {version}"
        state = writer._held.tensors
        assert state is not None
        results["held_words"] = sum(int(s.words.size) for s in state.values())
        results["rows"] = {n: list(s.rows) for n, s in state.items() if s.rows is not None}
        Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_two_dtensor_shard_writers_are_bit_exact_for_50_steps(tmp_path: Path) -> None:
    cfg = {"init": str(tmp_path / "init"), "store": str(tmp_path / "store"), "out": str(tmp_path)}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(cfg,), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in ranks:
        assert r["raw"] == 0 and r["held_words"] == 0
        assert r["verified"] > 0 and r["reconstructed"] > 0
    assert sum(r["uncertain"] for r in ranks) > 0  # the zero bias's first step at least
    # embed has 37 rows: torch's even split gives rank 0 rows 0-19 and rank 1 rows 19-37
    assert ranks[0]["rows"]["embed"] == [0, 19] and ranks[1]["rows"]["embed"] == [19, 37]
    assert REPLICATED in ranks[0]["rows"] and REPLICATED not in ranks[1]["rows"]


def test_row_slices_of_local_parameters_in_one_process(tmp_path: Path) -> None:
    """FSDP1-style: each writer's optimizer holds its local rows as plain parameters; a
    publish every second step on one version sends those tensors whole (never an anchor:
    the writers must agree), and the receiver stays exact; restarted writers attach (a
    changed slice is refused) and continue with deltas."""
    from deltastore import ShardWriter, Subscriber, TensorMismatchError, commit_parts
    from deltastore.publish.sharded import RowSlice

    g = torch.Generator().manual_seed(1)
    full = {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}
    bounds = {n: [0, (s[0] + 1) // 2, s[0]] for n, s in SHAPES.items()}
    ranks = []
    for r in range(WORLD):
        local = {
            n: torch.nn.Parameter(t[bounds[n][r] : bounds[n][r + 1]].clone())
            for n, t in full.items()
        }
        opt = torch.optim.AdamW(list(local.values()), lr=3e-3, weight_decay=0.1)
        w = ShardWriter(tmp_path, r, WORLD, snapshot="none", optimizer=opt, max_frame_bytes=256)
        ranks.append((local, opt, w))
    sub = Subscriber(tmp_path)
    for version in range(1, 12):
        steps = 0 if version == 1 else 2 if version == 6 else 1
        for step in range(steps):
            grads = _grads(10 * version + step)
            for r, (local, opt, _) in enumerate(ranks):
                for n, p in local.items():
                    p.grad = grads[n][bounds[n][r] : bounds[n][r + 1]].clone()
                opt.step()
        buffer = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3) * version
        for r, (local, _, w) in enumerate(ranks):
            slices = {n: RowSlice(p, SHAPES[n], bounds[n][r]) for n, p in local.items()}
            # a buffer: not a parameter, held as a snapshot of this writer's rows
            slices["buffer"] = RowSlice(buffer[20 * r : 20 * (r + 1)], (40, 3), 20 * r)
            report = w.publish(slices, version=version)
            stats = report.snapshot_free
            assert stats is not None and stats.blocks_raw == 0
            assert report.kind == ("anchor" if version == 1 else "delta")
            assert (set(stats.absolute) == set(SHAPES)) == (version == 6)
            assert set(stats.snapshots) == {"buffer"}
        commit_parts(tmp_path, version=version, world=WORLD, timeout_s=10)
        for _, _, w in ranks:
            w.finish(version)
        sub.sync()
        held = sub.tensors
        assert held is not None
        assert torch.equal(held["buffer"], buffer)
        for n in SHAPES:
            truth = torch.cat([ranks[r][0][n].detach() for r in range(WORLD)])
            want = truth.to(torch.bfloat16).view(torch.int16).numpy()
            assert np.array_equal(held[n].contiguous().view(torch.int16).numpy(), want), n
    # restarted writers attach to the chain (checked frame by frame, digests rebuilt) and go on
    again = []
    for r, (local, opt, w) in enumerate(ranks):
        w._snapfree.close()  # type: ignore[union-attr]
        fresh = ShardWriter(tmp_path, r, WORLD, snapshot="none", optimizer=opt, max_frame_bytes=256)
        slices = {n: RowSlice(p, SHAPES[n], bounds[n][r]) for n, p in local.items()}
        slices["buffer"] = RowSlice(buffer[20 * r : 20 * (r + 1)], (40, 3), 20 * r)
        if r == 1:
            with torch.no_grad():
                local["up"][0, 0] += 1.0
            with pytest.raises(TensorMismatchError):
                fresh.attach(slices)
            with torch.no_grad():
                local["up"][0, 0] -= 1.0
        assert fresh.attach(slices) == 11
        held_words = {n: s.words.size for n, s in fresh._held.tensors.items()}  # type: ignore[union-attr]
        assert held_words == {**dict.fromkeys(SHAPES, 0), "buffer": 60}
        again.append((local, opt, fresh))
    grads = _grads(999)
    for r, (local, opt, w) in enumerate(again):
        for n, p in local.items():
            p.grad = grads[n][bounds[n][r] : bounds[n][r + 1]].clone()
        opt.step()
        slices = {n: RowSlice(p, SHAPES[n], bounds[n][r]) for n, p in local.items()}
        slices["buffer"] = RowSlice(buffer[20 * r : 20 * (r + 1)], (40, 3), 20 * r)
        stats = w.publish(slices, version=12).snapshot_free
        assert stats is not None and stats.blocks_raw == 0 and stats.reconstructed == len(SHAPES)
    commit_parts(tmp_path, version=12, world=WORLD, timeout_s=10)
    for _, _, w in again:
        w.finish(12)
    sub.sync()
    for n in SHAPES:
        truth = torch.cat([again[r][0][n].detach() for r in range(WORLD)])
        want = truth.to(torch.bfloat16).view(torch.int16).numpy()
        assert np.array_equal(sub.tensors[n].contiguous().view(torch.int16).numpy(), want), n  # type: ignore[index]
