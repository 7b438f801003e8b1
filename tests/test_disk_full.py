"""A full disk is a typed error, never SIGBUS: pulls, publisher state, local stores.

Files written through a memory map get their blocks reserved first
(:func:`deltastore.store.space.reserve`); "no space left" (``ENOSPC``) and "quota exhausted"
(``EDQUOT``) become :class:`~deltastore.errors.DiskFullError` (for a local store
:class:`~deltastore.errors.StoreFullError`, a ``StoreError`` too), the files being written are
removed, and what was recorded stays as it was. The CLI exits ``EXIT_NO_SPACE`` (8).

The disks are real tmpfs mounts of a few MB (``mount -t tmpfs``: root or CAP_SYS_ADMIN; the
tests skip with that reason elsewhere). The cases where the old code died of SIGBUS run in a
child process, so that a regression fails the test instead of killing pytest.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from deltastore import Publisher
from deltastore.checkpoint.safetensors import create_checkpoint
from deltastore.checkpoint.state import PENDING, STAGING, read_state
from deltastore.errors import DiskFullError, StoreError, StoreFullError
from deltastore.store import LocalStore
from deltastore.store import space as space_module
from tests.helpers import folder_bytes

ROOT = Path(__file__).parent.parent
MB = 1 << 20


def tensors(version: int, *, extra: bool = False) -> dict[str, torch.Tensor]:
    """8 float32 tensors of 1 MiB each (version-dependent values); ``extra``: one more tensor
    (another tensor table)."""
    g = torch.Generator().manual_seed(version)
    out = {f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(8)}
    if extra:
        out["extra.bias"] = torch.full((4096,), float(version))
    return out


def expected_bytes(ts: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.numpy().tobytes() for n, t in ts.items()}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """v1 (anchor) and v2 (an anchor with another tensor table: one tensor more)."""
    root = tmp_path_factory.mktemp("store") / "store"
    Publisher(root).publish(tensors(1), version=1)
    Publisher(root).publish(tensors(2, extra=True), version=2, anchor=True)
    return root


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount(size)``: a fresh tmpfs of ``size`` (e.g. "2m") mounted under ``tmp_path``;
    unmounted at the end. Skips where mounting is not permitted."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if shutil.which("mount") is None:
            pytest.skip("no mount command: a full disk is simulated with a real small tmpfs")
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            pytest.skip(
                f"cannot mount a tmpfs here ({result.stderr.strip()}): the full-disk tests "
                "need root or CAP_SYS_ADMIN"
            )
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def remount(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def run_child(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter that prints one JSON line last; a death by signal
    (SIGBUS: -7) fails the test with the child's output."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, (
        f"the child ended with {result.returncode} (negative: killed by that signal; -7 is "
        f"SIGBUS)\n{result.stdout}\n{result.stderr}"
    )
    return dict(json.loads(result.stdout.splitlines()[-1]))


PULL_CHILD = """
    import json, sys
    from deltastore.checkpoint.folders import pull_checkpoint
    try:
        pull_checkpoint({store!r}, {dest!r}, version={version}, lease_ttl=None)
        print(json.dumps({{"error": None}}))
    except OSError as exc:
        print(json.dumps({{
            "error": type(exc).__name__, "errno": exc.errno, "message": str(exc),
            "needed": getattr(exc, "needed", None), "free": getattr(exc, "free", None),
        }}))
"""


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_pull_into_a_too_small_disk_is_a_typed_error_and_leaves_nothing(
    store: Path, tmpfs: Callable[[str], Path]
) -> None:
    disk = tmpfs("2m")
    dest = disk / "d"
    out = run_child(PULL_CHILD.format(store=str(store), dest=str(dest), version=1))
    assert out["error"] == "DiskFullError", out
    assert out["errno"] == errno.ENOSPC
    message = str(out["message"])
    assert str(dest) in message
    needed, free = out["needed"], out["free"]
    assert isinstance(needed, int) and isinstance(free, int)
    assert needed >= 8 * MB and free < needed
    assert f"{needed:,} bytes" in message and f"{free:,} bytes" in message
    assert leftovers(disk) == []  # no temp file, no partial folder claiming a version
    assert shutil.disk_usage(disk).used == 0


def test_a_rebuild_without_room_for_two_copies_keeps_the_old_version(
    store: Path, tmpfs: Callable[[str], Path]
) -> None:
    disk = tmpfs("12m")  # one copy (8 MiB) fits, two do not
    dest = disk / "d"
    v1 = run_child(PULL_CHILD.format(store=str(store), dest=str(dest), version=1))
    assert v1["error"] is None, v1
    out = run_child(PULL_CHILD.format(store=str(store), dest=str(dest), version=2))
    assert out["error"] == "DiskFullError", out
    message = str(out["message"])
    assert str(dest) in message and "stays at version 1" in message
    assert f"{out['needed']:,} bytes" in message
    # the folder is still at v1, bit-exact, with nothing of the failed pull left behind
    state = read_state(dest)
    assert state is not None and state.version == 1
    assert folder_bytes(dest) == expected_bytes(tensors(1))
    assert not (dest / STAGING).exists() and not (dest / PENDING).exists()
    assert sorted(p.name for p in dest.iterdir()) == [".deltastore.json", "model.safetensors"]
    # with room, the same pull goes through
    remount(disk, "40m")
    again = run_child(PULL_CHILD.format(store=str(store), dest=str(dest), version=2))
    assert again["error"] is None, again
    state = read_state(dest)
    assert state is not None and state.version == 2
    assert folder_bytes(dest) == expected_bytes(tensors(2, extra=True))


def test_cli_pull_on_a_full_disk_exits_with_the_documented_code(
    store: Path, tmpfs: Callable[[str], Path]
) -> None:
    from deltastore_cli import common

    exe = Path(sys.executable).parent / "deltastore"
    if not exe.is_file():
        pytest.skip("the deltastore console script is not installed")
    disk = tmpfs("2m")
    dest = disk / "d"
    result = subprocess.run(
        [str(exe), "pull", str(store), str(dest), "--version", "1", "--lease-ttl", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == common.EXIT_NO_SPACE == 8, (result.returncode, result.stderr)
    assert str(dest) in result.stderr and "bytes" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert leftovers(disk) == []


def test_exit_code_of_a_full_disk() -> None:
    from deltastore_cli import common

    assert common.exit_code(DiskFullError("x")) == common.EXIT_NO_SPACE
    # a full local store is a StoreError too, and exits as a full disk
    assert common.exit_code(StoreFullError("x")) == common.EXIT_NO_SPACE


def test_publisher_disk_state_on_a_full_disk_is_a_typed_error(
    tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    disk = tmpfs("2m")
    code = f"""
        import json, logging, os
        import numpy as np, torch
        from deltastore import Publisher
        from deltastore.publish.snapshot import DiskSnapshot
        from deltastore.errors import DiskFullError
        logging.basicConfig(level=logging.WARNING)
        snap = DiskSnapshot({str(disk / "direct")!r})
        try:
            snap.replace({{"w": np.ones(4 << 20, dtype=np.uint8)}})
            direct = None
        except DiskFullError as exc:
            direct = {{"errno": exc.errno, "message": str(exc), "needed": exc.needed}}
        g = torch.Generator().manual_seed(0)
        t = {{"w": torch.randn(1024, 1024, generator=g)}}
        pub = Publisher({str(tmp_path / "store")!r}, snapshot="disk",
                        state_dir={str(disk / "state")!r})
        report = pub.publish(t, version=1)
        print(json.dumps({{"direct": direct, "version": report.version}}))
    """
    out = run_child(code)
    direct = out["direct"]
    assert isinstance(direct, dict), out
    assert direct["errno"] == errno.ENOSPC and direct["needed"] == 4 << 20
    assert str(disk / "direct") in direct["message"]
    assert out["version"] == 1  # committed; only the state for next time is lost (logged)
    # no snapshot, no temp file; the state left says "dirty": no saved state
    assert [p for p in leftovers(disk) if "snapshot" in p or "/." in p] == []
    assert json.loads((disk / "state" / "state.json").read_text())["dirty"] is True


def test_local_store_put_on_a_full_disk_is_a_store_error_and_removes_its_temp_file(
    tmpfs: Callable[[str], Path],
) -> None:
    disk = tmpfs("1m")
    local = LocalStore(disk / "store")
    local.put("small", b"x" * 1000)
    for put in (local.put, local.put_if_absent):
        with pytest.raises(StoreFullError) as info:
            put("versions/1/big", os.urandom(2 * MB))
        assert isinstance(info.value, StoreError) and isinstance(info.value, DiskFullError)
        assert info.value.errno == errno.ENOSPC and info.value.needed == 2 * MB
        assert str(local.root) in str(info.value) and f"{2 * MB:,} bytes" in str(info.value)
        assert sorted(p.name for p in (disk / "store").rglob("*") if p.is_file()) == ["small"]
    assert local.get("small") == b"x" * 1000


def test_reserve_writes_zeros_where_fallocate_is_unsupported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tmpfs: Callable[[str], Path]
) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(space_module.os, "posix_fallocate", unsupported)
    table = {"w": ("float32", (512, 1024)), "b": ("float16", (3,))}
    locs = create_checkpoint(tmp_path / "ok", table)
    path = locs["w"].path
    assert os.stat(path).st_blocks * 512 >= os.path.getsize(path)  # no hole
    data = np.fromfile(path, dtype=np.uint8)[locs["w"].start :]
    assert not data.any()
    disk = tmpfs("1m")
    with pytest.raises(DiskFullError) as info:
        create_checkpoint(disk / "d", table)
    assert info.value.errno == errno.ENOSPC and str(disk / "d") in str(info.value)
    assert leftovers(disk) == ["d"]  # the folder stays, its files are gone


def test_a_quota_error_is_a_disk_full_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def quota(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(space_module.os, "posix_fallocate", quota)
    with pytest.raises(DiskFullError) as info:
        create_checkpoint(tmp_path / "d", {"w": ("float32", (1024,))})
    assert info.value.errno == errno.EDQUOT and "quota" in str(info.value)
    assert list((tmp_path / "d").iterdir()) == []


def test_a_version_written_in_place_without_room_for_its_record_is_recorded_by_the_next_pull(
    tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    root = tmp_path / "store"
    v1 = tensors(1)
    v2 = {n: t + (torch.arange(t.numel()).reshape(t.shape) % 97 == 0) for n, t in v1.items()}
    pub = Publisher(root)
    pub.publish(v1, version=1)
    pub.publish(v2, version=2)  # a delta: written in place, no new blocks
    disk = tmpfs("12m")
    dest = disk / "d"
    assert run_child(PULL_CHILD.format(store=str(root), dest=str(dest), version=1))["error"] is None
    # fill the disk up to one page: room for the pending marker, none for the new sidecar
    with open(disk / "filler", "wb") as fh:
        fh.write(bytes(shutil.disk_usage(disk).free - 4096))
    out = run_child(PULL_CHILD.format(store=str(root), dest=str(dest), version=2))
    assert out["error"] == "DiskFullError", out
    message = str(out["message"])
    assert "not recorded" in message and str(dest) in message, message
    state = read_state(dest)
    assert state is not None and state.version == 1
    assert (dest / PENDING).exists()  # says: files ahead of the record
    assert {p.name for p in dest.iterdir()} == {PENDING, ".deltastore.json", "model.safetensors"}
    (disk / "filler").unlink()
    again = run_child(PULL_CHILD.format(store=str(root), dest=str(dest), version=2))
    assert again["error"] is None, again
    state = read_state(dest)
    assert state is not None and state.version == 2 and not (dest / PENDING).exists()
    assert folder_bytes(dest) == expected_bytes(v2)


def test_a_publisher_state_that_cannot_be_marked_dirty_is_dropped(
    tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    disk = tmpfs("16m")
    state = disk / "state"
    weights = {"w": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3))}
    pub = Publisher(tmp_path / "store", snapshot="disk", state_dir=state)
    pub.publish(weights, version=1)
    assert Publisher(tmp_path / "store", snapshot="disk", state_dir=state).version == 1
    with open(disk / "filler", "wb") as fh:  # not a page left
        fh.write(bytes(shutil.disk_usage(disk).free))
    weights["w"][:4] += 1.0
    assert pub.publish(weights, version=2).kind == "delta"  # committed; the state is not
    assert not (state / "state.json").exists()  # the stale v1 state is not left looking clean
    assert [p.name for p in state.iterdir()] == ["snapshot.bin"]  # no temp file
    (disk / "filler").unlink()
    assert Publisher(tmp_path / "store", snapshot="disk", state_dir=state).version is None
