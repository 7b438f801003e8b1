"""Receivers across changes of the tensor table, and receivers whose state left the chain.

Spec section 9.3:

- a folder pulled across versions whose tensor tables differ ({a, b} -> {a} -> {a, c} ->
  {a, c reshaped}) holds exactly each version's tensors (names, dtypes, shapes, bytes), on the
  command line and through ``pull_checkpoint`` / a long-lived ``FolderSync``; the old files
  are switched for new ones built beside them;
- a ``Subscriber`` that allocated its tensors reallocates them; one given the caller's tensors
  raises ``TableChangedError`` naming what changed, before fetching or writing anything;
- a folder, a self-allocating and an engine-owned ``Subscriber`` left at a version that lost a
  publisher race recover from the newest anchor at or below the target (with a warning), and
  fail with a ``ChainError`` that names the store's chain when no such anchor can be reached.

Tensors are compared bit-wise through integer views.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from deltastore import Layout, LocalStore, Publisher, Subscriber
from deltastore.checkpoint.folders import PENDING, SIDECAR, FolderSync, pull_checkpoint
from deltastore.checkpoint.safetensors import create_checkpoint
from deltastore.errors import ChainError, TableChangedError
from deltastore.format.codecs import FrameDecoder
from deltastore.format.keys import anchor_key
from deltastore.format.manifest import manifest_key
from deltastore.maintenance.verify import verify_checkout
from deltastore.testing.faults import FaultyStore, InjectedFault
from deltastore_cli import app
from tests.test_folders import assert_bit_exact as assert_exact
from tests.test_folders import bits

Tensors = dict[str, torch.Tensor]
INDEX = "model.safetensors.index.json"
runner = CliRunner()

# --- helpers ------------------------------------------------------------------------------


def snapshot(tensors: Any) -> dict[str, np.ndarray]:
    return {n: bits(t).copy() for n, t in tensors.items()}


def load_folder(folder: Path) -> Tensors:
    out: Tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        part = load_file(f)
        assert not set(part) & set(out)
        out |= part
    return out


def assert_folder(folder: Path, store: Path, expected: Tensors, version: int) -> None:
    """The folder holds exactly ``expected`` at ``version``, nothing else, and checks clean."""
    assert_exact(expected, load_folder(folder))
    assert json.loads((folder / SIDECAR).read_text())["version"] == version
    names = sorted(p.name for p in folder.iterdir())
    data = [n for n in names if n != SIDECAR]
    assert data == ["model.safetensors"] or (INDEX in data and len(data) > 2), names
    report = verify_checkout(folder, store)
    assert report.ok, report.problems


def rand(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def nudge(g: torch.Generator, t: torch.Tensor) -> torch.Tensor:
    """About 5% of the elements changed."""
    mask = torch.rand(t.shape, generator=g) < 0.05
    return torch.where(mask, t + rand(g, tuple(t.shape), t.dtype), t)


def table_states(seed: int = 5) -> list[Tensors]:
    """``states[v]``: v1 {a, b} anchor, v2 delta, v3 {a} (b dropped), v4 {a, c} (c added),
    v5 delta, v6 {a, c} with c reshaped, v7 delta, v8 {a, c} with c retyped."""
    g = torch.Generator().manual_seed(seed)
    a = rand(g, (96, 32), torch.bfloat16)
    b = torch.randn(300, generator=g)
    s: list[Tensors] = [{}, {"a": a, "b": b}]
    s.append({"a": nudge(g, a), "b": nudge(g, b)})
    s.append({"a": nudge(g, s[2]["a"])})
    s.append({"a": nudge(g, s[3]["a"]), "c": rand(g, (16, 8), torch.float16)})
    s.append({n: nudge(g, t) for n, t in s[4].items()})
    s.append({"a": nudge(g, s[5]["a"]), "c": rand(g, (24, 8), torch.float16)})
    s.append({n: nudge(g, t) for n, t in s[6].items()})
    s.append({"a": s[7]["a"].clone(), "c": s[7]["c"].to(torch.float32)})
    return s


KINDS = ["anchor", "delta", "anchor", "anchor", "delta", "anchor", "delta", "anchor"]


@pytest.fixture(scope="module")
def states() -> list[Tensors]:
    return table_states()


@pytest.fixture(scope="module")
def table_store(states: list[Tensors], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tables") / "store"
    pub = Publisher(path, max_frame_bytes=1 << 10)
    for v in range(1, len(states)):
        assert pub.publish(states[v], version=v).kind == KINDS[v - 1], v
    return path


# --- points 1 and 2: folders ----------------------------------------------------------------


def test_cli_folder_follows_every_table_change(tmp_path: Path, states: list[Tensors]) -> None:
    """`deltastore publish` writes an anchor at each table change; `deltastore pull` brings
    the folder to each version with exactly that version's tensors, exit 0 each time."""
    store, state = tmp_path / "store", tmp_path / "state"
    for v in range(1, 7):
        src = tmp_path / f"ckpt{v}"
        src.mkdir()
        save_file(states[v], src / "model.safetensors")
        args = ["publish", str(store), str(src), "--version", str(v), "--state-dir", str(state)]
        result = runner.invoke(app, [*args, "--max-frame-bytes", "1024", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["kind"] == KINDS[v - 1]
    dest = tmp_path / "dest"
    for v in range(1, 7):
        result = runner.invoke(app, ["pull", str(store), str(dest), "--version", str(v)])
        assert result.exit_code == 0, result.output
        assert f"pulled v{v}" in result.stdout
        assert_folder(dest, store, states[v], v)
    result = runner.invoke(app, ["verify", str(store), "--checkout", str(dest)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "targets",
    [(1, 3, 4, 6), (2, 3, 5, 7, 8), (1, 8), (4, 6, 7), (3, 5, 6, 8)],
)
@pytest.mark.parametrize("reuse", [False, True], ids=["pull_checkpoint", "one FolderSync"])
def test_pull_follows_table_changes(
    table_store: Path, states: list[Tensors], tmp_path: Path, targets: tuple[int, ...], reuse: bool
) -> None:
    dest = tmp_path / "dest"
    folder = FolderSync(str(table_store), dest) if reuse else None
    for v in targets:
        report = (
            folder.pull(v)
            if folder is not None
            else pull_checkpoint(str(table_store), dest, version=v)
        )
        assert report.version == v
        assert_folder(dest, table_store, states[v], v)
        if folder is not None:
            assert folder.version == v


def test_a_folder_keeps_one_lease_across_table_changes(tmp_path: Path) -> None:
    """Every subscriber of one FolderSync (the folder's, the rebuild's at a table change, the
    reopened folder's) writes the same lease: none is left behind to hold old versions."""
    store = tmp_path / "store"
    pub = Publisher(store)
    pub.publish({"a": torch.zeros(8)}, version=1)
    pub.publish({"a": torch.ones(8)}, version=2)
    pub.publish({"a": torch.ones(8), "b": torch.zeros(4)}, version=3)  # an anchor
    folder = FolderSync(str(store), tmp_path / "dest")
    for v in (1, 2, 3):
        folder.pull(v)
        leases = LocalStore(store).list("leases/")
        assert len(leases) == 1, (v, leases)
        assert json.loads(LocalStore(store).get(leases[0]))["version"] == v


def test_a_sharded_folder_is_switched_to_a_single_file_and_back(
    table_store: Path, states: list[Tensors], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old shards and index are gone after the switch; nothing but the new files stay
    (and the other way round). A version older than the folder's is refused."""
    import deltastore.checkpoint.folders as folders

    dest = tmp_path / "dest"
    small = functools.partial(create_checkpoint, max_shard_bytes=2048)
    with monkeypatch.context() as m:
        m.setattr(folders, "create_checkpoint", small)
        pull_checkpoint(str(table_store), dest, version=2)
    assert (dest / INDEX).exists()
    assert_folder(dest, table_store, states[2], 2)
    pull_checkpoint(str(table_store), dest, version=4)
    assert_folder(dest, table_store, states[4], 4)
    assert sorted(p.name for p in dest.iterdir()) == sorted([SIDECAR, "model.safetensors"])
    with monkeypatch.context() as m:  # and back to shards
        m.setattr(folders, "create_checkpoint", small)
        pull_checkpoint(str(table_store), dest, version=6)
    assert (dest / INDEX).exists() and not (dest / "model.safetensors").exists()
    assert_folder(dest, table_store, states[6], 6)
    with pytest.raises(ChainError, match="newer than the requested 3"):
        pull_checkpoint(str(table_store), dest, version=3)
    assert_folder(dest, table_store, states[6], 6)


def fail_decode(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The n-th anchor frame decoded raises (after the ones before it were written)."""
    decode_into, changes, calls = FrameDecoder.decode_into, FrameDecoder.changes, [0]

    def hit() -> None:
        calls[0] += 1
        if calls[0] == n:
            raise InjectedFault("injected: decode failed")

    def decode_into_(self: FrameDecoder, *args: Any) -> Any:  # the one codec dispatch
        hit()
        return decode_into(self, *args)

    def changes_(self: FrameDecoder, *args: Any) -> Any:
        hit()
        return changes(self, *args)

    monkeypatch.setattr(FrameDecoder, "decode_into", decode_into_)
    monkeypatch.setattr(FrameDecoder, "changes", changes_)


def test_a_failed_rewrite_leaves_the_old_folder(
    table_store: Path, states: list[Tensors], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite that fails while the new files are built leaves the folder at its version,
    loadable, with nothing beside it; the next pull completes."""
    dest = tmp_path / "dest"
    pull_checkpoint(str(table_store), dest, version=2)
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    with monkeypatch.context() as m:
        fail_decode(m, 4)
        with pytest.raises(InjectedFault):
            FolderSync(str(table_store), dest).pull(4)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert_folder(dest, table_store, states[2], 2)
    pull_checkpoint(str(table_store), dest, version=4)
    assert_folder(dest, table_store, states[4], 4)
    assert not (dest / PENDING).exists()


# --- point 2: subscribers -------------------------------------------------------------------


@pytest.mark.parametrize("layout", [False, True], ids=["tensors", "tensors+layout"])
@pytest.mark.parametrize(
    ("held", "target", "changes"),
    [
        (2, 3, {"removed": ("b",)}),
        (3, 4, {"added": ("c",)}),
        (2, 4, {"added": ("c",), "removed": ("b",)}),
        (5, 6, {"reshaped": ("c",)}),
        (7, 8, {"retyped": ("c",)}),
    ],
)
def test_engine_owned_subscriber_raises_table_changed(
    table_store: Path,
    states: list[Tensors],
    layout: bool,
    held: int,
    target: int,
    changes: dict[str, tuple[str, ...]],
) -> None:
    """Caller-owned tensors are never reallocated: TableChangedError names what changed,
    nothing is fetched, the tensors stay bit for bit at their version."""
    tensors = {n: t.clone() for n, t in states[held].items()}
    store = FaultyStore(LocalStore(table_store))
    sub = Subscriber(
        store,
        tensors=tensors,
        version=held,
        layout=Layout.identity(tensors) if layout else None,
    )
    sub.sync(held)
    before = snapshot(tensors)
    store.reset()
    with pytest.raises(TableChangedError) as info:
        sub.sync(target)
    err = info.value
    for kind in ("added", "removed", "reshaped", "retyped"):
        assert getattr(err, kind) == changes.get(kind, ()), kind
        if kind in changes:
            assert f"1 {kind}: {changes[kind][0]}" in str(err)
    assert f"version {target}" in str(err) and "nothing was written" in str(err)
    assert not [op for op in store.ops if op.name == "get_range"]
    after = snapshot(tensors)
    assert all(np.array_equal(after[n], before[n]) for n in before)
    assert sub.version == held and sub.tensors is tensors


def test_table_changed_lists_a_few_names_and_counts(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    old = {f"w{i:02d}": rand(g, (4,), torch.float32) for i in range(12)}
    new = {f"x{i:02d}": rand(g, (4,), torch.float32) for i in range(9)}
    pub = Publisher(tmp_path / "s")
    pub.publish(old, version=1)
    pub.publish(new, version=2)
    sub = Subscriber(tmp_path / "s", tensors={n: t.clone() for n, t in old.items()}, version=1)
    with pytest.raises(TableChangedError) as info:
        sub.sync()
    msg = str(info.value)
    assert "9 added: x00, x01, x02, x03, x04, +4 more" in msg
    assert "12 removed: w00, w01, w02, w03, w04, +7 more" in msg
    assert len(info.value.added) == 9 and len(info.value.removed) == 12


def test_preallocated_buffers_raise_table_changed_after_their_first_sync(
    table_store: Path, states: list[Tensors]
) -> None:
    bufs = {n: torch.empty_like(t) for n, t in states[2].items()}
    sub = Subscriber(table_store, tensors=bufs)
    sub.sync(2)
    assert_exact(states[2], bufs)
    with pytest.raises(TableChangedError, match="1 removed: b"):
        sub.sync(3)
    assert_exact(states[2], bufs)


@pytest.mark.parametrize("layout", [None, ["a"]], ids=["own", "own+layout"])
def test_self_allocating_subscriber_follows_table_changes(
    table_store: Path, states: list[Tensors], layout: list[str] | None
) -> None:
    sub = Subscriber(table_store, layout=Layout.identity(layout) if layout else None)
    for v in (1, 2, 3, 4, 6, 7, 8):
        report = sub.sync(v)
        assert report.version == v and sub.version == v
        want = states[v] if layout is None else {n: states[v][n] for n in layout}
        assert_exact(want, sub.tensors)
    sub.verify()


@pytest.mark.parametrize("layout", [None, ["a"]], ids=["own", "own+layout"])
def test_a_failed_reallocation_keeps_the_old_tensors(
    table_store: Path,
    states: list[Tensors],
    monkeypatch: pytest.MonkeyPatch,
    layout: list[str] | None,
) -> None:
    """A subscriber that allocated its tensors fills new ones for a new table; when that
    fails, it still holds its old tensors, bit for bit, at their version."""
    sub = Subscriber(table_store, layout=Layout.identity(layout) if layout else None)
    sub.sync(2)
    held = sub.tensors
    before = snapshot(held)
    with monkeypatch.context() as m:
        fail_decode(m, 4)
        with pytest.raises(InjectedFault):
            sub.sync(4)
    assert sub.version == 2 and sub.tensors is held
    assert all(np.array_equal(snapshot(held)[n], before[n]) for n in before)
    sub.sync(4)
    assert_exact(states[4] if layout is None else {"a": states[4]["a"]}, sub.tensors)


# --- point 3: a receiver whose state left the chain -----------------------------------------


def chain_states(seed: int = 9) -> tuple[list[Tensors], Tensors, list[Tensors]]:
    """The shared v1-v4, the loser's v5, and the winner's v5-v8 (index = version)."""
    g = torch.Generator().manual_seed(seed)
    first = {"w": rand(g, (128, 32), torch.bfloat16), "n": torch.randn(64, generator=g)}
    shared = [{}, first]
    for _ in range(3):
        shared.append({k: nudge(g, t) for k, t in shared[-1].items()})
    loser = {k: nudge(g, t) for k, t in shared[4].items()}
    winner = list(shared)
    for _ in range(4):
        winner.append({k: nudge(g, t) for k, t in winner[-1].items()})
    return shared, loser, winner


class Fork:
    """A store where a publisher's v5 was committed, then the store was replaced by a
    winner's chain: ``same`` (the winner has its own v5 and v6 on it) or ``skip`` (the
    winner's v6 is a delta on v4; v5 is not in the store at all). Receivers hold the loser's
    v5: a folder, a self-allocating and an engine-owned subscriber."""

    def __init__(self, tmp: Path, how: str) -> None:
        shared, loser, winner = chain_states()
        self.store, self.winner = tmp / "store", winner
        won = tmp / "won"
        pub = Publisher(
            self.store, max_frame_bytes=2048, anchor_policy="never"
        )  # policy copies would change where recovery starts
        for v in range(1, 5):
            pub.publish(shared[v], version=v)
        shutil.copytree(self.store, won)
        pub.publish(loser, version=5)
        self.folder = tmp / "folder"
        pull_checkpoint(str(self.store), self.folder, version=4)
        pull_checkpoint(str(self.store), self.folder, version=5)
        self.own = Subscriber(self.store)
        self.own.sync(5)
        self.engine_tensors = {k: t.clone() for k, t in shared[4].items()}
        self.engine = Subscriber(self.store, tensors=self.engine_tensors, version=4)
        self.engine.sync(5)
        assert_exact(loser, self.engine_tensors)
        wpub = Publisher(won, max_frame_bytes=2048, anchor_policy="never")
        wpub.attach(shared[4], version=4)
        for v in (5, 6) if how == "same" else (6,):
            assert wpub.publish(winner[v], version=v).kind == "delta"
        shutil.rmtree(self.store)
        shutil.copytree(won, self.store)
        self.wpub = Publisher(self.store, max_frame_bytes=2048)
        self.wpub.attach(winner[6], version=6)

    def receivers(self) -> dict[str, Any]:
        return {
            "folder": lambda v: FolderSync(str(self.store), self.folder).pull(v),
            "own": self.own.sync,
            "engine": self.engine.sync,
        }

    def held(self, name: str) -> Any:
        if name == "folder":
            return load_folder(self.folder)
        return self.own.tensors if name == "own" else self.engine_tensors


@pytest.mark.parametrize("how", ["same", "skip"])
@pytest.mark.parametrize("receiver", ["folder", "own", "engine"])
def test_a_receiver_off_the_chain_recovers_from_an_anchor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, receiver: str
) -> None:
    fork = Fork(tmp_path, how)
    sync = fork.receivers()[receiver]
    with caplog.at_level(logging.WARNING, logger="deltastore"):
        report = sync(6)
    assert report.version == 6 and report.kind == "anchor" and report.applied[0] == 1
    assert_exact(fork.winner[6], fork.held(receiver))
    said = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "held version 5" in said and "anchor 1" in said, said
    if receiver == "folder":
        assert_folder(fork.folder, fork.store, fork.winner[6], 6)
    # it follows the store as usual from there
    fork.wpub.publish(fork.winner[7], version=7)
    caplog.clear()
    assert sync(7).applied == (7,)
    assert_exact(fork.winner[7], fork.held(receiver))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_folder_at_a_replaced_version_recovers_at_that_version(tmp_path: Path) -> None:
    """The target is the folder's version number, whose manifest now has another state.
    (A long-lived Subscriber trusts the manifest it cached for its own version; it finds the
    fork at the next version.)"""
    fork = Fork(tmp_path, "same")
    report = fork.receivers()["folder"](5)
    assert report.version == 5 and report.kind == "anchor"
    assert_folder(fork.folder, fork.store, fork.winner[5], 5)


@pytest.mark.parametrize("how", ["same", "skip"])
@pytest.mark.parametrize("receiver", ["folder", "own", "engine"])
def test_no_anchor_below_the_target_names_the_chain_then_a_new_anchor_helps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, receiver: str
) -> None:
    fork = Fork(tmp_path, how)
    (fork.store / manifest_key(1)).unlink()  # the only anchor is gone (pruned by hand)
    sync = fork.receivers()[receiver]
    before = snapshot(fork.held(receiver))
    folder_files = {p.name: p.read_bytes() for p in fork.folder.iterdir()}
    with pytest.raises(ChainError) as info:
        sync(6)
    msg = str(info.value)
    assert f"store {LocalStore(fork.store).url}" in msg, msg
    assert (
        "held version 5" in msg and "no anchor at or below 6" in msg and "publish an anchor" in msg
    )
    assert "folder" not in msg
    assert all(np.array_equal(snapshot(fork.held(receiver))[n], before[n]) for n in before)
    assert {p.name: p.read_bytes() for p in fork.folder.iterdir()} == folder_files
    fork.wpub.publish(fork.winner[7], version=7, anchor=True)
    with caplog.at_level(logging.WARNING, logger="deltastore"):
        report = sync(7)
    assert report.applied == (7,) and report.kind == "anchor"  # an anchor fits any state
    assert_exact(fork.winner[7], fork.held(receiver))


def test_cli_pull_of_a_folder_off_the_chain(tmp_path: Path) -> None:
    fork = Fork(tmp_path, "skip")
    result = runner.invoke(app, ["pull", str(fork.store), str(fork.folder)])
    assert result.exit_code == 0, result.output
    assert "pulled v6" in result.stdout
    assert "heldversion5" in "".join(result.stderr.split())
    assert_folder(fork.folder, fork.store, fork.winner[6], 6)
    (fork.store / manifest_key(1)).unlink()
    # a publisher that cannot find an anchor below its version writes an anchor copy with
    # its next delta (whatever its policy's budget), so fresh readers can start there again
    healed = fork.wpub.publish(fork.winner[7], version=7)
    assert healed.anchor_copy_bytes and "no anchor known" in str(healed.anchor_reason)
    (fork.store / anchor_key(7)).unlink()
    shutil.rmtree(fork.folder)
    # without it, a fresh folder has nothing to recover: the missing anchor is the store's
    result = runner.invoke(app, ["pull", str(fork.store), str(fork.folder)])
    assert result.exit_code != 0
    assert "publishananchor" in "".join(result.stderr.split())
