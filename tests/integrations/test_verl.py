"""deltastore as verl's checkpoint engine, against an installed verl (``make test-verl``, in
.venv-verl): the class verl's registry returns for ``"deltastore"`` after importing
``custom_backend_module``, driven as verl's actor and rollout workers drive it, over a local
folder and a moto S3 server. The scenarios are tests/test_integrations_verl.py's."""

from __future__ import annotations

import importlib
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")

from tests.test_integrations_verl import (
    Policy,
    damaged_version,
    receive,
    round_trip,
    send,
    skipped_version,
    wrong_base,
)

CREDENTIALS = {"key": "testing", "secret": "testing"}


@pytest.fixture(scope="module")
def engine_cls() -> Any:
    """The class verl instantiates for backend "deltastore", found as verl's workers find it:
    ``import_external_libs(custom_backend_module)``, then ``CheckpointEngineRegistry.get``."""
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("deltastore.integrations.verl")
    cls = CheckpointEngineRegistry.get("deltastore")
    assert issubclass(cls, CheckpointEngine)
    assert not getattr(cls, "__abstractmethods__", None)
    return cls


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    if request.param == "local":
        return str(tmp_path / "store"), None
    endpoint = request.getfixturevalue("s3_endpoint")  # tests/conftest.py: moto, bucket e2e
    return f"s3://e2e/verl-{uuid.uuid4().hex[:8]}", {**CREDENTIALS, "endpoint_url": endpoint}


def factory(cls: Any) -> Any:
    """verl's construction: ``CheckpointEngineRegistry.new(backend, [is_master=...,]
    bucket_size=..., **engine_kwargs)``."""

    def make(**engine_kwargs: Any) -> Any:
        from verl.checkpoint_engine import CheckpointEngineRegistry

        assert CheckpointEngineRegistry.get("deltastore") is cls
        return CheckpointEngineRegistry.new("deltastore", bucket_size=1 << 20, **engine_kwargs)

    return make


def test_registered(engine_cls: Any) -> None:
    """The registry's class, and verl's no-group protocol: topology, prepare, finalize."""
    from deltastore.integrations.verl import DeltastoreEngine, register

    assert register() is engine_cls  # idempotent
    assert issubclass(engine_cls, DeltastoreEngine)
    actor, rollout = engine_cls.build_topology(2, 3, [{}] * 5)
    assert actor == {} and rollout == {}
    engine = engine_cls(bucket_size=1 << 20, is_master=True, url="/nowhere")
    assert engine.prepare()["url"] == "/nowhere"
    engine.init_process_group()
    engine.finalize()


def test_round_trip(engine_cls: Any, store: tuple[str, dict[str, Any] | None]) -> None:
    round_trip(factory(engine_cls), *store)


def test_skipped_version(engine_cls: Any, store: tuple[str, dict[str, Any] | None]) -> None:
    skipped_version(factory(engine_cls), *store)


def test_wrong_base(engine_cls: Any, store: tuple[str, dict[str, Any] | None]) -> None:
    wrong_base(factory(engine_cls), *store)


def test_damaged_version(engine_cls: Any, store: tuple[str, dict[str, Any] | None]) -> None:
    damaged_version(factory(engine_cls), *store)


def test_omegaconf_kwargs(engine_cls: Any, tmp_path: Path) -> None:
    """engine_kwargs as verl hands them (an OmegaConf node from the YAML config)."""
    from omegaconf import OmegaConf

    url = str(tmp_path / "store")
    kwargs = OmegaConf.create(
        {"url": url, "publisher": {"max_workers": 1}, "subscriber": {"max_workers": 1}}
    )
    trainer = factory(engine_cls)(is_master=True, **kwargs)
    rollout = factory(engine_cls)(**kwargs)
    policy = Policy(seed=11)
    send(trainer, policy.weights(), 0)
    got, err = receive(rollout, 0)
    assert err is None
    assert set(got) == {n for n, _ in policy.weights()}


def test_custom_backend_module_in_a_fresh_process() -> None:
    """verl's workers import custom_backend_module before CheckpointEngineRegistry.new."""
    code = (
        "from verl.utils.import_utils import import_external_libs\n"
        "from verl.checkpoint_engine import CheckpointEngineRegistry as R\n"
        "import_external_libs('deltastore.integrations.verl')\n"
        "print(R.get('deltastore').__name__)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "DeltastoreCheckpointEngine"
    assert importlib.util.find_spec("deltastore.integrations.verl") is not None
