"""``deltastore bench --mode signing``: the comparison's numbers are computed from its samples
(synthetic numbers), and a tiny run through the CLI writes a JSON whose every ratio, extra
time and floor follows from the measured samples, whose signed store really is signed, and
whose syncs were bit-exact; the performance page's "Signing" section is built from a signing
JSON's numbers. No timing is asserted."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltastore.bench import report
from deltastore.bench.schema import BenchResult, Machine, WorkloadInfo
from deltastore.bench.signing import (
    INNER,
    OPERATIONS,
    compare,
    floor_s,
    spread,
    summary_line,
)
from deltastore.bench.signing_report import is_signing_json
from deltastore.bench.signing_schema import Floors, SigningResult, StoreSigning, Timing
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


_MACHINE = Machine(
    cpu_model="Test CPU", cores=2, memory_bytes=1 << 30, platform="test", python="3",
    torch="2", numpy="2", zstandard="0", safetensors="0", deltastore="0",
)  # fmt: skip


def _page_floors(version: int, payload: int, b3: list[float], verify: float) -> Floors:
    return Floors(
        version=version, payload_bytes=payload, frames=3, manifest_bytes=2000,
        unsigned_manifest_bytes=1500, inner=INNER, blake3=Timing.of(b3),
        canonical=Timing.of([0.0005]), sign=Timing.of([0.0003]), verify=Timing.of([verify]),
    )  # fmt: skip


def _page_store(name: str, scale: float) -> StoreSigning:
    """Four comparisons with chosen samples: ``off`` ``[2, 1, 4] * scale`` s for the anchor,
    a tenth for the delta; ``on`` 1.1x, 0.9x, 1.25x and 1.02x of them in turn."""
    floors = [
        _page_floors(0, 300_000_000, [0.075, 0.08, 0.085], 0.0002),
        _page_floors(1, 5_000_000, [0.002], 0.00015),
    ]
    comparisons = []
    for (name_, kind, version), k in zip(OPERATIONS, (1.1, 0.9, 1.25, 1.02), strict=True):
        off = [x * scale / (10 if version else 1) for x in (2.0, 1.0, 4.0)]
        on = Timing.of([off[0] * k, off[1] * k, off[2] * k * 0.5])
        f = floors[version]
        c = compare(name_, kind, version, f.payload_bytes, Timing.of(off), on, f, exact=True)
        comparisons.append(c)
    return StoreSigning(
        store=name, comparisons=comparisons, floors=floors, signed=True, unsigned=True,
        exact=True,
    )  # fmt: skip


def test_the_performance_page_signing_section_is_built_from_the_json(tmp_path: Path) -> None:
    result = SigningResult(
        created="2026-12-01T00:00:00+00:00", machine=_MACHINE, size="medium",
        elements=246_000_000, tensors=3, dense_bytes=492_000_000, lr=2.5e-6, seed=0, warmup=1,
        changed_elements=4_256_000, density=4_256_000 / 246_000_000, repeats=3, key_id="k",
        folder="-", generated_now=False,
        stores=[_page_store("local", 1.0), _page_store("moto", 2.0)], exact=True, skipped=[],
        load_average=[1.0, 2.5], wall_s=1.0,
    )  # fmt: skip
    bench = BenchResult(
        created="2026-12-01T00:00:00+00:00", machine=_MACHINE,
        workload=WorkloadInfo(
            size="tiny", elements=1, tensors=1, dense_bytes=2, lr=1e-6, seed=0, warmup=0,
            versions=1, changed_elements=[0], changed_fraction=[0.0], digests=["0"],
            generated_now=False, generate_s=0.0, folder="-",
        ),
        stores=[], scaling=None, bars=[], exact=True, skipped=[], wall_s=0.0,
    )  # fmt: skip
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    bench_json, signing_json = results / "bench.json", results / "signing.json"
    bench_json.write_text(bench.model_dump_json())
    signing_json.write_text(result.model_dump_json(indent=1))
    assert is_signing_json(signing_json) and not is_signing_json(bench_json)
    doc = tmp_path / "docs" / "performance.md"
    doc.parent.mkdir()
    assert report.main([str(bench_json), str(signing_json), "--performance-doc", str(doc)]) == 0
    page = doc.read_text()
    assert page == report.performance_doc(
        [(bench, bench_json)], doc, signings=[(result, signing_json)]
    )
    assert f"bench.json {signing_json.as_posix()} --performance-doc" in page
    assert (
        "- signing cost, medium: `deltastore bench --mode signing --size medium`, 3 interleaved "
        "rounds, stores local, moto, [signing.json](../benchmarks/results/signing.json) "
        "(2026-12-01)."
    ) in page
    assert (
        ".venv/bin/deltastore bench --mode signing --size medium --store local,moto --repeats 3 "
        f"--json {signing_json.as_posix()}\n"
    ) in page
    assert (
        "- signing cost (medium; on / off, Ed25519 + per-frame BLAKE3 vs unsigned, by the "
        "medians / the minimums): **local** anchor publish 1.100x / 1.100x, delta publish "
        "0.900x / 0.900x, anchor sync 1.250x / 1.250x, delta sync 1.020x / 1.020x; **moto** "
        "anchor publish 1.100x / 1.100x, delta publish 0.900x / 0.900x, anchor sync 1.250x / "
        "1.250x, delta sync 1.020x / 1.020x.\n"
    ) in page
    section = page.split("\n## Signing: medium (2026-12-01)\n\n", 1)[1].split("\n## ", 1)[0]
    assert "1.73% of the elements changed" in section and "in 3 interleaved rounds" in section
    assert "Ed25519 signature over the manifest's canonical bytes and a BLAKE3 of every" in section
    assert "Load average 1.0 and 2.5 (start, end); machine: Test CPU, 2 cores." in section
    head = (
        "| operation | payload | off median s | on/off median | on/off min | on - off | floor: "
        "BLAKE3 + canonical bytes + sign / verify | spread off / on |\n|---|---|---|---|---|---|"
        "---|---|\n"
    )
    # on - off of the medians: (k - 1) * 2 s * scale (a tenth for the delta); the floors:
    # BLAKE3's median 80 / 2 ms + canonical 0.5 ms + sign 0.3 or verify 0.2 / 0.15 ms; the
    # spreads: off 4 s / 1 s, on (4 s * k / 2) / (1 s * k)
    local = (
        "| anchor publish | 300.00 MB | 2.0000 | 1.100 | 1.100 | +200 ms | 80.0 + 0.50 + 0.30 = "
        "80.8 ms | 4.00 / 2.00 |\n"
        "| delta publish | 5.00 MB | 0.2000 | 0.900 | 0.900 | -20.0 ms | 2.0 + 0.50 + 0.30 = "
        "2.8 ms | 4.00 / 2.00 |\n"
        "| anchor sync | 300.00 MB | 2.0000 | 1.250 | 1.250 | +500 ms | 80.0 + 0.50 + 0.20 = "
        "80.7 ms | 4.00 / 2.00 |\n"
        "| delta sync | 5.00 MB | 0.2000 | 1.020 | 1.020 | +4.0 ms | 2.0 + 0.50 + 0.15 = "
        "2.6 ms | 4.00 / 2.00 |\n"
    )
    moto = (
        "| anchor publish | 300.00 MB | 4.0000 | 1.100 | 1.100 | +400 ms | 80.0 + 0.50 + 0.30 = "
        "80.8 ms | 4.00 / 2.00 |\n"
        "| delta publish | 5.00 MB | 0.4000 | 0.900 | 0.900 | -40.0 ms | 2.0 + 0.50 + 0.30 = "
        "2.8 ms | 4.00 / 2.00 |\n"
        "| anchor sync | 300.00 MB | 4.0000 | 1.250 | 1.250 | +1000 ms | 80.0 + 0.50 + 0.20 = "
        "80.7 ms | 4.00 / 2.00 |\n"
        "| delta sync | 5.00 MB | 0.4000 | 1.020 | 1.020 | +8.0 ms | 2.0 + 0.50 + 0.15 = "
        "2.6 ms | 4.00 / 2.00 |\n"
    )
    carry = (
        "\nSigned manifests carry an Ed25519 signature and per-frame BLAKE3: yes; unsigned ones "
        "neither: yes; every sync bit-exact: yes.\n"
    )
    assert f"### local\n\n{head}{local}{carry}\n### moto\n\n{head}{moto}{carry}" in section
    # a JSON that does not validate as a signing run: refused, nothing written
    signing_json.write_text(json.dumps({"mode": "signing", "schema_version": 1}))
    doc.unlink()
    assert report.main([str(bench_json), str(signing_json), "--performance-doc", str(doc)]) == 1
    assert not doc.exists()
