"""What the command line prints: JSON errors, global flags on either side of the command,
``log``'s anchor copies and bytes per changed element, help without stray line breaks, a
short ``verify --checkout``, and the version the package releases."""

from __future__ import annotations

import json
import re
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner, Result

from deltastore import __version__
from deltastore.format.manifest import manifest_key
from deltastore.store import open_store
from deltastore_cli import app, common
from deltastore_cli.verify import MAX_LINES

ROOT = Path(__file__).parent.parent
runner = CliRunner()


def cli(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(app, [str(a) for a in args], env=env)


def ok(*args: str | Path) -> Result:
    result = cli(*args)
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


@pytest.fixture(autouse=True)
def xdg_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"layer{i}.w": torch.randn(32, 32, generator=g).to(torch.bfloat16) for i in range(24)}
    for i, t in enumerate(out.values()):
        t[: step + i % 3] += 1.0
    return out


def checkpoint(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True)
    save_file(weights(step), folder / "model.safetensors")
    return folder


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """Three versions; v2 also carries an anchor copy (--anchor-policy every:2)."""
    path = tmp_path / "store"
    for v in (1, 2, 3):
        src = checkpoint(tmp_path / f"v{v}", v)
        ok("publish", path, src, "--version", str(v), "--anchor-policy", "every:2")
    return path


# --- errors under --json --------------------------------------------------------------------


def test_an_error_under_json_is_a_json_object_on_stdout(store: Path) -> None:
    result = cli("show", store, "99", "--json")
    assert result.exit_code == common.EXIT_NOT_FOUND
    error = json.loads(result.stdout)["error"]
    assert error["code"] == common.EXIT_NOT_FOUND
    assert error["type"] == "ManifestNotFoundError"
    assert "version 99" in error["message"]
    assert result.stderr.strip() == f"error: {error['message']}"  # the line stays for people


def test_a_usage_error_under_json_is_a_json_object_too(tmp_path: Path) -> None:
    result = cli("pull", tmp_path / "store", tmp_path / "dest", "--version", "x", "--json")
    assert result.exit_code == common.EXIT_USAGE
    error = json.loads(result.stdout)["error"]
    assert (error["code"], error["type"]) == (2, "UsageError")
    assert "--version" in error["message"]


def test_without_json_an_error_prints_nothing_on_stdout(store: Path) -> None:
    result = cli("show", store, "99")
    assert result.exit_code == common.EXIT_NOT_FOUND and result.stdout == ""


# --- global flags after the command, --json before it -----------------------------------------


def test_global_flags_may_follow_the_command_and_json_precede_it(store: Path) -> None:
    after = ok("log", store, "-q", "--json", "-v")
    before = ok("-q", "-v", "log", store, "--json")
    json_first = ok("--json", "log", store)
    assert json.loads(after.stdout) == json.loads(before.stdout) == json.loads(json_first.stdout)
    assert "INFO" in after.stderr or after.stderr == before.stderr  # -v took effect both ways


def test_flags_after_double_dash_are_left_alone(store: Path) -> None:
    result = cli("log", store, "--", "-q")
    assert result.exit_code == common.EXIT_USAGE  # "-q" is an extra argument there


# --- log and pull: anchor copies, bytes per changed element ------------------------------------


def test_log_marks_the_versions_that_carry_an_anchor_copy(store: Path) -> None:
    entries = json.loads(ok("log", store, "--json").stdout)
    copies = {e["version"]: e["anchor_copy"] for e in entries}
    held = {int(k.split("/")[1].split(".")[0]) for k in open_store(store).list("anchors/")}
    assert held == {3}  # every:2 from the anchor v1: one anchor copy, of v3
    assert copies == {1: False, 2: False, 3: True}
    table = ok("log", store).stdout.splitlines()
    header = table[0].split()
    assert "copy" in header and "B/changed" in header
    rows = {line.split()[0]: line for line in table[1:]}
    assert " yes " in rows["3"] and " yes " not in rows["2"] and " yes " not in rows["1"]


def test_log_and_pull_json_give_bytes_per_changed_element(store: Path, tmp_path: Path) -> None:
    for e in json.loads(ok("log", store, "--json").stdout):
        assert e["bytes_per_changed_element"] == pytest.approx(
            e["payload_bytes"] / e["changed_elements"]
        )
    pulled: dict[str, Any] = json.loads(ok("pull", store, tmp_path / "dest", "--json").stdout)
    assert pulled["bytes_per_changed_element"] == pytest.approx(
        pulled["payload_bytes"] / pulled["changed_elements"]
    )


# --- help -------------------------------------------------------------------------------------


def test_help_breaks_no_sentence_where_the_width_allows_one_line() -> None:
    """At 250 columns every command's description fits on one line, in `deltastore --help`
    and at the top of `COMMAND --help`: a second line there is a stray line break."""
    wide = {"COLUMNS": "250", "TERM": "xterm"}
    out = cli("--help", env=wide).stdout
    commands = (
        "publish",
        "pull",
        "log",
        "show",
        "gc",
        "verify",
        "mirror",
        "keygen",
        "demo",
        "bench",
    )
    panel = [row for row in out[out.index("Commands") :].splitlines() if row.startswith("│")]
    assert [line.split()[1] for line in panel] == list(commands), out
    for name in commands:
        text = cli(name, "--help", env=wide).stdout.splitlines()
        usage = next(i for i, line in enumerate(text) if "Usage:" in line)
        description = [line for line in text[usage + 1 : usage + 4] if line.strip()]
        assert len(description) == 1 or description[1].lstrip().startswith("╭"), (name, text)


# --- verify --checkout --------------------------------------------------------------------------


def test_verify_checkout_summarizes_and_lists_details_with_v(store: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    ok("pull", store, dest)
    healthy = ok("verify", store, "--checkout", dest).stdout.strip().splitlines()
    assert len(healthy) <= 3 and healthy[-1].endswith(": ok"), healthy
    data = bytearray((dest / "model.safetensors").read_bytes())
    (n,) = __import__("struct").unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    for name, info in header.items():  # damage every tensor
        if name != "__metadata__":
            data[8 + n + info["data_offsets"][0]] ^= 0xFF
    (dest / "model.safetensors").write_bytes(bytes(data))
    short = cli("verify", store, "--checkout", dest)
    assert short.exit_code == common.EXIT_MISMATCH
    lines = short.stdout.strip().splitlines()
    assert len(lines) == MAX_LINES + 2, lines  # 10 problems, "... and 14 more", the summary
    assert "and 14 more problems (-v lists them all)" in lines[-2]
    assert "24 problems" in lines[-1]
    full = cli("-v", "verify", store, "--checkout", dest)
    assert len(full.stdout.strip().splitlines()) == 24 + 1


# --- the version the package releases ----------------------------------------------------------


def test_the_package_is_the_release_the_docs_describe() -> None:
    """The docs and the spec say the default (v2) codecs are written by deltastore 0.2.0: the
    package, --version, the README and docs/cli.md say that release."""
    found = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    project = found.group(1) if found else None
    assert __version__ == project == "0.2.0"
    assert installed_version("deltastore") == __version__, "reinstall: pip install -e ."
    assert ok("--version").stdout.strip() == f"deltastore {__version__}"
    assert f"This is version {__version__}." in (ROOT / "README.md").read_text()
    assert f"of deltastore {__version__}:" in (ROOT / "docs" / "cli.md").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(__version__)}\]", changelog, re.M)


def test_a_manifest_names_the_library_that_wrote_it(store: Path) -> None:
    body = json.loads((store / manifest_key(3)).read_text())
    assert body["writer"]["library"] == f"deltastore {__version__}"
