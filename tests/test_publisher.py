"""Publisher rules: anchors, version order, attach after restart, races, failed commits."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from deltastore import (
    ChainError,
    Publisher,
    StoreError,
    Subscriber,
    TensorMismatchError,
    VersionExistsError,
    VersionOrderError,
)
from deltastore.format.manifest import manifest_key, parse_latest, parse_manifest
from deltastore.publish.commit import advance_latest


def model(seed: int, n: int = 50_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16),
        "b": torch.randn(7, generator=g).to(torch.float32),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }


def nudge(
    tensors: dict[str, torch.Tensor], seed: int, frac: float = 0.01
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in tensors.items()}
    w = out["w"].view(torch.int16)
    idx = torch.randperm(w.numel(), generator=g)[: int(frac * w.numel())]
    w[idx] ^= 1
    out["b"][0] += 1.0
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor] | None) -> bool:
    assert b is not None
    return set(a) == set(b) and all(
        np.array_equal(
            a[k].reshape(-1).view(torch.uint8).numpy(), b[k].reshape(-1).view(torch.uint8).numpy()
        )
        for k in a
    )


def test_first_publish_is_anchor_then_deltas(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=4096)
    v1 = model(0)
    r1 = pub.publish(v1, version=10)
    assert (r1.kind, r1.parent, r1.changed_elements) == ("anchor", None, r1.total_elements)
    v2 = nudge(v1, 1)
    r2 = pub.publish(v2, version=11)
    assert (r2.kind, r2.parent) == ("delta", 10)
    assert r2.changed_elements == 500 + 1
    assert r2.frames < r1.frames  # unchanged frames are not written
    assert pub.version == 11
    sub = Subscriber(tmp_path)
    sub.sync()
    assert same_bits(v2, sub.tensors)


def test_anchor_flags(tmp_path: Path) -> None:
    pub = Publisher(tmp_path)
    with pytest.raises(ChainError, match="anchor"):
        pub.publish(model(0), version=1, anchor=False)
    v1 = model(0)
    pub.publish(v1, version=1)
    v2 = nudge(v1, 2)
    r2 = pub.publish(v2, version=2, anchor=True)
    assert r2.kind == "anchor" and r2.parent == 1 and r2.changed_elements == 501
    m = parse_manifest((tmp_path / manifest_key(2)).read_bytes())
    assert m.parent is not None and m.parent.version == 1
    changed_shape = {**v2, "extra": torch.zeros(3)}
    with pytest.raises(ChainError):
        pub.publish(changed_shape, version=3, anchor=False)
    r3 = pub.publish(changed_shape, version=3)
    assert r3.kind == "anchor" and r3.parent is None


def test_subscriber_applies_an_anchor_in_place(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=2048)
    v1 = model(0)
    pub.publish(v1, version=1)
    mine = {k: t.clone() for k, t in v1.items()}
    sub = Subscriber(tmp_path, tensors=mine, version=1)
    v2 = nudge(v1, 3)
    pub.publish(v2, version=2, anchor=True)
    report = sub.sync()
    assert report.kind == "anchor" and report.applied == (2,)
    assert same_bits(v2, mine)


def test_versions_must_increase(tmp_path: Path) -> None:
    pub = Publisher(tmp_path)
    v1 = model(0)
    pub.publish(v1, version=5)
    for bad in (5, 4, -1):
        with pytest.raises(VersionOrderError):
            pub.publish(v1, version=bad)
    with pytest.raises(VersionOrderError):
        Publisher(tmp_path).publish(v1, version=3)  # below the store's head


def test_attach_after_restart_continues_the_chain(tmp_path: Path) -> None:
    v1 = model(0)
    Publisher(tmp_path).publish(v1, version=1)
    restarted = Publisher(tmp_path)
    with pytest.raises(TensorMismatchError):
        restarted.attach(nudge(v1, 4))
    assert restarted.version is None
    assert restarted.attach(v1) == 1
    v2 = nudge(v1, 5)
    report = restarted.publish(v2, version=2)
    assert report.kind == "delta" and report.parent == 1
    sub = Subscriber(tmp_path)
    sub.sync()
    assert same_bits(v2, sub.tensors)


def test_attach_to_empty_store_or_below_head(tmp_path: Path) -> None:
    with pytest.raises(ChainError):
        Publisher(tmp_path).attach(model(0))
    v1 = model(0)
    pub = Publisher(tmp_path)
    pub.publish(v1, version=1)
    pub.publish(nudge(v1, 1), version=2)
    with pytest.raises(ChainError, match="newest"):
        Publisher(tmp_path).attach(v1, version=1)


@pytest.mark.parametrize(
    ("name", "tensor"),
    [
        ("", torch.zeros(2)),
        ("bad\nname", torch.zeros(2)),
        ("deep", torch.zeros([1] * 17)),
    ],
)
def test_bad_tensor_tables_are_refused_before_upload(tmp_path: Path, name: str, tensor) -> None:
    with pytest.raises(TensorMismatchError):
        Publisher(tmp_path).publish({name: tensor}, version=1)
    assert not (tmp_path / "versions").exists()


def test_frame_size_is_bounded(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_frame_bytes"):
        Publisher(tmp_path, max_frame_bytes=2 << 30)


def test_stale_publisher_cannot_fork_the_chain(tmp_path: Path) -> None:
    v1 = model(0)
    a = Publisher(tmp_path)
    a.publish(v1, version=1)
    b = Publisher(tmp_path)
    b.attach(v1)
    a.publish(nudge(v1, 6), version=2)
    with pytest.raises(VersionOrderError):
        b.publish(nudge(v1, 7), version=2)
    with pytest.raises(ChainError):
        b.publish(nudge(v1, 7), version=3)  # its parent (1) is no longer the head (2)


def test_racing_publishers_one_commit(tmp_path: Path) -> None:
    v1 = model(0)
    pubs = [Publisher(tmp_path, max_frame_bytes=4096) for _ in range(4)]
    pubs[0].publish(v1, version=1)
    for p in pubs[1:]:
        p.attach(v1)
    pubs[0] = Publisher(tmp_path, max_frame_bytes=4096)
    pubs[0].attach(v1)
    candidates = [nudge(v1, 100 + i) for i in range(4)]
    barrier = threading.Barrier(4)
    outcomes: list[object] = [None] * 4

    def go(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = pubs[i].publish(candidates[i], version=2)
        except (VersionExistsError, VersionOrderError) as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in enumerate(outcomes) if not isinstance(o, Exception)]
    assert len(winners) == 1
    sub = Subscriber(tmp_path)
    sub.sync()
    assert same_bits(candidates[winners[0]], sub.tensors)
    for i, p in enumerate(pubs):
        assert p.version == (2 if i == winners[0] else 1)


def test_failed_commit_leaves_publisher_at_previous_version(tmp_path: Path, monkeypatch) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=4096)
    v1 = model(0)
    pub.publish(v1, version=1)
    v2 = nudge(v1, 8)

    def broken(key: str, data: bytes) -> None:
        raise StoreError("injected: store unavailable")

    with monkeypatch.context() as m:
        m.setattr(pub.store, "put_if_absent", broken)
        with pytest.raises(StoreError):
            pub.publish(v2, version=2)
    assert pub.version == 1
    assert Subscriber(tmp_path).latest() == 1  # nothing committed
    v3 = nudge(v2, 9)
    assert pub.publish(v3, version=3).kind == "delta"  # the snapshot is still v1's
    sub = Subscriber(tmp_path)
    sub.sync()
    assert same_bits(v3, sub.tensors)


def test_latest_never_moves_backwards(tmp_path: Path) -> None:
    pub = Publisher(tmp_path)
    v1 = model(0)
    pub.publish(v1, version=1)
    pub.publish(nudge(v1, 1), version=7)
    advance_latest(pub.store, 3, b"{}")  # a slow writer finishing late
    assert parse_latest((tmp_path / "LATEST").read_bytes()).version == 7
    (tmp_path / "LATEST").write_bytes(b"garbage")  # a damaged hint is replaced, not trusted
    advance_latest(pub.store, 8, b"{}")
    assert parse_latest((tmp_path / "LATEST").read_bytes()).version == 8


def test_non_contiguous_tensors_publish_like_their_contiguous_copy(tmp_path: Path) -> None:
    base = (torch.randn(64, 48) * 0.02).to(torch.bfloat16)
    pub = Publisher(tmp_path)
    pub.publish({"w": base.t()}, version=1)  # a transposed view
    sub = Subscriber(tmp_path)
    sub.sync()
    assert same_bits({"w": base.t().contiguous()}, sub.tensors)


def test_lagging_subscriber_applies_an_anchor_with_a_parent(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, max_frame_bytes=2048)
    v1 = model(0)
    pub.publish(v1, version=1)
    sub = Subscriber(tmp_path, tensors={k: t.clone() for k, t in v1.items()}, version=1)
    v2 = nudge(v1, 11)
    pub.publish(v2, version=2)
    v3 = nudge(v2, 12)
    assert pub.publish(v3, version=3, anchor=True).parent == 2
    report = sub.sync()  # at v1, the chain stops at the anchor v3 and applies it in place
    assert report.applied == (3,) and report.kind == "anchor"
    assert same_bits(v3, sub.tensors)


def test_lone_surrogate_names_are_refused_before_upload(tmp_path: Path) -> None:
    with pytest.raises(TensorMismatchError):
        Publisher(tmp_path).publish({"bad\ud800": torch.zeros(2)}, version=1)
    assert not (tmp_path / "versions").exists()


def test_publish_requests_do_not_grow_with_the_run(tmp_path: Path) -> None:
    """A publisher takes the head from its own state: the same store operations at version 1
    and at version 40, and no listing of all of manifests/."""
    from deltastore.store import LocalStore
    from deltastore.testing.faults import FaultyStore

    store = FaultyStore(LocalStore(tmp_path))
    pub = Publisher(store, anchor_policy="never")
    w = {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}
    seen: dict[int, list[tuple[str, str]]] = {}
    for v in range(41):
        w["w"].view(torch.int16)[0, v] += 1
        store.reset()
        pub.publish(w, version=v)
        seen[v] = [(op.name, op.key.replace(f"{v:020d}", "V")) for op in store.ops]
    assert ("list", "manifests/") in seen[0]  # the first publish looks at the whole store
    for v in (1, 40):
        assert ("list", "manifests/") not in seen[v], seen[v]
    strip = [(n, k.split("/")[0]) for n, k in seen[1]]
    assert strip == [(n, k.split("/")[0]) for n, k in seen[40]]
