"""Layout index math against torch slicing, and the layout sync's failure behaviour."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deltastore.tensors.words
from deltastore import (
    IntegrityError,
    Layout,
    LayoutError,
    Publisher,
    Subscriber,
    fuse,
    shard,
    stack,
)
from deltastore.layout.boxes import Fuse, Part, Replicate, Shard, Stack, covered

# --- index math: every placement agrees with the same expression evaluated by torch ops -----


def evaluate(part: Part, sources: dict[str, torch.Tensor]) -> torch.Tensor:
    """The local tensor ``part`` describes, built with torch ops (padding: -1)."""
    if isinstance(part, Replicate):
        return sources[part.name]
    if isinstance(part, Shard):
        inner = evaluate(part.part, sources)
        extent = inner.shape[part.dim]
        if part.block is not None:
            lo = min(part.rank * part.block, extent)
            piece = inner.narrow(part.dim, lo, max(0, min(part.block, extent - lo)))
            pad = list(inner.shape)
            pad[part.dim] = part.block - piece.shape[part.dim]
            return torch.cat([piece, torch.full(pad, -1, dtype=inner.dtype)], part.dim)
        if part.sizes is not None:
            return inner.split(list(part.sizes), part.dim)[part.rank]
        return inner.chunk(part.world, part.dim)[part.rank]
    if isinstance(part, Fuse):
        return torch.cat([evaluate(p, sources) for p in part.parts], part.dim)
    assert isinstance(part, Stack)
    return torch.stack([evaluate(p, sources) for p in part.parts])


@st.composite
def layouts(draw: Any) -> tuple[dict[str, tuple[int, ...]], Part]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    names = [f"t{i}" for i in range(draw(st.integers(1, 3)))]
    shapes = {n: shape for n in names}

    def sharded(name: str) -> Part:
        part: Part = Replicate(name)
        for _ in range(draw(st.integers(0, 2))):
            dim = draw(st.integers(0, ndim - 1))
            extent = evaluate_shape(part, shapes)[dim]
            world = draw(st.integers(1, 3))
            rank = draw(st.integers(0, world - 1))
            how = draw(st.sampled_from(["even", "sizes", "block"]))
            if extent == 0:
                continue
            if how == "even" and extent % world == 0:
                part = shard(part, dim, rank, world)
            elif how == "sizes":
                cuts = sorted(
                    draw(st.lists(st.integers(0, extent), min_size=world - 1, max_size=world - 1))
                )
                sizes = np.diff([0, *cuts, extent]).tolist()
                part = shard(part, dim, rank, world, sizes=sizes)
            else:
                part = shard(part, dim, rank, world, block=-(-extent // world))
        return part

    parts = [sharded(n) for n in names]
    local_shapes = [evaluate_shape(p, shapes) for p in parts]
    if draw(st.booleans()) and all(s == local_shapes[0] for s in local_shapes):
        return shapes, stack(parts)
    dim = draw(st.integers(0, ndim - 1))
    if all(
        len(s) == ndim and all(s[d] == local_shapes[0][d] for d in range(ndim) if d != dim)
        for s in local_shapes
    ):
        return shapes, fuse(parts, dim)
    return shapes, parts[0]


def evaluate_shape(part: Part, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(evaluate(part, {n: torch.zeros(s) for n, s in shapes.items()}).shape)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_placements_match_torch_ops(case: tuple[dict[str, tuple[int, ...]], Part]) -> None:
    shapes, part = case
    sources = {
        n: (torch.arange(int(np.prod(s)), dtype=torch.int64) + (i << 32)).reshape(s)
        for i, (n, s) in enumerate(shapes.items())
    }
    want = evaluate(part, sources).reshape(-1)
    bound = Layout({"x": part}).bind(shapes)
    assert bound.local_shapes["x"] == tuple(evaluate(part, sources).shape)
    got = torch.full_like(want, -1)
    hits = torch.zeros_like(want)
    for name, placements in bound.placements.items():
        i = list(shapes).index(name)
        positions = np.arange(int(np.prod(shapes[name])), dtype=np.int64)
        for p in placements:
            idx, local = p.select(positions)
            got[torch.from_numpy(local)] = torch.from_numpy(positions[idx] + (i << 32))
            hits[torch.from_numpy(local)] += 1
            lo, hi = p.span()
            assert idx.size == 0 or (lo <= positions[idx].min() and positions[idx].max() < hi)
    assert torch.equal(got, want)
    assert bool((hits <= 1).all())  # each local element comes from one box


def test_covered_counts_the_union_of_boxes() -> None:
    assert covered((10, 6), [((0, 0), (6, 6)), ((6, 0), (4, 6))]) == 60
    assert covered((10, 6), [((0, 0), (6, 6)), ((4, 0), (4, 6))]) == 48
    assert covered((6, 8), [((0, 0), (6, 4)), ((0, 0), (6, 4))]) == 24
    assert covered((4, 4), [((1, 1), (2, 2)), ((0, 0), (2, 2))]) == 7
    assert covered((5,), []) == 0


def test_bind_says_what_does_not_fit() -> None:
    shapes = {"w": (8, 4), "b": (3,)}
    with pytest.raises(LayoutError, match="does not split evenly"):
        Layout({"w": shard("w", 0, 0, 3)}).bind(shapes)
    with pytest.raises(LayoutError, match="'nope' is not in the manifest"):
        Layout({"x": "nope"}).bind(shapes)
    with pytest.raises(LayoutError, match="cannot fuse"):
        Layout({"x": fuse(["w", "b"])}).bind(shapes)
    with pytest.raises(LayoutError, match=r"shape \[8, 3\], the layout gives \[8, 4\]"):
        Layout({"w": "w"}).bind(shapes, {"w": torch.zeros(8, 3)})
    with pytest.raises(LayoutError, match="not in"):
        shard("w", 0, 2, 2)
    with pytest.raises(LayoutError, match="both declare"):
        _ = Layout({"w": "w"}) + Layout({"w": "b"})


# --- the layout sync -------------------------------------------------------------------------


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "norm": torch.randn(48, generator=g).to(torch.bfloat16),
    }


def step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    for t in out.values():
        flat = t.view(torch.int16).view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 20]] ^= 1
    return out


def two_ranks() -> Layout:
    """Both TP ranks of a row-parallel w (dim 1) and a replicated norm, in one process."""
    return Layout(
        {f"r{r}.w": shard("w", 1, r, 2) for r in range(2)}
        | {f"r{r}.norm": "norm" for r in range(2)}
    )


def bits(tensors: dict[str, torch.Tensor] | Any) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16).clone() for n, t in tensors.items()}


def expected(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        **{f"r{r}.w": state["w"].chunk(2, 1)[r] for r in range(2)},
        **{f"r{r}.norm": state["norm"] for r in range(2)},
    }


def test_scatter_failure_midway_is_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=512, anchor_policy="never")
    v0, v1 = model(0), step(model(0), 1)
    pub.publish(v0, version=0)
    calls = {"n": 0}
    real = deltastore.tensors.words.scatter

    def flaky(local: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            real(local, positions[: positions.size // 2], values[: values.size // 2])
            raise OSError("device lost")
        real(local, positions, values)

    sub = Subscriber(tmp_path, layout=two_ranks())
    sub.sync()
    before = bits(sub.tensors)
    monkeypatch.setattr(deltastore.tensors.words, "scatter", flaky)
    failing = Subscriber(tmp_path, layout=two_ranks(), tensors=sub.tensors, version=0)
    pub.publish(v1, version=1)
    with pytest.raises(OSError, match="device lost"):
        failing.sync()
    assert failing.version == 0
    assert all(torch.equal(before[n], t.view(torch.int16)) for n, t in sub.tensors.items())
    monkeypatch.setattr(deltastore.tensors.words, "scatter", real)
    again = Subscriber(tmp_path, layout=two_ranks(), tensors=sub.tensors, version=0)
    again.sync()
    assert all(
        torch.equal(again.tensors[n].view(torch.int16), t.view(torch.int16))
        for n, t in expected(v1).items()
    )


def test_wrong_parent_and_damaged_replica_are_refused(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=512, anchor_policy="never")
    v0 = model(0)
    pub.publish(v0, version=0)
    sub = Subscriber(tmp_path, layout=two_ranks())
    sub.sync()
    assert sub.tensors is not None
    v1 = step(v0, 1)
    pub.publish(v1, version=1)
    # one replica of the norm drifted in a bit the delta flips: the copy-weighted checksum
    # refuses the delta. (Verification is O(changed): a drift in bits no mask touches leaves
    # every new - old unchanged and is only seen by a full verify().)
    mask = v1["norm"].view(torch.int16) ^ v0["norm"].view(torch.int16)
    at = int(torch.nonzero(mask)[0])
    sub.tensors["r1.norm"].view(torch.int16)[at] ^= mask[at] & -mask[at]  # lowest mask bit
    before = bits(sub.tensors)
    with pytest.raises(IntegrityError, match="nothing was written"):
        sub.sync()
    assert all(torch.equal(before[n], t.view(torch.int16)) for n, t in sub.tensors.items())


def test_delta_on_another_parent_recovers_from_the_anchor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store was rewritten under a receiver: its version 1 is not the receiver's. The
    receiver goes back to the anchor v0 (a warning says why) and reaches the new v2."""
    v0 = model(0)
    pub = Publisher(tmp_path, max_frame_bytes=512, anchor_policy="never")
    pub.publish(v0, version=0)
    pub.publish(step(v0, 1), version=1)
    sub = Subscriber(tmp_path, layout=two_ranks())
    sub.sync()
    assert sub.tensors is not None
    (tmp_path / "manifests" / f"{1:020d}.json").unlink()  # an operator rolled the store back
    redo = Publisher(tmp_path, max_frame_bytes=512, anchor_policy="never")
    redo.attach(v0)
    other = step(v0, 7)
    redo.publish(other, version=1)
    redo.publish(step(other, 8), version=2)
    with caplog.at_level(logging.WARNING, logger="deltastore"):
        assert sub.sync().applied == (0, 1, 2)
    assert "another state of version 1" in caplog.text
    assert all(
        torch.equal(sub.tensors[n].view(torch.int16), t.view(torch.int16))
        for n, t in expected(step(other, 8)).items()
    )


def test_fresh_bootstrap_from_a_damaged_anchor_leaves_no_version(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=512, anchor_policy="never")
    pub.publish(model(0), version=0)
    manifest_path = next((tmp_path / "manifests").iterdir())
    data = manifest_path.read_bytes()
    obj = next((tmp_path / "versions").rglob("*.dsz"))
    blob = bytearray(obj.read_bytes())
    blob[len(blob) // 2] ^= 1
    obj.write_bytes(bytes(blob))
    assert manifest_path.read_bytes() == data
    sub = Subscriber(tmp_path, layout=two_ranks())
    with pytest.raises(IntegrityError):
        sub.sync()
    assert sub.version is None


def test_delta_applies_bit_exact_through_two_rank_layout(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=512, anchor_policy="never")
    states = [model(0)]
    for i in range(1, 4):
        states.append(step(states[-1], i))
    sub = Subscriber(tmp_path, layout=two_ranks())
    for v, state in enumerate(states):
        pub.publish(state, version=v)
        report = sub.sync()
        assert report.version == v
        assert sub.tensors is not None
        for name, want in expected(state).items():
            assert torch.equal(sub.tensors[name].view(torch.int16), want.view(torch.int16))


def test_padding_only_rank_is_allocated_with_its_sources_dtype(tmp_path: Path) -> None:
    """A vocab of 96 rows over 4 ranks of 32: rank 3 holds only padding, yet gets a tensor."""
    table = {"e": torch.randn(96, 8).to(torch.bfloat16)}
    Publisher(tmp_path).publish(table, version=1)
    layout = Layout({f"r{r}/e": shard("e", 0, r, 4, block=32) for r in range(4)})
    sub = Subscriber(tmp_path, layout=layout)
    sub.sync()
    assert sub.tensors is not None
    assert {n: (t.dtype, tuple(t.shape)) for n, t in sub.tensors.items()} == {
        f"r{r}/e": (torch.bfloat16, (32, 8)) for r in range(4)
    }
    assert torch.equal(sub.tensors["r2/e"].view(torch.int16), table["e"][64:].view(torch.int16))
    assert not sub.tensors["r3/e"].view(torch.int16).any()
