"""ModuleWriter failures that must not leave a rank waiting: a rank that cannot start, a rank
whose publish raises; and the version after a failed one (two gloo processes, CPU)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from tests import fsdp_harness as H  # noqa: E402

WORLD = 2


def _model() -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.Linear(13, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    return model


def _train(model: Any, opt: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from deltastore import ModuleWriter, Subscriber, VersionNotCommittedError

    out: dict[str, Any] = {}
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # a rank that cannot start: every rank raises, none waits in a collective
    bad = {"max_frame_bytes": 4} if rank == 1 else {}
    t0 = time.monotonic()
    try:
        ModuleWriter(cfg["store"], model, timeout_s=60, **bad)
    except Exception as exc:
        out["start"] = [type(exc).__name__, str(exc), time.monotonic() - t0]
    w = ModuleWriter(cfg["store"], model, timeout_s=60, poll_s=0.01)
    w.resume()
    w.step()  # v1, an anchor
    _train(model, opt, 1)

    def fail(_: int) -> None:
        raise RuntimeError("rank 1 lost its disk")

    t0 = time.monotonic()
    try:
        w.step(progress=fail if rank == 1 else None)
    except Exception as exc:
        out["failed"] = [type(exc).__name__, str(exc), time.monotonic() - t0]
    try:
        w.commit(2)  # the version given up is never committed
    except VersionNotCommittedError as exc:
        out["late"] = str(exc)
    out["next"] = w.next_version()
    report = w.step()  # the next version: past the one given up, a delta on v1
    out["after"] = [report.version, report.kind, w.version]
    if rank == 0:
        sub = Subscriber(cfg["store"])
        sub.sync()
        assert sub.tensors is not None
        out["exact"] = all(
            torch.equal(sub.tensors[n].view(torch.int32), p.full_tensor().view(torch.int32))
            for n, p in model.named_parameters()
        )
    else:
        for p in model.parameters():
            p.full_tensor()  # the collective rank 0 makes
    return out


def test_failures_stop_every_rank_and_the_next_version_skips_the_failed_one(
    tmp_path: Path,
) -> None:
    ranks = H.spawn(_worker, WORLD, {"dir": str(tmp_path), "store": str(tmp_path / "store")})
    # start: rank 1's own ValueError, rank 0 told which rank failed
    assert ranks[1]["start"][0] == "ValueError"
    assert ranks[0]["start"][0] == "ChainError" and "rank 1: ValueError" in ranks[0]["start"][1]
    # a failed publish on rank 1: its own error there, VersionNotCommittedError on rank 0
    # (the committer), long before the 60 s timeout
    assert ranks[1]["failed"][0] == "RuntimeError"
    assert ranks[0]["failed"][0] == "VersionNotCommittedError"
    assert "rank 1: RuntimeError: rank 1 lost its disk" in ranks[0]["failed"][1]
    assert all(r["failed"][2] < 30 for r in ranks), ranks
    for r in ranks:
        assert r["next"] == 3
        assert r["after"] == [3, "delta", 3]
    assert "aborted" in ranks[0]["late"] and "late" not in ranks[1]  # rank 1 does not commit
    assert ranks[0]["exact"] is True
