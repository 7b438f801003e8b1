"""FSDP2 and HSDP trainers publishing through :class:`deltastore.ModuleWriter`: gloo, CPU.

Real trainers (``tests/fsdp_harness.py``): a tiny language model sharded with
``fully_shard`` per block and on the root, with uneven ``Shard(0)`` shards (37 and 45 rows),
tied embeddings, a plain parameter left out of FSDP, a parameter replicated by hand
(``Replicate()``), one sharded on dim 1 (``Shard(1)``) and persistent and non-persistent
buffers; AdamW on seeded tokens. Every rank constructs one ``ModuleWriter`` and calls
``w.step()`` after each optimizer step; rank 0's Subscriber syncs every version and compares
it, bit for bit (integer views), with every tensor's ``full_tensor()``; a fresh Subscriber
reads the last one. No row offset is computed here: the writer's slices are checked against
the full tensors and for tiling across ranks.

Two spawns: two ranks (1-D mesh) run the snapshot mode, then the snapshot-free mode, each on
its own store (the module fixture; three tests read it); four ranks run HSDP on a 2x2 mesh.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from tests import fsdp_harness as H  # noqa: E402

STEPS = 10
#: Small frames: a tensor's rows are split over several frames, and frames over ranks.
OPTIONS = {"max_frame_bytes": 512}
TIED, UNPUBLISHED_BUFFER, DIM1 = "head.weight", "scratch", "side.proj"
PLAIN = ("scale", "pos", "seen")  # plain tensors: whole, by group rank 0


def _two_rank_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Snapshot mode, then snapshot-free mode, each a fresh model on its own store."""
    from deltastore import ModuleWriter

    mesh = H.make_mesh((world,))
    model = H.shard_model(H.build_model(), mesh)
    opt = H.make_optimizer(model)
    w = ModuleWriter(cfg["memory"], model, **OPTIONS)
    H.save(cfg, "memory", rank, H.publish_loop(w, model, opt, cfg["memory"], steps=STEPS))

    model = H.shard_model(H.build_model(), mesh)
    opt = H.make_optimizer(model)
    w = ModuleWriter(cfg["snapfree"], model, snapshot="none", optimizer=opt, **OPTIONS)
    params = {n for n, _ in model.named_parameters()}

    def cast(name: str, t: torch.Tensor) -> torch.dtype:
        return torch.bfloat16 if name in params else t.dtype  # buffers keep their dtype

    record = H.publish_loop(w, model, opt, cfg["snapfree"], steps=STEPS, cast=cast)
    H.save(cfg, "snapfree", rank, record)
    return {}


def _hsdp_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from deltastore import ModuleWriter

    model = H.shard_model(H.build_model(), H.make_mesh((2, 2)))
    opt = H.make_optimizer(model)
    w = ModuleWriter(cfg["memory"], model, **OPTIONS)
    record = H.publish_loop(w, model, opt, cfg["memory"], steps=STEPS, explicit=True)
    H.save(cfg, "hsdp", rank, record)
    return {}


def _run(tmp: Path, worker: Any, world: int) -> dict[str, Any]:
    cfg = {"dir": str(tmp), "memory": str(tmp / "memory"), "snapfree": str(tmp / "snapfree")}
    try:
        H.spawn(worker, world, cfg)
    except Exception as exc:  # the tests report it where a scenario's records are missing
        cfg["error"] = f"{type(exc).__name__}: {exc}"
    return cfg


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("fsdp2"), _two_rank_worker, 2)


def _records(cfg: dict[str, Any], name: str, world: int) -> list[dict[str, Any]]:
    records = H.load(cfg, name, world)
    if records is None:
        pytest.fail(f"the {name} scenario did not finish on every rank: {cfg.get('error')}")
    return records


def _check_chain(ranks: list[dict[str, Any]], world: int) -> None:
    """Writer attributes, consecutive versions, rank 0's bit-exact syncs, manifest names."""
    run = ranks[0]["run"]
    assert re.fullmatch(r"[0-9a-f]{32}", run), run
    assert [(r["run"], r["rank"], r["world"]) for r in ranks] == [
        (run, i, world) for i in range(world)
    ]
    names = ranks[0]["names"]
    assert TIED not in names and UNPUBLISHED_BUFFER not in names and "embed.weight" in names
    first = ranks[0]["versions"][0]["version"]
    for r in ranks:
        versions = r["versions"]
        assert len(versions) == STEPS + 1
        assert [v["version"] for v in versions] == list(range(first, first + STEPS + 1))
        assert [v["held"] for v in versions] == [v["version"] for v in versions]
        assert [v["kind"] for v in versions] == ["anchor"] + ["delta"] * STEPS
    for v in ranks[0]["versions"]:
        assert v["mismatch"] == [], f"version {v['version']}: {v['mismatch']}"
        assert v["names"] == sorted(names)  # the tied head once, as embed.weight
    for i in range(1, STEPS + 1):  # training moved the weights: every delta carries changes
        assert sum(r["versions"][i]["changed"] for r in ranks) > 0
    assert ranks[0]["fresh"] == {"version": first + STEPS, "mismatch": []}


def _writers(ranks: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """Each rank's slices (``{name: [row_start, rows]}``), after checking that they are the
    full tensor's rows and tile every published tensor exactly once, first and last version."""
    shapes = ranks[0]["shapes"]
    for k in (0, 1):
        for r in ranks:
            assert r["slices"][k]["wrong"] == [], (r["rank"], r["slices"][k]["wrong"])
        for name, shape in shapes.items():
            rows = shape[0] if shape else 1
            spans = sorted(
                tuple(s["rows"][name]) for r in ranks if name in (s := r["slices"][k])["rows"]
            )
            spans = [(a, n) for a, n in spans if n]
            ends = [a + n for a, n in spans]
            assert [a for a, _ in spans] == [0, *ends[:-1]] and ends[-1] == rows, (name, spans)
    return [r["slices"][1]["rows"] for r in ranks]


def test_fsdp2_module_writer_every_version_bit_exact(two_ranks: dict[str, Any]) -> None:
    ranks = _records(two_ranks, "memory", 2)
    _check_chain(ranks, 2)
    held = _writers(ranks)
    embed = [h.get("embed.weight", [0, 0])[1] for h in held]
    assert all(embed) and embed[0] != embed[1], embed  # 37 rows: both ranks, unevenly
    assert ranks[0]["layout"]["params"]["embed.weight"]["placements"] == ["Shard(dim=0)"]
    assert ranks[0]["layout"]["params"]["side.mix"]["placements"] == ["Replicate()"]
    for name in (*PLAIN, "side.mix"):  # whole, from one rank
        assert [name in h for h in held] == [True, False], name
    for r in ranks:  # the report counts this rank's slices
        assert r["versions"][0]["total"] == sum(
            n * _row_size(ranks[0]["shapes"][name])
            for name, (_, n) in r["slices"][0]["rows"].items()
        )


def _row_size(shape: list[int]) -> int:
    size = 1
    for d in shape[1:]:
        size *= d
    return size


def test_dim1_sharded_dtensor_is_published_by_rows_of_a_dim0_layout(
    two_ranks: dict[str, Any],
) -> None:
    """A dim-1 shard is redistributed to dim-0 rows (a shard's worth each, no rank gathers it
    whole): the ranks' rows tile the tensor, and every version is bit-exact."""
    for scenario in ("memory", "snapfree"):
        ranks = _records(two_ranks, scenario, 2)
        proj = [r["layout"]["params"][DIM1] for r in ranks]
        shape = ranks[0]["shapes"][DIM1]
        assert [p["placements"] for p in proj] == [["Shard(dim=1)"]] * 2
        assert all(p["local"][1] < shape[1] for p in proj)  # no rank holds it whole
        held = sorted(r["slices"][1]["rows"][DIM1] for r in ranks)
        assert [start for start, _ in held] == [0, held[0][1]], held
        assert sum(n for _, n in held) == shape[0] and all(n < shape[0] for _, n in held)
        for v in ranks[0]["versions"]:
            assert not [m for m in v["mismatch"] if m.startswith(DIM1)], (scenario, v)


def test_snapshot_free_module_writer_publishes_bf16_of_full_tensor(
    two_ranks: dict[str, Any],
) -> None:
    ranks = _records(two_ranks, "snapfree", 2)
    _check_chain(ranks, 2)  # every version: params as bf16 of full_tensor(), buffers as they are
    _writers(ranks)
    for r in ranks:
        assert [v["raw"] for v in r["versions"]] == [0] * (STEPS + 1), r["rank"]


def test_hsdp_2x2_replicas_write_no_rows(tmp_path: Path) -> None:
    cfg = _run(tmp_path, _hsdp_worker, 4)
    ranks = _records(cfg, "hsdp", 4)
    _check_chain(ranks, 4)
    held = _writers(ranks)
    params = ranks[0]["layout"]["params"]
    assert params["embed.weight"]["placements"] == ["Replicate()", "Shard(dim=0)"]
    coordinates = [r["layout"]["coordinate"] for r in ranks]
    assert sorted(map(tuple, coordinates)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r, h, (replica, _) in zip(ranks, held, coordinates, strict=True):
        if replica:  # a replica of the shards of replica group 0: nothing to write
            assert all(n == 0 for _, n in h.values()), h  # no slice, or none of its rows
            assert all(v["frames"] == v["changed"] == 0 for v in r["versions"])
        else:
            assert h.get("embed.weight", [0, 0])[1] > 0
            assert all(v["frames"] > 0 for v in r["versions"])
