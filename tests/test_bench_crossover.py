"""``deltastore bench --mode crossover``: the interpolation of the crossover on synthetic
numbers (a crossing, none below the sweep, none above it), the chain workload against the one
AdamW generator bit for bit, and a tiny sweep through the CLI whose JSON is complete and
consistent. No timing is asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltastore.bench.crossover import (
    DENSE_SLICE,
    WARMUP,
    CrossoverOptions,
    crossing,
    dense_slice,
    ensure_chain,
)
from deltastore.bench.crossover_schema import CrossoverResult
from deltastore.testing.synthetic import SIZES, AdamWTrajectory
from deltastore_cli import app


def test_crossing_interpolates_log_log_between_the_two_points() -> None:
    # ratio 4 at 0.1%, 0.5 at 1%: log r linear in log d crosses 0 at t = log 4 / log 8 = 2/3
    c = crossing([0.01, 0.001, 0.1], [0.5, 4.0, 0.1])  # any order
    assert c.status == "crossed" and c.between == (0.001, 0.01) and c.sign_changes == 1
    assert c.density is not None
    assert math.isclose(c.density, 0.001 * 10 ** (2 / 3), rel_tol=1e-12)


def test_crossing_at_a_point_with_ratio_one_is_that_point() -> None:
    c = crossing([0.001, 0.01], [2.0, 1.0])
    assert c.status == "crossed" and c.density is not None
    assert math.isclose(c.density, 0.01, rel_tol=1e-12)


def test_crossing_below_and_above_the_sweep() -> None:
    below = crossing([0.001, 0.01, 0.1], [0.9, 0.5, 0.1])
    assert below.status == "below the sweep" and below.density is None
    assert below.between is None and below.sign_changes == 0
    above = crossing([0.001, 0.01, 0.1], [9.0, 5.0, 1.5])
    assert above.status == "above the sweep" and above.density is None
    assert above.sign_changes == 0


def test_crossing_takes_the_first_drop_and_counts_every_change() -> None:
    c = crossing([0.001, 0.01, 0.1, 0.2], [3.0, 0.5, 1.2, 0.4])
    assert c.status == "crossed" and c.between == (0.001, 0.01) and c.sign_changes == 3


@pytest.mark.parametrize(
    ("densities", "ratios"), [([], []), ([0.1], [1.0, 2.0]), ([0.0], [1.0]), ([0.1], [0.0])]
)
def test_crossing_rejects_bad_points(densities: list[float], ratios: list[float]) -> None:
    with pytest.raises(ValueError, match=r"ratio|positive"):
        crossing(densities, ratios)


def test_the_chain_is_the_adamw_generator_with_the_rate_changed_between_steps(
    tmp_path: Path,
) -> None:
    lrs = [1e-7, 3e-5]
    options = CrossoverOptions(size="tiny", lrs=lrs, versions=2, workdir=tmp_path, log=print)
    chain, generated = ensure_chain(options, lrs)
    assert generated and chain.files == 1 + WARMUP + 2 * len(lrs)
    again, generated = ensure_chain(options, lrs)
    assert not generated and again.index == chain.index
    traj = AdamWTrajectory(SIZES["tiny"], lr=lrs[0])
    rates = [lrs[0]] * (1 + WARMUP) + [lrs[0]] * 2 + [lrs[1]] * 2
    for i, lr in enumerate(rates):
        for t in traj.tensors.values():
            for group in t._opt.param_groups:
                group["lr"] = lr
        tensors = traj.step() if i > 0 else traj.bf16()
        views = chain.views(chain.words(i))
        for name, tensor in tensors.items():
            want = tensor.reshape(-1).view(torch.int16).numpy()
            assert np.array_equal(views[name], want), (i, name)
    low = [chain.changed_fraction(i) for i in (2, 3)]
    high = [chain.changed_fraction(i) for i in (4, 5)]
    assert 0 < max(low) < 0.01 < 0.05 < min(high)  # the rate sets the density
    part = dense_slice(chain, 2)
    assert part.folder == chain.folder / DENSE_SLICE and part.files == 1 + WARMUP + 2
    assert part.index.digests == chain.index.digests[: part.files]
    for i in range(part.files):
        assert part.path(i).read_bytes() == chain.path(i).read_bytes()


def test_a_tiny_sweep_writes_a_consistent_result(tmp_path: Path) -> None:
    out, md = tmp_path / "x.json", tmp_path / "x.md"
    args = ["bench", "--mode", "crossover", "--size", "tiny", "--store", "local"]
    args += ["--lrs", "3e-5,1e-7", "--versions", "2", "--workdir", str(tmp_path / "wd")]
    args += ["--json", str(out), "--markdown", str(md)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    res = CrossoverResult.model_validate_json(out.read_text())
    assert json.loads(out.read_text())["mode"] == "crossover"
    assert res.exact and res.size == "tiny" and res.lrs == [1e-7, 3e-5]
    assert res.elements == SIZES["tiny"].numel() and res.dense_bytes == 2 * res.elements
    assert res.versions_per_point == 2 and res.warmup_versions == WARMUP
    [store] = res.stores
    assert store.store == "local" and store.link is None and store.exact
    assert store.dense.runs == 2 and store.dense.versions == [2, 3, 2, 3]  # before and after
    assert len(store.dense.sync_s) == 4
    assert store.dense.median_s == store.dense.methods[store.dense.method]
    assert store.dense.median_s == min(store.dense.methods.values())
    assert [p.lr for p in store.points] == res.lrs
    assert [p.versions for p in store.points] == [[2, 3], [4, 5]]
    for p in store.points:
        assert p.densities == [c / res.elements for c in p.changed_elements]
        assert p.density == float(np.median(p.densities))
        assert p.deltastore_median_s == float(np.median(p.deltastore_sync_s))
        assert p.dense_median_s == store.dense.median_s
        assert math.isclose(p.ratio, p.dense_median_s / p.deltastore_median_s)
    assert store.points[0].density < 0.01 < 0.05 < store.points[1].density
    want = crossing([p.density for p in store.points], [p.ratio for p in store.points])
    assert store.crossover == want
    [c] = res.bars  # a reported check, no bar
    assert (c.name, c.store, c.measured, c.op, c.status, c.passed) == (
        "crossover density",
        "local",
        want.density,
        "report",
        "reported",
        False,
    )
    assert (want.status in c.what) == (want.density is None)
    report = md.read_text()
    assert "### local" in report and "Crossover:" in report and report in result.output
