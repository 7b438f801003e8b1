"""The benchmark (benchmarks/README.md): smoke run of ``deltastore bench --size small`` through the
local store with the fewest versions, checked for well-formed output, bit-wise agreement of
every system (and every dense load method) with the workload, the strongest dense baseline in
every ratio, the floors and the bar; the dense loads and the floors on their own; the
performance page generated from the results JSON. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import mmap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from deltastore.bench import (
    SCHEMA_VERSION,
    SYSTEMS,
    BenchResult,
    Workload,
    WorkloadSpec,
    analysis,
    entropy,
    floors,
    report,
    serving,
)
from deltastore.bench.dense import (
    LOAD_FILE,
    LOAD_FILE_ONE_THREAD,
    RANGED,
    SAFE_OPEN,
    WHOLE_GET,
    DenseReceiver,
    DenseSender,
    parse_layout,
)
from deltastore.bench.ops import Differ, RssMeter, digest, flip_positions
from deltastore.bench.schema import (
    LinkInfo,
    PublishSample,
    PublishTimes,
    ScalingResult,
    ScalingSide,
    SyncSample,
    SyncTimes,
)
from deltastore.bench.systems import SUBSCRIBER_WORKERS
from deltastore.publish.publisher import Publisher
from deltastore.store import LocalStore
from deltastore_cli import app
from deltastore_cli.common import EXIT_ERROR

runner = CliRunner()
VERSIONS = 1


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[BenchResult, str, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "out.json"
    md = tmp / "out.md"
    args = ["-q", "bench", "--size", "small", "--store", "local", "--versions", str(VERSIONS)]
    args += ["--warmup", "0", "--workdir", str(tmp / "cache"), "--json", str(out)]
    result = runner.invoke(app, [*args, "--markdown", str(md)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert md.read_text() == result.stdout
    return BenchResult.model_validate_json(out.read_text()), result.stdout, tmp / "cache"


def test_json_is_well_formed(run: tuple[BenchResult, str, Path]) -> None:
    res, _, _ = run
    assert res.schema_version == SCHEMA_VERSION == 2
    assert BenchResult.model_validate(json.loads(res.model_dump_json())) == res
    assert res.workload.size == "small" and res.workload.versions == VERSIONS
    assert res.machine.cores >= 1 and res.machine.memory_bytes > 0
    assert [s.store for s in res.stores] == ["local"] and not res.skipped
    (store,) = res.stores
    assert list(store.systems) == list(SYSTEMS)
    assert "dense-naive" in SYSTEMS
    dense_bytes = res.workload.dense_bytes
    for name, sr in store.systems.items():
        assert sr.system == name and sr.publish_method and sr.method
        assert [s.version for s in sr.publish] == list(range(1, VERSIONS + 1))
        assert [s.version for s in sr.sync] == list(range(1, VERSIONS + 1))
        for p, changed in zip(sr.publish, res.workload.changed_elements, strict=True):
            assert p.changed_elements == changed > 0
            assert p.times.payload_bytes > 0 and p.times.total_s > 0
            assert math.isclose(p.bytes_per_changed, p.times.payload_bytes / changed)
        for s in sr.sync:
            assert s.times.total_s > 0
            assert s.times.cpu_s is not None and s.times.cpu_s >= 0
        m = sr.median
        assert m.publisher_rss_extra_fraction == m.publisher_rss_extra_bytes / dense_bytes
        # the medians and maxima of the raw samples, computed here
        pub_rss = [p.rss_extra_bytes for p in sr.publish]
        assert m.publisher_rss_extra_bytes == float(np.median(pub_rss))
        assert m.subscriber_rss_extra_bytes == float(
            np.median([s.rss_extra_bytes for s in sr.sync])
        )
        assert sr.publisher_rss_extra_max_bytes == max(pub_rss)
        if name != "dense":
            assert sr.methods == {} and all(s.method is None for s in sr.sync)
    assert store.systems["dense"].median.publish.payload_bytes > dense_bytes  # + header
    assert store.anchor_bytes is not None and 0 < store.anchor_bytes < dense_bytes
    assert store.anchor_fraction == store.anchor_bytes / dense_bytes


def test_dense_is_the_fastest_of_its_methods(run: tuple[BenchResult, str, Path]) -> None:
    res, _, _ = run
    (store,) = res.stores
    dense = store.systems["dense"]
    assert list(dense.methods) == [LOAD_FILE, SAFE_OPEN, LOAD_FILE_ONE_THREAD]
    for name, m in dense.methods.items():
        assert m.method == name and m.exact
        assert [s.version for s in m.sync] == list(range(1, VERSIONS + 1))
        assert all(s.method == name for s in m.sync)
        assert m.median.total_s == pytest.approx(
            float(np.median([s.times.total_s for s in m.sync]))
        )
    fastest = min(dense.methods.values(), key=lambda m: m.median.total_s)
    assert dense.method == fastest.method
    assert dense.sync == fastest.sync and dense.median.sync == fastest.median
    ds = store.systems["deltastore"].median
    assert store.ratios["dense"].sync == pytest.approx(fastest.median.total_s / ds.sync.total_s)


def _median_of(samples: list[float]) -> float:
    return float(np.median(samples))


def test_ratios_follow_from_the_raw_samples(run: tuple[BenchResult, str, Path]) -> None:
    """Every ratio against the medians computed here from the raw per-version samples in the
    JSON (not from the medians the code stored)."""
    res, _, _ = run
    (store,) = res.stores
    assert set(store.ratios) == {"dense", "coo", "xor-dense"}  # never dense-naive

    def med(system: str, side: str, field: str) -> float:
        samples = getattr(store.systems[system], side)
        return _median_of([getattr(x.times, field) for x in samples])

    for base, r in store.ratios.items():
        payload = med(base, "publish", "payload_bytes") / med(
            "deltastore", "publish", "payload_bytes"
        )
        assert r.payload == pytest.approx(payload, rel=1e-12)
        publish = med(base, "publish", "total_s") / med("deltastore", "publish", "total_s")
        assert r.publish == pytest.approx(publish, rel=1e-12)
        sync = med(base, "sync", "total_s") / med("deltastore", "sync", "total_s")
        assert r.sync == pytest.approx(sync, rel=1e-12)
    assert len(store.detect_bound_s) == VERSIONS
    bound = _median_of(store.detect_bound_s)
    assert store.detect_bound_median_s == pytest.approx(bound, rel=1e-12)
    assert store.publish_bound_ratio == pytest.approx(
        med("deltastore", "publish", "total_s") / bound, rel=1e-12
    )
    assert store.pause_fraction == pytest.approx(
        med("deltastore", "sync", "pause_s") / med("deltastore", "sync", "total_s"), rel=1e-12
    )


def _publish(version: int, payload: int, total_s: float, rss: int) -> PublishSample:
    times = PublishTimes(
        payload_bytes=payload, detect_s=0.0, encode_s=0.0, upload_s=0.0, total_s=total_s
    )
    return PublishSample(
        version=version, changed_elements=100, bytes_per_changed=payload / 100, times=times,
        rss_extra_bytes=rss,
    )  # fmt: skip


def _sync(version: int, total_s: float, pause_s: float, rss: int) -> SyncSample:
    t = SyncTimes(fetch_s=0, decode_s=0, verify_s=0, apply_s=0, pause_s=pause_s, total_s=total_s)
    return SyncSample(version=version, times=t, rss_extra_bytes=rss, digest="0", exact=True)


def test_medians_and_ratios_of_known_numbers() -> None:
    """Hand-computed medians (odd and even counts) and ratios of a fixture: a ratio computed
    from the wrong median, or the wrong way round, fails here."""
    ours = analysis.medians(
        [_publish(1, 300, 2.0, 10), _publish(2, 100, 1.0, 30), _publish(3, 200, 4.0, 20)],
        [_sync(1, 0.5, 0.1, 7), _sync(2, 0.3, 0.3, 5), _sync(3, 0.4, 0.2, 9)],
        dense_bytes=1000,
    )
    assert ours.publish.payload_bytes == 200 and ours.publish.total_s == 2.0
    assert ours.sync.total_s == 0.4 and ours.sync.pause_s == 0.2
    assert ours.bytes_per_changed == 2.0
    assert ours.publisher_rss_extra_bytes == 20 and ours.publisher_rss_extra_fraction == 0.02
    assert ours.subscriber_rss_extra_bytes == 7
    base = analysis.medians(
        [_publish(1, 5000, 3.0, 40), _publish(2, 1000, 9.0, 60)],  # even: mean of the middle
        [_sync(1, 2.0, 1.0, 1), _sync(2, 6.0, 1.0, 3)],
        dense_bytes=1000,
    )
    assert base.publish.payload_bytes == 3000 and base.publish.total_s == 6.0
    assert base.sync.total_s == 4.0
    r = analysis.ratios(ours, base)
    assert r.payload == 15.0 and r.publish == 3.0 and r.sync == 10.0
    assert r.publisher_rss == 2.5 and r.subscriber_rss == pytest.approx(2 / 7)


def test_floors_are_measured_on_the_same_changes(run: tuple[BenchResult, str, Path]) -> None:
    res, _, _ = run
    (store,) = res.stores
    fl = store.floors
    assert fl is not None
    published = store.systems["deltastore"].publish
    assert [f.version for f in fl.samples] == list(range(1, VERSIONS + 1))
    for f, p in zip(fl.samples, published, strict=True):
        assert f.changed_elements == p.changed_elements
        assert f.payload_bytes == p.times.payload_bytes  # every stored frame decompressed
        assert f.frames > 0 and min(f.decompress_s, f.gather_s, f.scatter_s) > 0
        parts = f.decompress_s + f.gather_s + f.checksum_s + f.scatter_s
        assert f.receiver_floor_s == pytest.approx(parts)
        assert f.scatter_floor_s > 0
        assert f.threads == SUBSCRIBER_WORKERS and f.pool_decompress_s and f.rmw_s
        assert f.memory_floor_s == pytest.approx(f.pool_decompress_s + f.rmw_s)
        assert f.xor_entropy_floor == pytest.approx(
            (f.gap_entropy_bytes + f.mask_entropy_bytes) / f.changed_elements  # type: ignore[operator]
        )
    memory = _median_of([f.memory_floor_s for f in fl.samples])  # type: ignore[misc]
    assert fl.memory_floor_median_s == pytest.approx(memory)
    assert fl.rmw_per_change_median_s == pytest.approx(
        _median_of([f.rmw_s / f.changed_elements for f in fl.samples])  # type: ignore[operator]
    )
    ds = store.systems["deltastore"].median.sync
    assert fl.memory_floor_ratio == pytest.approx(ds.total_s / memory)
    receiver = float(np.median([f.receiver_floor_s for f in fl.samples]))
    scatter = float(np.median([f.scatter_floor_s for f in fl.samples]))
    assert fl.receiver_floor_median_s == pytest.approx(receiver)
    assert fl.sync_floor_ratio == pytest.approx(ds.total_s / receiver)
    assert fl.pause_floor_ratio == pytest.approx(ds.pause_s / scatter)


def test_bar_checks(run: tuple[BenchResult, str, Path]) -> None:
    res, _, _ = run
    (store,) = res.stores
    assert store.floors is not None
    bars = {(b.name, b.store): b for b in res.bars}
    expect = {
        ("payload bytes per changed element", None): ("<=", 1.30),
        ("payload vs XOR entropy floor", None): ("<=", 1.05),
        ("payload smaller than coo", None): (">", 1.0),
        ("payload smaller than xor-dense", None): (">", 1.0),
        ("anchor size", None): ("<=", 0.70),
        ("publish vs detect lower bound", "local"): ("<=", 1.5),
        ("sync faster than dense", "local"): ("report", 0.0),
        ("sync vs receiver floor", "local"): ("<=", 2.0),
        ("subscriber extra peak RSS", "local"): ("<=", 0.05),
        ("pause fraction", "local"): ("<=", 0.20),
        ("pause vs scatter floor", "local"): ("<=", 1.5),
        ("sync vs memory floor", "local"): ("<=", 1.3),
        ("cpu per change", "local"): ("report", 0.0),
        ("serving thread progress", "local"): (">=", 0.9),
        ("scaling with model size", "local"): ("<=", 1.3),
    }
    assert {k: (b.op, b.threshold) for k, b in bars.items()} == expect
    # --size small: small against itself answers nothing, and is not counted as a pass
    scaling = bars["scaling with model size", "local"]
    assert scaling.status == "n/a" and not scaling.passed and scaling.measured is None
    assert bars["payload smaller than coo", None].measured == store.ratios["coo"].payload
    assert bars["sync faster than dense", "local"].measured == store.ratios["dense"].sync
    assert store.systems["dense"].method in bars["sync faster than dense", "local"].what
    assert bars["anchor size", None].measured == store.anchor_fraction
    assert bars["sync vs receiver floor", "local"].measured == store.floors.sync_floor_ratio
    assert bars["pause vs scatter floor", "local"].measured == store.floors.pause_floor_ratio
    assert bars["sync vs memory floor", "local"].measured == store.floors.memory_floor_ratio
    assert bars["payload vs XOR entropy floor", None].measured == pytest.approx(
        _median_of([f.payload_bytes / f.changed_elements / f.xor_entropy_floor
                    for f in store.floors.samples if f.xor_entropy_floor])
    )  # fmt: skip
    assert store.serving is not None
    assert bars["serving thread progress", "local"].measured == store.serving.progress_median
    # reported without a bar: the local dense ratio and the CPU per change (ns)
    for name in ("sync faster than dense", "cpu per change"):
        assert bars[name, "local"].status == "reported" and not bars[name, "local"].passed
    cpu = [s.times.cpu_s for s in store.systems["deltastore"].sync]
    per_change = [c / n for c, n in zip(cpu, res.workload.changed_elements, strict=True)]  # type: ignore[operator]
    assert bars["cpu per change", "local"].measured == pytest.approx(1e9 * _median_of(per_change))
    for b in res.bars:
        if b.status in ("n/a", "reported"):
            continue
        assert b.measured is not None
        assert b.status == ("pass" if b.passed else "fail")
        assert (
            b.passed
            == {
                "<=": b.measured <= b.threshold,
                ">=": b.measured >= b.threshold,
                "<": b.measured < b.threshold,
                ">": b.measured > b.threshold,
            }[b.op]
        )


def test_every_system_is_bit_exact(run: tuple[BenchResult, str, Path]) -> None:
    res, _, cache = run
    spec = WorkloadSpec(size="small", versions=VERSIONS, warmup=0)
    wl = Workload.load(cache / spec.key)
    assert res.workload.digests == wl.index.digests[1:]
    for sr in res.stores[0].systems.values():
        assert sr.exact
        assert [s.digest for s in sr.sync] == res.workload.digests
        for m in sr.methods.values():  # each dense method loaded every word by itself
            assert [s.digest for s in m.sync] == res.workload.digests
    assert res.scaling is not None and res.scaling.target.exact
    assert res.scaling.changed_elements > 0 and len(res.scaling.target.sync_s) > 0
    assert res.exact


def test_markdown_report(run: tuple[BenchResult, str, Path]) -> None:
    res, text, _ = run
    for system in SYSTEMS:
        assert f"| {system} |" in text
    assert "### The bar" in text and "All receivers bit-exact." in text
    assert text.count("| pass |") + text.count("| FAIL |") == len(res.bars) - 3
    assert text.count("| reported |") == 2 and "| sync faster than dense | local |" in text
    assert "| scaling with model size | local | - | <= 1.3 | n/a |" in text
    dense = res.stores[0].systems["dense"]
    assert f"Strongest dense: `{dense.method}`" in text
    assert f"**{dense.method}**" in text  # marked among the methods timed
    assert "| pause: one bare scatter |" in text
    assert "| memory: zstd decompress + one native XOR pass" in text
    assert "the XOR entropy floor (order-0 entropy of the gaps" in text
    assert "Serving thread (pure Python, in the subscriber's process)" in text


def test_performance_doc_is_generated_from_the_json(
    run: tuple[BenchResult, str, Path], tmp_path: Path
) -> None:
    res, _, _ = run
    source = tmp_path / "benchmarks" / "results" / "run.json"
    source.parent.mkdir(parents=True)
    source.write_text(res.model_dump_json(indent=1))
    doc = tmp_path / "docs" / "performance.md"
    doc.parent.mkdir()
    assert report.main([str(source), "--performance-doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Performance\n")
    assert "Generated by `python -m deltastore.bench.report" in text
    assert "[run.json](../benchmarks/results/run.json)" in text
    assert res.machine.cpu_model in text and res.created in text
    for system in SYSTEMS:
        assert f"| {system} |" in text
    dense = res.stores[0].systems["dense"]
    assert f"Strongest dense: `{dense.method}`" in text
    for b in res.bars:
        assert f"| {b.name} | {b.store or '-'} |" in text
    assert text.count("| pass |") + text.count("| FAIL |") == len(res.bars) - 3
    assert text.count("| n/a |") == 1
    passed = sum(b.passed for b in res.bars)
    assert f"{passed} of {len(res.bars) - 3} checks pass (" in text
    assert "; 1 not applicable to this run; 2 reported without a bar)." in text
    failing = [b for b in res.bars if b.status == "fail"]
    assert not any(b.name == "scaling with model size" for b in failing)
    assert len(
        [
            line
            for line in text.split("\n## What is left")[1].split("\n## ")[0].splitlines()
            if line.startswith("- **")
        ]
    ) == len(failing)
    assert "## Measured limits and pitfalls" in text
    assert report.performance_doc([(res, source)], doc) == text
    # a run through a shaped link beside it: both on the page, each with its command
    linked = res.model_copy(
        update={
            "stores": [
                s.model_copy(
                    update={
                        "store": "moto+cross-region",
                        "link": LinkInfo(
                            name="cross-region",
                            latency_s=0.06,
                            conn_bits_per_s=1e9,
                            total_bits_per_s=1e9,
                            dense_floor_s=1.0,
                            deltastore_floor_s=0.1,
                        ),
                    }
                )
                for s in res.stores
            ]
        }
    )
    other = source.with_name("link.json")
    other.write_text(linked.model_dump_json(indent=1))
    assert report.main([str(source), str(other), "--performance-doc", str(doc)]) == 0
    both = doc.read_text()
    assert "[link.json](../benchmarks/results/link.json)" in both
    assert f"--size {res.workload.size} --store moto --link cross-region --json" in both
    assert both.count("## Results: ") == 2 and "through the `cross-region` link" in both
    assert "Through the shaped link `cross-region`: 60 ms per request" in both


def test_report_refuses_another_schema(
    run: tuple[BenchResult, str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res, _, _ = run
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**json.loads(res.model_dump_json()), "schema_version": 1}))
    assert report.main([str(old), "--performance-doc", str(tmp_path / "p.md")]) == 1
    assert f"schema version {SCHEMA_VERSION}" in capsys.readouterr().err
    assert not (tmp_path / "p.md").exists()


def _small(cache: Path) -> Workload:
    return Workload.load(cache / WorkloadSpec(size="small", versions=VERSIONS, warmup=0).key)


def test_dense_object_store_loads(run: tuple[BenchResult, str, Path], tmp_path: Path) -> None:
    """Ranged GETs that split words and tensors, a header longer than the slack (one more
    GET), and a whole-object GET: each loads every word, from a zeroed buffer."""
    _, _, cache = run
    wl = _small(cache)
    store = LocalStore(tmp_path / "store")
    DenseSender(store, wl).publish(1, wl.read(1))
    flat = np.zeros(wl.numel, dtype=np.int16)
    recv = DenseReceiver(
        store, wl, flat, methods=(RANGED, WHOLE_GET), range_size=(1 << 20) + 7, header_slack=3
    )
    recv.start()
    for method in (RANGED, WHOLE_GET):
        flat.fill(0)
        times = recv.sync(1, method)
        assert digest([flat]) == wl.index.digests[1], method
        assert times.total_s > 0 and times.fetch_s > 0
    with pytest.raises(ValueError, match="times"):
        recv.sync(1, LOAD_FILE)


def test_dense_header_must_match_the_model(
    run: tuple[BenchResult, str, Path], tmp_path: Path
) -> None:
    _, _, cache = run
    wl = _small(cache)
    store = LocalStore(tmp_path / "store")
    DenseSender(store, wl).publish(1, wl.read(1))
    blob = store.get("v000001.bin")
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    layout = parse_layout(blob, wl)
    assert layout.size == len(blob) and len(layout.starts) == len(wl.index.tensors)
    name = wl.index.tensors[0].name
    for bad in (
        {**header, name: {**header[name], "dtype": "F16"}},
        {k: v for k, v in header.items() if k != name},
    ):
        raw = json.dumps(bad).encode()
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            parse_layout(len(raw).to_bytes(8, "little") + raw, wl)
    with pytest.raises(ValueError, match="header"):
        parse_layout(blob[:100], wl)


def test_floors_scatter_the_versions_changes(
    run: tuple[BenchResult, str, Path], tmp_path: Path
) -> None:
    """The floor pass gathers, checksums and scatters exactly the version's changes: tensors
    at the parent version end at the version, and the frames timed are the version's."""
    _, _, cache = run
    wl = _small(cache)
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store)
    pub.publish(wl.tensors(wl.read(0)), version=0)
    rep = pub.publish(wl.tensors(wl.read(1)), version=1)
    flat = wl.read(0)
    sample = floors.measure(store, wl, flat, 1)
    assert digest([flat]) == wl.index.digests[1]
    assert sample.changed_elements == wl.index.changed[1] == rep.changed_elements
    assert sample.payload_bytes == rep.payload_bytes and sample.frames == rep.frames
    assert sample.receiver_floor_s == pytest.approx(
        sample.decompress_s + sample.gather_s + sample.checksum_s + sample.scatter_s
    )
    # the memory floor's runs cover every change once: one pass takes the parent to the version
    flat = wl.read(0)
    changes = floors.workload_changes(wl, flat, 1)
    runs = floors.xor_runs(changes, 3)
    counts = [sum(p.size for _, p, _ in run) for run in runs]
    assert sum(counts) == wl.index.changed[1] and max(counts) - min(counts) <= 1
    assert all(p.dtype == np.int32 for run in runs for _, p, _ in run)
    with floors.FloorPool(3) as pool:
        assert pool.xor_pass(runs) > 0
        assert digest([flat]) == wl.index.digests[1]
        pool.xor_pass(runs)
        assert digest([flat]) == wl.index.digests[0]
        assert pool.decompress(floors.stored_frames(store, 1)) > 0
    # the entropy floor of the same changes, computed here with collections.Counter
    gaps, masks = Counter[int](), Counter[int]()
    for c in changes:
        pos = c.positions.tolist()
        gaps.update(b - a - 1 for a, b in zip([-1, *pos], pos, strict=False))
        masks.update((c.old ^ c.new).tolist())
    bits = sum(_entropy_bits_here(list(k.values())) for k in (gaps, masks))
    assert sample.xor_entropy_floor == pytest.approx(bits / 8 / sample.changed_elements)


def _entropy_bits_here(counts: list[int]) -> float:
    n = sum(counts)
    return -sum(c * math.log2(c / n) for c in counts)


def test_entropy_floor_of_a_known_distribution() -> None:
    """Two tensors: gaps 0, 0, 1, 1 | 1, 1, 3, 3 (each tensor's first gap from its start):
    12 bits; masks 1, 2 four times each: 8 bits; (12 + 8) / 8 bytes over 8 changes."""
    a = np.array([0, 1, 3, 5], np.int64)
    b = np.array([1, 3, 7, 11], np.int64)
    m = np.array([1, 2, 1, 2], np.uint16)
    got = entropy.xor_entropy([(a, m), (b, m)])
    assert got.changed == 8 and got.gap_bytes == 1.5 and got.mask_bytes == 1.0
    assert got.floor == 2.5 / 8
    one = entropy.xor_entropy([(np.arange(5), np.full(5, 7, np.uint16))])  # one symbol each
    assert (one.gap_bytes, one.mask_bytes, one.floor) == (0.0, 0.0, 0.0)
    assert entropy.xor_entropy([]).floor == 0.0
    assert list(entropy.gaps(np.array([4, 5, 9]))) == [4, 0, 3]


def test_link_floor_check_by_size(run: tuple[BenchResult, str, Path]) -> None:
    """A store behind a shaped link: sync / the link's floor for deltastore, <= 1.3 on large
    and <= 1.5 on the other sizes; the local dense ratio's bar gives way to the link's."""
    res, _, _ = run
    link = LinkInfo(
        name="region", latency_s=0.02, conn_bits_per_s=2e9, total_bits_per_s=2e9,
        dense_floor_s=1.0, deltastore_floor_s=0.04,
    )  # fmt: skip
    linked = res.stores[0].model_copy(update={"store": "moto+region", "link": link})
    sync = linked.systems["deltastore"].median.sync.total_s
    for size, bar in (("large", 1.3), ("medium", 1.5), (None, 1.5)):
        bars = {b.name: b for b in analysis.bar_checks([linked], None, size)}
        check = bars["sync vs link floor"]
        assert (check.op, check.threshold, check.store) == ("<=", bar, "moto+region")
        assert check.measured == pytest.approx(sync / 0.04)
        assert bars["sync faster than dense over the link"].threshold == 30
        assert "sync faster than dense" not in bars
    local = {b.name for b in analysis.bar_checks(res.stores, None, "large")}
    assert "sync vs link floor" not in local


def test_serving_thread_wiring(run: tuple[BenchResult, str, Path]) -> None:
    """The serving samples of the run (one per measured version, replayed) and of a sync
    stand-in: progress is the thread's rate during the sync over its idle rate."""
    res, _, _ = run
    sv = res.stores[0].serving
    assert sv is not None and [x.version for x in sv.samples] == list(range(1, VERSIONS + 1))
    for x in sv.samples:
        assert x.busy_units >= 0 and x.idle_units > 0 and x.sync_s > 0 and x.idle_s > 0
        assert x.progress == pytest.approx((x.busy_units / x.sync_s) / (x.idle_units / x.idle_s))
    assert sv.progress_median == _median_of([x.progress for x in sv.samples])  # type: ignore[misc]
    ds = res.stores[0].systems["deltastore"].median.sync.total_s
    assert sv.sync_slowdown == pytest.approx(sv.sync_median_s / ds)
    seen: list[int] = []
    samples = serving.measure(lambda v: (seen.append(v), time.sleep(0.01)), [3, 4])
    assert seen == [3, 4] and [x.version for x in samples] == [3, 4]
    assert all(x.sync_s >= 0.01 and x.busy_units > 0 and x.progress for x in samples)


def test_fastest_method_by_median() -> None:
    def sample(version: int, method: str | None, total: float) -> SyncSample:
        t = SyncTimes(
            fetch_s=0, decode_s=0, verify_s=0, apply_s=total, pause_s=total, total_s=total
        )
        return SyncSample(
            version=version, times=t, rss_extra_bytes=0, digest="0", exact=True, method=method
        )

    # "a" has the fastest single sync, "b" the lower median.
    samples = [sample(1, "a", 0.1), sample(1, "b", 0.3), sample(2, "a", 0.9)]
    samples += [sample(2, "b", 0.4), sample(3, "a", 0.8), sample(3, "b", 0.2)]
    methods = analysis.method_results(samples)
    assert list(methods) == ["a", "b"]
    assert methods["a"].median.total_s == 0.8 and methods["b"].median.total_s == 0.3
    assert analysis.fastest(methods) == "b"
    assert analysis.method_results([sample(1, None, 0.1)]) == {}


def test_workload_is_cached_and_reproducible(run: tuple[BenchResult, str, Path]) -> None:
    _, _, cache = run
    spec = WorkloadSpec(size="small", versions=VERSIONS, warmup=0)
    wl, generated = Workload.ensure(spec, cache)
    assert not generated
    words = wl.words(1)
    assert Differ().count(wl.words(0), words) == wl.index.changed[1]
    tensors = wl.tensors(wl.read(1))
    assert sum(t.numel() for t in tensors.values()) == wl.numel


def test_plot_needs_matplotlib_or_writes_a_png(
    run: tuple[BenchResult, str, Path], tmp_path: Path
) -> None:
    res, _, _ = run
    if importlib.util.find_spec("matplotlib") is None:
        result = runner.invoke(app, ["bench", "--size", "small", "--plot", str(tmp_path / "p")])
        assert result.exit_code == EXIT_ERROR
        assert "matplotlib" in result.stderr
        return
    from deltastore.bench import plot

    plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_differ_compares_bits() -> None:
    old = np.array([0, 0x8000, 0x7FC0, 0x7FC1, 5, 6], dtype=np.uint16).view(np.int16)
    new = np.array([0x8000, 0x8000, 0x7FC0, 0x7FC2, 5, 7], dtype=np.uint16).view(np.int16)
    d = Differ(chunk_bytes=4)  # chunks of two words
    assert d.positions(old, new).tolist() == [0, 3, 5]  # -0.0 vs +0.0; two NaN payloads
    assert d.count(old, new) == 3


def test_lower_bound_compares_every_word_of_every_pair() -> None:
    """The detect lower bound does the detection work: one comparison of every chunk of every
    pair (counted here by a spy), and refuses pairs that do not match."""
    seen: list[tuple[int, int, int]] = []

    class Spy(Differ):
        def _chunks(self, old: np.ndarray, new: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
            for a, ne in super()._chunks(old, new):
                seen.append((old.size, a, int(np.count_nonzero(ne))))
                yield a, ne

    rng = np.random.default_rng(0)
    olds = [rng.integers(-5, 5, n).astype(np.int16) for n in (10, 7)]
    news = [o.copy() for o in olds]
    news[0][[0, 9]] += 1
    news[1][[3]] -= 1
    bound = Spy(chunk_bytes=6).lower_bound(olds, news)  # chunks of 3 words
    assert isinstance(bound, float)
    assert [(n, a) for n, a, _ in seen] == [
        (10, 0),
        (10, 3),
        (10, 6),
        (10, 9),
        (7, 0),
        (7, 3),
        (7, 6),
    ]
    assert sum(c for *_, c in seen) == 3  # every changed word was seen
    with pytest.raises(ValueError, match="shapes differ"):
        Differ().lower_bound([olds[0]], [news[1]])
    with pytest.raises(ValueError, match="shorter"):
        Differ().lower_bound(olds, news[:1])


def test_flip_positions_are_distinct_and_seeded() -> None:
    pos = flip_positions(1000, 100, seed=3)
    assert len(set(pos.tolist())) == 100 and pos.min() >= 0 and pos.max() < 1000
    assert np.array_equal(pos, flip_positions(1000, 100, seed=3))


def test_rss_meter_sees_an_allocation() -> None:
    # Fresh anonymous pages, touched: after earlier tests freed large buffers, malloc may
    # hand a 64 MiB array memory that is still resident, which no meter could see.
    with RssMeter() as rss, mmap.mmap(-1, 64 << 20) as block:
        np.frombuffer(block, dtype=np.uint8).fill(1)
    assert rss.extra_bytes >= 32 << 20


def _scaling(target: str, small_s: float, target_s: float) -> ScalingResult:
    def side(size: str, t: float) -> ScalingSide:
        return ScalingSide(size=size, elements=1000, sync_s=[t], median_s=t, exact=True)

    return ScalingResult(
        changed_elements=10, store="local", small=side("small", small_s),
        target=side(target, target_s), ratio=target_s / small_s,
    )  # fmt: skip


def test_scaling_check_passes_fails_or_is_not_applicable() -> None:
    """The scaling check can fail: a larger model whose sync of K changes takes 1.5x the
    small one's fails, 1.2x passes; small against small is n/a, never a pass."""
    (fast,) = analysis.bar_checks([], _scaling("medium", 1.0, 1.2))
    (slow,) = analysis.bar_checks([], _scaling("medium", 1.0, 1.5))
    (same,) = analysis.bar_checks([], _scaling("small", 1.0, 1.0))
    assert (fast.status, fast.passed, fast.measured) == ("pass", True, pytest.approx(1.2))
    assert (slow.status, slow.passed, slow.measured) == ("fail", False, 1.5)
    assert (same.status, same.passed, same.measured) == ("n/a", False, None)
    assert "nothing to compare" in same.what


def test_bar_check_status_of_older_documents() -> None:
    """Results written before ``status`` existed read with it from ``passed``; a document
    whose status and passed disagree is refused."""
    (slow,) = analysis.bar_checks([], _scaling("medium", 1.0, 1.5))
    old = json.loads(slow.model_dump_json())
    del old["status"]
    assert type(slow).model_validate(old).status == "fail"
    assert type(slow).model_validate({**old, "passed": True}).status == "pass"
    with pytest.raises(ValueError, match="status"):
        type(slow).model_validate({**old, "status": "n/a", "passed": True})
    # a reported number has op "report" and status "reported", and nothing else has either
    with pytest.raises(ValueError, match="op report"):
        type(slow).model_validate({**old, "op": "report"})
    with pytest.raises(ValueError, match="status reported"):
        type(slow).model_validate({**old, "status": "reported"})


# --- trainer in the loop (deltastore bench --mode trainer) ---------------------------------


def test_trainer_mode_smoke(tmp_path: Path) -> None:
    """The trainer mode on the tiny model, in this process (no timing asserted): every field
    of the JSON is there and consistent, both publishers made the same versions, the
    subscribers were bit-exact, the report and the performance page render it."""
    from deltastore.bench.trainer import TrainerOptions, run_trainer
    from deltastore.bench.trainer_report import trainer_markdown
    from deltastore.bench.trainer_schema import TrainerResult

    res = run_trainer(
        TrainerOptions(
            size="tiny", versions=2, warmup=1, workdir=tmp_path, in_process=True, log=print
        )
    )
    res = TrainerResult.model_validate_json(res.model_dump_json())  # the JSON round-trips
    assert res.mode == "trainer" and res.size == "tiny" and res.bf16_bytes == 2 * res.elements
    assert "asked for" in res.size_reason
    assert set(res.runs) == {"none", "memory"}
    memory = res.runs["memory"]
    assert memory.available and memory.median is not None and memory.exact is True
    for run in res.runs.values():
        if not run.available:  # the snapshot-free publisher is not built in this tree
            assert run.error and not run.samples
            continue
        assert [s.version for s in run.samples] == [1, 2]
        for s in run.samples:
            assert s.step_s > 0 and s.publish_s > 0 and s.floor_s > 0
            assert s.ratio == pytest.approx(s.publish_s / s.step_s)
            assert s.payload_bytes > 0 and s.changed_elements > 0
        assert run.exact is True
        m = run.median
        assert m is not None and m.step_min_s == min(s.step_s for s in run.samples)
        assert m.min_ratio == pytest.approx(m.publish_min_s / m.step_min_s)
    assert all(s.cast_s is not None and s.kernel_s is None for s in memory.samples)
    if res.runs["none"].available:
        none = res.runs["none"]
        assert all(s.kernel_s is not None and s.blocks_raw == 0 for s in none.samples)
        assert res.payload_ratio == pytest.approx(
            float(
                np.median(
                    [
                        a.payload_bytes / b.payload_bytes
                        for a, b in zip(none.samples, memory.samples, strict=True)
                    ]
                )
            )
        )
    assert res.same_versions and res.exact
    digests = [[s.digest for s in r.samples] for r in res.runs.values() if r.available]
    assert all(d == digests[0] for d in digests)
    assert [b.name for b in res.bars] == [
        "snapshot-free publish / optimizer.step()",
        "snapshot-free extra peak RSS (bytes)",
        "snapshot-free payload / memory snapshot payload",
    ]
    assert res.bars[1].threshold == 64 << 20  # 2% of the tiny model is less than 64 MiB
    none_median = res.runs["none"].median
    if none_median is not None:
        assert res.bars[0].measured == none_median.min_ratio
    text = trainer_markdown(res)
    assert "| none |" in text and "| memory |" in text and "### The bar" in text
    source = tmp_path / "benchmarks" / "results" / "trainer.json"
    source.parent.mkdir(parents=True)
    source.write_text(res.model_dump_json(indent=1))
    bench_json = tmp_path / "benchmarks" / "results" / "bench.json"
    doc = tmp_path / "docs" / "performance.md"
    doc.parent.mkdir()
    assert report.main([str(bench_json), str(source), "--performance-doc", str(doc)]) == 1
    bench_json.write_text(_minimal_bench().model_dump_json())
    assert report.main([str(bench_json), str(source), "--performance-doc", str(doc)]) == 0
    page = doc.read_text()
    assert "## Results: trainer in the loop, tiny, AdamW foreach" in page
    assert "[trainer.json](../benchmarks/results/trainer.json)" in page
    assert "deltastore bench --mode trainer --size tiny" in page


def _minimal_bench() -> BenchResult:
    from deltastore.bench.runner import machine_info
    from deltastore.bench.schema import WorkloadInfo

    return BenchResult(
        created="2026-12-03T00:00:00+00:00",
        machine=machine_info(),
        workload=WorkloadInfo(
            size="tiny", elements=1, tensors=1, dense_bytes=2, lr=1e-6, seed=0, warmup=0,
            versions=1, changed_elements=[0], changed_fraction=[0.0], digests=["0"],
            generated_now=False, generate_s=0.0, folder="-",
        ),
        stores=[], scaling=None, bars=[], exact=True, skipped=[], wall_s=0.0,
    )  # fmt: skip


def test_trainer_size_is_the_largest_that_fits() -> None:
    from deltastore.bench.trainer import choose_size

    assert choose_size("auto", 25_000_000_000)[0] == "medium"  # large needs ~24 GB
    assert choose_size("auto", 10**13)[0] == "large"
    size, why = choose_size("auto", 1)
    assert size == "tiny" and "small" in why
    assert choose_size("small", 1)[0] == "small"
    with pytest.raises(ValueError, match="unknown size"):
        choose_size("huge", 10**12)
