"""The layout sync's dense path: delta frames that change many elements travel as ranges of XOR
masks and are staged, verified and written as whole runs; bit-exact, verified and all or
nothing like the per-element path, whatever the codec, density and layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deltastore.sync.ranks
import deltastore.tensors.words
from deltastore import (
    FrameError,
    IntegrityError,
    Layout,
    Publisher,
    Subscriber,
    TensorMismatchError,
    shard,
)
from deltastore.format.manifest import manifest_key, state_digest
from deltastore.sync.apply import DENSE, contribution, run_sums, stage_dense
from deltastore.tensors.words import Write

SHAPE = (768, 1536)  # 1.18 M bf16 elements: frames of several 1 MiB decode chunks


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    offset=st.integers(0, 500),
    tail=st.integers(0, 500),
    density=st.floats(0.0, 1.0),
    wide=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_run_sums_equal_the_contribution_of_the_changed_words(
    n: int, offset: int, tail: int, density: float, wide: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    wdt = np.uint32 if wide else np.uint16
    old = rng.integers(0, np.iinfo(wdt).max, n, dtype=wdt, endpoint=True)
    new = old.copy()
    at = np.flatnonzero(rng.random(n) < density)
    new[at] = rng.integers(0, np.iinfo(wdt).max, at.size, dtype=wdt, endpoint=True)
    size = old.dtype.itemsize
    nbytes = (offset + n + tail) * size
    ch = np.flatnonzero(old != new)
    want = contribution(ch + offset, old[ch], new[ch], nbytes)
    assert run_sums(old, new, offset * size, nbytes) == want
    # staged from a tensor holding the run at element 7: whole iff 1/DENSE of it changes
    dest = np.concatenate([np.zeros(7, wdt), old, np.zeros(3, wdt)])
    for xor, values in ((False, new), (True, old ^ new)):
        update, sums = stage_dense("t", dest, 7, values, offset, nbytes, xor=xor)
        assert sums == want
        assert update.dense == (ch.size * DENSE >= n)
        out = dest.copy()
        write = Write(
            out[update.start :], update.positions, update.old, update.new, update.dense, update.xor
        )
        write.put(write.new)
        assert np.array_equal(out[7 : 7 + n], new)
        assert np.array_equal(np.delete(out, np.s_[7 : 7 + n]), np.delete(dest, np.s_[7 : 7 + n]))
        write.put(write.old)  # the restore
        assert np.array_equal(out, dest)


def state0() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": (torch.randn(SHAPE, generator=g) * 0.02).to(torch.bfloat16),
        "norm": torch.randn(SHAPE[1], generator=g).to(torch.bfloat16),
    }


def step(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """Flip the low bit of ``fraction`` of the elements (of the first half of ``w`` only, so
    that frames of both densities occur in one version)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    for name, t in out.items():
        flat = t.view(torch.int16).view(-1)
        span = flat.numel() // 2 if name == "w" else flat.numel()
        flat[torch.randperm(span, generator=g)[: int(span * fraction)]] ^= 1
    return out


def layouts() -> dict[str, tuple[Layout | None, Any]]:
    """Layouts with their expected local tensors: whole tensors (one run per placement), a
    column split (row-parallel: no run; the element-wise rest) and a row split (one run per
    rank) with a replicated norm (copies counted 2)."""

    def cols(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"r{r}.w": s["w"].chunk(2, 1)[r] for r in range(2)} | {"norm": s["norm"]}

    def rows(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"r{r}.w": s["w"].chunk(2, 0)[r] for r in range(2)} | {
            f"r{r}.norm": s["norm"] for r in range(2)
        }

    return {
        "whole": (Layout({"w": "w", "norm": "norm"}), dict),
        "cols": (
            Layout({f"r{r}.w": shard("w", 1, r, 2) for r in range(2)} | {"norm": "norm"}),
            cols,
        ),
        "rows": (
            Layout(
                {f"r{r}.w": shard("w", 0, r, 2) for r in range(2)}
                | {f"r{r}.norm": "norm" for r in range(2)}
            ),
            rows,
        ),
    }


def spy_dense(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the runs staged whole."""
    calls: list[int] = []
    real = deltastore.sync.ranks.stage_dense

    def counted(*args: Any, **kwargs: Any) -> Any:
        update, sums = real(*args, **kwargs)
        calls.append(int(update.dense))
        return update, sums

    monkeypatch.setattr(deltastore.sync.ranks, "stage_dense", counted)
    return calls


def equal_bits(got: Any, want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(
        torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in want.items()
    )


@pytest.mark.parametrize("codecs", ["v1", "v2"])
@pytest.mark.parametrize("layout", ["whole", "cols", "rows"])
def test_dense_deltas_apply_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codecs: str, layout: str
) -> None:
    lay, local = layouts()[layout]
    pub = Publisher(tmp_path, max_frame_bytes=1 << 22, anchor_policy="never", codecs=codecs)  # type: ignore[arg-type]
    states = [state0()]
    for i, fraction in enumerate((0.5, 0.02, 1.0, 1 / DENSE + 0.01, 0.3), start=1):
        states.append(step(states[-1], fraction, i))
    sub = Subscriber(tmp_path, layout=lay)
    dense = spy_dense(monkeypatch)
    for v, state in enumerate(states):
        pub.publish(state, version=v)
        assert sub.sync().version == v
        assert equal_bits(sub.tensors, local(state)), f"version {v}"
    if layout != "cols":  # runs exist: the dense versions' frames are staged whole
        assert sum(dense) > 0


def test_a_dense_delta_on_a_drifted_state_is_refused_and_nothing_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=1 << 22, anchor_policy="never")
    v0 = state0()
    pub.publish(v0, version=0)
    sub = Subscriber(tmp_path, layout=Layout({"w": "w", "norm": "norm"}))
    sub.sync()
    assert sub.tensors is not None
    v1 = step(v0, 0.5, 1)
    pub.publish(v1, version=1)
    # one element the delta changes drifted in a bit the mask flips: the run's sums differ
    mask = v1["w"].view(torch.int16).view(-1) ^ v0["w"].view(torch.int16).view(-1)
    nonzero = torch.nonzero(mask).view(-1)
    at = int(nonzero[nonzero.numel() // 2])
    sub.tensors["w"].view(torch.int16).view(-1)[at] ^= mask[at] & -mask[at]
    before = {n: t.view(torch.int16).clone() for n, t in sub.tensors.items()}
    dense = spy_dense(monkeypatch)
    with pytest.raises(IntegrityError, match="nothing was written"):
        sub.sync()
    assert any(dense)
    assert equal_bits(sub.tensors, before)
    assert sub.version == 0


@pytest.mark.parametrize("kind", ["xor_range", "scatter_range"])
def test_a_dense_write_failing_midway_is_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The second write of a dense version fails: an in-place XOR (host words) before it writes
    anything (numpy checks operands first), or a range copy (device words: simulated with CPU
    tensors taken through torch's device path) halfway. Every write started is undone."""
    pub = Publisher(tmp_path, max_frame_bytes=1 << 22, anchor_policy="never", codecs="v1")
    v0 = state0()
    pub.publish(v0, version=0)
    v1 = step(v0, 0.5, 1)
    pub.publish(v1, version=1)
    pub.publish(step(v1, 0.5, 2), version=2, anchor=True)  # new words, staged as copies
    lay = Layout({"w": "w", "norm": "norm"})
    sub = Subscriber(tmp_path, layout=lay)
    sub.sync(version=0 if kind == "xor_range" else 1)
    before = {n: t.view(torch.int16).clone() for n, t in (sub.tensors or {}).items()}
    real, calls = getattr(deltastore.tensors.words, kind), {"n": 0}

    def flaky(local: Any, *args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            if kind == "scatter_range":  # half written, then the device is lost
                start, values = args
                real(local, start, values[: values.size // 2])
            raise OSError("device lost")
        real(local, *args)

    monkeypatch.setattr(deltastore.tensors.words, kind, flaky)
    if kind == "scatter_range":  # as on a device: no numpy view of the words
        monkeypatch.setattr(deltastore.tensors.words, "host_view", lambda local: None)
    with pytest.raises(OSError, match="device lost"):
        sub.sync(version=sub.version + 1)
    assert calls["n"] > 2  # the restore went through the same function
    assert equal_bits(sub.tensors, before)
    monkeypatch.setattr(deltastore.tensors.words, kind, real)
    assert sub.sync().version == 2
    assert equal_bits(sub.tensors, step(v1, 0.5, 2))


def test_an_anchor_on_a_known_state_is_checked_frame_by_frame(tmp_path: Path) -> None:
    """A full version over a known state: no sums of changes, each frame's Adler-32 when it is
    decoded and the frames' sums against the tensor's; a damaged frame or a tensor checksum
    the frames do not add up to is refused with nothing written."""
    lay, local = layouts()["rows"]
    pub = Publisher(tmp_path, max_frame_bytes=1 << 22, anchor_policy="never")
    v0 = state0()
    pub.publish(v0, version=0)
    sub = Subscriber(tmp_path, layout=lay)
    sub.sync()
    v1 = step(v0, 0.5, 1)
    assert pub.publish(v1, version=1, anchor=True).kind == "anchor"
    path = tmp_path / manifest_key(1)
    good = path.read_text()
    before = {n: t.view(torch.int16).clone() for n, t in (sub.tensors or {}).items()}

    def again() -> Subscriber:  # a receiver at version 0 that has not read version 1 yet
        return Subscriber(tmp_path, layout=lay, tensors=sub.tensors, version=0)

    bad = json.loads(good)
    bad["tensors"]["w"]["adler32"] ^= 0x00010000
    bad["state_digest"] = state_digest(
        (n, t["dtype"], t["shape"], t["adler32"]) for n, t in bad["tensors"].items()
    )
    path.write_text(json.dumps(bad))
    with pytest.raises(IntegrityError, match="do not add up"):
        again().sync()
    assert sub.version == 0 and equal_bits(sub.tensors, before)

    path.write_text(good)
    obj = tmp_path / json.loads(good)["tensors"]["w"]["frames"][-1]["object"]
    blob = obj.read_bytes()
    obj.write_bytes(blob[:-64] + bytes(b ^ 0x55 for b in blob[-64:]))
    with pytest.raises((IntegrityError, FrameError)):
        again().sync()
    assert sub.version == 0 and equal_bits(sub.tensors, before)

    obj.write_bytes(blob)
    repaired = again()
    assert repaired.sync().version == 1
    assert equal_bits(repaired.tensors, local(v1))


@pytest.mark.parametrize("layout", ["whole", "cols", "rows"])
def test_verify_reads_runs_whole_and_finds_one_flipped_bit(tmp_path: Path, layout: str) -> None:
    """The full check of a layout (at attach): runs by zlib's Adler-32, the rest element-wise;
    a flipped bit in any local tensor, a replica's included, names its tensor."""
    lay, _ = layouts()[layout]
    pub = Publisher(tmp_path, max_frame_bytes=1 << 22)
    pub.publish(state0(), version=0)
    sub = Subscriber(tmp_path, layout=lay)
    sub.sync()
    sub.verify()
    assert sub.tensors is not None
    for local, t in sub.tensors.items():
        flat = t.view(torch.int16).view(-1)
        at = flat.numel() * 2 // 3
        flat[at] ^= 4
        with pytest.raises(TensorMismatchError, match="norm" if "norm" in local else "w"):
            sub.verify()
        flat[at] ^= 4
    sub.verify()
