"""The deltastore side of the verl checkpoint engine (deltastore.integrations.verl), without verl.

The scenario functions here drive an engine class the way verl's workers do (``send_weights``
on the trainer, ``receive_weights`` on the rollout, ``asyncio``); this module runs them on
:class:`~deltastore.integrations.verl.DeltastoreEngine`, tests/integrations/test_verl.py on the
class registered in an installed verl, over a local folder and S3.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deltastore.errors import (
    ChainError,
    FrameError,
    IntegrityError,
    ManifestNotFoundError,
    TensorMismatchError,
    WrongParentError,
)
from deltastore.format.keys import data_prefix, manifest_key
from deltastore.integrations.verl import DeltastoreEngine, TrainerSide
from deltastore.store import open_store

Factory = Callable[..., Any]


class Policy:
    """A tiny bfloat16 model stepped by a real AdamW (one tensor frozen: it never changes)."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.bfloat16) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Embedding(64, 16),
            torch.nn.Linear(16, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 64),
        ).to(dtype)
        self.model[1].bias.requires_grad_(False)  # a tensor that never changes
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-2)

    def step(self, *, freeze_head: bool = False) -> None:
        """One optimizer step on random tokens (``freeze_head``: the last layer's grads
        dropped, so that step changes only the others)."""
        tokens = torch.randint(0, 64, (4, 8))
        logits = self.model(tokens).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if freeze_head:
            self.model[3].weight.grad = None
            self.model[3].bias.grad = None
        self.optimizer.step()

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What verl's ``get_per_tensor_param()`` yields: names and full tensors."""
        yield from self.model.state_dict(keep_vars=True).items()

    def copy(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.weights()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's words (int16 for 2-byte dtypes), for bit-wise comparison."""
    return t.detach().cpu().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {n for n in after if not torch.equal(bits(before[n]), bits(after[n]))}


def send(engine: Any, weights: Any, step: int | None) -> dict[str, float]:
    return dict(asyncio.run(engine.send_weights(weights, global_steps=step)))


def receive(engine: Any, step: int | None) -> tuple[dict[str, torch.Tensor], Exception | None]:
    """What ``receive_weights`` yields (copied, as verl's server adapter copies them) and the
    error it raised, if any."""
    got: dict[str, torch.Tensor] = {}

    async def drain() -> None:
        async for name, tensor in engine.receive_weights(global_steps=step):
            got[name] = tensor.clone()

    try:
        asyncio.run(drain())
    except Exception as exc:
        return got, exc
    return got, None


def wipe(url: str, storage_options: dict[str, Any] | None) -> None:
    store = open_store(url, storage_options)
    for key in store.list(""):
        store.delete(key)


# --- scenarios: factory(url=..., storage_options=..., [is_master=...]) -> engine ---------------


def round_trip(factory: Factory, url: str, opts: dict[str, Any] | None, versions: int = 4) -> None:
    """The rollout gets exactly the tensors that changed in each version, bit-equal."""
    policy = Policy(seed=1)
    trainer = factory(url=url, storage_options=opts, is_master=True, timeout_s=5)
    rollout = factory(url=url, storage_options=opts, timeout_s=5)
    other_rank = factory(url=url, storage_options=opts, is_master=False)
    before = policy.copy()
    for step in range(versions):
        if step:
            policy.step(freeze_head=step == 2)
        metrics = send(trainer, policy.weights(), step)
        assert send(other_rank, policy.weights(), step) == {}  # walks, publishes nothing
        assert metrics["deltastore/version"] == step
        assert metrics["deltastore/anchor"] == (step == 0)
        now = policy.copy()
        got, err = receive(rollout, step)
        assert err is None
        want = set(now) if step == 0 else changed(before, now)
        assert set(got) == want
        if step:
            assert "1.bias" not in got
            assert 0 < len(want) < len(now)
            assert ("3.weight" in want) == (step != 2)
        for name, tensor in got.items():
            assert torch.equal(bits(tensor), bits(now[name])), name
        before = now
    got, err = receive(rollout, versions - 1)  # the version held: nothing changed
    assert err is None
    assert got == {}


def skipped_version(factory: Factory, url: str, opts: dict[str, Any] | None) -> None:
    """A version missing below a newer one, or a delta on a version not held: ChainError, nothing
    yielded; the rollout stays at its version and goes on to a version on it."""
    policy = Policy(seed=2)
    trainer = factory(url=url, storage_options=opts, is_master=True)
    rollout = factory(url=url, storage_options=opts, timeout_s=5)
    for step in range(2):
        if step:
            policy.step()
        send(trainer, policy.weights(), step)
        assert receive(rollout, step)[1] is None
    # the trainer skips version 2: version 3 exists, 2 never will
    policy.step()
    send(trainer, policy.weights(), 3)
    for told in (2, None):  # told to expect 2, or the next after the held 1
        got, err = receive(rollout, told)
        assert isinstance(err, ChainError), err
        assert got == {}
    got, err = receive(rollout, 3)  # 3 is a delta on the held 1: the rollout goes on
    assert err is None
    assert got
    assert rollout.rollout.version == 3
    # a version deleted: 4 and 5 published, then 4's manifest removed: 5's parent is missing
    for step in (4, 5):
        policy.step()
        send(trainer, policy.weights(), step)
    open_store(url, opts).delete(manifest_key(4))
    for told in (4, None, 5):
        got, err = receive(rollout, told)
        assert isinstance(err, ChainError), err
        assert got == {}
    assert "skipped or deleted" in str(err)
    assert rollout.rollout.version == 3


def wrong_base(factory: Factory, url: str, opts: dict[str, Any] | None) -> None:
    """The store rewritten by another run: its version 2 is a delta on another state of the
    version 1 the rollout holds: WrongParentError, nothing yielded."""
    first, second = Policy(seed=3), Policy(seed=4)
    trainer = factory(url=url, storage_options=opts, is_master=True)
    rollout = factory(url=url, storage_options=opts, timeout_s=5)
    for step in range(2):
        if step:
            first.step()
        send(trainer, first.weights(), step)
        assert receive(rollout, step)[1] is None
    wipe(url, opts)
    other = factory(url=url, storage_options=opts, is_master=True)
    for step in range(3):
        if step:
            second.step()
        send(other, second.weights(), step)
    got, err = receive(rollout, 2)
    assert isinstance(err, WrongParentError), err
    assert got == {}
    assert rollout.rollout.version == 1


def damaged_version(factory: Factory, url: str, opts: dict[str, Any] | None) -> None:
    """Flipped bytes in a version's data: IntegrityError (or FrameError), nothing yielded, the
    rollout at the version it held, which it goes on from once the data is right again."""
    policy = Policy(seed=12)
    trainer = factory(url=url, storage_options=opts, is_master=True)
    rollout = factory(url=url, storage_options=opts, timeout_s=5)
    send(trainer, policy.weights(), 0)
    assert receive(rollout, 0)[1] is None
    policy.step()
    send(trainer, policy.weights(), 1)
    store = open_store(url, opts)
    key = max(store.list(data_prefix(1)), key=lambda k: len(store.get(k)))
    good = store.get(key)
    bad = bytearray(good)
    mid = len(bad) // 2
    bad[mid : mid + 8] = bytes(b ^ 0xFF for b in bad[mid : mid + 8])
    store.put(key, bytes(bad))
    got, err = receive(rollout, 1)
    assert isinstance(err, (IntegrityError, FrameError)), err
    assert got == {}
    assert rollout.rollout.version == 0
    store.put(key, good)
    got, err = receive(rollout, 1)
    assert err is None
    assert got


# --- the scenarios on the verl-free engine ----------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    round_trip(DeltastoreEngine, str(tmp_path / "store"), None)


def test_skipped_version(tmp_path: Path) -> None:
    skipped_version(DeltastoreEngine, str(tmp_path / "store"), None)


def test_wrong_base(tmp_path: Path) -> None:
    wrong_base(DeltastoreEngine, str(tmp_path / "store"), None)


def test_damaged_version(tmp_path: Path) -> None:
    damaged_version(DeltastoreEngine, str(tmp_path / "store"), None)


def test_wait_times_out(tmp_path: Path) -> None:
    rollout = DeltastoreEngine(url=str(tmp_path / "store"), timeout_s=0.0)
    got, err = receive(rollout, 0)
    assert isinstance(err, ManifestNotFoundError), err
    assert got == {}


def test_async_generator_weights(tmp_path: Path) -> None:
    """verl's weights may come as an async generator; a name given twice is refused."""
    policy = Policy(seed=5)

    async def weights(twice: bool) -> Any:
        for name, tensor in policy.weights():
            yield name, tensor
        if twice:
            yield "0.weight", policy.model[0].weight

    url = str(tmp_path / "store")
    with pytest.raises(TensorMismatchError):
        send(DeltastoreEngine(url=url, is_master=True), weights(True), 0)
    assert send(DeltastoreEngine(url=url, is_master=True), weights(False), 0)["deltastore/anchor"]
    assert send(DeltastoreEngine(url=url, is_master=False), weights(False), 1) == {}


def test_attach_after_restart(tmp_path: Path) -> None:
    """A restarted trainer sent the version the store holds attaches (no publish) and goes on
    with deltas; other tensors at that version are refused."""
    url = str(tmp_path / "store")
    policy = Policy(seed=6)
    send(DeltastoreEngine(url=url, is_master=True), policy.weights(), 7)
    restarted = DeltastoreEngine(url=url, is_master=True)
    metrics = send(restarted, policy.weights(), 7)
    assert metrics["deltastore/version"] == 7
    assert "deltastore/anchor" not in metrics  # attached: nothing published
    policy.step()
    assert send(restarted, policy.weights(), 8)["deltastore/anchor"] == 0.0
    with pytest.raises(TensorMismatchError):
        send(DeltastoreEngine(url=url, is_master=True), Policy(seed=7).weights(), 8)


def test_snapshot_free(tmp_path: Path) -> None:
    """With the optimizer (snapshot-free), float32 parameters arrive as their bfloat16 casts,
    bit-equal; only the changed ones."""
    url = str(tmp_path / "store")
    policy = Policy(seed=8, dtype=torch.float32)
    trainer = DeltastoreEngine(url=url, is_master=True)
    trainer.use_optimizer(policy.optimizer)
    rollout = DeltastoreEngine(url=url, timeout_s=5)
    for step in range(3):
        if step:
            policy.step()
        send(trainer, policy.weights(), step)
        got, err = receive(rollout, step)
        assert err is None
        if step:
            assert "1.bias" not in got
        assert got
        for name, tensor in got.items():
            want = policy.model.state_dict()[name].to(tensor.dtype)  # params: bf16 casts
            assert tensor.dtype == (torch.float32 if name == "1.bias" else torch.bfloat16)
            assert torch.equal(bits(tensor), bits(want)), name


def test_engine_contract() -> None:
    """No process group: empty topology, metadata that names the store; a url is required."""
    engine = DeltastoreEngine(bucket_size=1 << 20, url="/nowhere", is_master=True)
    assert DeltastoreEngine.build_topology(2, 4, [{}] * 6) == ({}, {})
    assert engine.prepare() == {"url": "/nowhere", "is_master": True}
    engine.init_process_group()
    engine.finalize()
    with pytest.raises(ValueError, match="engine_kwargs"):
        DeltastoreEngine(bucket_size=1)


def test_trainer_side_order(tmp_path: Path) -> None:
    side = TrainerSide(str(tmp_path / "store"))
    side.send(Policy(seed=9).weights())
    assert side.version == 0
    with pytest.raises(ValueError, match="before the first send"):
        side.use_optimizer(Policy(seed=9).optimizer)


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed")
def test_imports_without_verl() -> None:
    code = (
        "import deltastore.integrations.verl as v\n"
        "try:\n    v.register()\nexcept ImportError:\n    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok", out.stderr
