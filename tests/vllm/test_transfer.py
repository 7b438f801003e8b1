"""deltastore as vLLM's weight-transfer backend (``weight_transfer_config={"backend":
"deltastore"}``, registered by the ``vllm.general_plugins`` entry point): a real vLLM engine
follows a trainer's versions through vLLM's own update calls, offline (``LLM``) and over the
HTTP routes of ``vllm serve``; after each version its greedy tokens and first-token logprobs
equal those of a fresh engine loaded from that version's checkpoint folder. A failed update
(a version the store lacks, a corrupted frame) is an error, and the engine keeps serving the
version it had.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tools
from conftest import LAST, Chain

VERSIONS = [1, 2, 3, 4]
MISSING = 99  # a version the store does not hold


def run_transfer_engine(args: list[str], timeout: float = 900) -> Any:
    """``transfer_engine.py args...`` in a process of its own (engine and worker in one
    process, TP 1); its JSON result."""
    return tools.run_engine(args, 1, False, timeout, script="transfer_engine.py")


def check_applied(result: dict[str, Any], v: int) -> None:
    """The backend's result of one update on the worker: it went to ``v`` and rebuilt the
    modules vLLM repacked (CPU)."""
    assert result["ok"], result["error"]
    assert result["version"] == v and result["report"]["applied"] == [v], result
    assert result["rebuilt_modules"] > 0


@pytest.mark.full
def test_offline_llm_follows_versions_through_vllms_update_calls(
    chain: Callable[[str], Chain], reference: Any, tmp_path: Path
) -> None:
    c = chain("qwen3")
    refs = reference("qwen3", 1, [0, *VERSIONS, LAST])
    assert all(refs[a] != refs[b] for a, b in itertools.pairwise(VERSIONS))
    store = c.store_copy(tmp_path / "store")
    steps = [*VERSIONS, MISSING, LAST]
    out = run_transfer_engine(["offline", str(c.folders[0]), str(store), ",".join(map(str, steps))])
    assert out["start"] == refs[0]
    for step in out["steps"][:4]:
        v = step["target"]
        assert step["error"] is None, step["error"]
        check_applied(step["result"], v)
        assert step["weight_version"] == str(v)
        assert step["outputs"] == refs[v], f"version {v}: the engine's outputs differ"
    bad, good = out["steps"][4], out["steps"][5]
    # in-process: vLLM's call raises the deltastore error itself
    assert bad["error"] is not None, "an update to a version the store lacks went through"
    assert bad["error"]["type"] == "ManifestNotFoundError", bad["error"]
    assert f"deltastore update to version {MISSING} failed on rank 0" in bad["error"]["message"]
    assert not bad["result"]["ok"] and bad["result"]["version"] == 4
    assert bad["weight_version"] == "4"
    assert bad["outputs"] == refs[4], "after a failed update the engine must serve version 4"
    assert good["error"] is None, good["error"]
    check_applied(good["result"], LAST)
    assert good["result"]["report"]["kind"] == "anchor"
    assert good["outputs"] == refs[LAST]
    print(f"init {out['init_s']:.2f} s; updates " +
          ", ".join(f"v{s['target']} {s['update_s']:.2f} s" for s in out["steps"]))  # fmt: skip


# --- over HTTP: vllm serve --------------------------------------------------------------


class Server:
    """``vllm serve`` on 127.0.0.1 (dev mode: the weight-update routes), and a tiny client."""

    def __init__(self, folder: Path, log: Path) -> None:
        self.port = tools.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = tools.engine_env(1, multiprocess=True)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        cmd = [  # `vllm serve` (transfer_engine.serve says why not the `vllm` script)
            sys.executable, str(tools.HERE / "transfer_engine.py"), "serve", str(folder),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", "tiny", "--skip-tokenizer-init", "--dtype", "bfloat16",
            "--enforce-eager", "--max-model-len", "256", "--seed", "0",
            # the defaults of an offline LLM (the reference engines) on CPU
            "--max-num-seqs", "256", "--max-num-batched-tokens", "4096",
            "--weight-transfer-config", json.dumps({"backend": "deltastore"}),
        ]  # fmt: skip
        self.log = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 600) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"vllm serve not ready after {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        self._log.flush()
        return self.log.read_text()[-20000:]

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 600
    ) -> tuple[int, Any]:
        """(status, the response body as JSON, or as text when it is not JSON)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
        finally:
            conn.close()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def post(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        return self.request("POST", path, {} if body is None else body)

    def get(self, path: str) -> Any:
        status, got = self.request("GET", path)
        assert status == 200, (path, status, got)
        return got

    def update(self, info: dict[str, Any], version: int) -> tuple[int, Any]:
        """vLLM's RL update over HTTP: pause (the prefix cache is cleared), start, update,
        finish (when the update went well), resume. The update's (status, body)."""
        for path, body in (("/pause", None), ("/start_weight_update", None)):
            status, got = self.post(path, body)
            assert status == 200, (path, status, got)
        result = self.post("/update_weights", {"update_info": info})
        if result[0] == 200:
            status, got = self.post("/finish_weight_update", {"weight_version": str(version)})
            assert status == 200, ("/finish_weight_update", status, got)
        status, got = self.post("/resume")
        assert status == 200, ("/resume", status, got)
        return result

    def generate(self) -> list[dict[str, Any]]:
        """The prompts (token ids), greedy, with the chosen tokens' logprobs: as the
        reference engines generate them."""
        status, got = self.post("/v1/completions", {
            "model": "tiny", "prompt": tools.PROMPTS, "max_tokens": tools.MAX_TOKENS,
            "temperature": 0.0, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        })  # fmt: skip
        assert status == 200, (status, got)
        choices = sorted(got["choices"], key=lambda ch: ch["index"])
        return [
            {"ids": ch["token_ids"], "lp": ch["logprobs"]["token_logprobs"][0]} for ch in choices
        ]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()


@pytest.fixture
def server_of(tmp_path: Path) -> Iterator[Callable[[Path], Server]]:
    started: list[Server] = []

    def start(folder: Path) -> Server:
        srv = Server(folder, tmp_path / f"serve-{len(started)}.log")
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.mark.full
def test_vllm_serve_follows_versions_through_its_http_update_routes(
    chain: Callable[[str], Chain], reference: Any, server_of: Any, tmp_path: Path
) -> None:
    """The engine is loaded from version 0's folder (made by ``deltastore pull``: its
    ``.deltastore.json`` says which version it holds), no init call: each update names the
    store and the version."""
    c = chain("qwen3")
    refs = reference("qwen3", 1, [0, *VERSIONS, LAST])
    store = c.store_copy(tmp_path / "store")
    srv = server_of(c.folders[0])
    ready_s = srv.wait_ready()
    assert srv.generate() == refs[0]
    took: dict[int, float] = {}
    for v in VERSIONS:
        t0 = time.monotonic()
        status, got = srv.update({"url": str(store), "version": v}, v)
        took[v] = time.monotonic() - t0
        assert status == 200, (v, status, got, srv.tail())
        assert srv.get("/weight_info") == {"weight_version": str(v)}
        assert srv.generate() == refs[v], f"version {v}: the server's outputs differ"
    # failures: a version the store lacks, then a corrupted frame; each an error, after which
    # the server keeps serving version 4
    status, got = srv.update({"url": str(store), "version": MISSING}, MISSING)
    assert status >= 400, (status, got)
    log = srv.tail()
    assert f"deltastore update to version {MISSING} failed on rank 0 (ManifestNotFoundError)" in log
    assert srv.generate() == refs[4], "after a failed update the server must serve version 4"
    tools.corrupt_frame(store, 5)
    status, got = srv.update({"url": str(store), "version": 5}, 5)
    assert status >= 400, (status, got)
    log = srv.tail()
    assert "deltastore update to version 5 failed on rank 0 (" in log
    assert "versions/00000000000000000005/" in log.split("update to version 5 failed", 1)[1]
    assert srv.get("/weight_info") == {"weight_version": "4"}
    assert srv.generate() == refs[4], "after a corrupted frame the server must serve version 4"
    # the next update works (6 is an anchor: applied from its own frames)
    status, got = srv.update({"url": str(store), "version": LAST}, LAST)
    assert status == 200, (status, got, srv.tail())
    assert srv.generate() == refs[LAST]
    print(f"server ready in {ready_s:.1f} s; updates over HTTP " +
          ", ".join(f"v{v} {s:.2f} s" for v, s in took.items()))  # fmt: skip
