"""Local test servers for object-store backends, on 127.0.0.1 with a free port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The emulator's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server in this process; yields its endpoint URL; stopped afterwards."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@contextmanager
def gcs_emulator() -> Iterator[str]:
    """A gcp-storage-emulator (in memory) in this process; yields its endpoint URL; stopped
    afterwards. The emulator ignores generation preconditions (``ifGenerationMatch``).

    Sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` meanwhile so that gcsfs, if first imported
    here, does not probe gRPC (GCSStore uses the JSON-API filesystem either way)."""
    from gcp_storage_emulator.server import create_server

    saved = os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", None)
        else:
            os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = saved


def azurite_executable() -> str | None:
    """``azurite-blob`` from ``make``'s project-local install (``.azurite/``) or from PATH."""
    local = ROOT / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("azurite-blob")


@contextmanager
def azurite(timeout: float = 30.0) -> Iterator[str]:
    """An Azurite blob server in a subprocess; yields its connection string; killed afterwards.

    Raises :class:`FileNotFoundError` when no ``azurite-blob`` executable exists (callers skip).
    """
    exe = azurite_executable()
    if exe is None:
        raise FileNotFoundError("azurite-blob not found (make test installs it when npm exists)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="azurite-") as location:
        log_path = Path(location) / "azurite.out"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    exe,
                    "--blobHost",
                    "127.0.0.1",
                    "--blobPort",
                    str(port),
                    "--location",
                    str(Path(location) / "data"),
                    "--skipApiVersionCheck",
                    "--loose",
                    "--silent",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"azurite-blob exited with {proc.returncode}: "
                        + log_path.read_text(errors="replace")[-2000:]
                    )
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"azurite-blob did not listen on 127.0.0.1:{port} in {timeout:.0f} s"
                        ) from None
                    time.sleep(0.05)
            yield (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};"
                f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
            )
        finally:
            proc.kill()
            proc.wait(10)
