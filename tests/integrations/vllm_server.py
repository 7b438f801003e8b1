"""Helpers of the trainer-integration tests: a real ``vllm serve`` (dev mode, the
``"deltastore"`` weight-transfer backend) run from ``.venv-vllm`` on 127.0.0.1, a tiny HTTP
client for its completions, tiny models built and reference engines run in ``.venv-vllm``.

The tests themselves run in the framework's venv (``.venv-trl``, ...), which holds no vLLM:
every vLLM process here is started with ``.venv-vllm/bin/python`` and the tools of tests/vllm
(``tools.py``: tiny configs, prompts, ``corrupt_frame``; ``transfer_engine.py serve``: vLLM's
own CLI; ``engine.py reference``: fresh offline engines).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
VLLM_TESTS = ROOT / "tests" / "vllm"
#: the python of the vLLM venv (``make test-vllm`` builds it; ``make test-integrations`` too)
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

sys.path.insert(0, str(VLLM_TESTS))
import tools  # noqa: E402 - tests/vllm/tools.py: prompts, free_port, corrupt_frame, engine_env

__all__ = ["VLLM_PYTHON", "Server", "build_model", "reference_outputs", "tools"]


def vllm_run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``.venv-vllm/bin/python args...`` (an engine process: ``tools.engine_env``)."""
    proc = subprocess.run(
        [str(VLLM_PYTHON), *args], env=tools.engine_env(1, multiprocess=False),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}\n"
            f"{proc.stdout[-2000:]}"
        )
    return proc


def build_model(arch: str, dest: Path, seed: int = 0) -> Path:
    """``tools.build_model`` in ``.venv-vllm`` (its transformers writes the config vLLM
    reads): a random bf16 model of ``arch`` (e.g. ``qwen2``, ``llama+tied``) in ``dest``."""
    code = (
        "import sys; from pathlib import Path; import tools; "
        f"tools.build_model({arch!r}, Path({str(dest)!r}), seed={seed})"
    )
    vllm_run(["-c", code])
    return dest


def reference_outputs(folders: list[Path]) -> dict[Path, Any]:
    """Greedy outputs (``tools.PROMPTS``: token ids and the first token's logprob) of a fresh
    offline engine per checkpoint folder (``engine.py reference``, one process)."""
    proc = vllm_run([str(VLLM_TESTS / "engine.py"), "reference", *map(str, folders)])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tools.RESULT)]
    assert lines, proc.stdout[-4000:]
    got = json.loads(lines[-1][len(tools.RESULT) :])
    return {f: got[str(f)] for f in folders}


class Server:
    """``vllm serve FOLDER`` on 127.0.0.1 (dev mode, the deltastore backend), as in
    tests/vllm/test_transfer.py: the settings of the reference engines, so its greedy outputs
    equal theirs on the same weights."""

    def __init__(self, folder: Path, log: Path) -> None:
        self.port = tools.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = tools.engine_env(1, multiprocess=True)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        for name in ("DELTASTORE_SIGNING_KEY", "DELTASTORE_TRUSTED_KEYS"):
            env.pop(name, None)
        cmd = [
            str(VLLM_PYTHON), str(VLLM_TESTS / "transfer_engine.py"), "serve", str(folder),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", "tiny", "--skip-tokenizer-init", "--dtype", "bfloat16",
            "--enforce-eager", "--max-model-len", "256", "--seed", "0",
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

    def weight_version(self) -> Any:
        status, got = self.request("GET", "/weight_info")
        assert status == 200, got
        return got["weight_version"]

    def generate(self) -> list[dict[str, Any]]:
        """``tools.PROMPTS`` greedy (temperature 0) with the chosen tokens' logprobs, through
        ``/v1/completions``: as the reference engines generate them."""
        status, got = self.request("POST", "/v1/completions", {
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
