"""Round trips as a budget (docs/stores.md), counted where the S3 server sees them.

Every request goes through a shaped link (:mod:`deltastore.testing.link`) in front of moto,
with 50 ms of latency per request, so that requests made at once overlap and requests made
one after the other do not; :func:`critical_path` of the requests the link saw is the number
of sequential round trips. The budgets:

- a poll that finds nothing new: 1 request;
- a sync of k new deltas: at most 3 round trips for k = 1, at most k + 2 for k > 1;
- a publish: at most 3 round trips after its data objects are stored, and the same requests
  at version 10 and at version 1,000 (nothing grows with the run).

The chains are built straight against moto (no link); only the measured operations go
through it. The same numbers come back in the reports, counted by the client
(``SyncReport.requests`` / ``round_trips``, ``PublishReport.commit_round_trips``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from deltastore import Publisher, Subscriber
from deltastore.store.counting import critical_path
from deltastore.testing.link import LinkProfile, Request, ShapedLink

pytest.importorskip("s3fs")

LINK = LinkProfile("budget", latency_s=0.05, conn_bits_per_s=1e9, total_bits_per_s=1e9)
Tensors = dict[str, torch.Tensor]


def options(endpoint: str) -> dict[str, object]:
    return {"key": "testing", "secret": "testing", "endpoint_url": endpoint}


@pytest.fixture(scope="module")
def link(s3_endpoint: str) -> Iterator[ShapedLink]:
    with ShapedLink(int(s3_endpoint.rsplit(":", 1)[1]), LINK) as shaped:
        yield shaped


def step(w: Tensors, gen: torch.Generator) -> Tensors:
    """The next version: 1% of the elements of every tensor one ulp up."""
    out = {n: t.clone() for n, t in w.items()}
    for t in out.values():
        flat = t.view(torch.int16).view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 100]] += 1
    return out


@dataclass
class Chain:
    url: str
    states: dict[int, Tensors]  # the versions the tests start from, by number
    head: int


def build_chain(endpoint: str, name: str, head: int, keep: set[int]) -> Chain:
    """Versions 0..head (0 an anchor, the default anchor policy), published straight to
    moto; the states of the versions in ``keep`` (and the head) are kept."""
    gen = torch.Generator().manual_seed(head)
    w = {
        f"layer{i}.weight": torch.randn(64, 256, generator=gen).to(torch.bfloat16) for i in range(4)
    }
    url = f"s3://e2e/{name}"
    pub = Publisher(url, storage_options=options(endpoint))
    states: dict[int, Tensors] = {}
    for v in range(head + 1):
        if v:
            w = step(w, gen)
        pub.publish(w, version=v)
        if v in keep or v == head:
            states[v] = w
    return Chain(url, states, head)


@pytest.fixture(scope="module")
def chains(s3_endpoint: str) -> Callable[[int], Chain]:
    """The chain with ``head`` versions, built on first use and shared by the module."""
    built: dict[int, Chain] = {}

    def get(head: int) -> Chain:
        if head not in built:
            built[head] = build_chain(s3_endpoint, f"budget-{head}", head, {head - 5, head - 1})
        return built[head]

    return get


@pytest.fixture(scope="module", params=[10, 1000], ids=["v10", "v1000"])
def chain(request: pytest.FixtureRequest, chains: Callable[[int], Chain]) -> Chain:
    return chains(int(request.param))


def same(a: Tensors, b: Tensors | None) -> bool:
    return b is not None and all(
        torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a
    )


def follower(chain: Chain, link: ShapedLink, at: int) -> Subscriber:
    """A subscriber through the link, handed tensors at version ``at`` (checked, uncounted)."""
    tensors = {n: t.clone() for n, t in chain.states[at].items()}
    sub = Subscriber(chain.url, storage_options=options(link.endpoint), tensors=tensors, version=at)
    sub.verify()
    return sub


def describe(requests: list[Request]) -> str:
    t0 = min((r.start for r in requests), default=0.0)
    return "\n".join(
        f"{r.start - t0:6.3f}-{r.end - t0:6.3f} {r.method} {r.target[:100]}"
        for r in sorted(requests, key=lambda r: r.start)
    )


@pytest.mark.parametrize("k", [1, 5])
def test_a_sync_of_k_deltas_fits_the_round_trip_budget(
    chain: Chain, link: ShapedLink, k: int
) -> None:
    sub = follower(chain, link, chain.head - k)
    with link.counting() as seen:
        report = sub.sync()
    assert report.applied == tuple(range(chain.head - k + 1, chain.head + 1))
    assert same(chain.states[chain.head], sub.tensors)
    budget = 3 if k == 1 else k + 2
    assert critical_path(seen) <= budget, describe(seen)
    assert not [r for r in seen if r.method == "HEAD"], describe(seen)  # no HEAD before GET
    assert sum(r.method == "GET" and "/versions/" in r.target for r in seen) == k  # one each
    # the client's own count agrees with the server's
    assert (report.requests, report.round_trips) == (len(seen), critical_path(seen))
    # then a poll that finds nothing new: one request
    with link.counting() as poll:
        assert sub.latest() == chain.head
    assert len(poll) == 1 and poll[0].method == "GET" and "list-type=2" in poll[0].target
    sub.close()


def publish_requests(chain: Chain, link: ShapedLink) -> list[tuple[str, bool]]:
    """Publish three versions on top of ``chain`` through the link, checking each against the
    budget; the requests (method, is a listing) of the last one."""
    gen = torch.Generator().manual_seed(7)
    pub = Publisher(chain.url, storage_options=options(link.endpoint), anchor_policy="never")
    assert pub.attach(chain.states[chain.head]) == chain.head
    w = step(chain.states[chain.head], gen)
    pub.publish(w, version=chain.head + 1)  # the first publish probes the store once
    counts = []
    for v in (chain.head + 2, chain.head + 3):
        w = step(w, gen)
        with link.counting() as seen:
            report = pub.publish(w, version=v)
        data = [r for r in seen if r.method == "PUT" and "/versions/" in r.target]
        assert len(data) == 1, describe(seen)
        after = [r for r in seen if r.start >= data[-1].end]
        assert critical_path(after) <= 3, describe(seen)  # head check, commit, LATEST
        assert not [r for r in seen if r.method == "HEAD"], describe(seen)
        assert report.commit_round_trips == critical_path(after)
        assert report.requests == len(seen)
        counts.append(sorted((r.method, "list-type" in r.target) for r in seen))
    assert counts[0] == counts[1]
    sub = Subscriber(chain.url, storage_options=options(link.endpoint), lease_ttl=None)
    sub.sync()
    assert same(w, sub.tensors)
    return counts[1]


def test_a_publish_fits_the_budget_and_does_not_grow_with_the_run(
    chains: Callable[[int], Chain], link: ShapedLink
) -> None:
    """The same requests at version 10 and at version 1,000, both measured in this test
    (it runs after the syncs of both chains: it publishes on top of them)."""
    short, long = publish_requests(chains(10), link), publish_requests(chains(1000), link)
    assert short == long
    assert short  # a publish makes requests: the comparison is of something


def test_a_publish_with_an_anchor_copy_still_takes_three_round_trips_after_the_data(
    s3_endpoint: str, link: ShapedLink
) -> None:
    chain = build_chain(s3_endpoint, "budget-copy", 3, set())
    gen = torch.Generator().manual_seed(8)
    pub = Publisher(chain.url, storage_options=options(link.endpoint), anchor_policy="every:1")
    pub.attach(chain.states[3])
    w = step(chain.states[3], gen)
    pub.publish(w, version=4)
    w = step(w, gen)
    with link.counting() as seen:
        report = pub.publish(w, version=5)
    assert report.anchor_copy_bytes is not None
    data = [r for r in seen if r.method == "PUT" and "/versions/" in r.target]
    assert len(data) == 2  # the delta's object and the copy's, uploaded at once
    assert critical_path(data) == 1, describe(seen)
    after = [r for r in seen if r.start >= max(r.end for r in data)]
    assert critical_path(after) <= 3, describe(seen)  # head check, commit, copy and LATEST
    fresh = Subscriber(chain.url, storage_options=options(link.endpoint), lease_ttl=None)
    assert fresh.sync().path == "anchor"
    assert same(w, fresh.tensors)


# --- followers at fleet scale --------------------------------------------------------------


def test_poll_schedule_backs_off_while_idle_and_stays_bounded() -> None:
    from deltastore.sync.poll import PollSchedule

    s = PollSchedule(interval=2.0, max_interval=10.0)
    waits = []
    for _ in range(8):
        s.idle()
        waits.append(s.wait)
    assert waits[:3] == [3.0, 4.5, 6.75] and waits[-1] == 10.0  # 1.5x, up to the bound
    s.found()
    assert s.wait == 2.0
    s.failed()
    s.failed()
    s.failed()
    assert s.wait == 10.0  # doubled, bounded
    delays = [s.delay() for _ in range(200)]
    assert 8.0 <= min(delays) < max(delays) <= 12.0  # jittered by +-20%
    fixed = PollSchedule(interval=5.0, max_interval=5.0)
    fixed.idle()
    assert fixed.wait == 5.0
    for bad in ({"interval": 0}, {"interval": 3.0, "max_interval": 2.0}, {"growth": 0.5}):
        with pytest.raises(ValueError, match="need"):
            PollSchedule(**bad)  # type: ignore[arg-type]
