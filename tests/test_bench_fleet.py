"""``deltastore bench --mode fleet``: the origin meter counts every call and the bytes returned,
exactly; the checks follow from the runs' numbers (synthetic runs: pass, fail, n/a); and a
tiny run through the CLI writes a JSON whose every count, ratio and percentile is computed
from its measured samples, with every follower bit-exact. No timing is asserted. Also the
pieces the modes' results share: a shaped link's floors, and the committed results JSONs still
load."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from deltastore.bench.crossover_schema import CrossoverResult
from deltastore.bench.fleet import _Ledger, _Meter
from deltastore.bench.fleet_schema import (
    BYTES_TOLERANCE,
    FleetResult,
    FleetRun,
    Latency,
    Traffic,
    VersionRow,
    fleet_checks,
    fleet_markdown,
    percentile,
)
from deltastore.bench.runner import link_info
from deltastore.bench.schema import SCHEMA_VERSION, BenchResult
from deltastore.bench.sharded_schema import ShardedResult
from deltastore.bench.signing_schema import SigningResult
from deltastore.bench.trainer_schema import TrainerResult
from deltastore.store import open_store
from deltastore.testing.link import LINKS
from deltastore.testing.sizes import SIZES
from deltastore_cli import app


def test_latency_is_the_percentiles_of_its_samples() -> None:
    samples = [0.4, 0.1, 0.3, 0.2, 1.0]
    lat = Latency.of(samples, missing=2)
    assert lat.samples_s == samples and lat.missing == 2
    assert lat.p50_s == 0.3 and lat.last_s == 1.0
    # linear interpolation between the closest ranks: 0.4 + 0.96 * (1.0 - 0.4)
    assert math.isclose(lat.p99_s, 0.976, rel_tol=1e-12)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError, match="at least one sample"):
        percentile([], 50)


def test_the_meter_counts_every_call_and_the_bytes_returned(tmp_path: Path) -> None:
    ledger = _Ledger()
    store = _Meter(open_store(str(tmp_path)), ledger, who=7)
    other = _Meter(open_store(str(tmp_path)), ledger, who=8)
    store.put("a", b"x" * 1000)
    store.put("b", b"y" * 10)
    assert store.get("a") == b"x" * 1000
    assert store.get_range("a", 100, 50) == b"x" * 50
    assert sorted(store.list()) == ["a", "b"]
    token = store.get_with_token("b")
    assert token is not None and token[0] == b"y" * 10
    assert store.get_with_token("missing") is None
    with pytest.raises(Exception):  # noqa: B017, PT011 - a failed call still counts
        store.get("missing")
    assert other.get("b") == b"y" * 10
    assert ledger.window(0.0, math.inf, who=7) == Traffic(requests=8, bytes=1000 + 50 + 10)
    assert ledger.window(0.0, math.inf, who=8) == Traffic(requests=1, bytes=10)
    assert ledger.window(0.0, math.inf) == Traffic(requests=9, bytes=1070)
    assert ledger.window(math.inf, math.inf) == Traffic(requests=0, bytes=0)


def _row(version: int, ratio: float, last: float, copy: float | None, n: int) -> VersionRow:
    stored = 1000
    origin = Traffic(requests=10, bytes=round(ratio * stored))
    return VersionRow(
        version=version,
        kind="anchor" if version == 0 else "delta",
        stored_bytes=stored,
        window_s=2.0,
        origin=origin,
        per_follower_requests=origin.requests / n,
        per_follower_bytes=origin.bytes / n,
        bytes_ratio=origin.bytes / stored,
        requests_per_interval=5.0,
        latency=Latency.of([last / 2, last]),
        copy_s=copy,
        mirror_lag_s=None if copy is None else copy + 0.1,
    )


def _run(side: str, n: int, rows: list[VersionRow], idle: float) -> FleetRun:
    return FleetRun.model_validate(
        {
            "side": side,
            "followers": n,
            "versions": [r.model_dump() for r in rows],
            "idle_s": 3.0,
            "idle": {"requests": int(3 * idle), "bytes": 0},
            "idle_requests_per_interval": idle,
            "mirror_reads": {"requests": 1, "bytes": 1} if side == "mirror" else None,
            "link_requests": 10,
            "origin_requests": 10,
            "errors": 0,
            "first_error": None,
            "exact": True,
            "wall_s": 10.0,
        }
    )


def test_the_checks_follow_from_the_runs() -> None:
    direct = [_row(0, 8.0, 5.0, None, 8), _row(1, 8.0, 1.0, None, 8), _row(2, 8.0, 1.2, None, 8)]
    good = [_row(0, 1.0, 9.0, 0.5, 8), _row(1, 1.001, 1.5, 0.3, 8), _row(2, 0.998, 2.0, 0.4, 8)]
    runs = [
        _run("direct", 8, direct, 8.0),
        _run("mirror", 8, good, 1.0),
        _run("mirror", 1, [_row(0, 1.0, 1, 0.5, 1), _row(1, 1.2, 9.0, 0.2, 1)], 2.0),
        _run("mirror", 2, [_row(0, 0.0, 1, 0.5, 2), _row(1, 1.0, 9.0, 0.2, 2)], 1.0),
    ]
    checks = {c.name: c for c in fleet_checks(runs, 1.0, "moto+cross-region")}
    b8 = checks["mirror origin bytes per version (N=8)"]
    assert (b8.op, b8.threshold, b8.status) == ("<=", BYTES_TOLERANCE, "pass")
    assert math.isclose(b8.measured or 0, 0.002)  # |0.998 - 1|, the largest deviation
    assert checks["mirror origin bytes per version (N=1)"].status == "fail"  # 1.2x
    assert checks["mirror origin bytes per version (N=2)"].status == "fail"  # 0x: not copied
    d8 = checks["direct origin bytes per version (N=8)"]
    assert (d8.measured, d8.status) == (8.0, "reported")
    lat = checks["mirror commit-to-last-follower p99 (N=8)"]
    # the deltas only: mirror p99 over [1.5, 2.0]; direct p99 over [1.0, 1.2] + 1 s + copy p99
    assert math.isclose(lat.measured or 0, percentile([1.5, 2.0], 99))
    assert math.isclose(
        lat.threshold, percentile([1.0, 1.2], 99) + 1.0 + percentile([0.3, 0.4], 99)
    )
    assert lat.status == "pass"
    assert "mirror commit-to-last-follower p99 (N=1)" not in checks  # no direct run at N=1
    spread = checks["mirror origin requests per poll interval"]
    assert (spread.measured, spread.status) == (1.0, "fail")  # 2.0 - 1.0 > 0.5 (N=1 vs 8)
    one = fleet_checks(runs[:2], 1.0, "moto")
    assert [c.status for c in one if c.name.startswith("mirror origin requests")] == ["n/a"]


def _check_run(run: FleetRun, interval: float) -> None:
    """Every number of ``run`` that is computed from its samples."""
    n = run.followers
    for row in run.versions:
        lat = row.latency
        assert len(lat.samples_s) == n and lat.missing == 0
        assert lat.p50_s == float(np.percentile(lat.samples_s, 50))
        assert lat.p99_s == float(np.percentile(lat.samples_s, 99))
        assert lat.last_s == max(lat.samples_s) and all(s > 0 for s in lat.samples_s)
        assert row.per_follower_requests == row.origin.requests / n
        assert row.per_follower_bytes == row.origin.bytes / n
        assert row.bytes_ratio == row.origin.bytes / row.stored_bytes
        assert math.isclose(
            row.requests_per_interval, row.origin.requests * interval / row.window_s
        )
        assert row.stored_bytes > 0 and row.origin.requests > 0
        if run.side == "direct":  # each follower fetched at least the version's frames
            assert row.copy_s is None and row.origin.bytes > 0
        else:
            assert row.copy_s is not None and row.copy_s > 0
            assert row.origin.bytes >= row.stored_bytes  # the mirror read the version whole
            # the pass that copied it ended after the commit (it may have begun before)
            assert row.mirror_lag_s is not None and row.mirror_lag_s > 0
    assert math.isclose(run.idle_requests_per_interval, run.idle.requests * interval / run.idle_s)
    windows = sum(r.origin.requests for r in run.versions) + run.idle.requests
    assert windows <= run.origin_requests
    assert run.exact and run.errors == 0 and run.first_error is None
    assert (run.mirror_reads is None) == (run.side == "direct")


def test_a_tiny_run_writes_a_consistent_result(tmp_path: Path) -> None:
    out, md, wd = tmp_path / "f.json", tmp_path / "f.md", tmp_path / "wd"
    args = ["bench", "--mode", "fleet", "--followers", "1,2", "--versions", "1"]
    args += ["--poll-interval", "0.25", "--link", "lan", "--workdir", str(wd)]
    args += ["--json", str(out), "--markdown", str(md)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["mode"] == "fleet"
    res = FleetResult.model_validate_json(out.read_text())
    assert res.exact and res.size == "tiny" and res.versions == 1
    assert res.elements == SIZES["tiny"].numel() and res.dense_bytes == 2 * res.elements
    assert res.origin == "moto+lan" and res.link.name == "lan" and res.mirror_store == "local"
    assert res.followers == [1, 2] and res.poll_interval_s == 0.25
    sides = ["direct", "mirror"] if res.mirror else ["direct"]
    assert [(r.followers, r.side) for r in res.runs] == [(n, s) for n in (1, 2) for s in sides]
    assert res.skipped == ([] if res.mirror else [res.skipped[0]])
    for run in res.runs:
        assert [(r.version, r.kind) for r in run.versions] == [(0, "anchor"), (1, "delta")]
        _check_run(run, res.poll_interval_s)
    stored = [r.stored_bytes for r in res.runs[0].versions]
    assert all([r.stored_bytes for r in run.versions] == stored for run in res.runs)
    assert res.checks == fleet_checks(res.runs, res.poll_interval_s, res.origin)
    for c in res.checks:
        if c.status in ("pass", "fail"):
            assert c.measured is not None
            assert (c.status == "pass") == (c.measured <= c.threshold)
    assert md.read_text() == fleet_markdown(res)
    assert md.read_text() in result.output


# --- the pieces every mode's result shares -----------------------------------------------

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_link_info_floors_are_the_links_alone() -> None:
    # cross-region: 60 ms a request, 1 Gbit/s in total; 125 MB take 1 s, 1.25 MB 10 ms
    info = link_info(LINKS["cross-region"], 125_000_000, 1_250_000)
    assert (info.name, info.latency_s) == ("cross-region", 0.06)
    assert info.conn_bits_per_s == info.total_bits_per_s == 1e9
    assert info.dense_floor_s == pytest.approx(1.06, rel=1e-12)
    assert info.deltastore_floor_s == pytest.approx(0.13, rel=1e-12)
    assert link_info(LINKS["cross-region"], 125_000_000).deltastore_floor_s is None


def test_the_committed_results_still_load() -> None:
    """Every committed results JSON of a mode (and every main-bench one of the current
    schema) validates: no header field renamed, gone or added as required."""
    models: dict[str | None, type[BaseModel]] = {
        "fleet": FleetResult,
        "signing": SigningResult,
        "crossover": CrossoverResult,
        "sharded": ShardedResult,
        "trainer": TrainerResult,
    }
    loaded = 0
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        model = models.get(data.get("mode"))
        if model is None and data.get("schema_version") == SCHEMA_VERSION and "mode" not in data:
            model = BenchResult
        if model is None:
            continue
        result = model.model_validate(data)
        assert set(data) <= set(result.model_dump()), path.name
        loaded += 1
    assert loaded > 0
