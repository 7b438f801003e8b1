"""Tensor parallelism under a ModuleWriter, four gloo processes (dp 2 x tp 2), CPU.

1. Data parallel around tensor parallel, with no FSDP: every data-parallel replica holds its
   own copy of each tensor-parallel DTensor (a mesh of its own), so a ModuleWriter must write
   one copy only: column-parallel ``Shard(0)`` and row-parallel ``Shard(1)`` DTensors on each
   replica's tp mesh, a plain bias on every rank, AdamW.
2. FSDP2 around tensor parallelism (``parallelize_module`` then ``fully_shard`` on the dp
   mesh): strided shards ``(_StridedShard(0), Shard(0))`` and ``(Shard(0), Shard(1))``, which
   the writers redistribute to dim-0 rows.

Every version bit-exact against ``full_tensor()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from tests import fsdp_harness as H  # noqa: E402

WORLD, STEPS = 4, 6


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from deltastore import ModuleWriter, Subscriber

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    g = torch.Generator().manual_seed(0)  # the same weights on both replicas
    model = torch.nn.Module()
    model.up = torch.nn.Parameter(
        distribute_tensor(torch.randn(13, 6, generator=g), tp, [Shard(0)])
    )
    model.down = torch.nn.Parameter(
        distribute_tensor(torch.randn(6, 13, generator=g), tp, [Shard(1)])
    )
    model.bias = torch.nn.Parameter(torch.randn(6, generator=g))
    dparams = [model.up, model.down]
    opts = [
        torch.optim.AdamW(dparams, lr=1e-2, foreach=False),
        torch.optim.AdamW([model.bias], lr=1e-2),
    ]
    w = ModuleWriter(cfg["store"], model, timeout_s=60)
    w.resume()
    sub = Subscriber(cfg["store"]) if rank == 0 else None
    out: dict[str, Any] = {"rows": {}, "exact": []}
    for step in range(STEPS):
        if step:
            gg = torch.Generator().manual_seed(step)  # the same gradients on both replicas
            for p in dparams:
                full = torch.randn(p.shape, generator=gg)
                p.grad = distribute_tensor(full, tp, list(p.placements))
            model.bias.grad = torch.randn(6, generator=gg)
            for o in opts:
                o.step()
                o.zero_grad()
        w.step()
        truth = {
            n: p.full_tensor() if isinstance(p, DTensor) else p.detach()
            for n, p in model.named_parameters()
        }
        if sub is not None:
            sub.sync()
            assert sub.tensors is not None
            out["exact"].append(
                all(
                    torch.equal(sub.tensors[n].view(torch.int32), t.view(torch.int32))
                    for n, t in truth.items()
                )
            )
    out["rows"] = {n: [s.row_start, int(s.tensor.shape[0])] for n, s in w.slices().items()}
    out["fsdp_tp"] = _fsdp_tp(cfg, mesh, rank)
    return out


def _fsdp_tp(cfg: dict[str, Any], mesh: Any, rank: int) -> list[bool]:
    """FSDP2 around tensor parallelism; rank 0's bit-exact check per version."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from deltastore import ModuleWriter, Subscriber

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 16))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = cfg["store"] + "-fsdp-tp"
    w = ModuleWriter(store, model, timeout_s=60)
    sub = Subscriber(store) if rank == 0 else None
    exact: list[bool] = []
    for step in range(4):
        if step:
            g = torch.Generator().manual_seed(100 * step + rank // 2)  # per dp replica
            model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        w.step()
        truth = {n: p.full_tensor() for n, p in model.named_parameters()}
        if sub is not None:
            sub.sync()
            assert sub.tensors is not None
            exact.append(
                all(
                    torch.equal(sub.tensors[n].view(torch.int32), t.view(torch.int32))
                    for n, t in truth.items()
                )
            )
    return exact


def test_one_copy_of_each_data_parallel_replica_is_written(tmp_path: Path) -> None:
    ranks = H.spawn(_worker, WORLD, {"dir": str(tmp_path), "store": str(tmp_path / "store")})
    assert ranks[0]["exact"] == [True] * STEPS
    # replica dp=0 (ranks 0, 1) writes, replica dp=1 (ranks 2, 3) nothing
    assert ranks[0]["rows"] == {"up": [0, 7], "down": [0, 3], "bias": [0, 6]}
    assert ranks[1]["rows"] == {"up": [7, 6], "down": [3, 3]}  # down redistributed by rows
    assert ranks[2]["rows"] == ranks[3]["rows"] == {}
    assert ranks[0]["fsdp_tp"] == [True] * 4
