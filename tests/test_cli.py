"""The command line (docs/cli.md): publish / pull / log / show / demo over safetensors folders.

Most tests drive the typer app in-process with ``CliRunner``; the ``--watch`` test and the
exit-status checks that must see a real process run the ``deltastore`` console script.
Every pull is checked by loading the folder with ``safetensors.torch.load_file`` and comparing
it bit-wise (integer views) with the checkpoint that was published.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
import typer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner, Result

from deltastore import Publisher, __version__
from deltastore.checkpoint.folders import SIDECAR, default_state_dir
from deltastore.checkpoint.safetensors import CheckpointError
from deltastore.errors import (
    ChainError,
    FrameError,
    IntegrityError,
    InvalidKeyError,
    ManifestError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    TensorMismatchError,
    UnsupportedFormatError,
    VersionExistsError,
    VersionOrderError,
    WrongParentError,
)
from deltastore.format.manifest import LATEST_KEY, manifest_key
from deltastore.testing.synthetic import TINY, AdamWTrajectory
from deltastore_cli import app, common
from tests.helpers import console_script

ROOT = Path(__file__).parent.parent
SCHEMA = ROOT / "manifests" / "schema" / "manifest.v1.schema.json"
INDEX = "model.safetensors.index.json"

runner = CliRunner()

Tensors = dict[str, torch.Tensor]

# --- helpers ------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> np.ndarray:
    """Integer view of a tensor's bytes (never compares as floats)."""
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().reshape(-1).view(word).numpy()


def assert_bit_exact(expected: Tensors, got: Tensors) -> None:
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert np.array_equal(bits(got[name]), bits(t)), name


def load_folder(folder: Path) -> Tensors:
    """Every tensor of a checkpoint folder, loaded by safetensors itself."""
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no .safetensors in {folder}"
    out: Tensors = {}
    for f in files:
        part = load_file(f)
        assert not set(part) & set(out)
        out |= part
    return out


def assert_folder_is(folder: Path, expected: Tensors, version: int) -> None:
    """The folder loads with safetensors, equals ``expected`` bit-wise, and says ``version``."""
    assert_bit_exact(expected, load_folder(folder))
    assert sidecar(folder)["version"] == version


def sidecar(folder: Path) -> dict[str, Any]:
    return json.loads((folder / SIDECAR).read_text())


def save_single(folder: Path, tensors: Tensors) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def save_sharded(folder: Path, tensors: Tensors, shards: int = 3) -> Path:
    """An HF-style sharded folder: ``model-0000i-of-0000n.safetensors`` + index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, folder / fname, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2))
    return folder


def data_range(path: Path, name: str) -> tuple[int, int]:
    """Absolute byte range of tensor ``name`` in a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def tree(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (hidden files included), by relative path."""
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def inodes(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        p.name: (p.stat().st_dev, p.stat().st_ino) for p in sorted(folder.glob("*.safetensors"))
    }


def cli(*args: str | Path) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def ok(*args: str | Path) -> Result:
    result = cli(*args)
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


def ok_json(*args: str | Path) -> Any:
    return json.loads(ok(*args, "--json").stdout)


def assert_one_line_error(result: Result, code: int) -> str:
    """Exit ``code``, one ``error:`` line on stderr, no traceback; returns the line."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def xdg_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Publisher state defaults to $XDG_CACHE_HOME: keep it out of the user's home."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        yield cache


def extras(step: int) -> Tensors:
    """Tensors of other dtypes next to the bf16 model; some change with every step."""
    g = torch.Generator().manual_seed(100 + step)
    scale = torch.linspace(0.5, 1.5, 96, dtype=torch.float32)
    scale[step * 7 : step * 7 + 5] += torch.rand(5, generator=g)
    return {
        "extra.step": torch.tensor(step, dtype=torch.int64),
        "extra.scale": scale,
        "extra.mask": (torch.arange(33) % (step + 2) == 0),
    }


@pytest.fixture(scope="module")
def states() -> list[Tensors]:
    """Three versions: the tiny model at init and after two AdamW steps (+ other dtypes)."""
    traj = AdamWTrajectory(TINY, lr=1e-6, seed=7)
    out = [traj.bf16() | extras(0)]
    for step in (1, 2):
        out.append(traj.step() | extras(step))
    return out


@pytest.fixture(scope="module")
def sources(states: list[Tensors], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """v1: a sharded HF folder; v2: a folder with model.safetensors; v3: a bare file."""
    base = tmp_path_factory.mktemp("src")
    v1 = save_sharded(base / "v1", states[0])
    v2 = save_single(base / "v2", states[1])
    v3 = save_single(base / "v3", states[2]) / "model.safetensors"
    return [v1, v2, v3]


@pytest.fixture(scope="module")
def chain(
    sources: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[dict[str, Any]]]:
    """A store with an anchor (from the sharded folder) and two deltas published with
    ``--parent``, each with a fresh state folder so that only ``--parent`` makes the delta."""
    base = tmp_path_factory.mktemp("chain")
    store = base / "store"
    reports = [ok_json("publish", store, sources[0], "--version", "1", "--state-dir", base / "s1")]
    reports.append(
        ok_json(
            "publish",
            store,
            sources[1],
            "--version",
            "2",
            "--parent",
            sources[0],
            "--state-dir",
            base / "s2",
        )
    )
    reports.append(
        ok_json(
            "publish",
            store,
            sources[2],
            "--version",
            "3",
            "--parent",
            sources[1] / "model.safetensors",
            "--state-dir",
            base / "s3",
        )
    )
    return store, reports


def copy_store(chain: tuple[Path, Any], dest: Path) -> Path:
    shutil.copytree(chain[0], dest)
    return dest


def data_objects(store: Path, version: int) -> list[Path]:
    objs = sorted((store / "versions" / f"{version:020d}").glob("*.dsz"))
    assert objs
    return objs


def damage(store: Path, version: int) -> None:
    obj = data_objects(store, version)[0]
    flip_byte(obj, obj.stat().st_size // 2)


# --- version, help, demo ------------------------------------------------------------------


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_help_lists_every_command() -> None:
    result = ok("--help")
    for command in ("publish", "pull", "log", "show", "demo"):
        assert command in result.stdout
    for command in ("publish", "pull", "log", "show", "demo"):
        assert ok(command, "--help").stdout.strip()


def test_no_arguments_prints_help() -> None:
    result = cli()
    assert "publish" in result.output and "pull" in result.output


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


def test_demo_refuses_to_empty_a_default_folder_that_is_not_a_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deltastore-demo").mkdir()
    (tmp_path / "deltastore-demo" / "keep.txt").write_text("mine")
    result = cli("-q", "demo", "--size", "tiny", "--versions", "2", "--receivers", "1")
    line = assert_one_line_error(result, common.EXIT_STORE)
    assert "--store" in line
    assert (tmp_path / "deltastore-demo" / "keep.txt").read_text() == "mine"


def test_a_second_demo_empties_the_store_the_first_one_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twice in a row on the default store, as `make demo && make demo` does: the receivers'
    leases (and any anchor copies) of the first run do not stop the second."""
    monkeypatch.chdir(tmp_path)
    args = ["-q", "demo", "--size", "tiny", "--versions", "2", "--receivers", "2", "--json"]
    first = json.loads(ok(*args).stdout)
    store = tmp_path / "deltastore-demo"
    assert (store / "leases").is_dir() and any((store / "leases").iterdir())
    (store / "anchors").mkdir(exist_ok=True)
    (store / "anchors" / "00000000000000000001.json").write_text("{}")
    second = json.loads(ok(*args).stdout)
    assert first["ok"] and second["ok"]
    assert [r["version"] for r in second["rows"]] == [1, 2]  # emptied: starts again at v1
    assert not (store / "anchors").exists()


def test_demo_refuses_to_empty_a_store_it_did_not_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "deltastore-demo"
    Publisher(str(store)).publish({"w": torch.ones(4, dtype=torch.bfloat16)}, version=1)
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    result = cli("-q", "demo", "--size", "tiny", "--versions", "2", "--receivers", "1")
    line = assert_one_line_error(result, common.EXIT_STORE)
    assert "did not create" in line and "--store" in line
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before


# --- publish --------------------------------------------------------------------------------


def test_publish_anchor_then_deltas_with_parent(chain: tuple[Path, list[dict[str, Any]]]) -> None:
    store, reports = chain
    assert [r["version"] for r in reports] == [1, 2, 3]
    assert [r["kind"] for r in reports] == ["anchor", "delta", "delta"]
    assert [r["parent"] for r in reports] == [None, 1, 2]
    total = TINY.numel() + 96 + 33 + 1
    for r in reports:
        assert r["total_elements"] == total
        assert r["payload_bytes"] > 0 and r["frames"] > 0
        assert r["dense_bytes"] == 2 * TINY.numel() + 4 * 96 + 33 + 8
    assert reports[0]["changed_elements"] == total
    for r in reports[1:]:
        assert 0 < r["changed_elements"] < 0.1 * total
        assert r["payload_bytes"] < 0.1 * r["dense_bytes"]
    assert [
        json.loads((store / LATEST_KEY).read_text())["version"],
        sorted(p.name for p in (store / "manifests").iterdir()),
    ] == [3, [Path(manifest_key(v)).name for v in (1, 2, 3)]]


def test_publish_text_output(tmp_path: Path, sources: list[Path]) -> None:
    store = tmp_path / "store"
    state = tmp_path / "state"
    first = ok("publish", store, sources[0], "--version", "5", "--state-dir", state)
    assert re.match(r"published v5 \(anchor\): 100\.000% changed, .* of dense\) in ", first.stdout)
    second = ok("publish", store, sources[1], "--version", "6", "--state-dir", state)
    assert re.match(r"published v6 \(delta on v5\): \d+\.\d{3}% changed, ", second.stdout)
    assert second.stderr == ""


def test_publish_from_a_bare_safetensors_file_and_pull_it_back(
    tmp_path: Path, sources: list[Path], states: list[Tensors]
) -> None:
    store = tmp_path / "store"
    report = ok_json(
        "publish", store, sources[2], "--version", "1", "--state-dir", tmp_path / "state"
    )
    assert (report["kind"], report["parent"]) == ("anchor", None)
    ok("pull", store, tmp_path / "dest")
    assert_folder_is(tmp_path / "dest", states[2], 1)


def test_publish_without_parent_uses_the_saved_state(
    tmp_path: Path, sources: list[Path], states: list[Tensors]
) -> None:
    store, state = tmp_path / "store", tmp_path / "state"
    r1 = ok_json("publish", store, sources[0], "--version", "1", "--state-dir", state)
    assert (r1["kind"], r1["parent"]) == ("anchor", None)
    saved = json.loads((state / "state.json").read_text())
    assert (saved["dirty"], saved["version"], saved["store"]) == (False, 1, str(store.absolute()))
    r2 = ok_json("publish", store, sources[1], "--version", "2", "--state-dir", state)
    assert (r2["kind"], r2["parent"]) == ("delta", 1)
    assert r2["changed_elements"] < 0.1 * r2["total_elements"]
    # a fresh state folder knows no parent: an anchor
    r3 = ok_json("publish", store, sources[2], "--version", "3", "--state-dir", tmp_path / "new")
    assert (r3["kind"], r3["parent"]) == ("anchor", None)
    # `state` is at v2 but the store is at v3: it must not publish a delta on a stale parent
    stale = cli("publish", store, sources[1], "--version", "4", "--state-dir", state)
    line = assert_one_line_error(stale, common.EXIT_MISMATCH)
    assert "--parent" in line
    assert sorted(p.name for p in (store / "manifests").iterdir())[-1] == Path(manifest_key(3)).name
    # --anchor forces a full version even though a (stale) state exists
    r4 = ok_json("publish", store, sources[1], "--version", "4", "--state-dir", state, "--anchor")
    assert r4["kind"] == "anchor" and r4["changed_elements"] == r4["total_elements"]
    # ... and the state follows it: the next publish is a delta on v4
    r5 = ok_json("publish", store, sources[2], "--version", "5", "--state-dir", state)
    assert (r5["kind"], r5["parent"]) == ("delta", 4)
    log = ok_json("log", store)
    assert [(e["version"], e["kind"], e["parent"]) for e in log] == [
        (5, "delta", 4),
        (4, "anchor", None),
        (3, "anchor", None),
        (2, "delta", 1),
        (1, "anchor", None),
    ]
    dest = tmp_path / "dest"
    ok("pull", store, dest, "--version", "2")
    files = inodes(dest)
    # in place across the new anchor: v2 -> anchor v4 -> delta v5
    report = ok_json("pull", store, dest)
    assert (report["from_version"], report["applied"], report["kind"]) == (2, [4, 5], "anchor")
    assert_folder_is(dest, states[2], 5)
    assert inodes(dest) == files
    fresh = tmp_path / "fresh"
    assert ok_json("pull", store, fresh)["applied"] == [4, 5]
    assert_folder_is(fresh, states[2], 5)


def test_anchor_flag_forces_an_anchor_with_a_current_state(
    tmp_path: Path, sources: list[Path]
) -> None:
    store, state = tmp_path / "store", tmp_path / "state"
    ok("publish", store, sources[0], "--version", "1", "--state-dir", state)
    r2 = ok_json("publish", store, sources[1], "--version", "2", "--state-dir", state, "--anchor")
    # a full version, still bound to its parent (changed counts against it)
    assert (r2["kind"], r2["parent"]) == ("anchor", 1)
    assert 0 < r2["changed_elements"] < r2["total_elements"]
    shown = ok_json("show", store, "2")
    assert shown["kind"] == "anchor" and shown["parent"]["version"] == 1
    assert set(shown["tensors"]) == set(load_folder(sources[1]))
    assert all(
        f["codec"] in ("raw", "raw-planes") for t in shown["tensors"].values() for f in t["frames"]
    )


def test_publish_codecs_v1_writes_only_the_0_1_0_codecs(
    tmp_path: Path, sources: list[Path]
) -> None:
    """``--codecs v1`` (for receivers older than 0.2.0): every frame, anchor and delta, is
    raw, xor-dense or xor-sparse; the default writes the 0.2.0 codecs."""
    old, new = tmp_path / "old", tmp_path / "new"
    for i, src in enumerate(sources[:2], start=1):
        ok(
            "publish",
            old,
            src,
            "--version",
            str(i),
            "--state-dir",
            tmp_path / "s1",
            "--codecs",
            "v1",
        )
        ok("publish", new, src, "--version", str(i), "--state-dir", tmp_path / "s2")
    for store, allowed in ((old, {"raw", "xor-dense", "xor-sparse"}), (new, None)):
        used = set()
        for v in ("1", "2"):
            shown = ok_json("show", store, v)
            used |= {f["codec"] for t in shown["tensors"].values() for f in t["frames"]}
        if allowed is not None:
            assert used <= allowed, used
        else:
            assert used & {"xor-sparse2", "raw-planes"}, used
    bad = cli("publish", old, sources[2], "--version", "3", "--codecs", "v3")
    assert bad.exit_code != 0


def test_default_state_dir_is_under_xdg_cache(
    tmp_path: Path, sources: list[Path], xdg_cache: Path
) -> None:
    store = tmp_path / "store"
    ok("publish", store, sources[0], "--version", "1")
    folder = default_state_dir(str(store.absolute()))
    assert folder.is_relative_to(xdg_cache)
    assert json.loads((folder / "state.json").read_text())["version"] == 1
    r2 = ok_json("publish", store, sources[1], "--version", "2")
    assert (r2["kind"], r2["parent"]) == ("delta", 1)


def test_publish_with_a_mismatched_parent_commits_nothing(
    tmp_path: Path, sources: list[Path], states: list[Tensors]
) -> None:
    store, state = tmp_path / "store", tmp_path / "state"
    ok("publish", store, sources[0], "--version", "1", "--state-dir", state)
    before, state_before = tree(store), tree(state)
    # the parent checkpoint is v2's weights, but the store's newest version is v1
    wrong = cli(
        "publish",
        store,
        sources[2],
        "--version",
        "2",
        "--parent",
        sources[1],
        "--state-dir",
        state,
    )
    line = assert_one_line_error(wrong, common.EXIT_MISMATCH)
    assert "differ from version 1" in line and "Adler-32" in line
    # a parent with a tensor missing
    partial = save_single(
        tmp_path / "partial", {k: v for k, v in states[0].items() if k != "extra.scale"}
    )
    missing = cli(
        "publish", store, sources[1], "--version", "2", "--parent", partial, "--state-dir", state
    )
    line = assert_one_line_error(missing, common.EXIT_MISMATCH)
    assert "extra.scale: missing" in line
    assert tree(store) == before  # no manifest, no data object, LATEST unchanged
    assert json.loads((store / LATEST_KEY).read_text())["version"] == 1
    assert tree(state) == state_before
    # the store is still usable: the right parent works
    r2 = ok_json(
        "publish",
        store,
        sources[1],
        "--version",
        "2",
        "--parent",
        sources[0],
        "--state-dir",
        tmp_path / "other",
    )
    assert (r2["kind"], r2["parent"]) == ("delta", 1)


def test_publish_an_existing_version_is_a_conflict(tmp_path: Path, sources: list[Path]) -> None:
    store = tmp_path / "store"
    ok("publish", store, sources[0], "--version", "1", "--state-dir", tmp_path / "a")
    ok("publish", store, sources[1], "--version", "2", "--state-dir", tmp_path / "a")
    before = tree(store)
    for version, state in (("2", "a"), ("1", "b"), ("2", "b")):
        result = cli(
            "publish", store, sources[2], "--version", version, "--state-dir", tmp_path / state
        )
        line = assert_one_line_error(result, common.EXIT_CONFLICT)
        assert "not above" in line
    assert tree(store) == before


def bad_source(kind: str, base: Path) -> tuple[Path, str]:
    """A checkpoint publish must refuse, and a word its error line names."""
    folder = base / kind
    folder.mkdir()
    if kind == "missing":
        return folder / "nope", "nope"
    if kind == "dtype":
        save_file({"w": torch.ones(4), "c": torch.ones(4, dtype=torch.complex64)}, folder / "a.st")
        return folder / "a.st", "C64"
    if kind == "duplicate":
        save_file({"w": torch.ones(4)}, folder / "a.safetensors")
        save_file({"w": torch.zeros(4)}, folder / "b.safetensors")
        return folder, "both"
    (folder / INDEX).write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    return folder, "gone.safetensors"


@pytest.mark.parametrize("kind", ["missing", "dtype", "duplicate", "shard"])
def test_publish_of_a_bad_source_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    src, word = bad_source(kind, tmp_path)
    store = tmp_path / "store"
    result = cli("publish", store, src, "--version", "1", "--state-dir", tmp_path / "s")
    line = assert_one_line_error(result, common.EXIT_MISMATCH)
    assert word in line
    assert not (store / "manifests").exists()
    assert not (tmp_path / "s" / "state.json").exists()


@pytest.mark.parametrize(
    ("option", "value", "word"),
    [("--max-frame-bytes", "4", "max_frame_bytes"), ("--zstd-level", "23", "level")],
)
def test_publish_with_an_out_of_range_setting_is_a_clear_error(
    tmp_path: Path, sources: list[Path], option: str, value: str, word: str
) -> None:
    store = tmp_path / "store"
    result = cli(
        "publish", store, sources[2], "--version", "1", "--state-dir", tmp_path / "s", option, value
    )
    assert word in assert_one_line_error(result, common.EXIT_ERROR)
    assert not (store / "manifests").exists()


# --- pull -----------------------------------------------------------------------------------


def test_pull_into_an_empty_folder_then_in_place(
    chain: tuple[Path, Any], states: list[Tensors], tmp_path: Path
) -> None:
    store, _ = chain
    dest = tmp_path / "dest"
    dest.mkdir()  # an existing, empty folder
    r1 = ok_json("pull", store, dest, "--version", "1")
    assert (r1["version"], r1["from_version"], r1["applied"], r1["kind"]) == (
        1,
        None,
        [1],
        "anchor",
    )
    assert_folder_is(dest, states[0], 1)
    files = inodes(dest)
    assert sorted(p.name for p in dest.iterdir()) == sorted([*files, SIDECAR])

    r2 = ok_json("pull", store, dest, "--version", "2")
    assert (r2["from_version"], r2["applied"], r2["kind"]) == (1, [2], "delta")
    assert r2["payload_bytes"] > 0 and r2["changed_elements"] > 0
    assert_folder_is(dest, states[1], 2)
    assert inodes(dest) == files  # written in place: same files, no second copy
    assert sorted(p.name for p in dest.iterdir()) == sorted([*files, SIDECAR])

    text = ok("pull", store, dest)  # newest
    assert re.match(r"pulled v3 \(delta, applied 3\): ", text.stdout)
    assert_folder_is(dest, states[2], 3)
    assert inodes(dest) == files

    again = ok("pull", store, dest)
    assert again.stdout.strip() == "already at v3"
    assert_folder_is(dest, states[2], 3)
    assert ok_json("pull", store, dest)["kind"] == "none"


def test_pull_newest_into_a_new_folder_replays_the_chain(
    chain: tuple[Path, Any], states: list[Tensors], tmp_path: Path
) -> None:
    store, _ = chain
    dest = tmp_path / "a" / "b"  # parents are created
    report = ok_json("pull", store, dest)
    assert (report["version"], report["applied"], report["kind"]) == (3, [1, 2, 3], "anchor")
    assert_folder_is(dest, states[2], 3)


def test_sidecar_records_the_manifest_checksums(
    chain: tuple[Path, Any], states: list[Tensors], tmp_path: Path
) -> None:
    store, _ = chain
    dest = tmp_path / "dest"
    ok("pull", store, dest, "--version", "2")
    assert_folder_is(dest, states[1], 2)
    manifest = ok_json("show", store, "2")
    meta = sidecar(dest)
    assert meta["version"] == 2
    assert meta["state_digest"] == manifest["state_digest"]
    assert meta["adler32"] == {n: e["adler32"] for n, e in manifest["tensors"].items()}


def test_pull_into_a_hand_modified_folder_fails_and_changes_nothing(
    chain: tuple[Path, Any], states: list[Tensors], tmp_path: Path
) -> None:
    store, _ = chain
    dest = tmp_path / "dest"
    ok("pull", store, dest, "--version", "1")
    assert_folder_is(dest, states[0], 1)
    target = "model.layers.1.mlp.up_proj.weight"
    path = dest / "model.safetensors"
    start, stop = data_range(path, target)
    for offset in (start, (start + stop) // 2 + 1, stop - 1):
        flip_byte(path, offset)
    load_folder(dest)  # still a valid safetensors file
    before = tree(dest)
    sidecar_before = (dest / SIDECAR).read_bytes()
    for args in ((), ("--version", "2"), ("--version", "1")):
        result = cli("pull", store, dest, *args)
        line = assert_one_line_error(result, common.EXIT_MISMATCH)
        assert target in line and "version 1" in line
        assert tree(dest) == before
        assert (dest / SIDECAR).read_bytes() == sidecar_before


def test_pull_of_a_damaged_store_object_changes_nothing(
    chain: tuple[Path, Any], states: list[Tensors], tmp_path: Path
) -> None:
    store = copy_store(chain, tmp_path / "store")
    dest = tmp_path / "dest"
    ok("pull", store, dest, "--version", "1")
    assert_folder_is(dest, states[0], 1)
    damage(store, 2)
    before = tree(dest)
    line = assert_one_line_error(cli("pull", store, dest), common.EXIT_DAMAGED)
    assert "corrupted" in line
    assert tree(dest) == before
    assert_folder_is(dest, states[0], 1)
    # a new folder keeps the version it recorded before the damaged one failed
    fresh = tmp_path / "fresh"
    assert_one_line_error(cli("pull", store, fresh, "--version", "2"), common.EXIT_DAMAGED)
    assert_folder_is(fresh, states[0], 1)  # v1 was committed before v2 failed


def test_pull_into_a_foreign_folder_is_refused(chain: tuple[Path, Any], tmp_path: Path) -> None:
    store, _ = chain
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    before = tree(dest)
    line = assert_one_line_error(cli("pull", store, dest), common.EXIT_MISMATCH)
    assert SIDECAR in line
    assert tree(dest) == before


def test_pull_to_an_older_version_is_refused(
    chain: tuple[Path, Any], states: list[Tensors], tmp_path: Path
) -> None:
    store, _ = chain
    dest = tmp_path / "dest"
    ok("pull", store, dest)
    assert_folder_is(dest, states[2], 3)
    before = tree(dest)
    line = assert_one_line_error(cli("pull", store, dest, "--version", "1"), common.EXIT_MISMATCH)
    assert "newer" in line
    assert tree(dest) == before


def test_pull_of_an_unknown_version_creates_nothing(
    chain: tuple[Path, Any], tmp_path: Path
) -> None:
    store, _ = chain
    dest = tmp_path / "dest"
    line = assert_one_line_error(cli("pull", store, dest, "--version", "9"), common.EXIT_NOT_FOUND)
    assert "version 9" in line
    assert not dest.exists()
    empty = tmp_path / "empty-store"
    assert_one_line_error(cli("pull", empty, dest), common.EXIT_NOT_FOUND)
    assert not dest.exists()


def test_watch_with_version_is_a_usage_error(chain: tuple[Path, Any], tmp_path: Path) -> None:
    store, _ = chain
    result = cli("pull", store, tmp_path / "d", "--watch", "--version", "1")
    assert result.exit_code == common.EXIT_USAGE
    assert "--watch" in result.stderr
    assert not (tmp_path / "d").exists()
    result = cli("pull", store, tmp_path / "d", "--watch", "--interval", "2", "--max-interval", "1")
    assert result.exit_code == common.EXIT_USAGE
    assert "--max-interval" in result.stderr and "at least --interval" in result.stderr
    assert not (tmp_path / "d").exists()


def wait_for_version(dest: Path, version: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if sidecar(dest)["version"] == version:
                return
        except (FileNotFoundError, ValueError):
            pass
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    pytest.fail(f"the watcher did not reach v{version} within 60 s: {log.read_text()}")


def test_pull_watch_follows_new_versions_until_sigterm(
    tmp_path: Path, sources: list[Path], states: list[Tensors]
) -> None:
    exe = console_script()
    store, state, dest = tmp_path / "store", tmp_path / "state", tmp_path / "dest"
    ok("publish", store, sources[0], "--version", "1", "--state-dir", state)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(
            [exe, "-q", "pull", str(store), str(dest), "--watch", "--interval", "0.2"],
            stdout=fo,
            stderr=fe,
            env=os.environ.copy(),
        )
    try:
        wait_for_version(dest, 1, proc, err)
        assert_folder_is(dest, states[0], 1)
        files = inodes(dest)
        # published while the watcher runs
        ok("publish", store, sources[1], "--version", "2", "--state-dir", state)
        wait_for_version(dest, 2, proc, err)
        assert_folder_is(dest, states[1], 2)
        ok("publish", store, sources[2], "--version", "3", "--state-dir", state)
        wait_for_version(dest, 3, proc, err)
        assert_folder_is(dest, states[2], 3)
        assert inodes(dest) == files
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == common.EXIT_OK, err.read_text()
    stdout = out.read_text()
    assert "pulled v1 (anchor" in stdout
    assert "pulled v2 (delta" in stdout and "pulled v3 (delta" in stdout
    assert "stopped watching" in err.read_text()
    assert "Traceback" not in err.read_text()
    assert_folder_is(dest, states[2], 3)


# --- log and show -------------------------------------------------------------------------


def test_log_json(chain: tuple[Path, list[dict[str, Any]]]) -> None:
    store, reports = chain
    log = ok_json("log", store)
    assert [e["version"] for e in log] == [3, 2, 1]
    assert [e["kind"] for e in log] == ["delta", "delta", "anchor"]
    assert [e["parent"] for e in log] == [2, 1, None]
    by_version = {r["version"]: r for r in reports}
    for e in log:
        r = by_version[e["version"]]
        for key in ("changed_elements", "total_elements", "payload_bytes", "dense_bytes", "frames"):
            assert e[key] == r[key], key
        assert e["payload_bytes"] > 0
        assert e["changed_fraction"] == pytest.approx(e["changed_elements"] / e["total_elements"])
        assert e["payload_ratio"] == pytest.approx(e["payload_bytes"] / e["dense_bytes"])
        datetime.strptime(e["created"], "%Y-%m-%dT%H:%M:%S.%fZ")
    assert log[0]["created"] >= log[1]["created"] >= log[2]["created"]
    assert log[2]["changed_fraction"] == 1.0
    assert [e["version"] for e in ok_json("log", store, "--limit", "2")] == [3, 2]
    assert ok_json("log", Path(store).parent / "no-such-store") == []
    header = ok("log", Path(store).parent / "no-such-store").stdout.split()
    assert header == [
        *("version", "kind", "parent", "changed", "payload", "of", "dense", "B/changed"),
        *("anchor", "copy", "created"),
    ]


def test_log_text(chain: tuple[Path, list[dict[str, Any]]]) -> None:
    store, _ = chain
    lines = ok("log", store).stdout.strip().splitlines()
    assert lines[0].split() == [
        "version",
        "kind",
        "parent",
        "changed",
        "payload",
        "of",
        "dense",
        "B/changed",
        "anchor",
        "copy",
        "created",
    ]
    rows = [line.split() for line in lines[1:]]
    assert [r[:3] for r in rows] == [["3", "delta", "2"], ["2", "delta", "1"], ["1", "anchor", "-"]]
    assert rows[2][3] == "100.000%"
    for row in rows:
        assert re.fullmatch(r"\d+\.\d{3}%", row[3])
        assert re.fullmatch(r"\d+\.\d{2}%", row[6])
        assert re.fullmatch(r"\d+\.\d{3}", row[7])  # payload bytes per changed element
        assert row[8] in ("yes", "-")  # an anchor copy of this version
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", row[9])


def test_show_json_is_the_manifest_and_validates(
    chain: tuple[Path, list[dict[str, Any]]], states: list[Tensors]
) -> None:
    store, reports = chain
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    shown = {v: ok_json("show", store, str(v)) for v in (1, 2, 3)}
    for v, m in shown.items():
        validator.validate(m)
        assert m["version"] == v
        assert m["format_version"] == 1
        assert set(m["tensors"]) == set(states[v - 1])
        for name, t in states[v - 1].items():
            entry = m["tensors"][name]
            assert tuple(entry["shape"]) == tuple(t.shape)
            assert entry["dtype"] == str(t.dtype).removeprefix("torch.")
        payload = sum(f["length"] for t in m["tensors"].values() for f in t["frames"])
        assert payload == reports[v - 1]["payload_bytes"] > 0
    assert (shown[1]["kind"], shown[1]["parent"]) == ("anchor", None)
    for v in (2, 3):
        assert shown[v]["kind"] == "delta"
        assert shown[v]["parent"] == {
            "version": v - 1,
            "state_digest": shown[v - 1]["state_digest"],
        }
    assert shown[2]["tensors"]["extra.step"]["changed"] == 1


def test_show_text_and_tensors(
    chain: tuple[Path, list[dict[str, Any]]], states: list[Tensors]
) -> None:
    store, reports = chain
    text = ok("show", store, "2").stdout
    fields = dict(line.split(None, 1) for line in text.strip().splitlines() if "  " in line)
    assert fields["version"].strip() == "2"
    assert fields["kind"].strip() == "delta"
    assert fields["parent"].strip() == "1"
    assert text.count("\n") == 9  # no tensor table without --tensors
    assert f"tensors       {len(states[1])} ({reports[1]['total_elements']} elements" in text
    assert f"changed       {reports[1]['changed_elements']} " in text
    assert "model.embed_tokens.weight" not in text

    table = ok("show", store, "2", "--tensors").stdout
    assert table.startswith(text.rstrip("\n"))
    rows = {line.split()[0]: line.split() for line in table.splitlines()[10:]}
    assert set(rows) == set(states[1])
    manifest = ok_json("show", store, "2")
    for name, t in states[1].items():
        row = rows[name]
        assert row[1] == str(t.dtype).removeprefix("torch.")
        assert row[2] == ("x".join(map(str, t.shape)) or "scalar")
        assert row[3] == str(manifest["tensors"][name]["changed"])
        assert row[4] == str(len(manifest["tensors"][name]["frames"]))


def test_show_unknown_version_is_not_found(chain: tuple[Path, Any]) -> None:
    store, _ = chain
    line = assert_one_line_error(cli("show", store, "42"), common.EXIT_NOT_FOUND)
    assert "version 42 is not committed" in line
    assert_one_line_error(cli("show", store, "42", "--json"), common.EXIT_NOT_FOUND)


def test_show_of_a_damaged_manifest_is_exit_5(chain: tuple[Path, Any], tmp_path: Path) -> None:
    store = copy_store(chain, tmp_path / "store")
    (store / manifest_key(2)).write_text('{"format_version": 1}')
    assert_one_line_error(cli("show", store, "2"), common.EXIT_DAMAGED)
    assert_one_line_error(cli("log", store), common.EXIT_DAMAGED)


# --- errors, options, exit codes ----------------------------------------------------------


def store_command_args(store: Path, sources: list[Path], tmp_path: Path) -> dict[str, list[Any]]:
    """Arguments that make each store-reading command run against ``store``."""
    return {
        "publish": [store, sources[2], "--version", "9", "--state-dir", tmp_path / "s"],
        "pull": [store, tmp_path / "dest"],
        "log": [store],
        "show": [store, "1"],
    }


@pytest.mark.parametrize("command", ["publish", "pull", "log", "show"])
def test_storage_option_on_a_local_store_is_a_clear_error(
    command: str, chain: tuple[Path, Any], sources: list[Path], tmp_path: Path
) -> None:
    store, _ = chain
    args = store_command_args(store, sources, tmp_path)
    before = tree(store)
    result = cli(command, *args[command], "--storage-option", "key=sEcReT", "-o", "anon=true")
    line = assert_one_line_error(result, common.EXIT_STORE)
    assert "local store takes no storage options" in line
    assert "anon" in line and "key" in line
    assert "sEcReT" not in result.output  # values (credentials) are never printed
    assert tree(store) == before
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("command", ["publish", "pull", "log", "show"])
def test_storage_option_without_equals_is_a_usage_error(
    command: str, chain: tuple[Path, Any], sources: list[Path], tmp_path: Path
) -> None:
    store, _ = chain
    args = store_command_args(store, sources, tmp_path)
    before = tree(store)
    result = cli(command, *args[command], "--storage-option", "novalue")
    assert result.exit_code == common.EXIT_USAGE, result.output
    assert "KEY=VALUE" in result.stderr
    assert "Traceback" not in result.output
    assert tree(store) == before
    assert not (tmp_path / "dest").exists()


def test_parse_storage_options() -> None:
    assert common.parse_storage_options(None) is None
    assert common.parse_storage_options([]) is None
    parsed = common.parse_storage_options(["a=1", "b=true", 'c="x"', "d=plain", "e=x=y", "f="])
    assert parsed == {"a": 1, "b": True, "c": "x", "d": "plain", "e": "x=y", "f": ""}
    for bad in ("novalue", "=value"):
        with pytest.raises(typer.BadParameter):
            common.parse_storage_options([bad])


def test_verbose_shows_a_traceback_the_default_does_not(chain: tuple[Path, Any]) -> None:
    store, _ = chain
    quiet = cli("show", store, "42")
    assert quiet.exit_code == common.EXIT_NOT_FOUND
    assert "Traceback" not in quiet.stderr
    loud = cli("-v", "show", store, "42")
    assert loud.exit_code == common.EXIT_NOT_FOUND
    assert "Traceback" in loud.stderr
    assert "ManifestNotFoundError" in loud.stderr
    assert loud.stderr.rstrip().splitlines()[-1] == quiet.stderr.strip()


def test_console_script_exit_status_and_stderr(chain: tuple[Path, Any], tmp_path: Path) -> None:
    exe = console_script()
    store, _ = chain
    proc = subprocess.run(
        [exe, "show", str(store), "42"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == common.EXIT_NOT_FOUND
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: version 42 is not committed in store {store}"
    ]


def test_error_messages_are_printed_verbatim_not_as_rich_markup(tmp_path: Path) -> None:
    store = tmp_path / "x[" / "b]" / "[bold]store"
    store.parent.mkdir(parents=True)
    result = cli("show", store, "9")
    assert result.exit_code == common.EXIT_NOT_FOUND, result.exception
    assert str(store) in result.stderr


def test_show_tensors_prints_names_verbatim(tmp_path: Path) -> None:
    store = tmp_path / "store"
    names = ["layer[/b].w", "x[bold]y"]
    Publisher(store).publish({n: torch.ones(3) for n in names}, version=1)
    result = cli("show", store, "1", "--tensors")
    assert result.exit_code == 0, result.exception
    rows = {line.split()[0] for line in result.stdout.splitlines()[10:]}
    assert rows == set(names)


def test_pull_of_a_dtype_safetensors_cannot_hold_is_a_clear_error(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fnuz = torch.linspace(-1, 1, 10).to(torch.float8_e4m3fnuz)
    Publisher(store).publish({"w": fnuz, "b": torch.ones(3)}, version=1)
    result = cli("pull", store, tmp_path / "dest")
    line = assert_one_line_error(result, common.EXIT_MISMATCH)
    assert "float8_e4m3fnuz" in line


def test_exit_codes_are_stable() -> None:
    assert (
        common.EXIT_OK,
        common.EXIT_ERROR,
        common.EXIT_USAGE,
        common.EXIT_NOT_FOUND,
        common.EXIT_STORE,
        common.EXIT_DAMAGED,
        common.EXIT_MISMATCH,
        common.EXIT_CONFLICT,
        common.EXIT_INTERRUPTED,
    ) == (0, 1, 2, 3, 4, 5, 6, 7, 130)
    expected = {
        ObjectNotFoundError: common.EXIT_NOT_FOUND,
        ManifestNotFoundError: common.EXIT_NOT_FOUND,
        VersionExistsError: common.EXIT_CONFLICT,
        StoreError: common.EXIT_STORE,
        PreconditionFailedError: common.EXIT_STORE,
        IntegrityError: common.EXIT_DAMAGED,
        FrameError: common.EXIT_DAMAGED,
        ManifestError: common.EXIT_DAMAGED,
        UnsupportedFormatError: common.EXIT_DAMAGED,
        InvalidKeyError: common.EXIT_DAMAGED,
        TensorMismatchError: common.EXIT_MISMATCH,
        CheckpointError: common.EXIT_MISMATCH,
        WrongParentError: common.EXIT_MISMATCH,
        ChainError: common.EXIT_MISMATCH,
        VersionOrderError: common.EXIT_CONFLICT,
        ValueError: common.EXIT_ERROR,
        OSError: common.EXIT_ERROR,
    }
    for cls, code in expected.items():
        assert common.exit_code(cls("x")) == code, cls


def test_docs_list_every_command_option_and_exit_code() -> None:
    doc = ROOT / "docs" / "cli.md"
    if not doc.is_file():
        pytest.skip("docs/cli.md is not written yet")
    text = doc.read_text()
    command = typer.main.get_command(app)
    assert isinstance(command, typer.main.TyperGroup)
    for name, sub in command.commands.items():
        assert f"deltastore {name}" in text, name
        for param in sub.params:
            for opt in param.opts:
                if opt.startswith("-"):
                    assert opt in text, (name, opt)
    for opt in ("--version", "--verbose", "--quiet"):
        assert opt in text
    section = re.split(r"(?im)^#+ .*exit code.*$", text)
    assert len(section) > 1, "docs/cli.md has no exit-code section"
    body = section[1]
    cell = r"(?m)^\s*(?:[-*]\s+|\|\s*)?\**`?(\d{1,3})`?\**\s*(?:\||[-:]|\s)"
    documented = {int(m) for m in re.findall(cell, body)}
    constants = {
        k: v for k, v in vars(common).items() if k.startswith("EXIT_") and isinstance(v, int)
    }
    assert documented >= set(constants.values()), sorted(set(constants.values()) - documented)
    if any(name in body for name in constants):  # rows name the constants: each on its code
        for name, code in constants.items():
            rows = [m for line in body.splitlines() if name in line if (m := re.match(cell, line))]
            assert [int(m.group(1)) for m in rows] == [code], name


# --- help and output (docs/cli.md) --------------------------------------------------------


def test_help_shows_upper_case_arguments_and_no_value_for_flags() -> None:
    group = typer.main.get_command(app)
    assert isinstance(group, typer.main.TyperGroup)
    assert "<bool>" not in ok("--help").stdout and "<int>" not in ok("--help").stdout
    for name, sub in group.commands.items():
        out = ok(name, "--help").stdout
        usage = next(line for line in out.splitlines() if "Usage:" in line)
        assert "{" not in usage and "}" not in usage, usage
        for param in sub.params:
            if param.param_type_name == "argument":
                metavar = param.name.upper()  # type: ignore[union-attr]
                assert metavar in usage, (name, usage)
                assert re.search(rf"(?m)^\W*\*?\s*{metavar}\s", out), (name, metavar)
        assert "<bool>" not in out, name  # flags take no value
        assert "<int>" not in out or name in ("publish", "demo", "bench"), name


def test_demo_and_bench_sizes_are_the_names_of_the_one_sizes_table() -> None:
    from deltastore.testing.sizes import SIZES

    assert "<" + "|".join(SIZES) + ">" in ok("demo", "--help").stdout
    for command in ("demo", "bench"):
        unknown = cli(command, "--size", "huge")
        assert unknown.exit_code == common.EXIT_USAGE
        message = re.sub(r"[\s│]+", " ", unknown.stderr)  # unwrap the error box
        assert f"'huge' is not one of {', '.join(map(repr, SIZES))}." in message, message
    for name in SIZES:  # case-insensitive (bench then stops at its empty --store)
        parsed = cli("bench", "--size", name.upper(), "--store", ",")
        assert parsed.exit_code == common.EXIT_USAGE and "--store names no store" in parsed.stderr


def test_importing_the_cli_imports_no_torch() -> None:
    """Every command module is imported with the app; the library only when a command runs."""
    code = "import sys, deltastore_cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_error_while_printing_the_result_is_not_handled_as_the_commands_error(
    chain: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outcome is settled before the result is printed: a closed stdout pipe then ends the
    command as click ends it (exit 1, nothing on stderr), not with an ``error:`` line."""
    store, _ = chain

    def closed_pipe(*args: Any, **kwargs: Any) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(common.out_console, "print", closed_pipe)
    result = cli("log", store)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert result.stderr == ""
    failed = cli("show", store, "42")  # an error of the work: its line and code
    assert_one_line_error(failed, common.EXIT_NOT_FOUND)


def test_gc_says_what_it_can_collect(tmp_path: Path) -> None:
    help_text = ok("gc", "--help").stdout
    assert re.search(r"Usage: \S+ gc \[--keep N\] \[--orphans\] \[OPTIONS\] STORE\s", help_text)
    assert "--keep" in help_text and "--orphans" in help_text
    result = cli("gc", tmp_path)
    assert result.exit_code == common.EXIT_USAGE
    assert "nothing to collect: give --keep N and/or --orphans" in result.output


def test_human_bytes() -> None:
    assert common.human_bytes(0) == "0 B"
    assert common.human_bytes(999) == "999 B"
    assert common.human_bytes(999.6) == "999.60 B"  # not "1000 B"
    assert common.human_bytes(12288) == "12.29 kB"
    assert common.human_bytes(999_999) == "1.00 MB"  # not "1000.00 kB"
    assert common.human_bytes(None) == "size unknown"


def test_gc_reports_orphan_sizes_and_says_when_the_store_gives_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltastore.maintenance.orphans import GcReport, Orphan

    store = tmp_path / "store"
    Publisher(store).publish({"w": torch.ones(10)}, version=1)
    orphan = store / "versions" / f"{2:020d}" / "lost.dsz"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"x" * 12288)
    out = ok("gc", store, "--orphans", "--min-age", "0").stdout
    assert f"removed versions/{2:020d}/lost.dsz (12.29 kB)" in out
    assert "removed 1 orphan (12.29 kB)" in out

    # an object store: orphans without a size (the store does not report it), never "0 B"
    blind = Orphan(f"versions/{2:020d}/a.dsz", 2, False, None, None, None)
    sized = Orphan(f"versions/{2:020d}/b.dsz", 2, False, 5000, None, None)
    for orphans, total in [
        ((blind,), "(size unknown: the store does not report sizes)"),
        ((blind, sized), "(5.00 kB and 1 of unknown size)"),
    ]:
        report = GcReport(
            store="s3://bucket/p",
            newest=1,
            manifests=1,
            referenced=1,
            orphans=orphans,
            removed=tuple(o.key for o in orphans),
            dry_run=False,
            min_age_s=0.0,
        )
        monkeypatch.setattr(
            "deltastore.maintenance.orphans.gc", lambda *a, report=report, **k: report
        )
        out = ok("gc", "s3://bucket/p", "--orphans").stdout
        assert "0 B" not in out
        assert f"removed {blind.key} (size unknown)" in out
        assert f"removed {len(orphans)} orphan{'s' if len(orphans) > 1 else ''} {total}" in out
        got = ok_json("gc", "s3://bucket/p", "--orphans")
        assert got["removed_unknown_size"] == 1


def test_pull_over_several_versions_counts_element_changes_not_elements(
    chain: tuple[Path, Any], tmp_path: Path
) -> None:
    store, _ = chain
    dest = tmp_path / "dest"
    ok("pull", store, dest, "--version", "1")
    many = ok_json("pull", store, tmp_path / "other", "--version", "1")
    assert many["applied"] == [1]
    text = ok("pull", store, dest).stdout  # v2 and v3: the counts of both add up
    n = ok_json("pull", store, tmp_path / "json", "--version", "1")["changed_elements"]
    assert n == many["changed_elements"]
    match = re.search(r"applied 2, 3\): .* fetched, (\d+) element changes over 2 versions ", text)
    assert match, text
    assert "elements changed" not in text
    one = ok("pull", store, tmp_path / "other").stdout  # v1 -> v3 is also two versions
    assert "element changes over 2 versions" in one
    single = ok("pull", store, tmp_path / "json", "--version", "2").stdout
    assert re.search(r"applied 2\): .* fetched, \d+ elements changed in ", single), single


CTRL_C = """
import os, signal, sys, time
import deltastore_cli as cli
from deltastore_cli import common

def ctrl_c(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)

if sys.argv[1] == "after-print":  # Ctrl-C lands right after the result is printed
    real = common.out_console.print
    def print_then_ctrl_c(*args, **kwargs):
        real(*args, **kwargs)
        sys.stdout.flush()
        ctrl_c()
    common.out_console.print = print_then_ctrl_c
elif sys.argv[1] == "during-work":
    import deltastore.maintenance.history
    deltastore.maintenance.history.version_log = ctrl_c
elif sys.argv[1] == "before-work":  # pull parses its options before the work
    from deltastore_cli import pull
    pull.parse_storage_options = ctrl_c
sys.argv = ["deltastore", *sys.argv[2:]]
cli.main()
"""


def test_ctrl_c_after_the_result_is_printed_keeps_the_result(chain: tuple[Path, Any]) -> None:
    store, _ = chain
    proc = subprocess.run(
        [sys.executable, "-c", CTRL_C, "after-print", "log", str(store)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert proc.stderr == ""
    assert [line.split()[0] for line in proc.stdout.splitlines()[1:]] == ["3", "2", "1"]


@pytest.mark.parametrize(
    ("when", "args"), [("during-work", ["log"]), ("before-work", ["pull", "DEST"])]
)
def test_ctrl_c_during_the_work_is_exit_130_and_one_line(
    chain: tuple[Path, Any], tmp_path: Path, when: str, args: list[str]
) -> None:
    store, _ = chain
    args = [args[0], str(store), *[str(tmp_path / "d") for a in args[1:]]]
    proc = subprocess.run(
        [sys.executable, "-c", CTRL_C, when, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == common.EXIT_INTERRUPTED, (proc.returncode, proc.stderr)
    assert proc.stderr == "interrupted\n"
    assert proc.stdout == ""


def test_warnings_are_not_wrapped_when_stderr_is_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io
    import logging

    saved = logging.root.handlers[:], logging.root.level
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    message = "retrying " + " ".join(f"word{i}" for i in range(60))  # about 400 characters
    try:
        common.setup_logging(0)
        logging.getLogger("deltastore.test").warning(message)
    finally:
        logging.root.handlers[:], _ = saved[0], logging.root.setLevel(saved[1])
    lines = stderr.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith(message) and "WARNING" in lines[0]
