"""``deltastore bench --mode signing``: the comparison's numbers are computed from its samples
(synthetic numbers), and a tiny run through the CLI writes a JSON whose every ratio, extra
time and floor follows from the measured samples, whose signed store really is signed, and
whose syncs were bit-exact. No timing is asserted."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltastore.bench.signing import (
    INNER,
    OPERATIONS,
    compare,
    floor_s,
    spread,
    summary_line,
)
from deltastore.bench.signing_schema import Floors, SigningResult, Timing
from deltastore.bench.workload import Workload, WorkloadSpec
from deltastore.testing.sizes import SIZES
from deltastore_cli import app


def _floors(version: int = 1) -> Floors:
    return Floors(
        version=version,
        payload_bytes=12_000_000,
        frames=3,
        manifest_bytes=2000,
        unsigned_manifest_bytes=1500,
        inner=INNER,
        blake3=Timing.of([0.003, 0.002, 0.004]),
        canonical=Timing.of([0.0003]),
        sign=Timing.of([0.0001, 0.0003]),
        verify=Timing.of([0.0004]),
    )


def test_timing_is_the_median_and_minimum_of_its_samples() -> None:
    t = Timing.of([0.3, 0.1, 0.2, 0.5])
    assert t.samples_s == [0.3, 0.1, 0.2, 0.5]  # in the order taken
    assert t.median_s == 0.25 and t.min_s == 0.1 and spread(t) == 5.0
    with pytest.raises(ValueError, match="at least one sample"):
        Timing.of([])


def test_a_comparison_is_computed_from_its_samples() -> None:
    floor = _floors()
    off, on = Timing.of([1.0, 2.0, 3.0]), Timing.of([5.0, 3.0, 2.0])
    c = compare("delta publish", "publish", 1, 12_000_000, off, on, floor, exact=True)
    assert (c.off, c.on) == (off, on)
    assert c.ratio_median == 1.5 and c.ratio_min == 2.0 and c.extra_median_s == 1.0
    assert c.floor_s == floor_s("publish", floor)
    assert math.isclose(c.floor_s, 0.003 + 0.0003 + 0.0002)
    s = compare("delta sync", "sync", 1, 12_000_000, off, on, floor, exact=False)
    assert math.isclose(s.floor_s, 0.003 + 0.0003 + 0.0004) and not s.exact
    assert summary_line(c, floor) == (
        "delta publish: 1.500x (+1000 ms; floor: BLAKE3 of 12.00 MB = 3.0 ms + canonical "
        "bytes 0.30 ms + sign 0.20 ms = 3.5 ms)"
    )
    assert "+ verify 0.40 ms = 3.7 ms)" in summary_line(s, floor)


def test_a_tiny_run_writes_a_consistent_result(tmp_path: Path) -> None:
    out, md, wd = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "wd"
    args = ["bench", "--mode", "signing", "--size", "tiny", "--repeats", "2"]
    args += ["--workdir", str(wd), "--json", str(out), "--markdown", str(md)]
    result = CliRunner().invoke(app, args)  # the default store: local
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["mode"] == "signing"
    res = SigningResult.model_validate_json(out.read_text())
    assert res.exact and res.size == "tiny" and res.repeats == 2 and res.skipped == []
    assert res.elements == SIZES["tiny"].numel() and res.dense_bytes == 2 * res.elements
    wl = Workload.load(res.folder)
    assert wl.index == Workload.ensure(WorkloadSpec("tiny", lr=2.5e-6, versions=1), wd)[0].index
    assert res.changed_elements == wl.index.changed[1] > 0
    assert res.density == res.changed_elements / res.elements
    [store] = res.stores
    assert store.store == "local" and store.exact and store.signed and store.unsigned
    floors = {f.version: f for f in store.floors}
    assert sorted(floors) == [0, 1]
    for f in floors.values():
        assert f.frames > 0 and f.inner == INNER
        assert f.manifest_bytes > f.unsigned_manifest_bytes  # BLAKE3s; the signature is not
        for t in (f.blake3, f.canonical, f.sign, f.verify):
            assert len(t.samples_s) == 2 and t.median_s == statistics.median(t.samples_s)
            assert t.min_s == min(t.samples_s)
    assert floors[0].payload_bytes > floors[1].payload_bytes > 0  # the anchor, the delta
    assert [(c.name, c.op, c.version) for c in store.comparisons] == list(OPERATIONS)
    report = md.read_text()
    for c in store.comparisons:
        floor = floors[c.version]
        assert c.payload_bytes == floor.payload_bytes and c.exact
        for t in (c.off, c.on):
            assert len(t.samples_s) == 2 and all(s > 0 for s in t.samples_s)
            assert t.median_s == statistics.median(t.samples_s) and t.min_s == min(t.samples_s)
        assert math.isclose(c.ratio_median, c.on.median_s / c.off.median_s)
        assert math.isclose(c.ratio_min, c.on.min_s / c.off.min_s)
        assert c.extra_median_s == c.on.median_s - c.off.median_s
        assert c.floor_s == floor_s(c.op, floor)
        assert f"- {summary_line(c, floor)}" in report
    assert "### local" in report and report in result.output


def test_the_signing_mode_takes_no_shaped_link() -> None:
    args = ["bench", "--mode", "signing", "--size", "tiny", "--store", "moto", "--link", "lan"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "shaped link" in result.output
