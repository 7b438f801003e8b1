"""LocalStore: the conformance suite plus what only a local folder can show."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from deltastore.errors import StoreError, VersionExistsError
from deltastore.store import LocalStore, open_store
from deltastore.testing.conformance import StoreTests


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalStore:
        return LocalStore(tmp_path / "store")


def _commit(root: str, i: int, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    try:
        LocalStore(root).put_if_absent("manifests/x.json", f"process-{i}".encode())
        queue.put(("won", i))
    except VersionExistsError:
        queue.put(("lost", i))


def test_put_if_absent_race_across_processes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_commit, args=(str(tmp_path), i, queue)) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    outcomes = [queue.get(timeout=5) for _ in procs]
    winners = [i for what, i in outcomes if what == "won"]
    assert len(winners) == 1 and len(outcomes) == 6
    assert (tmp_path / "manifests/x.json").read_bytes() == f"process-{winners[0]}".encode()


def test_no_temp_files_left_behind(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a/b", b"1")
    store.put_if_absent("a/c", b"2")
    with pytest.raises(VersionExistsError):
        store.put_if_absent("a/c", b"3")
    store.put_if_match("LATEST", b"4", None)
    leftovers = [n for n in os.listdir(tmp_path / "a") if n.startswith(".")]
    assert leftovers == []
    assert store.list() == ["LATEST", "a/b", "a/c"]


def test_open_store_urls(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path  # type: ignore[attr-defined]
    assert open_store(tmp_path).root == tmp_path  # type: ignore[attr-defined]
    with pytest.raises(StoreError, match="not supported"):
        open_store("gopher://host/bucket")
    with pytest.raises(StoreError, match="storage options"):
        open_store(str(tmp_path), {"anon": True})


def test_unreadable_store_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    store = LocalStore(tmp_path / "file")  # the root is a file, not a folder
    with pytest.raises(StoreError):
        store.put("k", b"v")
