"""``deltastore verify`` of anchor copies (``anchors/<v>.json``, format v1 section 9.4).

A store of 6 versions published with ``anchor_policy="every:2"`` (copies of v3 and v5, the
chain below each intact). A fresh reader starts from the newest copy at or below its target,
so a damaged copy must be reported even though every version's chain is sound:

- the fast check reads each copy's frames like a manifest's (missing object, truncated
  object, bytes that fail the XXH3-64), naming the copy's key;
- the deep check replays each copy on its own and compares its frames' and tensors' Adler-32
  with its version's: a frame whose manifest Adler-32 was edited, or a frame re-encoded with
  another value (valid, with its hash and length fixed), passes the fast check, and before
  copies were replayed passed ``--deep`` too.

Every problem of a copy names its key and says what to do; the CLI exits 5. A copy whose
chain below is gone (retention) is replayed once, in its version's place. The deep check's
memory stays about one tensor with copies in the store.
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from typer.testing import CliRunner, Result

from deltastore import Publisher
from deltastore.checkpoint.folders import pull_checkpoint
from deltastore.format.codecs import RAW, RAW_PLANES, FrameDecoder, FrameEncoder
from deltastore.format.codecs.v2 import FrameEncoder2
from deltastore.format.keys import anchor_key, manifest_key
from deltastore.maintenance.verify import (
    ADLER32,
    FRAME,
    MISSING_OBJECT,
    TRUNCATED,
    XXH3,
    VerifyReport,
    verify_store,
)
from deltastore_cli import app
from deltastore_cli import common as common

VERSIONS = 6
COPIES = (3, 5)
TENSORS = 4
NAME = "w1"


def states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    t = {f"w{i}": torch.randn(4096, generator=g).to(torch.bfloat16) for i in range(TENSORS)}
    out = []
    for v in range(1, VERSIONS + 1):
        for i, x in enumerate(t.values()):
            x[(v + i) :: 13] += 0.5
        out.append({n: x.clone() for n, x in t.items()})
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("copies") / "store"
    pub = Publisher(path, max_frame_bytes=2048, max_object_bytes=8192, anchor_policy="every:2")
    for v, state in enumerate(states(), start=1):
        pub.publish(state, version=v)
    assert sorted(int(p.stem) for p in (path / "anchors").glob("*.json")) == list(COPIES)
    return path


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "store"))


def copy_of(store: Path, version: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((store / anchor_key(version)).read_text())
    return data


def rewrite_copy(store: Path, version: int, c: dict[str, Any]) -> None:
    (store / anchor_key(version)).write_text(json.dumps(c, indent=1) + "\n")


def kinds(report: VerifyReport) -> list[tuple[str, int | None]]:
    return sorted((p.kind, p.version) for p in report.problems)


def cli(*args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_copy_problem(
    store: Path, version: int, kind: str, *, deep: bool, fast_ok: bool = False
) -> VerifyReport:
    """``verify`` (``--deep`` when ``deep``) reports exactly one ``kind`` problem on the copy
    of ``version``, naming its key and what to do; the CLI exits 5 and ``--json`` has it."""
    if fast_ok:
        assert verify_store(store).ok
        assert cli("verify", store).exit_code == 0
    report = verify_store(store, deep=deep)
    assert kinds(report) == [(kind, version)], [p.line() for p in report.problems]
    problem = report.problems[0]
    assert anchor_key(version) in problem.line()
    assert "falls back to the chain" in problem.message and "gc --orphans" in problem.message
    flags = ["--deep"] if deep else []
    result = cli("verify", store, *flags)
    assert result.exit_code == common.EXIT_DAMAGED, result.output
    assert result.stdout.splitlines()[0] == problem.line()
    data = json.loads(cli("verify", store, *flags, "--json").stdout)
    assert data["ok"] is False and data["kinds"] == {kind: 1}
    assert [(p["kind"], p["version"], p["key"]) for p in data["problems"]] == [
        (kind, version, problem.key)
    ]
    return report


def first_frame(c: dict[str, Any]) -> dict[str, Any]:
    frame: dict[str, Any] = c["tensors"][NAME]["frames"][0]
    return frame


# --- healthy ------------------------------------------------------------------------------


def test_a_healthy_store_with_copies_passes(pristine: Path) -> None:
    fast = verify_store(pristine)
    assert fast.ok, fast.problems
    frames = sum(
        len(t["frames"])
        for key in [manifest_key(v) for v in range(1, VERSIONS + 1)]
        + [anchor_key(v) for v in COPIES]
        for t in json.loads((pristine / key).read_text())["tensors"].values()
    )
    assert fast.frames == frames
    deep = verify_store(pristine, deep=True)
    assert deep.ok, deep.problems
    # every version's tensors, and every copy's, replayed once
    assert deep.tensors_checked == TENSORS * (VERSIONS + len(COPIES)) and deep.unverified == 0
    assert deep.bytes_read == 2 * fast.bytes_read
    assert cli("verify", pristine, "--deep").exit_code == 0


# --- the fast check: a copy's frames are read like a manifest's -------------------------------


def test_missing_copy_object(store: Path) -> None:
    f = first_frame(copy_of(store, 3))
    (store / f["object"]).unlink()
    report = assert_copy_problem(store, 3, MISSING_OBJECT, deep=False)
    assert report.problems[0].key == f["object"]
    deep = verify_store(store, deep=True)
    assert kinds(deep) == [(MISSING_OBJECT, 3)] and deep.unverified > 0


def test_truncated_copy_object(store: Path) -> None:
    f = first_frame(copy_of(store, 5))
    path = store / f["object"]
    path.write_bytes(path.read_bytes()[: f["offset"] + f["length"] // 2])
    assert_copy_problem(store, 5, TRUNCATED, deep=False)
    assert kinds(verify_store(store, deep=True)) == [(TRUNCATED, 5)]


def test_flipped_byte_in_a_copy(store: Path) -> None:
    f = first_frame(copy_of(store, 3))
    path = store / f["object"]
    raw = bytearray(path.read_bytes())
    raw[f["offset"] + f["length"] // 2] ^= 0x20
    path.write_bytes(bytes(raw))
    report = assert_copy_problem(store, 3, XXH3, deep=False)
    assert report.problems[0].tensor == NAME
    assert kinds(verify_store(store, deep=True)) == [(XXH3, 3)]


# --- the deep check: a copy is replayed and compared with its version ------------------------


def test_wrong_frame_adler32_in_a_copy(store: Path) -> None:
    """Before copies were replayed, this passed ``verify --deep`` (exit 0), while a fresh
    reader starting at v3 or v4 hit it and had to fall back to the chain."""
    c = copy_of(store, 3)
    first_frame(c)["adler32"] ^= 1  # not in the state digest: the copy still validates
    rewrite_copy(store, 3, c)
    report = assert_copy_problem(store, 3, ADLER32, deep=True, fast_ok=True)
    problem = report.problems[0]
    assert problem.tensor == NAME and "decodes to Adler-32" in problem.message
    assert report.tensors_checked == TENSORS * (VERSIONS + len(COPIES)) - 1
    assert report.unverified == 0
    # what the message says: a pull skips the copy and reaches v3 by the chain
    report_pull = pull_checkpoint(str(store), store.parent / "pulled", version=3)
    assert report_pull.applied == (1, 2, 3)


def reencode_with_another_value(store: Path, version: int) -> None:
    """Re-encode the first frame of ``NAME`` in the copy of ``version`` with one element
    changed (same codec), in a new object, and fix its length and XXH3-64 in the copy: a
    frame valid in every way but its content."""
    c = copy_of(store, version)
    f = first_frame(c)
    assert f["codec"] in (RAW, RAW_PLANES)
    stored = (store / f["object"]).read_bytes()[f["offset"] : f["offset"] + f["length"]]
    words = np.empty(f["stop"] - f["start"], dtype="<u2")
    FrameDecoder().decode_into(f["codec"], stored, words)
    words[7] ^= 0x0100
    frame = FrameEncoder().raw(words) if f["codec"] == RAW else FrameEncoder2().raw_planes(words)
    key = f"versions/{version:020d}/{'e' * 12}-anchor-000009.dsz"
    (store / key).write_bytes(frame)
    f.update(object=key, offset=0, length=len(frame), xxh3=xxhash.xxh3_64_hexdigest(frame))
    rewrite_copy(store, version, c)


def test_another_value_in_a_valid_copy_frame(store: Path) -> None:
    reencode_with_another_value(store, 5)
    report = assert_copy_problem(store, 5, ADLER32, deep=True, fast_ok=True)
    assert report.problems[0].key == f"versions/{5:020d}/{'e' * 12}-anchor-000009.dsz"


def test_a_copy_frame_that_does_not_decode(store: Path) -> None:
    c = copy_of(store, 5)
    f = first_frame(c)
    junk = b"\x00not a frame\xff" * 8
    key = f"versions/{5:020d}/{'e' * 12}-anchor-000009.dsz"
    (store / key).write_bytes(junk)
    f.update(object=key, offset=0, length=len(junk), xxh3=xxhash.xxh3_64_hexdigest(junk))
    rewrite_copy(store, 5, c)
    assert_copy_problem(store, 5, FRAME, deep=True, fast_ok=True)


def test_a_copy_whose_chain_below_is_gone(store: Path) -> None:
    """Retention deleted v1 and v2: the copy of v3 starts the chain and is replayed once, in
    v3's place; its damage says that the versions from v3 on cannot be pulled from scratch."""
    for v in (1, 2):
        (store / manifest_key(v)).unlink()
        shutil.rmtree(store / "versions" / f"{v:020d}")
    healthy = verify_store(store, deep=True)
    assert healthy.ok, healthy.problems
    # v3 to v6 (v3 from its copy, not replayed a second time) and v5's copy
    assert healthy.tensors_checked == TENSORS * (VERSIONS - 2 + 1)
    c = copy_of(store, 3)
    first_frame(c)["adler32"] ^= 1
    rewrite_copy(store, 3, c)
    assert verify_store(store).ok
    report = verify_store(store, deep=True)
    assert kinds(report) == [(ADLER32, 3)], report.problems
    assert anchor_key(3) in report.problems[0].message
    assert "cannot be pulled from scratch" in report.problems[0].message
    assert report.unverified == 3  # NAME in v4..v6: not reached (v5's copy is checked)
    assert cli("verify", store, "--deep").exit_code == common.EXIT_DAMAGED


# --- memory -------------------------------------------------------------------------------


def deep_peak(path: Path, elements: int) -> tuple[int, int]:
    """(model bytes, peak traced memory of a deep check) for 20 bf16 tensors of ``elements``
    each, 4 versions with an anchor copy of v3 (4 frames per tensor whatever the size)."""
    g = torch.Generator().manual_seed(5)
    tensors = {
        f"w{i:02d}": torch.randn(elements, generator=g).to(torch.bfloat16) for i in range(20)
    }
    pub = Publisher(path, max_frame_bytes=elements // 2, anchor_policy="every:2")
    pub.publish(tensors, version=1)
    for v in (2, 3, 4):
        for t in tensors.values():
            t[v::29] += 1.0
        pub.publish(tensors, version=v)
    assert [p.stem for p in (path / "anchors").glob("*.json")] == [f"{3:020d}"]
    tracemalloc.start()
    try:
        report = verify_store(path, deep=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok and report.tensors_checked == 20 * 5, report.problems
    return 20 * 2 * elements, peak


def test_deep_replay_of_copies_keeps_memory_bounded_by_a_tensor(tmp_path: Path) -> None:
    """Tensors 4x larger: the peak grows by a few tensors (and the frames in flight), not
    by the model (2.5 MiB -> 10 MiB)."""
    small_model, small = deep_peak(tmp_path / "small", 64 << 10)
    big_model, big = deep_peak(tmp_path / "big", 256 << 10)
    tensor = 2 * (256 << 10)
    assert big - small < 4 * tensor < (big_model - small_model) / 3, (small, big)
    assert big < big_model / 2, big
