"""The benchmark (issue 6): a smoke run of ``deltastore bench --size small`` through the local
store with the fewest versions, checked for well-formed output and bit-wise agreement of
every system with the workload. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from deltastore.bench import SCHEMA_VERSION, SYSTEMS, BenchResult, Workload, WorkloadSpec
from deltastore.bench.ops import Differ, RssMeter, flip_positions
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
    assert res.schema_version == SCHEMA_VERSION
    assert BenchResult.model_validate(json.loads(res.model_dump_json())) == res
    assert res.workload.size == "small" and res.workload.versions == VERSIONS
    assert res.machine.cores >= 1 and res.machine.memory_bytes > 0
    assert [s.store for s in res.stores] == ["local"] and not res.skipped
    (store,) = res.stores
    assert list(store.systems) == list(SYSTEMS)
    dense_bytes = res.workload.dense_bytes
    for name, sr in store.systems.items():
        assert sr.system == name
        assert [s.version for s in sr.publish] == list(range(1, VERSIONS + 1))
        assert [s.version for s in sr.sync] == list(range(1, VERSIONS + 1))
        for p, changed in zip(sr.publish, res.workload.changed_elements, strict=True):
            assert p.changed_elements == changed > 0
            assert p.times.payload_bytes > 0 and p.times.total_s > 0
            assert math.isclose(p.bytes_per_changed, p.times.payload_bytes / changed)
            assert p.rss_extra_bytes >= 0
        for s in sr.sync:
            assert s.times.total_s > 0 and s.rss_extra_bytes >= 0
        m = sr.median
        assert m.publisher_rss_extra_fraction == m.publisher_rss_extra_bytes / dense_bytes
        assert sr.publisher_rss_extra_max_bytes >= m.publisher_rss_extra_bytes
    assert store.systems["dense"].median.publish.payload_bytes > dense_bytes  # + header


def test_ratios_follow_from_the_medians(run: tuple[BenchResult, str, Path]) -> None:
    res, _, _ = run
    (store,) = res.stores
    ds = store.systems["deltastore"].median
    assert set(store.ratios) == {"dense", "coo", "xor-dense"}
    for base, r in store.ratios.items():
        b = store.systems[base].median
        assert r.payload == pytest.approx(b.publish.payload_bytes / ds.publish.payload_bytes)
        assert r.publish == pytest.approx(b.publish.total_s / ds.publish.total_s)
        assert r.sync == pytest.approx(b.sync.total_s / ds.sync.total_s)
    assert len(store.detect_bound_s) == VERSIONS
    assert store.detect_bound_median_s == pytest.approx(float(np.median(store.detect_bound_s)))
    assert store.publish_bound_ratio == pytest.approx(
        ds.publish.total_s / store.detect_bound_median_s
    )
    assert store.pause_fraction == pytest.approx(ds.sync.pause_s / ds.sync.total_s)
    bars = {(b.name, b.store): b for b in res.bars}
    assert bars["payload smaller than coo", None].measured == store.ratios["coo"].payload
    assert bars["sync faster than dense", "local"].threshold == 3.0
    for b in res.bars:
        assert b.measured is not None
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
    assert res.scaling is not None and res.scaling.target.exact
    assert res.scaling.changed_elements > 0 and len(res.scaling.target.sync_s) > 0
    assert res.exact


def test_markdown_report(run: tuple[BenchResult, str, Path]) -> None:
    res, text, _ = run
    for system in SYSTEMS:
        assert f"| {system} |" in text
    assert "### The bar" in text and "All receivers bit-exact." in text
    assert text.count("| pass |") + text.count("| FAIL |") == len(res.bars)


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
    assert d.lower_bound([old], [new]) >= 0


def test_flip_positions_are_distinct_and_seeded() -> None:
    pos = flip_positions(1000, 100, seed=3)
    assert len(set(pos.tolist())) == 100 and pos.min() >= 0 and pos.max() < 1000
    assert np.array_equal(pos, flip_positions(1000, 100, seed=3))


def test_rss_meter_sees_an_allocation() -> None:
    with RssMeter() as rss:
        block = np.ones(64 << 20, dtype=np.uint8)
        del block
    assert rss.extra_bytes >= 32 << 20
