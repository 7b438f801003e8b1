"""Anchor copies from sharded writers: two ShardWriters in one process, the cost policy.

A 60-version run of a small bf16 model (about 2% of the elements change per version, low-bit
flips, frames of 2048 elements) published by two :class:`ShardWriter` s (rank 0 the first rows
of every 2-D tensor and the 0-dim one, rank 1 the rest and the 1-D one) and committed by
:func:`commit_parts`. With the default anchor policy ("cost") some deltas get an anchor copy
(``anchors/<v>.json``, each rank encoding its rows of it): the copies are full anchors of
their version's state, the store verifies deep, a fresh subscriber starting at the end reads at
most 2.2 anchors of bytes and every copy bootstraps a subscriber bit for bit (int16 views).
``anchor_policy="never"`` writes none; writers that disagree on a copy corrupt nothing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deltastore import RowSlice, ShardWriter, Subscriber, commit_parts
from deltastore.errors import ManifestError, VersionNotCommittedError
from deltastore.format.keys import ANCHOR_PREFIX, anchor_key, manifest_key
from deltastore.format.manifest import Manifest, parse_manifest
from deltastore.maintenance.verify import verify_store
from deltastore.publish.publisher import PublishReport
from deltastore.publish.runs import part_key
from deltastore.store import LocalStore

WORLD = 2
#: 2048-element bf16 frames: several frames per tensor, several frames per rank.
OPTIONS: dict[str, Any] = {"max_frame_bytes": 4096}
SHAPES = {
    "embed.weight": (301, 64),
    "attn.q.weight": (64, 64),
    "attn.k.weight": (32, 64),
    "mlp.up.weight": (128, 64),
    "mlp.down.weight": (64, 128),
    "head.weight": (257, 64),
    "norm.weight": (64,),  # 1-D: all of it from rank 1
}
VERSIONS = 60
Tensors = dict[str, torch.Tensor]


class Counting(LocalStore):
    """A local store that counts the bytes read (whole objects and ranges)."""

    read = 0

    def get(self, key: str) -> bytes:
        data = super().get(key)
        self.read += len(data)
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = super().get_range(key, start, length)
        self.read += len(data)
        return data


def initial(seed: int) -> Tensors:
    g = torch.Generator().manual_seed(seed)
    out = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    out["scale"] = torch.tensor(1.25, dtype=torch.bfloat16)  # 0-dim: all of it from rank 0
    return out


def step(tensors: Tensors, seed: int, frac: float = 0.02) -> Tensors:
    """XOR a value in 1..7 into the low bits of ``frac`` of the elements of every tensor
    (vectorized on int16 views); the 0-dim tensor changes every 7th step."""
    rng = np.random.default_rng(seed)
    out: Tensors = {}
    for name, t in tensors.items():
        t = t.clone()
        words = t.reshape(-1).view(torch.int16).numpy()
        if t.dim() == 0:
            words ^= np.int16(seed % 7 == 0)
        else:
            idx = rng.choice(words.size, size=max(1, int(frac * words.size)), replace=False)
            words[idx] ^= rng.integers(1, 8, size=idx.size, dtype=np.int16)
        out[name] = t
    return out


def cut_of(rows: int) -> int:
    return rows * 2 // 5  # uneven


def slices(full: Tensors, rank: int) -> dict[str, RowSlice]:
    out: dict[str, RowSlice] = {}
    for name, t in full.items():
        if t.dim() != 2:
            if rank == (0 if t.dim() == 0 else WORLD - 1):
                out[name] = RowSlice.whole(t)
            continue
        cut = cut_of(t.shape[0])
        a, b = (0, cut) if rank == 0 else (cut, t.shape[0])
        out[name] = RowSlice(t[a:b], tuple(t.shape), a)
    return out


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.int16).numpy()


def assert_bit_exact(expected: Tensors, got: Any) -> None:
    assert got is not None and set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and tuple(got[name].shape) == tuple(t.shape), name
        assert np.array_equal(bits(got[name]), bits(t)), name


def publish_round(
    root: Path, ws: list[ShardWriter], full: Tensors, version: int
) -> tuple[Manifest, list[PublishReport]]:
    reports = [w.publish(slices(full, w.rank), version=version) for w in ws]
    manifest = commit_parts(root, version=version, world=WORLD, timeout_s=10)
    for w in ws:
        assert w.finish(version, timeout_s=10) == manifest
    return manifest, reports


def copies_of(root: Path) -> list[int]:
    keys = LocalStore(root).list(ANCHOR_PREFIX)
    return sorted(int(k[len(ANCHOR_PREFIX) :].split(".")[0]) for k in keys)


def run(root: Path, n: int, **options: Any) -> tuple[list[Tensors], list[list[PublishReport]]]:
    """Publish ``n`` versions from two writers; the states (index ``v - 1``) and reports."""
    ws = [ShardWriter(root, rank, WORLD, **(OPTIONS | options)) for rank in range(WORLD)]
    states = [initial(0)]
    reports = []
    for v in range(1, n + 1):
        if v > 1:
            states.append(step(states[-1], seed=v))
        manifest, got = publish_round(root, ws, states[-1], v)
        assert manifest.kind == ("anchor" if v == 1 else "delta")
        reports.append(got)
    return states, reports


@pytest.fixture(scope="module")
def cost_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Tensors], list[Any]]:
    root = tmp_path_factory.mktemp("cost") / "store"
    states, reports = run(root, VERSIONS)
    return root, states, reports


def test_the_cost_policy_writes_anchor_copies_of_the_committed_state(
    cost_run: tuple[Path, list[Tensors], list[list[PublishReport]]],
) -> None:
    root, _, reports = cost_run
    copies = copies_of(root)
    assert len(copies) >= 2, copies  # 60 versions of ~5% of an anchor each: some copies
    assert 1 not in copies  # an anchor version needs none
    for v in copies:
        m = parse_manifest((root / manifest_key(v)).read_bytes(), key=manifest_key(v))
        c = parse_manifest((root / anchor_key(v)).read_bytes(), key=anchor_key(v))
        assert m.kind == "delta" and c.kind == "anchor" and c.parent is None
        assert c.version == v and c.state_digest == m.state_digest
        assert {n: (e.dtype, e.shape, e.adler32) for n, e in c.tensors.items()} == {
            n: (e.dtype, e.shape, e.adler32) for n, e in m.tensors.items()
        }
    # every rank took the same decision, and says so in its report
    for rank in range(WORLD):
        with_copy = [v for v, r in enumerate(reports, 1) if r[rank].anchor_copy_bytes is not None]
        assert with_copy == copies, rank
        for v in copies:
            assert str(reports[v - 1][rank].anchor_reason).startswith("cost"), (v, rank)
    report = verify_store(root, deep=True)
    assert report.ok, report.summary()
    assert report.versions == tuple(range(1, VERSIONS + 1))


def test_a_fresh_subscriber_at_the_end_reads_at_most_2_2_anchors(
    cost_run: tuple[Path, list[Tensors], list[list[PublishReport]]],
) -> None:
    root, states, _ = cost_run
    copies = copies_of(root)
    anchor = parse_manifest((root / manifest_key(1)).read_bytes())
    anchor_bytes = anchor.payload_bytes + (root / manifest_key(1)).stat().st_size
    counting = Counting(root)
    fresh = Subscriber(counting, lease_ttl=None)
    got = fresh.sync()
    assert got.version == VERSIONS and got.path == "anchor" and got.kind == "anchor"
    assert got.applied[0] == max(copies) and got.applied[-1] == VERSIONS
    steps = [max(copies), *got.applied[1:]]
    manifests = (root / anchor_key(max(copies))).stat().st_size + sum(
        (root / manifest_key(v)).stat().st_size for v in got.applied[1:]
    )
    fetched = got.payload_bytes + manifests  # the frames it fetched and the manifests of its path
    assert fetched <= 2.2 * anchor_bytes, (fetched, anchor_bytes, steps)
    assert got.payload_bytes <= counting.read
    assert_bit_exact(states[-1], fresh.tensors)


def test_every_anchor_copy_bootstraps_a_subscriber_bit_exact(
    cost_run: tuple[Path, list[Tensors], list[list[PublishReport]]],
) -> None:
    root, states, _ = cost_run
    for v in copies_of(root):
        sub = Subscriber(root, lease_ttl=None)
        got = sub.sync(v)
        assert got.applied == (v,) and got.path == "anchor", (v, got)
        assert_bit_exact(states[v - 1], sub.tensors)


def test_the_never_policy_writes_no_copy(tmp_path: Path) -> None:
    root = tmp_path / "store"
    states, reports = run(root, 20, anchor_policy="never")  # "cost" copies version 8
    assert copies_of(root) == []
    assert not (root / "anchors").exists()
    assert all(r.anchor_copy_bytes is None for rs in reports for r in rs)
    assert all(r.anchor_reason is None for rs in reports[1:] for r in rs)
    sub = Subscriber(root, lease_ttl=None)
    assert sub.sync().path == "anchor"  # the first version: the only anchor
    assert_bit_exact(states[-1], sub.tensors)


def test_writers_that_disagree_on_a_copy_corrupt_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 wants a copy every version, rank 1 never: each version is committed without a
    copy (and a warning says why). A part whose copy lacks a tensor's slice is refused with a
    ManifestError and the version aborted. Writers that agree then commit a copy; the store
    verifies deep and subscribers are bit-exact throughout."""
    root = tmp_path / "store"
    ws = [
        ShardWriter(root, 0, WORLD, anchor_policy="every:1", **OPTIONS),
        ShardWriter(root, 1, WORLD, anchor_policy="never", **OPTIONS),
    ]
    state = initial(1)
    publish_round(root, ws, state, 1)
    follower = Subscriber(root, lease_ttl=None)
    follower.sync()
    for v in (2, 3, 4):
        state = step(state, seed=100 + v)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deltastore"):
            manifest, reports = publish_round(root, ws, state, v)
        assert reports[0].anchor_copy_bytes is not None and reports[1].anchor_copy_bytes is None
        assert manifest.kind == "delta" and copies_of(root) == []
        assert "1 of 2 writers sent an anchor copy" in caplog.text, caplog.text
        assert follower.sync().version == v
        assert_bit_exact(state, follower.tensors)
    # both want a copy, but rank 1's part lacks the slice of one tensor: refused, typed
    ws = [ShardWriter(root, rank, WORLD, anchor_policy="every:1", **OPTIONS) for rank in (0, 1)]
    for w in ws:
        assert w.attach(slices(state, w.rank)) == 4
    refused = step(state, seed=200)
    for w in ws:
        assert w.publish(slices(refused, w.rank), version=5).anchor_copy_bytes is not None
    key = root / part_key(5, 1, WORLD)
    part = json.loads(key.read_bytes())
    del part["anchor_copy"]["head.weight"]
    key.write_text(json.dumps(part))
    with pytest.raises(ManifestError, match="anchor copy"):
        commit_parts(root, version=5, world=WORLD, timeout_s=10)
    assert not (root / manifest_key(5)).exists() and not (root / anchor_key(5)).exists()
    for w in ws:
        with pytest.raises(VersionNotCommittedError, match="aborted"):
            w.finish(5, timeout_s=10)
    # writers that agree: version 6, a delta on 4 with its copy
    state = step(state, seed=201)
    manifest, _ = publish_round(root, ws, state, 6)
    assert manifest.parent is not None and manifest.parent.version == 4
    assert copies_of(root) == [6]
    copy = parse_manifest((root / anchor_key(6)).read_bytes())
    assert copy.kind == "anchor" and copy.state_digest == manifest.state_digest
    report = verify_store(root, deep=True)
    assert report.ok, report.summary()
    assert follower.sync().version == 6
    assert_bit_exact(state, follower.tensors)
    fresh = Subscriber(root, lease_ttl=None)
    got = fresh.sync()
    assert got.version == 6 and got.applied == (6,) and got.path == "anchor"
    assert_bit_exact(state, fresh.tensors)


def test_restarted_writers_keep_the_anchor_account(tmp_path: Path) -> None:
    """Writers restarted at version 10 (new ShardWriters attached to the head) write their
    anchor copies at the same versions as writers that ran straight through."""
    straight, _ = run(tmp_path / "a", 24, anchor_policy="cost:0.5")
    root = tmp_path / "b"
    ws = [ShardWriter(root, rank, WORLD, anchor_policy="cost:0.5", **OPTIONS) for rank in (0, 1)]
    for v, state in enumerate(straight[:10], start=1):
        publish_round(root, ws, state, v)
    again = [ShardWriter(root, rank, WORLD, anchor_policy="cost:0.5", **OPTIONS) for rank in (0, 1)]
    for w in again:
        assert w.attach(slices(straight[9], w.rank)) == 10
    for v, state in enumerate(straight[10:], start=11):
        publish_round(root, again, state, v)
    assert len(copies_of(tmp_path / "a")) >= 3
    assert copies_of(root) == copies_of(tmp_path / "a")
    fresh = Subscriber(root, lease_ttl=None)
    assert fresh.sync().applied[0] == max(copies_of(root))
    assert_bit_exact(straight[-1], fresh.tensors)


def test_snapshot_free_writers_write_exact_anchor_copies(tmp_path: Path) -> None:
    """Two snapshot-free writers (each with its own AdamW over its rows, float32, published
    as bf16) and the cost policy: their copies are full anchors of the versions' states, bit
    for bit the bf16 cast of the parameters."""
    root = tmp_path / "store"
    g = torch.Generator().manual_seed(2)
    full = {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items() if len(s) == 2}
    bounds = {n: (0, cut_of(t.shape[0]), t.shape[0]) for n, t in full.items()}
    ranks = []
    for r in range(WORLD):
        local = {
            n: torch.nn.Parameter(t[bounds[n][r] : bounds[n][r + 1]].clone())
            for n, t in full.items()
        }
        opt = torch.optim.AdamW(list(local.values()), lr=2e-4)
        w = ShardWriter(root, r, WORLD, snapshot="none", optimizer=opt, **OPTIONS)
        ranks.append((local, opt, w))
    states: list[Tensors] = []
    for v in range(1, 13):
        if v > 1:
            g = torch.Generator().manual_seed(1000 + v)
            grads = {n: torch.randn(t.shape, generator=g) for n, t in full.items()}
            for r, (local, opt, _) in enumerate(ranks):
                for n, p in local.items():
                    p.grad = grads[n][bounds[n][r] : bounds[n][r + 1]].clone()
                opt.step()
        for r, (local, _, w) in enumerate(ranks):
            w.publish(
                {n: RowSlice(p, tuple(full[n].shape), bounds[n][r]) for n, p in local.items()},
                version=v,
            )
        commit_parts(root, version=v, world=WORLD, timeout_s=10)
        for _, _, w in ranks:
            w.finish(v, timeout_s=10)
        states.append(
            {
                n: torch.cat([ranks[r][0][n].detach() for r in range(WORLD)]).to(torch.bfloat16)
                for n in full
            }
        )
    copies = copies_of(root)
    assert len(copies) >= 2, copies
    for v in copies:
        sub = Subscriber(root, lease_ttl=None)
        assert sub.sync(v).applied == (v,)
        assert_bit_exact(states[v - 1], sub.tensors)
    report = verify_store(root, deep=True)
    assert report.ok, report.summary()
    fresh = Subscriber(root, lease_ttl=None)
    fresh.sync()
    assert_bit_exact(states[-1], fresh.tensors)
