"""Local paths as a user types them: ``..``, ``file://``, relative and absolute spellings.

Every spelling of one folder names one thing: a checkpoint given as ``../dir/v1`` is read, a
store given as ``sub/../store`` and later as ``/abs/store`` keeps one publisher state (the
next publish is a delta), a folder pulled as ``../dest`` is the folder pulled as its absolute
path. Names that come from a checkpoint's index file are not the user's: a shard named
``../x.safetensors`` or ``/abs/x.safetensors`` is still refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner, Result

from deltastore.checkpoint.folders import default_state_dir
from deltastore.checkpoint.safetensors import checkpoint_files
from deltastore.errors import CheckpointError
from deltastore.store import open_store
from deltastore.store.registry import store_url
from deltastore_cli import app, common

runner = CliRunner()


def cli(*args: str | Path) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def ok_json(*args: str | Path) -> Any:
    result = cli(*args, "--json")
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return json.loads(result.stdout)


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    w[:step] += 1.0
    return {"w": w, "b": torch.arange(32, dtype=torch.float32) + step}


def save(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True)
    save_file(weights(step), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(autouse=True)
def xdg_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Publisher state in a cache of this test (default_state_dir reads $XDG_CACHE_HOME)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


def test_checkpoints_given_with_dotdot_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(tmp_path / "dir" / "v1", 1)
    save(tmp_path / "dir" / "v2", 2)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    store = tmp_path / "store"
    first = ok_json("publish", store, "../dir/v1", "--version", "1")
    assert first["kind"] == "anchor"
    second = ok_json(
        "publish", store, "../dir/v2/model.safetensors", "--version", "2", "--parent", "../dir/v1"
    )
    assert (second["kind"], second["parent"]) == ("delta", 1)


def test_one_store_spelled_two_ways_keeps_one_publisher_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (1, 2, 3):
        save(tmp_path / f"v{step}", step)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    first = ok_json("publish", "sub/../store", tmp_path / "v1", "--version", "1")
    second = ok_json("publish", tmp_path / "store", tmp_path / "v2", "--version", "2")
    assert first["kind"] == "anchor"
    assert (second["kind"], second["parent"]) == ("delta", 1), second["anchor_reason"]
    third = ok_json("publish", f"file://{tmp_path}/sub/../store", tmp_path / "v3", "--version", "3")
    assert (third["kind"], third["parent"]) == ("delta", 2)
    state = default_state_dir(str(tmp_path / "store"))
    assert default_state_dir("sub/../store") == state
    assert default_state_dir(f"file://{tmp_path}/store") == state
    assert store_url("sub/../store") == open_store("sub/../store").url == str(tmp_path / "store")


def test_a_symlinked_store_folder_is_the_folder(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert open_store(tmp_path / "link").url == str(tmp_path / "real")
    assert default_state_dir(str(tmp_path / "link")) == default_state_dir(str(tmp_path / "real"))


def test_a_folder_pulled_with_dotdot_is_the_same_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(tmp_path / "v1", 1)
    store = tmp_path / "store"
    ok_json("publish", store, tmp_path / "v1", "--version", "1")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    pulled = ok_json("pull", "../store", "../dest")
    assert pulled["version"] == 1
    again = ok_json("pull", store, tmp_path / "dest")
    assert (again["kind"], again["version"]) == ("none", 1)
    check = cli("verify", "../store", "--checkout", "../dest")
    assert check.exit_code == 0, check.output


@pytest.mark.parametrize("name", ["../outside.safetensors", "/abs/outside.safetensors"])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path: Path, name: str) -> None:
    """The hostile-name check stays for names read from an index's weight_map."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(weights(1), tmp_path / "outside.safetensors")  # exists: refused for its name
    index = {"metadata": {}, "weight_map": {"w": name, "b": name}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file inside"):
        checkpoint_files(folder)
    result = cli("publish", tmp_path / "store", folder, "--version", "1")
    assert result.exit_code == common.EXIT_MISMATCH, result.output
    assert "not a file inside" in result.stderr
    # the same folder reached through ".." is read when its index is sound
    index["weight_map"] = {"w": "model.safetensors", "b": "model.safetensors"}
    save_file(weights(1), folder / "model.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_files(tmp_path / "ckpt" / ".." / "ckpt") == [
        tmp_path / "ckpt" / ".." / "ckpt" / "model.safetensors"
    ]
