"""The checkpoint-folder paths run without torch: ``publish``, ``pull``, ``gc``, ``verify`` and
the library's folder sync (``FolderSync``, ``pull_checkpoint``, ``publish_checkpoint``,
``watch_checkpoint``) hold host tensors (numpy words over memory maps), never torch's.

Each command runs in a subprocess whose ``torch`` cannot be imported (a ``torch`` package that
raises ImportError comes first on PYTHONPATH), on safetensors checkpoints written here with
torch (bfloat16, float16, float32, int64, bool; an empty tensor). Every pulled folder is
compared with the published checkpoint tensor by tensor, byte for byte (the files' bytes at
each tensor's data offsets, with its dtype and shape). The host-tensor layer itself is checked
in-process against torch tensors: the same memory, the same manifests, the same results.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from deltastore import Publisher, Subscriber
from deltastore.checkpoint.folders import PENDING, read_state
from deltastore.checkpoint.safetensors import MappedCheckpoint, create_checkpoint, locate
from deltastore.errors import TensorMismatchError
from deltastore.tensors import words
from deltastore.tensors.dtypes import flat_words, host_words, np_words
from deltastore.tensors.host import HostTensor
from tests.helpers import FORBIDDEN, console_script


def states() -> list[dict[str, torch.Tensor]]:
    """Four versions: v2 and v3 change a few elements of v1 (NaN payloads and -0.0 among
    them); v4 adds a tensor (another table)."""
    g = torch.Generator().manual_seed(7)
    v1 = {
        "emb": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "w": torch.randn(64, 96, generator=g),
        "h": torch.randn(50, generator=g).to(torch.float16),
        "step": torch.arange(10, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "none": torch.zeros(0, 4),
    }
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["emb"][3, :7] += 1
    v2["emb"].view(torch.int16)[100] = 0x7FC1  # a NaN with a payload
    v2["w"][5, 5] = -0.0
    v2["step"] += 1
    v3 = {n: t.clone() for n, t in v2.items()}
    v3["w"][:, 2] *= 3
    v3["mask"][0] = ~v3["mask"][0]
    v4 = {n: t.clone() for n, t in v3.items()} | {"extra": torch.ones(7, dtype=torch.bfloat16)}
    return [v1, v2, v3, v4]


def tensor_bytes(src: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Each tensor of a checkpoint file or folder: dtype, shape and its bytes in the file."""
    out = {}
    for name, loc in locate(src).items():
        with open(loc.path, "rb") as fh:
            fh.seek(loc.start)
            out[name] = (loc.dtype, loc.shape, fh.read(loc.stop - loc.start))
    return out


def run(env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [console_script(), *map(str, args)], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, (args, result.returncode, result.stdout, result.stderr)
    assert FORBIDDEN not in result.stderr and "Traceback" not in result.stderr, result.stderr
    return result


def kinds(store: Path) -> dict[int, str]:
    sub = Subscriber(str(store), lease_ttl=None)
    return {v: sub.manifest(v).kind for v in sub.versions()}


def test_cli_publish_pull_gc_verify_without_torch(no_torch: dict[str, str], tmp_path: Path) -> None:
    ck = []
    for i, state in enumerate(states()):
        ck.append(tmp_path / f"ck{i + 1}" / "model.safetensors")
        ck[-1].parent.mkdir()
        save_file(state, ck[-1], metadata={"format": "pt"})
    store, dest = tmp_path / "store", tmp_path / "dest"
    # an anchor, a delta on --parent, a pull into a new folder
    run(no_torch, "publish", store, ck[0], "--version", "1")
    run(no_torch, "publish", store, ck[1].parent, "--version", "2", "--parent", ck[0])
    run(no_torch, "pull", store, dest)
    assert tensor_bytes(dest) == tensor_bytes(ck[1])
    state = read_state(dest)
    assert state is not None and state.version == 2
    # a delta on the publisher's saved state (no --parent), an update pull, a no-op pull
    run(no_torch, "publish", store, ck[2], "--version", "3")
    assert kinds(store) == {1: "anchor", 2: "delta", 3: "delta"}
    inode = (dest / "model.safetensors").stat().st_ino
    run(no_torch, "pull", store, dest)
    assert tensor_bytes(dest) == tensor_bytes(ck[2])
    assert (dest / "model.safetensors").stat().st_ino == inode  # written in place
    noop = run(no_torch, "pull", store, dest, "--json")
    assert json.loads(noop.stdout)["version"] == 3 and tensor_bytes(dest) == tensor_bytes(ck[2])
    # another table: an anchor, and the folder rebuilt beside the old files
    run(no_torch, "publish", store, ck[3], "--version", "4")
    run(no_torch, "pull", store, dest)
    assert tensor_bytes(dest) == tensor_bytes(ck[3])
    assert kinds(store)[4] == "anchor"
    # gc, verify of the store and of the folder (against its sidecar, and the store)
    shutil.rmtree(store / "leases")  # the pulls' leases would keep their versions
    run(no_torch, "gc", store, "--keep", "1", "--orphans", "--min-age", "0")
    assert sorted(kinds(store)) == [4]
    run(no_torch, "verify", store)
    run(no_torch, "verify", "--checkout", dest)
    run(no_torch, "verify", "--checkout", dest, store)
    assert tensor_bytes(dest) == tensor_bytes(ck[3])


LIBRARY = """
import sys, threading
from pathlib import Path
import numpy as np
from deltastore.checkpoint import (
    FolderSync, publish_checkpoint, pull_checkpoint, read_state, watch_checkpoint,
)
from deltastore.checkpoint.safetensors import locate

root = Path(sys.argv[1])
store, ck = str(root / "store"), [root / f"ck{i}" for i in (1, 2, 3)]
assert publish_checkpoint(store, ck[0], version=1, state_dir=root / "state").kind == "anchor"
rep = publish_checkpoint(store, ck[1], version=2, parent=ck[0], state_dir=root / "state2")
assert rep.kind == "delta", rep
assert pull_checkpoint(store, root / "a").version == 2
folder = FolderSync(store, root / "b")
assert folder.pull(1).version == 1 and folder.pull().version == 2
# a tensor changed by hand: rebuilt by a repair (a subscriber over just that tensor)
loc = locate(root / "b")["emb"]
data = np.memmap(loc.path, dtype=np.uint8, mode="r+")
data[loc.start + 5] ^= 0x10
data.flush()
del data
repaired = FolderSync(store, root / "b", repair=True)
assert repaired.pull(2).version == 2
assert repaired.last_repair is not None and repaired.last_repair.rebuilt == ("emb",)
assert publish_checkpoint(store, ck[2], version=3, state_dir=root / "state2").kind == "delta"
stop = threading.Event()
seen = []
def on_report(report):
    seen.append(report.version)
    stop.set()
watch_checkpoint(store, root / "a", interval=0.05, stop=stop, on_report=on_report)
assert seen == [3] and read_state(root / "a").version == 3
assert "torch" not in sys.modules
print("ok")
"""


def test_library_folder_sync_without_torch(no_torch: dict[str, str], tmp_path: Path) -> None:
    for i, state in enumerate(states()[:3]):
        (tmp_path / f"ck{i + 1}").mkdir()
        save_file(state, tmp_path / f"ck{i + 1}" / "model.safetensors")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LIBRARY), str(tmp_path)],
        env=no_torch,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    for dest, version in (("a", 3), ("b", 2)):
        assert tensor_bytes(tmp_path / dest) == tensor_bytes(tmp_path / f"ck{version}"), dest
        assert not (tmp_path / dest / PENDING).exists()


# --- the host-tensor layer, in-process, against torch -------------------------------------


def test_mapped_checkpoint_host_and_torch_views_share_the_files_memory(tmp_path: Path) -> None:
    src = states()[0]
    save_file(src, tmp_path / "m.safetensors")
    path = tmp_path / "m.safetensors"
    ck = MappedCheckpoint(locate(path), writable=True)
    for name, t in src.items():
        host = ck.host[name]
        assert (host.dtype, host.shape) == (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        assert host.words.tobytes() == np_words(t.contiguous()).tobytes(), name
        assert ck.tensors[name].dtype == t.dtype and ck.tensors[name].shape == t.shape
    ck.host["step"].words[2] = 99  # through the host words: seen by torch and in the file
    assert int(ck.tensors["step"][2]) == 99
    ck.tensors["w"][0, 0] = 2.5  # and the other way round
    assert ck.host["w"].words[0] == np.float32(2.5).view(np.uint32)
    ck.flush()
    assert tensor_bytes(path)["step"][2][16:24] == (99).to_bytes(8, "little")


def test_publish_host_tensors_writes_the_same_versions_as_torch_tensors(tmp_path: Path) -> None:
    v = states()[:3]
    hosts = []
    for i, state in enumerate(v):
        save_file(state, tmp_path / f"{i}.safetensors")
        hosts.append(MappedCheckpoint(locate(tmp_path / f"{i}.safetensors")).host)
    a, b = Publisher(tmp_path / "a"), Publisher(tmp_path / "b")
    for i in range(3):
        ra = a.publish(v[i], version=i + 1)
        rb = b.publish(hosts[i], version=i + 1)
        assert (ra.kind, ra.changed_elements) == (rb.kind, rb.changed_elements)
    sa, sb = Subscriber(str(tmp_path / "a")), Subscriber(str(tmp_path / "b"))
    for version in (1, 2, 3):
        ma, mb = sa.manifest(version), sb.manifest(version)
        assert ma.state_digest == mb.state_digest and ma.kind == mb.kind
    # attach accepts host tensors too, checked against the head manifest
    c = Publisher(tmp_path / "b")
    assert c.attach(hosts[2]) == 3
    with pytest.raises(TensorMismatchError):
        Publisher(tmp_path / "b").attach(hosts[1])


def test_subscriber_keeps_host_tensors_in_sync_in_place(tmp_path: Path) -> None:
    v = states()[:3]
    pub = Publisher(tmp_path / "s")
    for i, state in enumerate(v):
        pub.publish(state, version=i + 1)
    table = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in v[0].items()}
    ck = MappedCheckpoint(create_checkpoint(tmp_path / "f", table), writable=True)
    words_before = {n: t.words for n, t in ck.host.items()}
    sub = Subscriber(str(tmp_path / "s"), tensors=ck.host)
    assert sub.sync(1).kind == "anchor"
    sub.verify()
    assert sub.sync().version == 3
    assert sub.tensors is ck.host and all(ck.host[n].words is w for n, w in words_before.items())
    for name, t in v[2].items():
        assert ck.host[name].words.tobytes() == np_words(t).tobytes(), name
    ck.flush()
    assert {n: b for n, (_, _, b) in tensor_bytes(tmp_path / "f").items()} == {
        n: np_words(t).tobytes() for n, t in v[2].items()
    }


def test_host_words_gather_and_scatter_like_torch() -> None:
    rng = np.random.default_rng(3)
    t = torch.from_numpy(rng.integers(0, 1 << 16, 1000, dtype=np.uint16).view(np.int16))
    host = HostTensor(np_words(t).copy(), "bfloat16", (10, 100))
    ttensor = t.view(torch.bfloat16).reshape(10, 100)
    assert flat_words(host) is host.words and host_words(host) is host.words
    at = np.sort(rng.choice(1000, 37, replace=False)).astype(np.int64)
    wdt = np.dtype(np.uint16)
    tw = flat_words(ttensor)
    assert np.array_equal(words.gather(host.words, at, wdt), words.gather(tw, at, wdt))
    assert np.array_equal(
        words.gather_range(host.words, 10, 20, wdt), words.gather_range(tw, 10, 20, wdt)
    )
    values = rng.integers(0, 1 << 16, at.size, dtype=np.uint16)
    for positions in (at, at.astype(np.int32), words.compact(at)):
        h = host.words.copy()
        words.scatter(h, positions, values)
        c = tw.clone()
        words.scatter(c, positions, values)
        assert np.array_equal(h, np_words(c)), positions.dtype
    words.scatter_range(host.words, 5, values[:4])
    words.scatter_range(tw, 5, values[:4])
    assert np.array_equal(host.words, np_words(tw))
    assert host.torch().dtype == torch.bfloat16 and host.torch().shape == (10, 100)


def test_host_tensor_refuses_words_that_do_not_fit() -> None:
    with pytest.raises(TensorMismatchError, match="uint16"):
        HostTensor(np.zeros(6, dtype=np.uint8), "bfloat16", (6,))
    with pytest.raises(TensorMismatchError, match="one per"):
        HostTensor(np.zeros(5, dtype=np.uint16), "bfloat16", (2, 3))
    with pytest.raises(TensorMismatchError, match="contiguous"):
        HostTensor(np.zeros(12, dtype=np.uint32)[::2], "float32", (6,))
    assert HostTensor.zeros("int64", (2, 3)).numel() == 6
