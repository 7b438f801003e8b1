"""A moto S3 server that enforces IAM policies, in a subprocess on 127.0.0.1 (a free port).

moto checks IAM (signature, then the caller's identity policies) once its count of requests
made without authentication reaches ``INITIAL_NO_AUTH_ACTION_COUNT``; the count and the limit
are process-wide, so the server runs in its own process, never in the test process's shared
moto (``tests/servers.py``). :func:`iam_moto` starts it without authentication, creates an
``admin`` user allowed everything, then switches enforcement on (``POST
/moto-api/reset-auth`` with ``0``: what moto's own ``set_initial_no_auth_action_count`` does in
server mode); from then on every request needs an IAM user's keys. Users are created by the
admin (:meth:`IamMoto.user`).

:func:`doc_policies` reads the IAM policy documents of ``docs/stores.md`` (a fenced ``json``
block right after a ``<!-- policy: NAME -->`` line), so the tests run the policies the docs
give. Not thread-safe (one test thread); the server is killed when the context exits.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
REGION = "us-east-1"
_POLICY = re.compile(r"<!-- policy: ([a-z0-9-]+) -->\n```json\n(.*?)\n```", re.S)


def doc_policies(doc: Path = ROOT / "docs" / "stores.md") -> dict[str, dict[str, Any]]:
    """The policy documents of ``doc`` by name (``<!-- policy: NAME -->`` + a json block)."""
    return {name: json.loads(body) for name, body in _POLICY.findall(doc.read_text())}


def for_bucket(policy: dict[str, Any], bucket: str, doc_bucket: str = "my-bucket") -> str:
    """``policy`` as JSON text with the docs' bucket name replaced by ``bucket``."""
    return json.dumps(policy).replace(f"arn:aws:s3:::{doc_bucket}", f"arn:aws:s3:::{bucket}")


@dataclass
class IamMoto:
    """The server at ``url``; ``admin`` holds the storage options of a user allowed all."""

    url: str
    admin: dict[str, str] = field(default_factory=dict)

    def client(self, service: str, options: dict[str, str]) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.url,
            aws_access_key_id=options["key"],
            aws_secret_access_key=options["secret"],
            region_name=REGION,
        )

    def user(self, name: str, policy: str) -> dict[str, str]:
        """Create IAM user ``name`` with the inline policy ``policy`` (JSON text) and an access
        key; its s3fs storage options (``key``, ``secret``, ``endpoint_url``)."""
        iam = self.client("iam", self.admin)
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=policy)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return self.options(key["AccessKeyId"], key["SecretAccessKey"])

    def options(self, key: str, secret: str) -> dict[str, str]:
        return {"key": key, "secret": secret, "endpoint_url": self.url}


def _wait_listening(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"moto.server exited with {proc.returncode}: {log.read_text(errors='replace')}"
            )
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto.server did not listen on 127.0.0.1:{port}") from None
            time.sleep(0.05)


@contextmanager
def iam_moto(timeout: float = 30.0) -> Iterator[IamMoto]:
    """A moto server enforcing IAM, with an ``admin`` user; killed afterwards."""
    import requests

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = "inf"  # none until the admin exists (reset below)
    with tempfile.TemporaryDirectory(prefix="moto-iam-") as tmp:
        log_path = Path(tmp) / "moto.out"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            _wait_listening(proc, port, log_path, timeout)
            server = IamMoto(f"http://127.0.0.1:{port}")
            server.admin = server.options("bootstrap", "bootstrap")  # no auth yet
            allow_all = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
            }
            server.admin = server.user("admin", json.dumps(allow_all))
            answer = requests.post(f"{server.url}/moto-api/reset-auth", data=b"0", timeout=10)
            answer.raise_for_status()
            yield server
        finally:
            proc.kill()
            proc.wait(10)
