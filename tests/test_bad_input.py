"""Damaged stores and wrong tensors: every sync fails with a typed error and writes nothing.

Each test publishes an anchor (v1) and a delta (v2) of a small bf16 model whose big tensor
spans several frames, syncs a subscriber to v1, damages the store (or the tensors), and checks
that ``sync()`` raises the expected :class:`DeltastoreError` subclass, that the subscriber
stays at version 1 with tensors bit-wise equal to their v1 values, and (where the damage can
be undone) that the same tensors still reach v2 bit-exactly once the store is repaired.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deltastore.tensors.words as words_module
from deltastore import Publisher, Subscriber
from deltastore.errors import (
    ChainError,
    DeltastoreError,
    FrameError,
    IntegrityError,
    InvalidKeyError,
    ManifestError,
    ObjectNotFoundError,
    TensorMismatchError,
    UnsupportedFormatError,
    WrongParentError,
)
from deltastore.format.checksum import adler32
from deltastore.format.codecs import CodecSet
from deltastore.format.manifest import manifest_key, state_digest
from deltastore.store.base import validate_key
from deltastore.tensors.dtypes import np_words

SHAPES: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (1000, 300),  # 300k elements, ~10 frames of 64 KiB
    "model.layers.0.self_attn.q_proj.weight": (256, 256),  # 2 frames
    "model.layers.0.input_layernorm.weight": (256,),
    "model.layers.1.mlp.down_proj.weight": (128, 130),
    "lm_head.bias": (7,),
}
BIG = "model.embed_tokens.weight"
MAX_FRAME_BYTES = 64 * 1024
DamageFn = Callable[["World"], None]


# --- model, store and subscriber ---------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16)


def clone_bits(tensors: Any) -> dict[str, torch.Tensor]:
    return {name: bits(t).clone() for name, t in tensors.items()}


def assert_bits(expected: dict[str, torch.Tensor], tensors: Any) -> None:
    assert tensors is not None
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        got = tensors[name]
        assert got.dtype == torch.bfloat16, name
        assert torch.equal(bits(got), want), f"{name} is not bit-wise equal"


def make_versions() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """v1: random bf16 weights; v2: ~2% of the elements of every tensor change bit-wise."""
    gen = torch.Generator().manual_seed(1234)
    v1 = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    v1["lm_head.bias"].view(torch.int16)[:] = torch.tensor(
        [0x0000, -0x8000, 0x7FC0, 0x7F81, 0x0001, 0x7F80, -0x0080], dtype=torch.int16
    )  # +0, -0, NaN, NaN with payload, subnormal, +inf, -inf
    v2 = {}
    for name, t in v1.items():
        words = bits(t).clone().reshape(-1)
        hit = torch.rand(words.numel(), generator=gen) < 0.02
        hit[0] = True
        words[hit] ^= torch.randint(1, 8, (int(hit.sum()),), generator=gen, dtype=torch.int16)
        v2[name] = words.view(torch.bfloat16).reshape(t.shape)
    return v1, v2


@dataclass
class Template:
    store: Path
    v1: dict[str, torch.Tensor]
    v2: dict[str, torch.Tensor]


def make_template(tmp_path_factory: pytest.TempPathFactory, codecs: CodecSet) -> Template:
    store = tmp_path_factory.mktemp(f"template-{codecs}") / "store"
    v1, v2 = make_versions()
    pub = Publisher(store, max_frame_bytes=MAX_FRAME_BYTES, max_object_bytes=4096, codecs=codecs)
    assert pub.publish(v1, version=1).kind == "anchor"
    report = pub.publish(v2, version=2)
    assert report.kind == "delta"
    assert 0 < report.changed_elements < report.total_elements
    return Template(store, v1, v2)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """Publish v1 and v2 once with the 0.1.0 codecs (``raw`` anchor, ``xor-sparse`` and
    ``xor-dense`` frames, which the tests below target by name); every test works on its own
    copy of this store."""
    return make_template(tmp_path_factory, "v1")


@pytest.fixture(scope="module")
def template_v2(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """The same versions published with the 0.2.0 codecs (the publisher's default:
    ``raw-planes`` anchor frames, ``xor-sparse2`` delta frames)."""
    return make_template(tmp_path_factory, "v2")


@dataclass
class World:
    store: Path
    template: Template
    sub: Subscriber
    clone: dict[str, torch.Tensor]  # bits of the subscriber's tensors at v1

    def manifest_json(self, version: int) -> dict[str, Any]:
        return json.loads((self.store / manifest_key(version)).read_text())

    def write_manifest(self, version: int, obj: dict[str, Any], *, fix_digest: bool) -> None:
        """Rewrite a committed manifest in place; ``fix_digest`` keeps state_digest consistent
        with the (edited) tensor table, so only the damage under test is wrong."""
        if fix_digest:
            obj["state_digest"] = state_digest(
                (n, t["dtype"], t["shape"], t["adler32"]) for n, t in obj["tensors"].items()
            )
        (self.store / manifest_key(version)).write_text(json.dumps(obj, indent=1))

    def edit_manifest(
        self, version: int, edit: Callable[[dict[str, Any]], None], *, fix_digest: bool = True
    ) -> None:
        obj = self.manifest_json(version)
        edit(obj)
        self.write_manifest(version, obj, fix_digest=fix_digest)

    def frames(self, version: int, name: str = BIG) -> list[dict[str, Any]]:
        frames: list[dict[str, Any]] = self.manifest_json(version)["tensors"][name]["frames"]
        return frames

    def data_path(self, key: str) -> Path:
        return self.store / key

    def repair(self) -> None:
        shutil.rmtree(self.store)
        shutil.copytree(self.template.store, self.store)


def make_world(template: Template, tmp_path: Path) -> World:
    store = tmp_path / "store"
    shutil.copytree(template.store, store)
    sub = Subscriber(store, max_workers=3)
    assert sub.sync(1).version == 1
    assert_bits(clone_bits(template.v1), sub.tensors)
    return World(store, template, sub, clone_bits(sub.tensors))


@pytest.fixture
def world(template: Template, tmp_path: Path) -> World:
    return make_world(template, tmp_path)


@pytest.fixture
def world_v2(template_v2: Template, tmp_path: Path) -> World:
    return make_world(template_v2, tmp_path)


def expect_sync_error(
    world: World, errors: type[Exception] | tuple[type[Exception], ...], *words: str
) -> DeltastoreError:
    """sync() raises one of ``errors``, a DeltastoreError whose message names one of
    ``words``; the subscriber is still at v1 with its v1 bits."""
    with pytest.raises(errors) as info:
        world.sub.sync()
    err = info.value
    assert isinstance(err, DeltastoreError)
    message = str(err)
    assert message.strip()
    assert any(w.lower() in message.lower() for w in words), message
    assert world.sub.version == 1
    assert_bits(world.clone, world.sub.tensors)
    return err


def assert_reaches_v2_after_repair(world: World, *, same_subscriber: bool) -> None:
    """Once the store is repaired the tensors left behind still reach v2 bit-exactly.

    Manifests are immutable once committed, so a subscriber may cache one it parsed; after a
    manifest was damaged the check uses a new subscriber attached to the same tensors (which
    also re-verifies that they are exactly at v1)."""
    world.repair()
    sub = world.sub
    if not same_subscriber:
        assert sub.tensors is not None
        sub = Subscriber(world.store, tensors=sub.tensors, version=1)
    assert sub.sync().version == 2
    assert_bits(clone_bits(world.template.v2), sub.tensors)


# --- damaged data objects ------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["header", "middle", "last", "small-tensor"])
def test_flipped_byte_in_frame(world: World, where: str) -> None:
    if where == "small-tensor":
        frame = world.frames(2, "lm_head.bias")[0]
        offset = frame["offset"] + frame["length"] // 2
    else:
        frames = world.frames(2)
        frame = frames[len(frames) // 2]
        offset = (
            frame["offset"]
            + {
                "header": 0,
                "middle": frame["length"] // 2,
                "last": frame["length"] - 1,
            }[where]
        )
    _flip(world.data_path(frame["object"]), offset)
    expect_sync_error(world, IntegrityError, "corrupted", "xxh3")
    assert_reaches_v2_after_repair(world, same_subscriber=True)


@pytest.mark.parametrize("keep", [0.5, 0.0, "minus-one"])
def test_truncated_data_object(world: World, keep: float | str) -> None:
    frame = world.frames(2)[-1]
    path = world.data_path(frame["object"])
    data = path.read_bytes()
    cut = len(data) - 1 if keep == "minus-one" else int(len(data) * float(keep))
    path.write_bytes(data[:cut])
    expect_sync_error(world, (FrameError, IntegrityError), "truncated", "corrupted")
    assert_reaches_v2_after_repair(world, same_subscriber=True)


def test_missing_data_object(world: World) -> None:
    frame = world.frames(2)[0]
    world.data_path(frame["object"]).unlink()
    err = expect_sync_error(world, ObjectNotFoundError, frame["object"])
    assert isinstance(err, FileNotFoundError)
    assert_reaches_v2_after_repair(world, same_subscriber=True)


def test_every_v2_data_object_is_needed(world: World) -> None:
    """The delta spans several data objects; removing any one of them fails the sync."""
    objects = sorted({f["object"] for f in world.frames(2)})
    assert len(objects) >= 2
    for key in objects:
        path = world.data_path(key)
        saved = path.read_bytes()
        path.unlink()
        expect_sync_error(world, ObjectNotFoundError, key)
        path.write_bytes(saved)
    assert world.sub.sync().version == 2
    assert_bits(clone_bits(world.template.v2), world.sub.tensors)


# --- tensors that are not the delta's parent ----------------------------------------------


def test_modified_tensors_fail_attach_verification(template: Template) -> None:
    tensors = {n: t.clone() for n, t in template.v1.items()}
    bits(tensors[BIG]).reshape(-1)[123_456] ^= 1  # one bit of one element
    before = clone_bits(tensors)
    sub = Subscriber(template.store, tensors=tensors, version=1)
    with pytest.raises(TensorMismatchError) as info:
        sub.sync()
    assert isinstance(info.value, DeltastoreError)
    assert BIG in str(info.value)
    assert sub.version == 1
    assert_bits(before, tensors)
    # an explicit verify() says the same, and the unmodified tensors pass
    with pytest.raises(TensorMismatchError):
        sub.verify()
    good = {n: t.clone() for n, t in template.v1.items()}
    ok = Subscriber(template.store, tensors=good, version=1)
    ok.verify()
    assert ok.sync().version == 2
    assert_bits(clone_bits(template.v2), good)


@pytest.mark.parametrize("change", ["signed-zero", "nan-payload"])
def test_float_equal_modification_fails_attach_verification(
    template: Template, change: str
) -> None:
    """-0.0 for +0.0 or another NaN payload: float-equal, still not the v1 state."""
    tensors = {n: t.clone() for n, t in template.v1.items()}
    words = bits(tensors["lm_head.bias"])
    if change == "signed-zero":
        words[0] = -0x8000  # +0.0 -> -0.0
    else:
        words[2] = 0x7FC1  # NaN -> NaN with another payload
    before = clone_bits(tensors)
    sub = Subscriber(template.store, tensors=tensors, version=1)
    with pytest.raises(TensorMismatchError, match=r"lm_head\.bias"):
        sub.sync()
    assert sub.version == 1
    assert_bits(before, tensors)


def test_manifest_with_other_parent_digest(world: World) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["parent"]["state_digest"] = "ab" * 32

    world.edit_manifest(2, edit)
    expect_sync_error(world, (WrongParentError, ManifestError), "parent", "state")
    assert_reaches_v2_after_repair(world, same_subscriber=False)


def test_manifest_with_other_parent_version(world: World) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["parent"]["version"] = 0

    world.edit_manifest(2, edit)
    expect_sync_error(world, (ChainError, WrongParentError, ManifestError), "version")
    assert_reaches_v2_after_repair(world, same_subscriber=False)


# --- malformed manifests ------------------------------------------------------------------


@pytest.mark.parametrize("value", [2, 0, "1", True, None, 1.5, [1]])
def test_unknown_format_version(world: World, value: Any) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["format_version"] = value

    world.edit_manifest(2, edit)
    expect_sync_error(world, UnsupportedFormatError, "format_version")
    assert_reaches_v2_after_repair(world, same_subscriber=False)


def test_missing_format_version(world: World) -> None:
    world.edit_manifest(2, lambda m: m.pop("format_version"))
    err = expect_sync_error(world, ManifestError, "format_version")
    assert not isinstance(err, UnsupportedFormatError)  # not a newer format: not a manifest


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"\xff\xfe not utf-8", b"[]", b'{"format_version": 1}', b"null"],
    ids=["empty", "truncated", "not-utf8", "array", "bare", "null"],
)
def test_garbled_manifest(world: World, content: bytes) -> None:
    (world.store / manifest_key(2)).write_bytes(content)
    expect_sync_error(world, ManifestError, "manifest", "json")


def test_manifest_under_another_versions_key(world: World) -> None:
    """The manifest of v1 copied to the key of v2: the version inside does not match."""
    (world.store / manifest_key(2)).write_bytes((world.store / manifest_key(1)).read_bytes())
    expect_sync_error(world, ManifestError, "version")


BAD_OBJECTS = [
    "../versions/x.dsz",
    "versions/../../etc/passwd",
    "versions/..",
    "versions/./x.dsz",
    "versions//x.dsz",
    "/etc/passwd",
    "/versions/x.dsz",
    "s3://other-bucket/x",
    "file:///etc/passwd",
    "versions\\..\\..\\x.dsz",
    "versions/x\\y.dsz",
    "versions/x\x00.dsz",
    "versions/x.dsz\n",
    "versions/ｘ.dsz",  # noqa: RUF001 - a full-width x, on purpose
    "manifests/00000000000000000001.json",
    "LATEST",
    "",
]


@pytest.mark.parametrize("bad", BAD_OBJECTS, ids=[repr(b) for b in BAD_OBJECTS])
def test_frame_object_outside_the_version_data(world: World, bad: str) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"][BIG]["frames"][1]["object"] = bad

    world.edit_manifest(2, edit)
    expect_sync_error(world, (ManifestError, InvalidKeyError), "object", "key")
    assert_reaches_v2_after_repair(world, same_subscriber=False)


@pytest.mark.parametrize("what", ["last-stop", "huge-stop", "overlap", "reversed"])
def test_frame_outside_its_tensor(world: World, what: str) -> None:
    numel = 1000 * 300

    def edit(m: dict[str, Any]) -> None:
        frames = m["tensors"][BIG]["frames"]
        if what == "last-stop":
            frames[-1]["stop"] = numel + 1
        elif what == "huge-stop":
            frames[-1]["stop"] = 2**47
        elif what == "overlap":
            frames[1]["start"] = frames[0]["stop"] - 1
        else:
            frames[0]["start"], frames[0]["stop"] = frames[0]["stop"], frames[0]["start"]

    world.edit_manifest(2, edit)
    expect_sync_error(world, ManifestError, "frame")
    assert_reaches_v2_after_repair(world, same_subscriber=False)


# --- tensor table mismatches --------------------------------------------------------------


@pytest.mark.parametrize("field", ["dtype", "shape", "shape-same-numel"])
def test_manifest_tensor_differs_from_local(world: World, field: str) -> None:
    def edit(m: dict[str, Any]) -> None:
        entry = m["tensors"]["model.layers.0.self_attn.q_proj.weight"]
        if field == "dtype":
            entry["dtype"] = "float16"  # same element size: frames stay valid
        elif field == "shape":
            entry["shape"] = [256, 512]
        else:
            entry["shape"] = [128, 512]

    world.edit_manifest(2, edit)
    expect_sync_error(world, TensorMismatchError, "q_proj")
    assert_reaches_v2_after_repair(world, same_subscriber=False)


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_local_tensor_differs_from_manifest(world: World, change: str) -> None:
    """The subscriber's tensor is swapped for a view with another dtype or shape (same
    memory): the table check refuses before anything is written."""
    tensors = world.sub.tensors
    assert tensors is not None
    original = tensors[BIG]
    tensors[BIG] = original.view(torch.float16) if change == "dtype" else original.reshape(-1)
    with pytest.raises(TensorMismatchError) as info:
        world.sub.sync()
    assert isinstance(info.value, DeltastoreError)
    assert BIG in str(info.value)
    tensors[BIG] = original
    assert world.sub.version == 1
    assert_bits(world.clone, tensors)
    assert world.sub.sync().version == 2
    assert_bits(clone_bits(world.template.v2), tensors)


def test_missing_local_tensor(world: World) -> None:
    tensors = world.sub.tensors
    assert tensors is not None
    saved = tensors.pop("lm_head.bias")
    with pytest.raises(TensorMismatchError, match=r"lm_head\.bias"):
        world.sub.sync()
    tensors["lm_head.bias"] = saved
    assert world.sub.version == 1
    assert_bits(world.clone, tensors)


# --- wrong checksums ----------------------------------------------------------------------


@pytest.mark.parametrize("name", [BIG, "lm_head.bias"])
def test_wrong_tensor_adler32(world: World, name: str) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"][name]["adler32"] ^= 0x00010000

    world.edit_manifest(2, edit)
    err = expect_sync_error(world, IntegrityError, "adler")
    assert name in str(err)
    assert "nothing was written" in str(err)
    assert_reaches_v2_after_repair(world, same_subscriber=False)


@pytest.mark.parametrize("field", ["adler32", "parent_adler32"])
def test_wrong_frame_adler32(world: World, field: str) -> None:
    frames = world.frames(2)
    index = next(i for i, f in enumerate(frames) if f["codec"] == "xor-sparse")

    def edit(m: dict[str, Any]) -> None:
        m["tensors"][BIG]["frames"][index][field] ^= 1

    world.edit_manifest(2, edit)
    expect_sync_error(world, IntegrityError, "adler")
    assert_reaches_v2_after_repair(world, same_subscriber=False)


def test_wrong_frame_changed_count(world: World) -> None:
    """A frame whose declared change count disagrees with its data (tensor total kept
    consistent by moving one change to another frame)."""

    def edit(m: dict[str, Any]) -> None:
        frames = m["tensors"][BIG]["frames"]
        frames[0]["changed"] += 1
        frames[1]["changed"] -= 1

    world.edit_manifest(2, edit)
    expect_sync_error(world, (FrameError, IntegrityError), "declares", "changes", "frame")
    assert_reaches_v2_after_repair(world, same_subscriber=False)


# --- rollback during the write phase ------------------------------------------------------


def test_failure_during_scatter_rolls_back(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    real = words_module.scatter
    calls: list[int] = []

    def flaky(local: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
        calls.append(positions.size)
        if len(calls) == 3:
            raise RuntimeError("injected failure in the 3rd scatter")
        real(local, positions, values)

    monkeypatch.setattr(words_module, "scatter", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        world.sub.sync()
    assert len(calls) >= 4  # two scatters undone after the failing third
    assert world.sub.version == 1
    assert_bits(world.clone, world.sub.tensors)
    monkeypatch.undo()
    assert words_module.scatter is real
    assert world.sub.sync().version == 2
    assert_bits(clone_bits(world.template.v2), world.sub.tensors)


def test_partial_failing_scatter_is_rolled_back(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scatter that writes and then fails (an asynchronous device error surfaces after
    the copy was issued) must be undone as well."""
    real = words_module.scatter
    calls: list[int] = []

    def writes_then_fails(local: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
        calls.append(positions.size)
        real(local, positions, values)
        if len(calls) == 3:
            raise RuntimeError("injected failure after the 3rd scatter wrote")

    monkeypatch.setattr(words_module, "scatter", writes_then_fails)
    with pytest.raises(RuntimeError, match="injected"):
        world.sub.sync()
    assert world.sub.version == 1
    assert_bits(world.clone, world.sub.tensors)


# --- hostile sizes and keys ---------------------------------------------------------------


def test_huge_frame_length_is_refused_before_reading(world: World) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"][BIG]["frames"][0]["length"] = 2**62

    world.edit_manifest(2, edit)
    expect_sync_error(world, (FrameError, ManifestError), "frame", "length")


def test_delta_naming_a_tensor_its_parent_lacks(template: Template, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(template.store, store)
    extra = torch.zeros(16, dtype=torch.bfloat16)
    tensors = {n: torch.empty_like(t) for n, t in template.v1.items()} | {"extra": extra}
    sub = Subscriber(store, tensors=tensors)
    assert sub.sync(1).version == 1  # the anchor fills the tensors it names
    before = clone_bits(tensors)
    path = store / manifest_key(2)
    m = json.loads(path.read_text())
    value = adler32(np_words(extra))
    m["tensors"]["extra"] = {
        "dtype": "bfloat16",
        "shape": [16],
        "adler32": value,
        "parent_adler32": value,
        "changed": 0,
        "frames": [],
    }
    m["state_digest"] = state_digest(
        (n, t["dtype"], t["shape"], t["adler32"]) for n, t in m["tensors"].items()
    )
    path.write_text(json.dumps(m))
    with pytest.raises((WrongParentError, ManifestError, TensorMismatchError)):
        sub.sync()
    assert sub.version == 1
    assert_bits(before, tensors)


@pytest.mark.parametrize("key", ["versions/x.dsz\n", "manifests/00000000000000000001.json\n"])
def test_validate_key_refuses_trailing_newline(key: str) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(key)


@pytest.mark.parametrize(
    "key",
    ["../x", "/abs", "a//b", "a/./b", "a/../b", ".hidden", "s3://b/x", "a\\b", "a\x00b", ""],
)
def test_validate_key_refuses_escapes(key: str) -> None:
    with pytest.raises(InvalidKeyError) as info:
        validate_key(key)
    assert isinstance(info.value, DeltastoreError)
    assert "key" in str(info.value)
