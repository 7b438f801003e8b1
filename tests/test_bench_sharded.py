"""``deltastore bench --mode sharded`` at the smallest size, its ranks as threads of this process
(no process start-up): the JSON is complete and consistent and the store bit-exact. No timing
or memory is asserted (the memory numbers of an in-process run are not measured at all)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltastore.bench.sharded import (
    SHARDED_SIZES,
    ShardedOptions,
    run_sharded,
    shard_rows,
    sharded_markdown,
)
from deltastore.bench.sharded_schema import ShardedResult
from deltastore_cli import app


def test_sharded_mode_writes_a_consistent_result(tmp_path: Path) -> None:
    densities = [0.02, 0.6]
    res = run_sharded(
        ShardedOptions(densities=densities, repeats=1, workdir=tmp_path, in_process=True, log=print)
    )
    again = ShardedResult.model_validate_json(res.model_dump_json())
    assert again == res and res.mode == "sharded" and res.exact
    shapes = SHARDED_SIZES[res.size].shapes()
    assert res.elements == sum(r.shard_elements for r in res.ranks)
    assert [r.rank for r in res.ranks] == list(range(res.world))
    for run in res.ranks:
        rows = {n: shard_rows(s[0], run.rank, res.world) for n, s in shapes.items()}
        assert set(run.digests) == set(shapes)
        assert run.shard_elements == sum(
            (b - a) * math.prod(shapes[n][1:]) for n, (a, b) in rows.items()
        )
        assert run.shard_bf16_bytes == 2 * run.shard_elements
        # the anchor, then per density one version per measure
        assert [s.version for s in run.samples] == list(range(1 + 2 * len(densities)))
        assert run.samples[0].kind == "anchor" and run.samples[0].density is None
        for s in run.samples:
            assert s.total_elements == run.shard_elements
            assert s.changed_elements == round(s.changed_fraction * s.total_elements)
            if s.density is not None:
                assert s.kind == "delta"
                assert abs(s.changed_fraction - s.density) < 0.02
    assert {s.density for s in res.summary} == {None, *densities}
    for s in res.summary:  # plain deltas apart from those with an anchor copy (cost policy)
        copies = [
            x.anchor_copy_bytes is not None
            for r in res.ranks
            for x in r.samples
            if x.density == s.density and x.kind == "delta"
        ]
        assert s.density is None or s.anchor_copy in copies
    names = {b.name for b in res.bars}
    for d in densities:
        assert any(f"peak / shard bf16 bytes (traced, {d:.0%} changed" in n for n in names)
        assert any(f"held changes / shard bf16 bytes (rss, {d:.0%} changed" in n for n in names)
    assert all(b.status == "n/a" for b in res.bars)  # nothing measured in one process
    text = sharded_markdown(res)
    assert "--mode sharded" in text and "| 60% |" in text


@pytest.mark.parametrize("bad", ["0", "1.5", "x", ""])
def test_sharded_mode_refuses_bad_densities(bad: str) -> None:
    result = CliRunner().invoke(app, ["bench", "--mode", "sharded", "--densities", bad])
    assert result.exit_code != 0
    assert "--densities" in result.output
