"""The command line: version and the first demo."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from deltastore import __version__
from deltastore.cli import app
from deltastore.manifest import manifest_key

runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_demo_runs_bit_exact_on_a_kept_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    result = runner.invoke(
        app, ["demo", "--size", "tiny", "--versions", "3", "--store", str(store)]
    )
    assert result.exit_code == 0, result.output
    assert "all receivers bit-exact" in result.output
    assert "MISMATCH" not in result.output
    for v in (1, 2, 3):
        assert (store / manifest_key(v)).is_file()
