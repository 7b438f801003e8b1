"""Crash consistency of sync (docs/guide.md): a pull into a checkpoint folder killed at
every stage, then a pull in a fresh process against the same folder.

Each kill runs in its own process: a helper process imports deltastore once and forks one
child per case; the child installs a hook that sends itself SIGKILL at the chosen point
(during a frame fetch, after a frame was decoded, after the version verified, halfway
through the n-th scatter of the write phase, before the sidecar is written, between the
sidecar's temp file and its rename, while the files of a new folder are created, and while a
repair writes) and runs ``FolderSync.pull``. The test then pulls again in-process and checks:

- the folder ends bit-exact at the target (loaded with safetensors, compared as integers),
  with the sidecar at the target and no marker or temp file left;
- where each tensor was found: an oracle compares the killed folder's tensors bit-wise with
  the published states and must agree with :class:`FolderRepair` (tensors at a version,
  tensors at none: rebuilt from the newest anchor at or below the target);
- a folder left consistent (kill before the write phase) needs no repair.

The number of kill points covered is printed at the end of the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from deltastore import Publisher
from deltastore.checkpoint.folders import PENDING, SIDECAR, FolderSync, pull_checkpoint, read_state
from deltastore.checkpoint.safetensors import CheckpointError, MappedCheckpoint, locate
from deltastore.checkpoint.state import STAGING
from deltastore.maintenance.verify import verify_checkout

ROOT = Path(__file__).parent.parent
Tensors = dict[str, torch.Tensor]
WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FRAME_BYTES = 8 << 10
SHAPES = {
    "model.embed_tokens.weight": (512, 64),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 128),
    "model.layers.1.input_layernorm.weight": (64,),
    "model.layers.1.mlp.up_proj.weight": (128, 64),
    "model.layers.1.mlp.down_proj.weight": (64, 128),
    "model.norm.weight": (64,),
    "lm_head.weight": (512, 64),
}
#: v1 anchor, v2-v4 deltas, v5 an anchor on v4, v6 a delta on v5.
ANCHORS = (1, 5)
VERSIONS = 6
KILLED = -signal.SIGKILL
covered: Counter[str] = Counter()

# --- data ---------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(WORD[t.element_size()]).numpy()


def make_states(
    shapes: dict[str, tuple[int, ...]],
    *,
    versions: int,
    seed: int,
    frozen: tuple[tuple[str, int], ...] = (),
) -> list[Tensors]:
    """``states[v]`` is version v (``states[0]`` unused): bf16 tensors of ``shapes`` and a
    float32 ``model.rotary.scale``; ~5% of the elements change per version, except the
    (name, version) pairs in ``frozen``."""
    g = torch.Generator().manual_seed(seed)
    first = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    first["model.rotary.scale"] = torch.randn(300, generator=g)
    states = [first, first]
    for v in range(2, versions + 1):
        nxt = {}
        for name, t in states[-1].items():
            mask = torch.rand(t.shape, generator=g) < 0.05
            step = (torch.randn(t.shape, generator=g) * 0.01).to(t.dtype)
            nxt[name] = t.clone() if (name, v) in frozen else torch.where(mask, t + step, t)
        states.append(nxt)
    return states


@pytest.fixture(scope="module")
def states() -> list[Tensors]:
    return make_states(SHAPES, versions=VERSIONS, seed=7, frozen=(("model.norm.weight", 4),))


@pytest.fixture(scope="module")
def store(states: list[Tensors], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("crash") / "store"
    pub = Publisher(path, max_frame_bytes=FRAME_BYTES)
    for v in range(1, VERSIONS + 1):
        rep = pub.publish(states[v], version=v, anchor=v in ANCHORS)
        assert rep.kind == ("anchor" if v in ANCHORS else "delta")
    return path


@pytest.fixture(scope="module")
def folders(store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Pristine folders pulled to v2, v3 and v4 (copied for each case)."""
    base = tmp_path_factory.mktemp("folders")
    out = {}
    for v in (2, 3, 4):
        pull_checkpoint(str(store), base / f"v{v}", version=v)
        out[v] = base / f"v{v}"
    return out


def load_folder(folder: Path) -> Tensors:
    out: Tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def assert_folder_at(folder: Path, states: list[Tensors], version: int) -> None:
    got = load_folder(folder)
    assert set(got) == set(states[version])
    for name, t in states[version].items():
        assert np.array_equal(bits(got[name]), bits(t)), name
    state = read_state(folder)
    assert state is not None and state.version == version
    assert not (folder / PENDING).exists()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == [SIDECAR]


def where(
    folder: Path, states: list[Tensors], candidates: tuple[int, ...]
) -> dict[str, int | None]:
    """The oracle: for each tensor of the folder, the newest candidate version it equals bit
    for bit (None: none of them)."""
    tensors = MappedCheckpoint(locate(folder)).tensors
    return {
        name: max(
            (v for v in candidates if np.array_equal(bits(t), bits(states[v][name]))),
            default=None,
        )
        for name, t in tensors.items()
    }


# --- the kill helper ----------------------------------------------------------------------


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def countdown(n: int) -> Callable[[], bool]:
    """A thread-safe counter: true at the n-th call."""
    lock, calls = threading.Lock(), [0]

    def hit() -> bool:
        with lock:
            calls[0] += 1
            return calls[0] == n

    return hit


def install(point: str, n: int) -> None:
    """Patch deltastore so that this process kills itself at ``point`` (n-th occurrence)."""
    import deltastore.checkpoint.folders as folders
    import deltastore.checkpoint.safetensors as checkpoint
    import deltastore.sync.fetch as pipeline
    import deltastore.tensors.words as words
    from deltastore.format.codecs import FrameDecoder

    hit = countdown(n)
    if point == "fetch":  # the n-th frame's bytes arrived, before they are checked
        get_range = pipeline.Fetcher.fetch

        def fetch(self: Any, f: Any, timer: Any, **kw: Any) -> bytes:
            if hit():
                self.store.get_range(f.object, f.offset, f.length)
                die()
            return get_range(self, f, timer, **kw)

        pipeline.Fetcher.fetch = fetch  # type: ignore[method-assign]
        buffer = pipeline.Fetcher._buffer  # a job's frames at once (the native batch path)

        def buffer_(self: Any, tasks: Any, timer: Any, span: Any) -> Any:
            got = buffer(self, tasks, timer, span)
            for _ in tasks:  # the n-th frame's bytes, as for a frame fetched alone
                if hit():
                    die()
            return got

        pipeline.Fetcher._buffer = buffer_  # type: ignore[method-assign]
    elif point == "decode":  # after the n-th frame was decoded (anchors: into the files)
        # the one codec dispatch: every receiver path decodes through these two, any codec
        changes, decode_into = FrameDecoder.changes, FrameDecoder.decode_into

        def changes_(self: Any, *a: Any) -> Iterator[Any]:
            yield from changes(self, *a)
            if hit():
                die()

        def decode_into_(self: Any, *a: Any) -> None:
            decode_into(self, *a)
            if hit():
                die()

        FrameDecoder.changes = changes_  # type: ignore[method-assign]
        FrameDecoder.decode_into = decode_into_  # type: ignore[method-assign]
        import deltastore.kernels.batch as native  # decodes a job's xor-sparse2 frames itself

        stage_batch = native.stage_batch

        def stage_batch_(*a: Any) -> Any:
            got = stage_batch(*a)
            if hit():
                die()
            return got

        native.stage_batch = stage_batch_
    elif point == "verified":  # every frame and tensor verified, nothing written yet
        write_all = words.write_all

        def write_phase(writes: Any, *a: Any) -> None:
            if hit():
                die()
            write_all(writes, *a)

        words.write_all = write_phase
    elif point in ("write", "repair"):  # the n-th scatter (or XOR write) writes half, then dies
        scatter = words.scatter

        def scatter_half(local: Any, positions: Any, values: Any) -> None:
            if hit():
                half = max(1, positions.size // 2)
                scatter(local, positions[:half], values[:half])
                die()
            scatter(local, positions, values)

        words.scatter = scatter_half
        xor_at = words.xor_at

        def xor_half(local: Any, positions: Any, masks: Any) -> None:
            if hit():
                half = max(1, positions.size // 2)
                xor_at(local, positions[:half], masks[:half])
                die()
            xor_at(local, positions, masks)

        words.xor_at = xor_half
        xor_all = words.xor_all

        def xor_all_half(writes: Any) -> None:
            for i, (local, positions, masks) in enumerate(writes):
                if hit():
                    xor_all(writes[:i])
                    half = max(1, positions.size // 2)
                    xor_at(local, positions[:half], masks[:half])
                    die()
            xor_all(writes)

        words.xor_all = xor_all_half
    elif point == "record":  # written and flushed, the sidecar not yet replaced
        write_state = folders._write_state

        def record(dest: Path, m: Any) -> None:
            if hit():
                die()
            write_state(dest, m)

        folders._write_state = record
    elif point == "rename":  # the sidecar's temp file is written, not yet renamed
        replace = os.replace

        def rename(src: Any, dst: Any, **kw: Any) -> None:
            if str(dst).endswith(SIDECAR) and hit():
                die()
            replace(src, dst, **kw)

        os.replace = rename  # type: ignore[assignment]
    elif point == "switch":  # a new table's files are complete; the n-th move into the folder
        replace = os.replace

        def move(src: Any, dst: Any, **kw: Any) -> None:
            replace(src, dst, **kw)
            if Path(src).parent.name == STAGING != Path(dst).parent.name and hit():
                die()

        os.replace = move  # type: ignore[assignment]
    elif point == "create":  # the marker exists, the first file is half created
        write_reserved = checkpoint._write_reserved

        def create(path: Path, head: bytes, data: int) -> None:
            if hit():
                path.write_bytes(b"\x10\x00\x00")
                die()
            write_reserved(path, head, data)

        checkpoint._write_reserved = create
    else:
        raise ValueError(point)


def child(case: dict[str, Any]) -> None:
    install(case["point"], case["n"])
    FolderSync(case["store"], case["dest"], **case.get("options", {})).pull(case["target"])


def serve() -> None:
    """Helper process: one JSON case per stdin line; fork a child per case, answer its
    exit status (``-9``: killed; 0: the pull finished; 3: it raised)."""
    for line in sys.stdin:
        case = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child(case)
            except BaseException:
                traceback.print_exc()
                code = 3
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)


@contextlib.contextmanager
def kill_server() -> Iterator[Callable[..., int]]:
    """The helper process (:func:`serve`) that forks one child per killed pull; yields
    ``run(store, dest, target, point, n=1, **options)`` -> the child's exit status (-9:
    killed; 0: the pull finished first); ``options`` (JSON values) go to the child's
    ``FolderSync`` (tests/test_soak.py passes its folder's ``reader_id`` and ``lease_ttl``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("DELTASTORE_SIGNING_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tests.test_crash_sync import serve; serve()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def run(store: Path, dest: Path, target: int, point: str, n: int = 1, **options: Any) -> int:
        case = {"store": str(store), "dest": str(dest), "target": target, "point": point, "n": n}
        case["options"] = options
        stdin.write(json.dumps(case) + "\n")
        stdin.flush()
        answer = stdout.readline()
        assert answer, "the helper process died"
        return int(json.loads(answer))

    try:
        yield run
    finally:
        stdin.close()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def killer() -> Iterator[Callable[..., int]]:
    with kill_server() as run:
        yield run


@pytest.fixture(scope="module", autouse=True)
def report_coverage(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    total = sum(covered.values())
    detail = ", ".join(f"{k} {v}" for k, v in sorted(covered.items()))
    line = f"sync kill points covered: {total} ({detail})"
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is not None and reporter is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)
    else:  # pragma: no cover - without the capture or terminal plugins
        print(line)


# --- the cases ----------------------------------------------------------------------------


@dataclass
class Crash:
    """The module's store, pristine folders, published states and the kill helper."""

    killer: Callable[..., int]
    store: Path
    folders: dict[int, Path]
    states: list[Tensors]
    tmp: Path

    def killed(self, start: int | None, target: int, point: str, n: int = 1) -> Path:
        """A copy of the folder at ``start`` (None: a new folder) whose pull to ``target``
        was killed at ``point`` (its n-th occurrence)."""
        dest = self.tmp / "dest"
        if start is not None:
            shutil.copytree(self.folders[start], dest)
        assert self.killer(self.store, dest, target, point, n) == KILLED, f"{point} #{n}"
        covered[point] += 1
        assert (dest / PENDING).exists()  # a pull was under way
        return dest

    def frames(self, version: int) -> int:
        """Scatters of the version's write phase: one per frame that changes something."""
        m = json.loads((self.store / "manifests" / f"{version:020d}.json").read_text())
        return sum(f["changed"] > 0 for t in m["tensors"].values() for f in t["frames"])

    def recover(self, dest: Path, target: int, candidates: tuple[int, ...]) -> FolderSync:
        """Pull the killed folder ``dest`` again in this process and check the result and
        the repair against the oracle. Returns the FolderSync that recovered."""
        try:
            found = where(dest, self.states, candidates)
        except CheckpointError:  # no file, or a half-created one
            found = {}
        recorded = read_state(dest)
        consistent = recorded is not None and all(
            np.array_equal(bits(t), bits(self.states[recorded.version][name]))
            for name, t in MappedCheckpoint(locate(dest)).tensors.items()
        )
        folder = FolderSync(str(self.store), dest)
        report = folder.pull(target)
        assert report.version == target
        assert_folder_at(dest, self.states, target)
        repair = folder.last_repair
        if consistent or not found:  # nothing to repair: a plain pull (or a new folder)
            assert repair is None
            return folder
        assert repair is not None
        assert (repair.target, repair.recorded) == (target, recorded.version if recorded else None)
        expected: dict[int | None, set[str]] = {}
        for name, v in found.items():
            expected.setdefault(v, set()).add(name)
        assert set(repair.rebuilt) == expected.pop(None, set())
        assert {v: set(names) for v, names in repair.found.items()} == expected
        if repair.rebuilt:
            assert repair.anchor == max(a for a in ANCHORS if a <= target)
            assert "inconsistent: rebuilt from anchor" in repair.summary()
            assert report.kind == "anchor" and repair.anchor in report.applied
        return folder


@pytest.fixture
def crash(
    killer: Callable[..., int],
    store: Path,
    folders: dict[int, Path],
    states: list[Tensors],
    tmp_path: Path,
) -> Crash:
    return Crash(killer, store, folders, states, tmp_path)


@pytest.mark.parametrize(
    ("point", "n"),
    [
        ("fetch", 1),
        ("fetch", 5),
        ("decode", 3),
        ("verified", 1),
        ("write", 1),
        ("write", 6),
        ("write", -1),  # the last scatter of the version
        ("record", 1),
        ("rename", 1),
    ],
)
def test_delta_pull_killed(crash: Crash, point: str, n: int) -> None:
    """A folder at v3 pulling the delta v4, killed at ``point``."""
    dest = crash.killed(3, 4, point, crash.frames(4) if n < 0 else n)
    folder = crash.recover(dest, 4, (3, 4))
    repair = folder.last_repair
    if point in ("fetch", "decode", "verified"):  # before the write phase: still a good v3
        assert repair is None
    elif point == "write":  # halfway through the n-th frame: that tensor is at no version
        assert repair is not None and len(repair.rebuilt) == 1
    else:  # the whole version was written; the sidecar was not
        assert repair is not None and set(repair.found) == {4} and not repair.rebuilt
        assert repair.summary() == "10 tensors already at v4"
    # the folder now follows the store as usual
    assert folder.pull(6).applied == (5, 6)
    assert_folder_at(dest, crash.states, 6)


@pytest.mark.parametrize(
    ("start", "target", "during", "applied"),
    [
        (2, 4, 4, (3, 4)),  # two deltas; killed in the second: the sidecar says v3
        (3, 6, 5, (5, 6)),  # the anchor v5 applied in place over v3, killed while written
        (3, 6, 6, (5, 6)),  # killed in the delta after it: the sidecar says v5
    ],
)
def test_catch_up_killed_in_a_later_version(
    crash: Crash, start: int, target: int, during: int, applied: tuple[int, ...]
) -> None:
    """A pull that applies several versions, killed in the middle of writing ``during``."""
    before = applied[: applied.index(during)]
    n = sum(crash.frames(v) for v in before) + crash.frames(during) // 2
    dest = crash.killed(start, target, "write", n)
    crash.recover(dest, target, (start, *applied))


def test_in_place_anchor_pull_killed(crash: Crash) -> None:
    """A folder at v4 applying the anchor v5 in place, killed halfway through its writes."""
    dest = crash.killed(4, 5, "write", crash.frames(5) // 2)
    repair = crash.recover(dest, 5, (4, 5)).last_repair
    assert repair is not None and repair.anchor == 5 and len(repair.rebuilt) == 1


@pytest.mark.parametrize(
    ("point", "n"),
    [
        ("create", 1),
        ("fetch", 3),
        ("decode", 4),
        ("record", 1),  # the anchor v1 is in the files, not yet recorded
        ("write", 3),  # v1 recorded, killed while writing v2
    ],
)
def test_new_folder_pull_killed(crash: Crash, point: str, n: int) -> None:
    """A new folder filled from the anchor v1 and brought to v4, killed at ``point``: the
    folder has the marker, files, and maybe no sidecar; the next pull resumes it."""
    dest = crash.killed(None, 4, point, n)
    repair = crash.recover(dest, 4, (1, 2, 3, 4)).last_repair
    if point == "record":
        assert repair is not None and set(repair.found) == {1}
        assert repair.summary() == "10 tensors at v1 advanced to v4"


def test_a_killed_repair_is_repaired(crash: Crash) -> None:
    """The pull that repairs a killed pull is killed too, while it writes."""
    dest = crash.killed(3, 4, "write", 2)
    assert crash.killer(crash.store, dest, 4, "repair", 2) == KILLED
    covered["repair"] += 1
    assert (dest / PENDING).exists()
    folder = FolderSync(str(crash.store), dest)
    folder.pull(4)
    assert_folder_at(dest, crash.states, 4)
    assert folder.last_repair is not None


def test_repair_is_reported_on_the_command_line(crash: Crash) -> None:
    from deltastore_cli import app

    dest = crash.killed(3, 4, "write", 2)
    broken = sorted(n for n, v in where(dest, crash.states, (3, 4)).items() if v is None)
    assert len(broken) == 1
    result = CliRunner().invoke(app, ["pull", str(crash.store), str(dest), "--version", "4"])
    assert result.exit_code == 0, result.output
    assert "pulled v4" in result.stdout
    said = "".join(result.stderr.split())  # rich may wrap the log line
    assert "".join(f"1 tensor ({broken[0]}) inconsistent: rebuilt from anchor v1".split()) in said
    assert_folder_at(dest, crash.states, 4)


def test_a_folder_changed_by_hand_is_refused_unless_repair_is_asked(crash: Crash) -> None:
    """No marker (no pull was interrupted): a mismatch is an error, and nothing is written;
    ``repair=True`` repairs it; ``repair=False`` refuses even an interrupted pull."""
    from deltastore.errors import TensorMismatchError

    dest = Path(shutil.copytree(crash.folders[3], crash.tmp / "dest"))
    store = str(crash.store)
    name = "model.layers.1.mlp.up_proj.weight"
    ck = MappedCheckpoint(locate(dest), writable=True)
    ck.tensors[name].view(torch.int16)[7] ^= 0x40
    ck.flush()
    before = (dest / "model.safetensors").read_bytes()
    with pytest.raises(TensorMismatchError, match=name):
        FolderSync(store, dest).pull(4)
    assert (dest / "model.safetensors").read_bytes() == before
    assert not (dest / PENDING).exists()
    (dest / PENDING).write_text("{}")
    with pytest.raises(TensorMismatchError, match=name):
        FolderSync(store, dest, repair=False).pull(4)
    (dest / PENDING).unlink()
    folder = FolderSync(store, dest, repair=True)
    folder.pull(4)
    assert_folder_at(dest, crash.states, 4)
    assert folder.last_repair is not None and folder.last_repair.rebuilt == (name,)


def test_a_repair_never_goes_back(crash: Crash) -> None:
    """A killed pull of v4 into a folder at v3, then a pull of v2: refused, nothing written;
    a pull of v3 (the recorded version) repairs the folder to v3."""
    from deltastore.errors import ChainError

    dest = crash.killed(3, 4, "write", 4)
    before = (dest / "model.safetensors").read_bytes()
    with pytest.raises(ChainError, match="newer than the requested 2"):
        FolderSync(str(crash.store), dest).pull(2)
    assert (dest / "model.safetensors").read_bytes() == before
    FolderSync(str(crash.store), dest).pull(3)
    assert_folder_at(dest, crash.states, 3)


# --- a pull to another tensor table, killed -------------------------------------------------


@pytest.fixture(scope="module")
def table_change(
    states: list[Tensors], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Tensors], Path]:
    """A store whose v1-v3 are the module's, v4 an anchor with another table (a tensor
    dropped, one added, one reshaped) and v5 a delta on it; and a pristine folder at v3."""
    g = torch.Generator().manual_seed(3)
    new = {n: t.clone() for n, t in states[3].items() if n != "model.layers.1.mlp.down_proj.weight"}
    new["model.extra.weight"] = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    new["model.norm.weight"] = torch.randn(128, generator=g).to(torch.bfloat16)
    later = {n: t.clone() for n, t in new.items()}
    later["model.extra.weight"].view(torch.int16)[::7] ^= 1
    tstates = [*states[:4], new, later]
    base = tmp_path_factory.mktemp("table")
    pub = Publisher(base / "store", max_frame_bytes=FRAME_BYTES)
    for v in range(1, 6):
        assert pub.publish(tstates[v], version=v).kind == ("delta" if v in (2, 3, 5) else "anchor")
    pull_checkpoint(str(base / "store"), base / "v3", version=3)
    return base / "store", tstates, base / "v3"


@pytest.mark.parametrize(
    ("point", "n", "committed"),
    [
        ("decode", 3, False),  # the new files are being filled beside the old ones
        ("record", 1, False),  # filled and flushed, their sidecar not written
        ("rename", 1, False),  # their sidecar's temp file written, not renamed
        ("switch", 1, True),  # the new file moved into the folder, not the sidecar
        ("switch", 2, True),  # the sidecar moved too; the marker and staging folder remain
    ],
)
def test_table_change_killed(
    killer: Callable[..., int],
    table_change: tuple[Path, list[Tensors], Path],
    tmp_path: Path,
    point: str,
    n: int,
    committed: bool,
) -> None:
    """A folder at v3 pulling v5 (another tensor table: the new files are built beside the
    old ones, then switched), killed at ``point``. Before the switch is committed the folder is
    still a valid, loadable v3; after it, the next pull finishes the switch. Either way the
    next pull ends at v5 with exactly v5's tensors and nothing else."""
    store, tstates, pristine = table_change
    dest = Path(shutil.copytree(pristine, tmp_path / "dest"))
    assert killer(store, dest, 5, point, n) == KILLED, f"{point} #{n}"
    covered[f"table {point}"] += 1
    assert (dest / PENDING).exists() and (dest / STAGING).exists()
    if not committed:  # untouched: loadable by safetensors and clean, at v3
        got = load_folder(dest)
        assert set(got) == set(tstates[3])
        for name, t in tstates[3].items():
            assert np.array_equal(bits(got[name]), bits(t)), name
        state = read_state(dest)
        assert state is not None and state.version == 3
        assert verify_checkout(dest, store).ok
    folder = FolderSync(str(store), dest)
    report = folder.pull(5)
    assert report.version == 5 and folder.last_repair is None
    assert_folder_at(dest, tstates, 5)
    assert sorted(p.name for p in dest.iterdir()) == sorted([SIDECAR, "model.safetensors"])
    assert verify_checkout(dest, store).ok
