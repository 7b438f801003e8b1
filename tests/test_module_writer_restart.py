"""A ModuleWriter job killed and restarted: real processes (gloo, 2 ranks, CPU, FSDP2).

Each case runs a small ``fully_shard`` model with AdamW in two processes that publish one
version per step with :class:`ModuleWriter` (bf16), and kills the job at a point of the commit
protocol: (a) rank 1 exits (``os._exit(1)``) after its part of version K is written, before the
commit, and the launcher then kills rank 0 (waiting in a collective for rank 1); (b) the
committer, rank 0, exits after ``commit(K)`` and before ``finish(K)``, and the launcher kills
rank 1. A new pair of processes (a new process group, the same store) rebuilds the trainer
state by replaying the same seeded steps up to the store's newest committed version, calls
``resume()``, checks its :class:`ResumeReport` and publishes 3 more versions. Then the store
verifies (deep), a subscriber that followed the first job during its run catches up, a fresh
subscriber starts, both bit for bit (int16 views) against the ranks' gathered bf16 weights, and
a late ``commit_parts`` by the crashed run is refused with a typed error.
"""

from __future__ import annotations

import json
import os
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

WORLD = 2
K = 4  # the version the first job dies at
MORE = 3  # versions the restarted job publishes
VOCAB, DIM, HIDDEN = 37, 16, 48  # 37 rows: an uneven FSDP split (19 + 18)
#: Collective timeout: a lost rank fails the worker instead of hanging the test.
TIMEOUT = timedelta(seconds=60)
OPTIONS: dict[str, Any] = {"max_frame_bytes": 256, "timeout_s": 30.0, "poll_s": 0.02}


# --- the trainer (runs in the worker processes) ---------------------------------------------


def build(mesh: Any) -> Any:
    """The model, seeded, sharded with FSDP2 (``fully_shard``) on ``mesh``; a persistent
    buffer (published) and a non-persistent one (not)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.up = nn.Linear(DIM, HIDDEN)
            self.down = nn.Linear(HIDDEN, DIM)
            self.norm = nn.LayerNorm(DIM)
            self.register_buffer("scale", torch.tensor([0.5, 2.0]))
            self.register_buffer("cache", torch.zeros(3), persistent=False)

        def forward(self, idx: Any) -> Any:
            h = self.embed(idx)
            h = h + self.down(torch.relu(self.up(h)))
            return self.norm(h) * self.scale[0]

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: Any, opt: Any, step: int, rank: int) -> None:
    """Training step ``step`` (1, 2, ...): this rank's seeded batch, backward, AdamW."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, VOCAB, (8, 5), generator=g)
    loss = (model(idx) - 0.1).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def truth(model: Any) -> dict[str, Any]:
    """What the version holds: every parameter gathered (a collective) and the persistent
    buffers, cast to bf16."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = full.detach().to(torch.bfloat16).clone()
    out["scale"] = model.scale.detach().to(torch.bfloat16).clone()
    return out


def mark(cfg: dict[str, Any], name: str, data: Any = None) -> None:
    path = Path(cfg["out"], name)
    path.with_suffix(".tmp").write_text(json.dumps(data))
    path.with_suffix(".tmp").replace(path)


def _worker(rank: int, cfg: dict[str, Any]) -> None:
    """One rank of a job: ``cfg["phase"]`` is ``"crash"`` (the first job, which dies as
    ``cfg["case"]`` says) or ``"resume"`` (the restarted job)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        _run(rank, cfg)
    except BaseException:
        Path(cfg["out"], f"error-{cfg['phase']}-{rank}.txt").write_text(traceback.format_exc())
        raise


def _run(rank: int, cfg: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from deltastore import ModuleWriter

    dist.init_process_group(
        "gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=WORLD, timeout=TIMEOUT
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    model = build(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    phase, store = cfg["phase"], cfg["store"]
    if phase == "resume":
        for s in range(1, cfg["head"]):  # replay: version v holds the weights after v - 1 steps
            train(model, opt, s, rank)
        held = truth(model)  # the replayed state of the store's head
        if rank == 0:
            torch.save(held, Path(cfg["out"], "head.pt"))
    extra = {"snapshot": "none", "optimizer": opt} if cfg["snapshot_free"] else {}
    w = ModuleWriter(store, model, dtype=torch.bfloat16, **OPTIONS, **extra)
    report = w.resume()
    mark(
        cfg,
        f"{phase}-resume-{rank}.json",
        {
            "head": report.head,
            "kind": report.kind,
            "abandoned": list(report.abandoned),
            "reason": report.reason,
            "run": w.run,
            "rank": w.rank,
            "world": w.world,
        },
    )
    if phase == "resume":
        versions = []
        for s in range(cfg["head"], cfg["head"] + MORE):
            train(model, opt, s, rank)
            versions.append(w.step().version)
            assert w.version == versions[-1]
        held = truth(model)
        if rank == 0:
            torch.save(held, Path(cfg["out"], "final.pt"))
        mark(cfg, f"resume-versions-{rank}.json", versions)
        dist.destroy_process_group()
        return
    for v in range(1, K):
        if v > 1:
            train(model, opt, v - 1, rank)
        assert w.step().version == v
        held = truth(model)
        if rank == 0:
            torch.save(held, Path(cfg["out"], f"truth-{v}.pt"))
    train(model, opt, K - 1, rank)
    assert w.publish().version == K
    if cfg["case"] == "part-written" and rank == 1:
        mark(cfg, "rank1-published")
        os._exit(1)  # killed after its part is written, before the commit
    if cfg["case"] == "committed" and rank == 0:
        manifest = w.commit(K)
        assert manifest is not None and manifest.version == K
        mark(cfg, "rank0-committed")  # (no gather: rank 1 is not in one any more)
        os._exit(1)  # the committer dies after the commit, before finish
    if cfg["case"] == "committed":
        assert w.finish(K).version == K  # rank 1 holds K, then waits for rank 0
        mark(cfg, "rank1-finished")
    # the other rank: in the next collective (rank 0 of case "part-written" stands for a
    # committer that has not reached its commit yet) until the launcher kills it
    mark(cfg, f"waiting-{rank}")
    try:
        dist.barrier()
    except Exception as exc:
        mark(cfg, f"error-{rank}.json", type(exc).__name__)
    time.sleep(600)


# --- the test (the launcher) -----------------------------------------------------------------


def bits(t: Any) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.int16).numpy()


def assert_bit_exact(expected: dict[str, Any], got: Any) -> None:
    assert got is not None and set(got) == set(expected), (sorted(got or ()), sorted(expected))
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and tuple(got[name].shape) == tuple(t.shape), name
        assert np.array_equal(bits(got[name]), bits(t)), name


#: Modules the fork server imports once, so that each worker starts in a fraction of a second
#: instead of importing torch again (seconds on a loaded machine).
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "deltastore.publish.module_writer",
    __name__,
]


def start(cfg: dict[str, Any]) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    procs = [ctx.Process(target=_worker, args=(rank, cfg), daemon=True) for rank in range(WORLD)]
    for p in procs:
        p.start()
    return procs


def errors(out: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(out.glob("error-*.txt")))


def wait_for(cond: Any, out: Path, follow: Any, what: str, timeout: float = 120.0) -> None:
    """Poll ``cond()`` (syncing the follower meanwhile) until it holds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if errors(out):
            pytest.fail(f"a worker failed while waiting for {what}:\n{errors(out)}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        follow()
        time.sleep(0.05)


def kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(30)


@pytest.mark.parametrize(
    ("case", "snapshot_free"),
    [("part-written", False), ("committed", False), ("part-written", True)],
    ids=["part-written", "committed", "part-written-snapshot-free"],
)
def test_a_killed_job_restarts_and_the_store_stays_exact(
    tmp_path: Path, case: str, snapshot_free: bool
) -> None:
    from deltastore import Subscriber, commit_parts
    from deltastore.errors import (
        SupersededRunError,
        VersionExistsError,
        VersionNotCommittedError,
    )
    from deltastore.format.keys import manifest_key
    from deltastore.maintenance.orphans import gc
    from deltastore.maintenance.verify import verify_store
    from deltastore.store import LocalStore

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    cfg: dict[str, Any] = {
        "store": str(store),
        "out": str(out),
        "case": case,
        "snapshot_free": snapshot_free,
    }
    follower = Subscriber(str(store), lease_ttl=None)
    seen: list[int] = []

    def follow() -> None:
        if (store / "LATEST").exists():
            seen.append(follower.sync().version)

    # the first job, killed at K
    procs = start(cfg | {"phase": "crash", "init": str(tmp_path / "init-1")})
    try:
        if case == "part-written":
            wait_for(lambda: not procs[1].is_alive(), out, follow, "rank 1 to die")
            assert procs[1].exitcode == 1 and (out / "rank1-published").exists(), errors(out)
            wait_for(lambda: (out / "waiting-0").exists(), out, follow, "rank 0 to wait")
        else:
            wait_for(lambda: not procs[0].is_alive(), out, follow, "rank 0 to die")
            assert procs[0].exitcode == 1 and (out / "rank0-committed").exists(), errors(out)
            wait_for(lambda: (out / "waiting-1").exists(), out, follow, "rank 1 to finish")
            assert (out / "rank1-finished").exists()
    finally:
        kill(procs)  # the launcher ends the job
    head = K - 1 if case == "part-written" else K
    assert (store / manifest_key(K)).exists() == (case == "committed")
    first = json.loads((out / "crash-resume-0.json").read_text())
    assert first == json.loads((out / "crash-resume-1.json").read_text()) | {"rank": 0}
    assert (first["head"], first["kind"], first["abandoned"]) == (None, "anchor", [])
    old_run = first["run"]
    follow()
    assert seen and follower.version == head
    if head < K:  # the follower holds the version the job committed last
        assert_bit_exact(torch.load(out / f"truth-{head}.pt"), follower.tensors)

    # the restarted job: a new process group, the same store
    procs = start(cfg | {"phase": "resume", "init": str(tmp_path / "init-2"), "head": head})
    try:
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0], errors(out)
    finally:
        kill(procs)
    reports = [json.loads((out / f"resume-resume-{r}.json").read_text()) for r in range(WORLD)]
    for rank, r in enumerate(reports):
        assert (r["rank"], r["world"]) == (rank, WORLD)
        assert r["head"] == head and r["kind"] == "delta" and r["reason"] is None, r
        assert r["abandoned"] == ([K] if case == "part-written" else []), r
        assert r["run"] == reports[0]["run"] != old_run
    versions = [json.loads((out / f"resume-versions-{r}.json").read_text()) for r in range(WORLD)]
    assert versions[0] == versions[1] == list(range(head + 1, head + 1 + MORE))
    final = torch.load(out / "final.pt")

    assert_bit_exact(torch.load(out / "head.pt"), follower.tensors)  # the replay is exact
    report = verify_store(store, deep=True)
    assert report.ok, report.summary()
    assert report.versions == tuple(range(1, head + MORE + 1))
    got = follower.sync()
    assert got.from_version == head and got.version == head + MORE, got
    assert_bit_exact(final, follower.tensors)
    fresh = Subscriber(str(store), lease_ttl=None)
    assert fresh.sync().version == head + MORE
    assert_bit_exact(final, fresh.tensors)
    # the crashed run's late commit of the version it died at (the new run has committed a
    # version of that number or above since) is refused
    late = K if case == "part-written" else K + 1
    with pytest.raises((SupersededRunError, VersionNotCommittedError, VersionExistsError)):
        commit_parts(store, version=late, world=WORLD, run=old_run, timeout_s=1, poll_s=0.05)
    # and of a version above the new run's: the fence
    with pytest.raises(SupersededRunError) as refused:
        commit_parts(store, version=head + MORE + 1, world=WORLD, run=old_run, timeout_s=1)
    assert old_run in str(refused.value), refused.value
    # gc removes what the crashed run left (its parts of K in case "part-written") and
    # nothing a version needs
    leftovers = [k for k in LocalStore(store).list("versions/") if f"/parts/{old_run}/" in k]
    parts = [k for k in leftovers if not k.endswith("abort.json")]  # the refusals' markers aside
    assert bool(parts) == (case == "part-written"), leftovers
    removed = set(gc(store, orphans=True).removed)
    assert {k for k in leftovers if not k.endswith("abort.json")} <= removed
    assert verify_store(store, deep=True).ok
    again = Subscriber(str(store), lease_ttl=None)
    assert again.sync().version == head + MORE
    assert_bit_exact(final, again.tensors)
