"""``--timeout`` is the whole command's deadline, and its message reports what happened.

Against an endpoint on 127.0.0.1 that refuses connections (a closed port) and one that
accepts them but never answers (a socket that listens and never replies), ``log`` and
``pull`` end within the deadline plus a margin for a loaded machine (a correctness bound, not
a performance assertion), and the message's attempt count and elapsed time are the real
ones: the attempts are counted where they land (the connections the silent server accepted,
the calls a fake filesystem received) and the elapsed time is compared with a clock.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from deltastore.errors import StoreError
from deltastore.store.fsspec_store import (
    FsspecStore,
    RetryPolicy,
    command_deadline,
    current_deadline,
)
from deltastore_cli import app, common

pytest.importorskip("s3fs")

runner = CliRunner()
DEADLINE = 3.0
#: What the command may take beyond its deadline on a loaded machine.
MARGIN = 5.0
SUMMARY = re.compile(r"the command made (\d+) failed attempts? in ([0-9.]+) s")


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


class Silent:
    """A server on 127.0.0.1 that accepts connections and never answers; counts them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        self.accepted = 0
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    server = Silent()
    yield server
    server.close()


def s3_args(port: int) -> list[str]:
    return ["-o", f"endpoint_url=http://127.0.0.1:{port}", "-o", "key=a", "-o", "secret=b"]


def timed(*args: str | Path) -> tuple[Result, float]:
    t0 = time.monotonic()
    result = runner.invoke(app, [str(a) for a in args])
    return result, time.monotonic() - t0


def check_message(result: Result, elapsed: float) -> tuple[int, float]:
    """One error line, exit 4, the deadline named; returns its (attempts, seconds)."""
    assert result.exit_code == common.EXIT_STORE, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "deadline of 3 s (--timeout)" in line, line
    found = SUMMARY.search(line)
    assert found, line
    attempts, seconds = int(found.group(1)), float(found.group(2))
    assert 0 < seconds <= elapsed + 0.05, (seconds, elapsed)
    assert current_deadline() is None  # lifted when the command ended
    return attempts, seconds


@pytest.mark.parametrize("command", ["log", "pull"])
def test_a_refusing_endpoint_ends_within_the_deadline(
    command: str, closed_port: int, tmp_path: Path
) -> None:
    dest = [tmp_path / "dest"] if command == "pull" else []
    result, elapsed = timed(
        command, "s3://bucket", *dest, "--timeout", str(DEADLINE), *s3_args(closed_port)
    )
    assert elapsed < DEADLINE + MARGIN, elapsed
    attempts, _ = check_message(result, elapsed)
    # every attempt but the last of each operation is logged as a retry
    retries = result.stderr.count("retrying in")
    assert retries + 1 <= attempts <= retries + 2, (attempts, retries, result.stderr)
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("command", ["log", "pull"])
def test_a_silent_endpoint_ends_within_the_deadline(
    command: str, silent: Silent, tmp_path: Path
) -> None:
    dest = [tmp_path / "dest"] if command == "pull" else []
    result, elapsed = timed(
        command, "s3://bucket", *dest, "--timeout", str(DEADLINE), *s3_args(silent.port)
    )
    assert elapsed < DEADLINE + MARGIN, elapsed
    attempts, seconds = check_message(result, elapsed)
    assert seconds >= DEADLINE - 0.05, seconds  # it waited for the deadline, not less
    time.sleep(0.2)  # the server's accept loop may lag behind the kernel's accepts
    # each attempt connects once; the one abandoned at the deadline may not have connected
    # yet (on a loaded machine its client can still be starting)
    assert silent.accepted <= attempts <= silent.accepted + 1, (attempts, silent.accepted)
    assert attempts >= 1


# --- the count itself, where every attempt is seen -------------------------------------------


class FakeFs:
    """A filesystem whose every call fails (refused) or hangs (silent); counts the calls."""

    def __init__(self, mode: str) -> None:
        self.mode, self.calls = mode, 0
        self.release = threading.Event()

    def cat_file(self, path: str, **_: Any) -> bytes:
        self.calls += 1
        if self.mode == "silent":
            self.release.wait(60)
        raise ConnectionRefusedError(111, "Connection refused")


@pytest.mark.parametrize("mode", ["refused", "silent"])
def test_the_message_counts_every_attempt_of_every_operation(mode: str) -> None:
    fs = FakeFs(mode)
    store = FsspecStore(
        "fake://bucket", fs, "bucket", retry=RetryPolicy(attempts=4, base_delay=0.01)
    )
    seconds = 1.0
    t0 = time.monotonic()
    with command_deadline(seconds):
        errors = []
        for key in ("LATEST", "manifests/x", "manifests/y"):
            with pytest.raises(StoreError) as info:
                store.get(key)
            errors.append(str(info.value))
    elapsed = time.monotonic() - t0
    fs.release.set()
    assert elapsed < seconds + MARGIN
    last = errors[-1]
    counted = SUMMARY.search(last)
    assert counted, last
    assert int(counted.group(1)) == fs.calls, (last, fs.calls)
    assert float(counted.group(2)) <= elapsed + 0.05
    if mode == "silent":
        assert fs.calls == 1  # one attempt, abandoned at the deadline
        assert "not attempted" in last and "abandoned" in last
        assert float(counted.group(2)) >= seconds - 0.05
    else:
        assert fs.calls >= 4  # the first operation's attempts, then one per operation
