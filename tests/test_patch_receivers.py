"""Receivers of ``xor-patch`` frames (format edition 4): a plain Subscriber, the layout sync (whole
tensors, column and row shards with a replicated tensor: the per-element, dense-mask and
new-word-range paths) and the deep replay of ``deltastore verify`` apply versions whose frames
are rewritten as ``xor-patch`` bit-exactly, including absolute entries equal to the old word
and whole frames of absolute entries; damage is caught by the checksums; a reader that does
not know the codec refuses the version by name before fetching a frame."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import deltastore.sync.routing
import deltastore.sync.stage
import deltastore.tensors.words
from deltastore import (
    FrameError,
    IntegrityError,
    Layout,
    ManifestError,
    Publisher,
    Subscriber,
    shard,
)
from deltastore.format import codecs
from deltastore.format.codecs import XOR_PATCH, FrameEncoder
from deltastore.format.manifest import LATEST_KEY, manifest_key, parse_manifest
from deltastore.maintenance.verify import verify_store
from deltastore.store.local import LocalStore

SHAPE = (64, 512)  # 32 Ki bf16 elements: frames of 4 Ki elements


def state0() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": (torch.randn(SHAPE, generator=g) * 0.02).to(torch.bfloat16),
        "norm": torch.randn(SHAPE[1], generator=g).to(torch.bfloat16),
    }


def step(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """Flip the low bit of ``fraction`` of the elements of every tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    for t in out.values():
        flat = t.view(torch.int16).view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[: int(flat.numel() * fraction)]] ^= 1
    return out


def words(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).view(-1).numpy().view(np.uint16)


def patch_version(
    root: Path,
    version: int,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    seed: int,
    whole: str = "w",
) -> dict[str, int]:
    """Rewrite every frame of committed delta ``version`` as ``xor-patch``: per frame, the
    changed elements (30% of them as absolute new words, the others as XOR masks) plus 2% of
    the unchanged ones as absolute words equal to the old; the first frame of ``whole`` wholly
    absolute (positions 0..n-1, as a writer that does not know the old words sends it).
    Written into a new data object; the manifest's ``changed`` counts entries. Returns the
    count of absolute entries equal to the old word, by tensor."""
    key = manifest_key(version)
    doc = json.loads((root / key).read_bytes())
    rng = np.random.default_rng(seed)
    enc = FrameEncoder()
    blob = bytearray()
    obj = f"versions/{version:020d}/{doc['writer']['token'][:12]}-900000.dsz"
    same: dict[str, int] = {}
    for name, t in doc["tensors"].items():
        o_all, n_all = words(old[name]), words(new[name])
        same[name] = 0
        for i, f in enumerate(t["frames"]):
            o, nw = o_all[f["start"] : f["stop"]], n_all[f["start"] : f["stop"]]
            n = o.size
            if name == whole and i == 0:
                pos, absolute = np.arange(n), np.ones(n, np.bool_)
            else:
                diff = o != nw
                pos = np.flatnonzero(diff | (rng.random(n) < 0.02))
                absolute = ~diff[pos] | (rng.random(pos.size) < 0.3)
            same[name] += int(np.count_nonzero(o[pos] == nw[pos]))
            data = enc.xor_patch(pos, np.where(absolute, nw[pos], o[pos] ^ nw[pos]), absolute)
            f |= {
                "codec": XOR_PATCH,
                "object": obj,
                "offset": len(blob),
                "length": len(data),
                "xxh3": xxhash.xxh3_64_hexdigest(data),
                "changed": int(pos.size),
            }
            blob += data
        t["changed"] = sum(f["changed"] for f in t["frames"])
    (root / obj).write_bytes(bytes(blob))
    write_manifest(root, version, doc)
    return same


def write_manifest(root: Path, version: int, doc: dict[str, Any]) -> None:
    """Commit the edited manifest ``doc`` in place (checked by the format's parser), and the
    LATEST hint's SHA-256 with it when the hint names this version."""
    body = parse_manifest(json.dumps(doc).encode()).to_bytes()
    (root / manifest_key(version)).write_bytes(body)
    latest = json.loads((root / LATEST_KEY).read_bytes())
    if latest["version"] == version:
        latest["sha256"] = hashlib.sha256(body).hexdigest()
        (root / LATEST_KEY).write_text(json.dumps(latest, separators=(",", ":")))


def publish_chain(root: Path) -> list[dict[str, torch.Tensor]]:
    """Versions 0 (anchor) to 3: v1 sparse, v2 dense (30% changed: XOR parts staged as mask
    ranges), v3 sparse; versions 1 to 3 rewritten as ``xor-patch``."""
    pub = Publisher(root, max_frame_bytes=8192, anchor_policy="never")
    states = [state0()]
    for v, fraction in enumerate((0.02, 0.3, 0.05), start=1):
        states.append(step(states[-1], fraction, v))
    for v, state in enumerate(states):
        pub.publish(state, version=v)
    for v in range(1, len(states)):
        same = patch_version(root, v, states[v - 1], states[v], seed=v)
        assert sum(same.values()) > 1000  # absolute entries equal to the old word occur
    return states


def layouts() -> dict[str, tuple[Layout | None, Any]]:
    """No layout (the local path); whole tensors; a column split (no runs: element-wise); a
    row split (one run per rank) with a replicated norm (copies counted 2)."""

    def cols(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"r{r}.w": s["w"].chunk(2, 1)[r] for r in range(2)} | {"norm": s["norm"]}

    def rows(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"r{r}.w": s["w"].chunk(2, 0)[r] for r in range(2)} | {
            f"r{r}.norm": s["norm"] for r in range(2)
        }

    return {
        "plain": (None, dict),
        "whole": (Layout({"w": "w", "norm": "norm"}), dict),
        "cols": (
            Layout({f"r{r}.w": shard("w", 1, r, 2) for r in range(2)} | {"norm": "norm"}),
            cols,
        ),
        "rows": (
            Layout(
                {f"r{r}.w": shard("w", 0, r, 2) for r in range(2)}
                | {f"r{r}.norm": "norm" for r in range(2)}
            ),
            rows,
        ),
    }


def equal_bits(got: Any, want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(
        torch.equal(got[n].view(torch.int16), t.contiguous().view(torch.int16))
        for n, t in want.items()
    )


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("patch-chain")
    return root, publish_chain(root)


def copy_of(chain: tuple[Path, Any], tmp_path: Path) -> Path:
    shutil.copytree(chain[0], tmp_path / "s")
    return tmp_path / "s"


@pytest.mark.parametrize("layout", ["plain", "whole", "cols", "rows"])
def test_xor_patch_versions_apply_bit_exact(
    chain: tuple[Path, list[dict[str, torch.Tensor]]],
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
) -> None:
    root, states = chain
    lay, local = layouts()[layout]
    ranges: list[int] = []
    real = deltastore.sync.routing.route_range

    def spy(*args: Any, **kwargs: Any) -> None:
        ranges.append(args[4].size)
        real(*args, **kwargs)

    monkeypatch.setattr(deltastore.sync.routing, "route_range", spy)
    staged: list[bool] = []  # the local path: each frame's update positions are ascending
    real_narrow = deltastore.tensors.words.narrow

    def ascending(pos: np.ndarray, numel: int) -> np.ndarray:
        staged.append(bool(np.all(np.diff(pos) > 0)))
        return real_narrow(pos, numel)

    monkeypatch.setattr(deltastore.sync.stage, "narrow", ascending)
    sub = Subscriber(root, layout=lay)
    for v, state in enumerate(states):
        assert sub.sync(version=v).version == v
        assert equal_bits(sub.tensors, local(state)), f"version {v}"
    if layout != "plain":  # the absolute first frame of w traveled as a range of new words
        assert 4096 in ranges
    else:
        assert staged and all(staged)


def test_a_fresh_subscriber_replays_the_chain_to_the_newest(
    chain: tuple[Path, list[dict[str, torch.Tensor]]],
) -> None:
    root, states = chain
    sub = Subscriber(root)
    assert sub.sync().version == len(states) - 1
    assert equal_bits(sub.tensors, states[-1])


def test_deep_verify_replays_xor_patch_frames(
    chain: tuple[Path, list[dict[str, torch.Tensor]]],
) -> None:
    report = verify_store(chain[0], deep=True)
    assert report.ok, report.problems
    assert report.tensors_checked == 2 * len(chain[1])


def damage_absolute_word(root: Path, version: int) -> None:
    """Rewrite the first frame of ``w`` (all absolute) of ``version`` with one new word's low
    bit flipped, frame checksums left as they were."""
    key = manifest_key(version)
    doc = json.loads((root / key).read_bytes())
    f = doc["tensors"]["w"]["frames"][0]
    raw = (root / f["object"]).read_bytes()
    data = raw[f["offset"] : f["offset"] + f["length"]]
    (part,) = codecs.FrameDecoder().changes(XOR_PATCH, data, 4096, 2, 4096)
    bad = part.words.copy()
    bad[100] ^= 1
    data = FrameEncoder().xor_patch(np.arange(4096), bad, np.ones(4096, np.bool_))
    obj = f["object"].replace("-900000", "-900001")
    (root / obj).write_bytes(data)
    f |= {"object": obj, "offset": 0, "length": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}
    write_manifest(root, version, doc)


@pytest.mark.parametrize("layout", ["plain", "rows"])
def test_a_wrong_absolute_word_is_refused_and_nothing_written(
    chain: tuple[Path, list[dict[str, torch.Tensor]]], tmp_path: Path, layout: str
) -> None:
    root = copy_of(chain, tmp_path)
    damage_absolute_word(root, 2)
    lay, local = layouts()[layout]
    sub = Subscriber(root, layout=lay)
    sub.sync(version=1)
    with pytest.raises(IntegrityError):
        sub.sync(version=2)
    assert sub.version == 1 and equal_bits(sub.tensors, local(chain[1][1]))
    report = verify_store(root, deep=True)
    assert [p.kind for p in report.problems] == ["adler32"]
    assert report.problems[0].version == 2


def test_a_reader_without_the_codec_refuses_it_by_name_before_fetching(
    chain: tuple[Path, list[dict[str, torch.Tensor]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader of editions 1-3 (its codec table without ``xor-patch``) says "unknown frame
    codec 'xor-patch'" (upgrade deltastore) for version 1 and reads no data object of it."""
    root, states = chain
    sub = Subscriber(root)
    sub.sync(version=0)
    old = MappingProxyType({c: s for c, s in codecs.CODEC_TABLE.items() if c != XOR_PATCH})
    monkeypatch.setattr(codecs, "CODEC_TABLE", old)
    reads: list[str] = []
    real = LocalStore.get_range

    def spy(self: LocalStore, key: str, *args: Any) -> bytes:
        reads.append(key)
        return real(self, key, *args)

    monkeypatch.setattr(LocalStore, "get_range", spy)
    with pytest.raises(FrameError, match=r"unknown frame codec .xor-patch.*upgrade deltastore"):
        sub.sync(version=1)
    assert not [k for k in reads if k.startswith("versions/00000000000000000001/")]
    assert sub.version == 0 and equal_bits(sub.tensors, states[0])


def test_two_ranks_over_gloo_apply_xor_patch_versions_bit_exact(tmp_path: Path) -> None:
    """The engine layout of ``tests/test_distributed.py`` (TP shards, a fused QKV, a padded
    embedding) on two gloo ranks: absolute entries travel through the exchange as sparse new
    words and as ranges; every rank checks its tensors bit-wise against plain torch ops."""
    from tests.test_distributed import _publish, _spawn, versions

    store = LocalStore(tmp_path / "store")
    states = versions(4)
    _publish(store, states, tmp_path)
    for v in range(1, len(states)):
        patch_version(store.root, v, states[v - 1], states[v], seed=v, whole="up")
    assert XOR_PATCH in (store.root / manifest_key(1)).read_text()
    config = {"init": str(tmp_path / "pg"), "url": str(store.root), "options": None}
    results = _spawn(2, config | {"dir": str(tmp_path), "versions": len(states)})
    assert [r["threads"] for r in results] == [[], []]


def test_a_codec_of_a_newer_edition_is_named_when_the_manifest_is_parsed(
    chain: tuple[Path, list[dict[str, torch.Tensor]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a reader says about a codec its manifest model does not know (as deltastore 0.3.0
    would of an edition-5 codec): the codec by name and "upgrade", not "malformed", and no
    frame of that version is fetched."""
    root = copy_of(chain, tmp_path)
    doc = json.loads((root / manifest_key(2)).read_bytes())
    doc["tensors"]["norm"]["frames"][0]["codec"] = "xor-future"
    (root / manifest_key(2)).write_text(json.dumps(doc))
    sub = Subscriber(root)
    sub.sync(version=1)
    reads: list[str] = []
    real = LocalStore.get_range

    def spy(self: LocalStore, key: str, *args: Any) -> bytes:
        reads.append(key)
        return real(self, key, *args)

    monkeypatch.setattr(LocalStore, "get_range", spy)
    with pytest.raises(ManifestError, match=r"unknown frame codec 'xor-future'.*upgrade"):
        sub.sync(version=2)
    assert not [k for k in reads if k.startswith("versions/00000000000000000002/")]
    assert sub.version == 1 and equal_bits(sub.tensors, chain[1][1])
