"""The shaped link (deltastore.testing.link): latency and bandwidth applied per request and
in both directions, requests counted where the server sees them, and a publish and sync
through it bit-exact (the request budgets themselves: tests/test_round_trips.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from deltastore import Publisher, Subscriber
from deltastore.testing.link import LinkProfile, Request, ShapedLink

pytest.importorskip("s3fs")

SLOW = LinkProfile("test", latency_s=0.05, conn_bits_per_s=8e6, total_bits_per_s=16e6)


@pytest.fixture
def link(s3_endpoint: str) -> Iterator[ShapedLink]:
    port = int(s3_endpoint.rsplit(":", 1)[1])
    with ShapedLink(port, SLOW) as shaped:
        yield shaped


def options(link: ShapedLink) -> dict[str, object]:
    return {"key": "testing", "secret": "testing", "endpoint_url": link.endpoint}


def test_critical_path_counts_sequential_requests_only() -> None:
    seq = [Request("GET", "/a", 0.0, 1.0), Request("GET", "/b", 1.0, 2.0)]
    par = [Request("GET", f"/{i}", 2.0, 3.0) for i in range(5)]
    assert ShapedLink.critical_path(seq) == 2
    assert ShapedLink.critical_path(par) == 1
    assert ShapedLink.critical_path(seq + par) == 3
    assert ShapedLink.critical_path([]) == 0


def test_latency_and_bandwidth_are_applied(link: ShapedLink) -> None:
    from deltastore.store import open_store

    store = open_store("s3://e2e/link-shape", options(link))
    store.put("blob", b"x" * 200_000)  # 1.6 Mbit: 0.2 s at 8 Mbit/s
    with link.counting() as got:
        t0 = time.monotonic()
        assert store.get("blob") == b"x" * 200_000
        elapsed = time.monotonic() - t0
    assert [r.method for r in got] == ["GET"]  # no HEAD before it
    assert got[0].target.startswith("/e2e/link-shape/blob")
    assert got[0].end - got[0].start >= SLOW.latency_s
    # one round trip, then the bytes at the connection's cap
    assert elapsed >= SLOW.latency_s + 0.15
    with link.counting() as up:
        t0 = time.monotonic()
        store.put("up", b"y" * 200_000)  # uploads are paced too
        elapsed = time.monotonic() - t0
    assert [r.method for r in up] == ["PUT"]
    assert elapsed >= SLOW.latency_s + 0.15


def test_publish_and_sync_through_the_link(link: ShapedLink) -> None:
    url = "s3://e2e/link-chain"
    gen = torch.Generator().manual_seed(3)
    w = {"w": torch.randn(64, 256, generator=gen).to(torch.bfloat16)}
    pub = Publisher(url, storage_options=options(link))
    pub.publish(w, version=0)
    sub = Subscriber(url, storage_options=options(link), lease_ttl=None)
    sub.sync()
    with link.counting() as poll:
        assert sub.latest() == 0
    w["w"].view(torch.int16)[0, :300] += 1
    pub.publish(w, version=1)
    with link.counting() as sync:
        report = sub.sync()
    assert report.applied == (1,)
    assert sub.tensors is not None
    assert torch.equal(sub.tensors["w"].view(torch.int16), w["w"].view(torch.int16))
    assert len(poll) == 1  # a listing after the held version
    assert ShapedLink.critical_path(sync) <= 3  # list, manifest, frames
