"""deltastore as verl's checkpoint engine, against an installed verl (``make test-verl``, in
.venv-verl): the class verl's registry returns for ``"deltastore"`` after importing
``custom_backend_module``, driven as verl's actor and rollout workers drive it, over a local
folder and a moto S3 server. The scenarios are tests/test_integrations_verl.py's."""

from __future__ import annotations

import importlib
import os
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


ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RESULT = "DELTASTORE-RESULT "  # tests/vllm/tools.py's result prefix


def hf_state(model: Any, tmp: Path) -> dict[str, Any]:
    """The checkpoint's tensors (names as vLLM loads them), bf16: what the trainer publishes."""
    import torch
    from safetensors.torch import load_file

    model.save_pretrained(tmp)
    out: dict[str, Any] = {}
    for f in sorted(tmp.glob("*.safetensors")):
        out |= {n: t.to(torch.bfloat16).contiguous() for n, t in load_file(f).items()}
    return out


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm (make test-vllm)")
def test_vllm_loads_what_the_rollout_received(engine_cls: Any, tmp_path: Path) -> None:
    """A tiny Qwen2 trained by AdamW for 2 steps: the checkpoint the rollout assembles from
    what it received (all at version 0, then the changed tensors) gives the same greedy tokens
    and logprobs in a fresh vLLM (CPU) engine as the trainer's own checkpoint of version 2
    (and not those of version 0)."""
    import json as _json

    import torch
    import transformers as tf
    from safetensors.torch import save_file

    config = tf.Qwen2Config(
        vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=256, max_position_embeddings=512,
        tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    url = str(tmp_path / "store")
    trainer = factory(engine_cls)(url=url, is_master=True)
    rollout = factory(engine_cls)(url=url, timeout_s=5)
    held: dict[str, Any] = {}
    for step in range(3):
        if step:
            batch = torch.randint(0, 1000, (4, 32))
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        state = hf_state(model, tmp_path / f"hf{step}")
        send(trainer, iter(state.items()), step)
        got, err = receive(rollout, step)
        assert err is None
        held |= got
        if step == 0:
            first = dict(state)
    want = tmp_path / "trainer-v2"
    mine = tmp_path / "rollout-v2"
    old = tmp_path / "trainer-v0"
    for folder, tensors in ((want, state), (mine, held), (old, first)):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        config.save_pretrained(folder)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'vllm'}",
    }
    out = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm" / "engine.py"), "reference", str(want),
         str(mine), str(old)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)][-1]
    result = _json.loads(line[len(RESULT) :])
    assert result[str(want)] == result[str(mine)]
    assert all(o["ids"] for o in result[str(mine)])
    assert result[str(old)] != result[str(mine)]  # the two steps changed the outputs
