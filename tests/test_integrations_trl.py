"""deltastore.integrations.trl without vLLM or TRL: :class:`DeltastoreWeightTransfer` against
a fake ``vllm serve`` on 127.0.0.1 that records each call (method, path, JSON body) in order.

Driven as TRL 1.16's ``AsyncGRPOTrainer`` drives a ``weight_transfer`` (init once; per sync
pause, send_weights(named parameters), resume; destroy): the HTTP calls come in vLLM's
update order, each version the server is told of is committed in the store and holds the
trainer's weights cast to bfloat16 bit for bit, a failed update raises the typed error named
in the server's message and makes the next version an anchor, a foreign commit on the chain or
another tensor table raises before the server is told anything. The real server:
tests/integrations/test_trl.py (``make test-integrations``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from deltastore import Publisher, Subscriber
from deltastore.catalog.chain import ChainReader
from deltastore.errors import (
    EngineSyncError,
    IntegrityError,
    TableChangedError,
    VersionOrderError,
)
from deltastore.integrations.trl import DeltastoreWeightTransfer
from deltastore.store import open_store

Call = tuple[str, str, Any]


class FakeServer:
    """A fake ``vllm serve`` (dev mode): 200 and ``{}`` for every route, ``/health`` and
    ``/server_info`` as vLLM answers them; ``fail[path]`` = (status, body) for the next call
    of ``path`` (then cleared)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.fail: dict[str, tuple[int, Any]] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                outer.calls.append((method, self.path, body))
                route = self.path.split("?")[0]
                status, out = outer.fail.pop(route, (200, None))
                if out is None:
                    out = {
                        "/server_info": {
                            "vllm_config": {"model_config": {"dtype": "torch.bfloat16"}}
                        },
                        "/reset_prefix_cache": {"success": True},
                    }.get(route, {})
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def take(self) -> list[Call]:
        """The calls since the last take."""
        out, self.calls = self.calls, []
        return out

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    yield srv
    srv.close()


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """A float32 model with a few named parameters (and a buffer, which is not sent)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(64, 16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 64)
    )
    model.register_buffer("scale", torch.ones(3))
    return model


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randint(0, 64, (4, 8))
    loss = model(x).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def stored(store: Path, version: int) -> dict[str, torch.Tensor]:
    """The tensors of ``version`` of the store, read by a fresh subscriber."""
    sub = Subscriber(str(store), lease_ttl=None)
    sub.sync(version)
    assert sub.version == version and sub.tensors is not None
    return {n: t.clone() for n, t in sub.tensors.items()}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), n


def sync(wt: DeltastoreWeightTransfer, model: torch.nn.Module) -> None:
    """One sync as TRL's ``_sync_weight_merged``: pause, send_weights, resume."""
    wt.pause()
    wt.send_weights((n, p.detach()) for n, p in model.named_parameters())
    wt.resume()


def update_calls(version: int) -> list[Call]:
    """The calls of one successful sync to ``version``."""
    return [
        ("POST", "/pause?mode=keep", {}),
        ("POST", "/start_weight_update", {}),
        ("POST", "/update_weights", {"update_info": {"version": version}}),
        ("POST", "/finish_weight_update", {"weight_version": str(version)}),
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/resume", {}),
    ]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store whose version 0 is tiny_model()'s weights in bfloat16 (the server's model)."""
    path = tmp_path / "store"
    Publisher(str(path), signing_key=None).publish(bf16_state(tiny_model()), version=0)
    return path


def test_calls_come_in_vllms_order_and_each_version_holds_the_trainers_weights(
    server: FakeServer, store: Path
) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wt = DeltastoreWeightTransfer(server.url, str(store), signing_key=None)
    wt.init_weight_transfer()
    assert server.take() == [
        ("GET", "/health", None),
        ("GET", "/server_info?config_format=json", None),
        ("POST", "/init_weight_transfer_engine", {"init_info": {"url": str(store)}}),
    ]
    assert wt.dtype == torch.bfloat16
    # the cold sync: the weights are version 0's, nothing is published, the server is told 0
    sync(wt, model)
    assert server.take() == update_calls(0)
    assert ChainReader(open_store(str(store))).newest() == 0
    for step in (1, 2, 3):
        train_step(model, opt)
        sync(wt, model)
        assert server.take() == update_calls(step)
        assert wt.version == step
        assert_bitwise(stored(store, step), bf16_state(model))
        assert ChainReader(open_store(str(store))).manifest(step).kind == "delta"
    wt.destroy()
    assert server.take() == [("POST", "/shutdown_weight_transfer_engine", {})]


def test_a_failed_update_raises_the_servers_error_type_and_the_next_version_is_an_anchor(
    server: FakeServer, store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wt = DeltastoreWeightTransfer(server.url, str(store), signing_key=None, pause_mode="abort")
    wt.init_weight_transfer()
    sync(wt, model)
    train_step(model, opt)
    sync(wt, model)
    assert wt.version == 1
    server.take()
    # vLLM's answer to an update the backend failed (its message names the type)
    message = "deltastore update to version 2 failed on rank 0 (IntegrityError): frame 0: bad"
    server.fail["/update_weights"] = (500, {"error": {"message": message, "code": 500}})
    train_step(model, opt)
    wt.pause()
    with pytest.raises(IntegrityError, match=r"to version 2 .*HTTP 500.*keeps version 1"):
        wt.send_weights((n, p.detach()) for n, p in model.named_parameters())
    assert "to version 2" in caplog.text
    wt.resume()
    assert wt.version == 1
    assert [c[1] for c in server.take()] == [
        "/pause?mode=abort", "/start_weight_update", "/update_weights",
        "/finish_weight_update", "/resume",
    ]  # fmt: skip
    # an error without the backend's type: EngineSyncError
    server.fail["/update_weights"] = (500, "Internal Server Error")
    train_step(model, opt)
    with pytest.raises(EngineSyncError, match="to version 3"):
        sync(wt, model)
    wt.resume()
    # the next version is whole (the server may lack the versions before it), then deltas
    train_step(model, opt)
    sync(wt, model)
    reader = ChainReader(open_store(str(store)))
    assert [reader.manifest(v).kind for v in (2, 3, 4)] == ["delta", "anchor", "anchor"]
    assert wt.version == 4
    assert_bitwise(stored(store, 4), bf16_state(model))
    train_step(model, opt)
    sync(wt, model)
    assert ChainReader(open_store(str(store))).manifest(5).kind == "delta"


def test_a_foreign_commit_on_the_chain_raises_before_the_server_is_told(
    server: FakeServer, store: Path
) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wt = DeltastoreWeightTransfer(server.url, str(store), signing_key=None)
    wt.init_weight_transfer()
    sync(wt, model)
    server.take()
    # another writer continues the chain from version 0 first
    other = Publisher(str(store), signing_key=None)
    other.attach(bf16_state(tiny_model()))
    other.publish(bf16_state(tiny_model(seed=5)), version=1)
    train_step(model, opt)
    wt.pause()
    with pytest.raises(VersionOrderError, match="newest version 1"):
        wt.send_weights((n, p.detach()) for n, p in model.named_parameters())
    wt.resume()
    assert [c[1] for c in server.take()] == ["/pause?mode=keep", "/resume"]
    assert wt.version == 0


def test_another_tensor_table_raises_before_anything_is_written(
    server: FakeServer, store: Path
) -> None:
    wt = DeltastoreWeightTransfer(server.url, str(store), signing_key=None)
    wt.init_weight_transfer()
    server.take()
    params = list(tiny_model().named_parameters())
    with pytest.raises(TableChangedError) as info:
        wt.send_weights((n, p.detach()) for n, p in params[1:])
    assert info.value.removed == (params[0][0],)
    assert server.take() == []
    assert ChainReader(open_store(str(store))).newest() == 0


def test_other_weights_at_the_start_are_published_whole(
    server: FakeServer, store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model(seed=3)  # not version 0's values
    wt = DeltastoreWeightTransfer(server.url, str(store), signing_key=None)
    wt.init_weight_transfer()
    sync(wt, model)
    assert "publishing them whole as version 1" in caplog.text
    assert ChainReader(open_store(str(store))).manifest(1).kind == "anchor"
    assert wt.version == 1
    assert_bitwise(stored(store, 1), bf16_state(model))


def test_snapshot_free_publishes_the_optimizers_parameters_as_bfloat16(
    server: FakeServer, store: Path
) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wt = DeltastoreWeightTransfer(
        server.url, str(store), signing_key=None, optimizer=opt, server_version=0
    )
    wt.init_weight_transfer()
    init = [c for c in server.take() if c[1] == "/init_weight_transfer_engine"]
    assert init == [
        ("POST", "/init_weight_transfer_engine", {"init_info": {"url": str(store), "version": 0}})
    ]
    sync(wt, model)
    reports: list[Any] = []
    wt.on_publish = reports.append
    for step in (1, 2, 3):
        train_step(model, opt)
        sync(wt, model)
        assert server.take()[-4:-2] == update_calls(step)[2:4]
        assert_bitwise(stored(store, step), bf16_state(model))
    assert [r.version for r in reports] == [1, 2, 3]
    assert all(r.snapshot_free is not None for r in reports)


def test_destroy_resumes_a_server_left_paused(server: FakeServer, store: Path) -> None:
    wt = DeltastoreWeightTransfer(server.url, str(store), signing_key=None)
    wt.init_weight_transfer()
    wt.pause()
    server.take()
    wt.destroy()
    assert [c[1] for c in server.take()] == ["/resume", "/shutdown_weight_transfer_engine"]


def test_a_server_that_does_not_come_up_is_an_error(store: Path) -> None:
    srv = FakeServer()
    url = srv.url
    srv.close()
    wt = DeltastoreWeightTransfer(url, str(store), signing_key=None, ready_timeout=1.5)
    with pytest.raises(EngineSyncError, match=r"not ready after 1\.5 s"):
        wt.init_weight_transfer()
    with pytest.raises(ValueError, match="http"):
        DeltastoreWeightTransfer("file:///etc", str(store))
