"""Store errors a user meets in the first hour (docs/stores.md).

- A bucket that does not exist is named as such by the library and by every command, with a
  non-zero exit, instead of looking like an empty store; ``verify`` of a store without any
  version does not say "ok".
- A store that ignores conditional writes (the GCS emulator) is refused by ``publish`` with a
  message naming ``--unsafe-commits``, and accepted with it; in that mode the publisher reads
  its manifest back and raises :class:`ForkError` when it is not its own, and readers that
  find ``LATEST`` disagreeing with its manifest warn of a possible fork.
- An unreachable endpoint (127.0.0.1 with a closed port) shows each retry on stderr and fails
  within ``--timeout``.
- The credential options the docs show work through ``-o KEY=VALUE`` (S3 against moto).

Servers run on 127.0.0.1 with a free port (tests/servers.py, tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import logging
import re
import shlex
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner, Result

from deltastore import Publisher, Subscriber
from deltastore.errors import (
    BucketNotFoundError,
    ForkError,
    ObjectNotFoundError,
    PreconditionsIgnoredError,
    StoreError,
)
from deltastore.format.manifest import LATEST_KEY, MANIFEST_PREFIX, Latest, manifest_key
from deltastore.maintenance.verify import verify_store
from deltastore.store import LocalStore, open_store
from deltastore.store.fsspec_store import RetryPolicy
from deltastore_cli import app
from deltastore_cli import common as common
from tests.servers import free_port, gcs_emulator

pytest.importorskip("s3fs")

ROOT = Path(__file__).resolve().parent.parent
CREDENTIALS = {"key": "testing", "secret": "testing"}
runner = CliRunner()


def cli(*args: str | Path) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def flat(text: str) -> str:
    """``text`` on one line (log lines may wrap on a narrow console)."""
    return " ".join(text.split())


def s3_options(endpoint: str) -> list[str]:
    return ["-o", "key=testing", "-o", "secret=testing", "-o", f"endpoint_url={endpoint}"]


def tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 32, generator=g)
    w[step % 64] += step
    return {"w": w.to(torch.bfloat16), "b": torch.arange(16, dtype=torch.float32) * step}


def checkpoint(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors(step), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(autouse=True)
def xdg_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publisher state defaults to $XDG_CACHE_HOME: keep it out of the user's home."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture(autouse=True)
def quiet_servers() -> Iterator[None]:
    """The in-process moto server logs each request (werkzeug, INFO): keep stderr the CLI's.
    The CLI installs its log handler on the root logger, on a stream CliRunner closes after
    the command: the root logger is restored after each test."""
    werkzeug = logging.getLogger("werkzeug")
    level, handlers, root_level = werkzeug.level, logging.root.handlers[:], logging.root.level
    werkzeug.setLevel(logging.WARNING)
    yield
    werkzeug.setLevel(level)
    logging.root.handlers[:] = handlers
    logging.root.setLevel(root_level)


@pytest.fixture(scope="module")
def gcs_endpoint() -> Iterator[str]:
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    with gcs_emulator() as url:
        from gcsfs.core import GCSFileSystem

        GCSFileSystem(skip_instance_cache=True, endpoint_url=url, token="anon").mkdir("e2e")
        yield url


def gcs_options(endpoint: str) -> list[str]:
    return ["-o", f"endpoint_url={endpoint}", "-o", "token=anon", "-o", "project=test"]


# --- point 6: a bucket that does not exist ---------------------------------------------------


@pytest.mark.parametrize("command", ["publish", "pull", "log", "verify", "show", "gc"])
def test_every_command_names_a_missing_bucket(
    command: str, s3_endpoint: str, tmp_path: Path
) -> None:
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}/policy"
    args: dict[str, list[Any]] = {
        "publish": [url, checkpoint(tmp_path / "ckpt", 1), "--version", "1"],
        "pull": [url, tmp_path / "dest"],
        "log": [url],
        "verify": [url],
        "show": [url, "1"],
        "gc": [url, "--orphans"],
    }
    result = cli(command, *args[command], *s3_options(s3_endpoint))
    assert result.exit_code == common.EXIT_STORE, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert f"bucket {bucket!r} of store {url} does not exist" in lines[0]
    assert "_probe" not in result.output and "holds no committed version" not in result.output
    assert result.stdout == ""  # no empty table, no "0 versions ... ok"
    assert not (tmp_path / "dest").exists()


def test_each_store_operation_raises_bucket_not_found(s3_endpoint: str) -> None:
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    store = open_store(f"s3://{bucket}/p", {**CREDENTIALS, "endpoint_url": s3_endpoint})
    operations = {
        "list": lambda: store.list(MANIFEST_PREFIX),
        "list_after": lambda: store.list_after(MANIFEST_PREFIX, manifest_key(3)),
        "get": lambda: store.get(LATEST_KEY),
        "get_range": lambda: store.get_range("versions/x.dsz", 0, 10),
        "get_with_token": lambda: store.get_with_token(LATEST_KEY),
        "head_token": lambda: store.head_token(LATEST_KEY),
        "exists": lambda: store.exists(manifest_key(1)),
        "put": lambda: store.put("versions/x.dsz", b"data"),
        "put_if_absent": lambda: store.put_if_absent(manifest_key(1), b"{}"),
        "put_if_match": lambda: store.put_if_match(LATEST_KEY, b"{}", None),
        "delete": lambda: store.delete("versions/x.dsz"),
    }
    for name, op in operations.items():
        with pytest.raises(BucketNotFoundError, match=f"bucket '{bucket}'") as info:
            op()
        assert isinstance(info.value, StoreError | FileNotFoundError), name
        assert not isinstance(info.value, ObjectNotFoundError), name  # not "a missing key"


def test_an_empty_bucket_is_an_empty_store_and_is_checked_once(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltastore.store.s3 import S3Store

    store = S3Store(
        f"s3://e2e/{uuid.uuid4().hex[:8]}", {**CREDENTIALS, "endpoint_url": s3_endpoint}
    )
    checks: list[str] = []
    real = store._bucket_exists

    def counted() -> bool | None:
        checks.append(store.bucket)
        return real()

    monkeypatch.setattr(store, "_bucket_exists", counted)
    for _ in range(3):
        assert store.list(MANIFEST_PREFIX) == []
        assert store.get_with_token(LATEST_KEY) is None
        with pytest.raises(ObjectNotFoundError):
            store.get(manifest_key(1))
    assert checks == ["e2e"]  # one request for the bucket, then never again


def test_verify_of_a_store_without_versions_is_not_ok(s3_endpoint: str, tmp_path: Path) -> None:
    report = verify_store(tmp_path / "nothing")
    assert not report.ok and report.empty and report.problems == ()
    assert "holds no committed version" in report.summary()
    assert not report.summary().endswith("ok")
    assert report.to_json()["ok"] is False
    for store, options in (
        (tmp_path / "nothing", []),
        (f"s3://e2e/{uuid.uuid4().hex[:8]}", s3_options(s3_endpoint)),  # bucket exists, empty
    ):
        result = cli("verify", store, *options)
        assert result.exit_code == common.EXIT_NOT_FOUND, result.output
        assert "holds no committed version" in result.stdout
        assert not result.stdout.strip().endswith("ok")


# --- point 5: stores that ignore preconditions ----------------------------------------------


def test_publish_refuses_a_store_that_ignores_preconditions_unless_unsafe_commits(
    gcs_endpoint: str, tmp_path: Path
) -> None:
    url = f"gs://e2e/{uuid.uuid4().hex[:8]}"
    options = gcs_options(gcs_endpoint)
    ckpt = checkpoint(tmp_path / "ckpt-1", 1)
    refused = cli("publish", url, ckpt, "--version", "1", *options)
    assert refused.exit_code == common.EXIT_STORE, refused.output
    line = flat(refused.stderr)
    assert "ignores ifGenerationMatch preconditions" in line
    assert "--unsafe-commits" in line and "unsafe_commits=True" in line
    assert cli("log", url, *options, "--json").stdout.strip() == "[]"  # nothing committed

    for step in (1, 2):
        src = checkpoint(tmp_path / f"ckpt-{step}", step)
        done = cli("publish", url, src, "--version", str(step), "--unsafe-commits", *options)
        assert done.exit_code == 0, done.output
        assert done.stdout.startswith(f"published v{step} (")
    pulled = cli("pull", url, tmp_path / "dest", *options)
    assert pulled.exit_code == 0, pulled.output
    got = load_file(tmp_path / "dest" / "model.safetensors")
    for name, t in tensors(2).items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    assert cli("verify", url, *options).exit_code == 0


def test_help_of_unsafe_commits_states_the_risk() -> None:
    result = cli("publish", "--help")
    assert "--unsafe-commits" in result.stdout
    assert "one publisher" in flat(result.stdout)


def ignoring_s3(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An S3 store on a server that ignores ``If-None-Match`` (as some S3-compatible ones do)."""
    from deltastore.store.s3 import S3Store

    store = S3Store(f"s3://e2e/{uuid.uuid4().hex[:8]}", {**CREDENTIALS, "endpoint_url": endpoint})
    monkeypatch.setattr(store, "_create", lambda path, data: store.fs.pipe_file(path, data))
    return store


def test_publisher_unsafe_commits_for_every_store_type(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = ignoring_s3(s3_endpoint, monkeypatch)
    with pytest.raises(PreconditionsIgnoredError, match="unsafe_commits=True") as info:
        Publisher(store).publish(tensors(1), version=1)
    assert "--unsafe-commits" in str(info.value)
    assert [k for k in store.list() if not k.startswith("_probe/")] == []  # nothing uploaded
    pub = Publisher(store, unsafe_commits=True)
    pub.publish(tensors(1), version=1)
    assert pub.publish(tensors(2), version=2).kind == "delta"
    assert Subscriber(store).latest() == 2
    # a store that enforces preconditions: the flag changes nothing
    local = Publisher(LocalStore(tmp_path / "local"), unsafe_commits=True)
    local.publish(tensors(1), version=1)
    assert verify_store(tmp_path / "local").ok


def test_sharded_writers_and_commit_parts_take_unsafe_commits(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltastore.publish.sharded import RowSlice, ShardWriter, commit_parts

    store = ignoring_s3(s3_endpoint, monkeypatch)
    slices = {n: RowSlice.whole(t) for n, t in tensors(1).items()}
    with pytest.raises(PreconditionsIgnoredError):
        ShardWriter(store, 0, 1).publish(slices, version=1)
    writer = ShardWriter(store, 0, 1, unsafe_commits=True)
    writer.publish(slices, version=1)
    with pytest.raises(PreconditionsIgnoredError):
        commit_parts(store, version=1, world=1, timeout_s=5)
    assert commit_parts(store, version=1, world=1, timeout_s=5, unsafe_commits=True).version == 1
    assert writer.finish(1).version == 1
    assert Subscriber(store).latest() == 1


def test_unsafe_commit_read_back_detects_another_publishers_manifest(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two publishers commit v2 at once: the second overwrites the first one's manifest
    (nothing enforces create-if-absent); the first finds out when it reads it back."""
    store = ignoring_s3(s3_endpoint, monkeypatch)
    Publisher(store, unsafe_commits=True).publish(tensors(1), version=1)
    pub = Publisher(store, unsafe_commits=True)
    pub.attach(tensors(1))
    create = store._create

    def racing(path: str, data: bytes) -> None:
        create(path, data)
        if path.endswith(manifest_key(2)):  # the other publisher's commit lands now
            store.fs.pipe_file(path, data.replace(pub.token.encode(), b"0" * 32))

    monkeypatch.setattr(store, "_create", racing)
    latest_before = store.get(LATEST_KEY)
    with pytest.raises(ForkError, match=r"version 2 .* is not this publisher's"):
        pub.publish(tensors(2), version=2)
    assert pub.version == 1  # the publisher did not adopt a version that is not its own
    assert store.get(LATEST_KEY) == latest_before  # LATEST was not moved to it

    # an overwrite that lands after the first read-back is caught by the second one
    store = ignoring_s3(s3_endpoint, monkeypatch)
    Publisher(store, unsafe_commits=True).publish(tensors(1), version=1)
    pub = Publisher(store, unsafe_commits=True)
    pub.attach(tensors(1))
    import deltastore.publish.commit as commit_module  # the one commit sequence

    advance = commit_module.advance_latest

    def late(target: Any, version: int, body: bytes, **kwargs: Any) -> None:
        advance(target, version, body, **kwargs)
        store.put(manifest_key(version), body.replace(pub.token.encode(), b"f" * 32))

    monkeypatch.setattr(commit_module, "advance_latest", late)
    with pytest.raises(ForkError):
        pub.publish(tensors(3), version=3)


def test_cli_publish_reports_a_fork_with_a_non_zero_exit(
    gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import deltastore.publish.commit as commit_module  # the one commit sequence

    url = f"gs://e2e/{uuid.uuid4().hex[:8]}"
    commit = commit_module.commit_manifest

    def overwritten(store: Any, **kwargs: Any) -> Any:
        manifest, body = commit(store, **kwargs)  # then another publisher's commit lands
        store.put(manifest_key(manifest.version), body.replace(kwargs["token"].encode(), b"0" * 32))
        return manifest, body

    monkeypatch.setattr(commit_module, "commit_manifest", overwritten)
    ckpt = checkpoint(tmp_path / "ckpt", 1)
    result = cli(
        "publish", url, ckpt, "--version", "1", "--unsafe-commits", *gcs_options(gcs_endpoint)
    )
    assert result.exit_code == common.EXIT_MISMATCH, result.output
    assert "not this publisher's" in flat(result.stderr)
    assert result.stdout == ""  # no "published v1"


def test_a_latest_that_disagrees_with_its_manifest_is_reported_as_a_possible_fork(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path / "store")
    Publisher(store).publish(tensors(1), version=1)
    other = hashlib.sha256(b"the other publisher's manifest").hexdigest()
    forked = Latest(format_version=1, version=1, manifest=manifest_key(1), sha256=other)
    store.put(LATEST_KEY, forked.model_dump_json().encode())
    caplog.set_level(logging.WARNING, logger="deltastore")
    sub = Subscriber(store)
    assert sub.latest() == 1 and sub.latest() == 1  # still found by listing
    forks = [r for r in caplog.records if "possible fork: two publishers" in r.getMessage()]
    assert len(forks) == 1 and forks[0].levelno == logging.WARNING  # once per LATEST
    result = cli("pull", store.root, tmp_path / "dest")
    assert result.exit_code == 0, result.output
    assert "possible fork: two publishers" in flat(result.stderr)
    verified = cli("verify", store.root)
    assert verified.exit_code == common.EXIT_DAMAGED
    assert "possible fork" in verified.stdout


# --- point 7: an unreachable endpoint --------------------------------------------------------


def test_unreachable_endpoint_shows_each_retry_and_fails_within_the_timeout(
    tmp_path: Path,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    timeout = 3.0
    for command, args in (
        ("log", ["s3://bucket/policy"]),
        ("pull", ["s3://bucket/policy", tmp_path / "dest"]),
        ("publish", ["s3://bucket/policy", checkpoint(tmp_path / "ckpt", 1), "--version", "1"]),
    ):
        start = time.monotonic()
        result = cli(command, *args, *s3_options(dead), "--timeout", str(timeout))
        elapsed = time.monotonic() - start
        assert result.exit_code == common.EXIT_STORE, result.output
        text = flat(result.stderr)
        retries = re.findall(r"failed \(EndpointConnectionError: .*?\); attempt (\d) of 8", text)
        assert retries and retries == [str(n) for n in range(1, len(retries) + 1)], text
        assert re.search(r"retrying in \d+\.\d\d s", text)
        assert "still failing after" in text and "--timeout" in text
        assert elapsed < timeout + 3, (command, elapsed)  # the bound holds (loosely)
        assert not (tmp_path / "dest").exists()


def test_timeout_bounds_the_retries_and_is_a_storage_option(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from deltastore.store.s3 import S3Store

    dead = f"http://127.0.0.1:{free_port()}"
    many = RetryPolicy(attempts=1000, base_delay=0.05, max_delay=0.2)
    options = {**CREDENTIALS, "endpoint_url": dead, "timeout": 3}  # as -o timeout=3
    store = S3Store("s3://bucket/p", options, retry=many)
    assert store.timeout == 3 and store.retry.total_seconds == 3
    caplog.set_level(logging.WARNING, logger="deltastore")
    start = time.monotonic()
    with pytest.raises(StoreError, match=r"still failing after \d+ attempts? .* within 3 s"):
        store.list(MANIFEST_PREFIX)
    assert time.monotonic() - start < 3 + 2  # not 1000 attempts: the timeout stops them
    retries = [r for r in caplog.records if "attempt" in r.getMessage()]
    assert len(retries) >= 2 and all(r.levelno == logging.WARNING for r in retries)
    assert all("of 1000, retrying in" in r.getMessage() for r in retries)


def test_one_attempt_is_one_request_no_hidden_retries() -> None:
    """s3fs's and botocore's own retries are off (they added 7-17 s of silence before): one
    attempt against a server that hangs up on every request sends the request at most twice.
    aiohttp re-sends an idempotent request once, at once, when the server closes the connection
    before answering (RFC 9112, 9.3.1); botocore's retry loop and s3fs's would add 4 or more."""
    from deltastore.store.s3 import S3Store

    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []

    def hang_up() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # timed out (no more connections) or closed
                return
            accepted.append(1)
            conn.close()
            server.settimeout(2.0)  # after the first: the loop ends 2 s after the last one

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    store = S3Store(
        "s3://bucket/p", {**CREDENTIALS, "endpoint_url": endpoint}, retry=RetryPolicy(attempts=1)
    )
    try:
        with pytest.raises(StoreError, match="after 1 attempt "):
            store.get(LATEST_KEY)
        thread.join(timeout=30)
    finally:
        server.close()
    assert not thread.is_alive()
    assert 1 <= len(accepted) <= 2


def test_own_storage_options_never_reach_the_filesystem(s3_endpoint: str) -> None:
    """``-o unsafe_commits=true`` crashed inside s3fs; ``-o timeout=`` would have too."""
    url = f"s3://e2e/{uuid.uuid4().hex[:8]}"
    for extra in (["-o", "unsafe_commits=true"], ["-o", "timeout=5"], ["--timeout", "5"]):
        result = cli("log", url, *s3_options(s3_endpoint), *extra, "--json")
        assert result.exit_code == 0, (extra, result.output)
        assert result.stdout.strip() == "[]"
    bad = cli("log", url, *s3_options(s3_endpoint), "-o", "timeout=-1")
    assert bad.exit_code == common.EXIT_STORE and "timeout must be" in bad.stderr
    local = cli("log", ROOT / "no-such-store", "-o", "timeout=5", "-o", "unsafe_commits=true")
    assert local.exit_code == 0, local.output  # deltastore's own options: fine on a local store


# --- point 9: credentials, as the docs show them ---------------------------------------------


def documented_commands(doc: Path, scheme: str) -> list[str]:
    """``deltastore ...`` command lines for ``scheme://`` stores in a markdown file's console
    blocks (backslash continuations joined, environment assignments kept)."""
    text = doc.read_text().replace("\\\n", " ")
    return [
        " ".join(line.split())
        for line in text.splitlines()
        if re.search(rf"(^|\s)deltastore \w+ {scheme}://", line)
    ]


def test_the_documented_s3_credential_commands_work_against_moto(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each documented ``deltastore publish s3://`` command that passes credentials with
    ``-o key=... -o secret=...`` or ``AWS_*`` variables (and a profile) runs as written,
    with the docs' placeholders replaced by moto's bucket, endpoint and test keys."""
    profile_files = tmp_path / "aws"
    profile_files.mkdir()
    (profile_files / "credentials").write_text(
        "[trainer]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(profile_files / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(profile_files / "config"))
    ran: set[str] = set()
    for doc in (ROOT / "docs" / "stores.md", ROOT / "docs" / "cli.md"):
        for line in documented_commands(doc, "s3"):
            words = shlex.split(line)
            at = words.index("deltastore")
            env = dict(w.split("=", 1) for w in words[:at] if "=" in w)
            args = words[at + 1 :]
            if args[0] != "publish" or not (
                "key=" in line or "AWS_ACCESS_KEY_ID" in line or "profile=" in line
            ):
                continue
            url = f"s3://e2e/{uuid.uuid4().hex[:8]}"
            args = [url if a.startswith("s3://") else a for a in args]
            args[2] = str(checkpoint(tmp_path / "ckpt", 1))  # SRC
            args = [
                re.sub(r"^(key|secret)=.*", r"\1=testing", a)
                if re.match(r"(key|secret)=", a)
                else re.sub(r"^endpoint_url=.*", f"endpoint_url={s3_endpoint}", a)
                for a in args
            ]
            if "endpoint_url" not in " ".join(args):  # AWS S3 itself: point it at moto
                args += ["-o", f"endpoint_url={s3_endpoint}"]
            with monkeypatch.context() as m:
                for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
                    m.delenv(name, raising=False)
                for name, value in env.items():
                    if name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                        value = "testing"
                    if name.startswith("AWS_ENDPOINT_URL"):
                        value = s3_endpoint
                    m.setenv(name, value)
                result = cli(*args)
            assert result.exit_code == 0, (line, result.output)
            assert cli("log", url, *s3_options(s3_endpoint), "--json").stdout.count('"version"')
            ran.add("key" if "key=" in line else "profile" if "profile" in line else "env")
    assert ran == {"key", "env", "profile"}, ran


def test_the_docs_name_real_credential_options_for_each_backend() -> None:
    """Every storage option the credential sections show is a parameter of the backend's
    filesystem (s3fs, gcsfs, adlfs), and each backend has a complete command."""
    import inspect

    import adlfs
    import s3fs
    from gcsfs.core import GCSFileSystem  # what GCSStore uses

    real = {
        # profile goes through S3FileSystem's **kwargs to the botocore session
        "s3": set(inspect.signature(s3fs.S3FileSystem.__init__).parameters) | {"profile"},
        "gs": set(inspect.signature(GCSFileSystem.__init__).parameters),
        "az": set(inspect.signature(adlfs.AzureBlobFileSystem.__init__).parameters),
    }
    own = {"timeout", "unsafe_commits"}
    wanted = {
        "s3": {"key", "secret", "endpoint_url", "profile"},
        "gs": {"token", "project"},
        "az": {"account_name", "account_key", "connection_string"},
    }
    for doc in (ROOT / "docs" / "stores.md", ROOT / "docs" / "cli.md"):
        for scheme, names in real.items():
            lines = documented_commands(doc, scheme)
            shown = {m for line in lines for m in re.findall(r"-o ([a-z_]+)=", line)}
            assert shown - own <= names, (doc.name, scheme, shown - own - names)
            assert wanted[scheme] <= shown, (doc.name, scheme, wanted[scheme] - shown)
    text = (ROOT / "docs" / "stores.md").read_text() + (ROOT / "docs" / "cli.md").read_text()
    for variable in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_PROFILE",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_ACCOUNT_NAME",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "token=anon",
    ):
        assert variable in text, variable
