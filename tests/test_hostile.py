# ruff: noqa: F811 - the fixtures of test_bad_input are imported, and tests take them by name
"""Hostile and damaged input (spec section 8.3): typed errors, nothing applied, bounded memory.

Every sync-level case below damages version 2 of the store of ``tests/test_bad_input.py`` (its
fixtures and :func:`expect_sync_error` are reused) and checks that ``sync()`` raises a
:class:`DeltastoreError` subclass while the subscriber stays at version 1 with its tensors
bit-wise unchanged; a fresh subscriber facing a damaged anchor keeps no tensors and no version.
Then hypothesis fuzzes ``parse_manifest``/``parse_latest`` and ``FrameDecoder`` for a bounded
number of examples (``DELTASTORE_FUZZ_EXAMPLES`` raises it and randomizes the runs), checking
that only deltastore's typed errors escape and that no decoder allocates more than the size
the frame's manifest entry allows. The module prints how many hostile inputs it tried.

Hostile inputs covered by other modules (counted by :func:`test_reference_table_is_current`
from their parametrizations; not repeated here):

=========================================  ==========================================  =====
input                                      test                                        cases
=========================================  ==========================================  =====
non-UTF-8, empty, truncated, non-object    test_bad_input::test_garbled_manifest           6
``object`` with ``..``, ``//``, ``\\``,    test_bad_input::test_frame_object_outside_      17
NUL, newline, URL, absolute path           the_version_data
overlapping / reversed / past-the-end      test_bad_input::test_frame_outside_its_tensor   4
frames
unknown / missing ``format_version``       test_bad_input::test_unknown_format_version,    8
                                           test_missing_format_version
manifest under another version's key       test_bad_input::test_manifest_under_another_    1
                                           versions_key
huge frame ``length``                      test_bad_input::test_huge_frame_length_is_      1
                                           refused_before_reading
store keys escaping the root               test_bad_input::test_validate_key_refuses_*    12
corrupted / truncated / missing data       test_bad_input::test_flipped_byte_in_frame,     9
                                           test_truncated_data_object, test_missing_...
wrong checksums, counts, parents           test_bad_input::test_wrong_*, test_manifest_    7
                                           with_other_parent_*
huge zstd window (decoder level)           test_codecs::test_huge_window_is_refused        2
lying / missing / mismatched content size  test_codecs::test_lying_content_size_...,       3
                                           test_frame_without_content_size_...,
                                           test_content_size_must_match_declared_size
garbage, truncated frames                  test_codecs::test_garbage_is_refused,          10
                                           test_truncated_frames_are_refused
invalid ``xor-sparse`` bodies              test_codecs::test_invalid_xor_sparse_...       14
invalid ``xor-patch`` bodies               test_codecs_patch::test_damaged_content_...     9
schema-invalid manifests                   test_schema::test_invalid_examples_...         27
JSON text and invariants beyond the schema test_schema::test_examples_beyond_the_...       10
forged signatures, frames, objects         test_signing_ed25519::test_subscriber_         10
(an Ed25519-signed store)                  refuses_and_applies_nothing
=========================================  ==========================================  =====
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltastore.format.codecs as codecs
import deltastore.format.manifest as manifest_module
import tests.test_bad_input as bad_input
import tests.test_codecs as test_codecs
import tests.test_codecs_patch as test_codecs_patch
import tests.test_schema as test_schema
import tests.test_signing_ed25519 as test_signing_ed25519
from deltastore import Subscriber, __version__
from deltastore.errors import (
    DeltastoreError,
    FrameError,
    IntegrityError,
    InvalidKeyError,
    ManifestError,
    TensorMismatchError,
)
from deltastore.format.codecs import (
    CODECS,
    RAW,
    RAW_PLANES,
    XOR_DENSE,
    XOR_PATCH,
    XOR_SPARSE,
    XOR_SPARSE2,
    FrameDecoder,
    FrameEncoder,
)
from deltastore.format.codecs.patch import patch_bounds
from deltastore.format.codecs.v2 import SPARSE2_HEADER, FrameEncoder2, sparse2_bounds
from deltastore.format.dtypes import word_dtype
from deltastore.format.manifest import manifest_key, parse_latest, parse_manifest
from tests.test_bad_input import (  # noqa: F401 - fixtures used by name
    BIG,
    World,
    expect_sync_error,
    template,
    template_v2,
    world,
    world_v2,
)

#: Hostile inputs tried, by category, and fuzz inputs that were accepted (valid after all):
#: printed at the end of the module.
TRIED: Counter[str] = Counter()
ACCEPTED: Counter[str] = Counter()
DELTA_KEY = manifest_key(2)
EVIL_OBJECT = "versions/00000000000000000002/evil00000000-000000.dsz"


@pytest.fixture(scope="module", autouse=True)
def _print_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    capman = request.config.pluginmanager.getplugin("capturemanager")
    lines = [
        f"  {name}: {count}" + (f" ({ACCEPTED[name]} accepted)" if ACCEPTED[name] else "")
        for name, count in sorted(TRIED.items())
        if count
    ]
    summary = (
        f"\nhostile inputs tried by {Path(__file__).name}: {sum(TRIED.values())} "
        f"(+ {sum(n for *_, n in REFERENCES)} in other modules)\n" + "\n".join(lines)
    )
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print(summary)
    else:  # pragma: no cover - capture disabled
        print(summary)


# --- the reference table -------------------------------------------------------------------

REFERENCES: list[tuple[Any, tuple[str, ...], int]] = [
    (bad_input, ("test_garbled_manifest",), 6),
    (bad_input, ("test_frame_object_outside_the_version_data",), 17),
    (bad_input, ("test_frame_outside_its_tensor",), 4),
    (bad_input, ("test_unknown_format_version", "test_missing_format_version"), 8),
    (bad_input, ("test_manifest_under_another_versions_key",), 1),
    (bad_input, ("test_huge_frame_length_is_refused_before_reading",), 1),
    (
        bad_input,
        ("test_validate_key_refuses_trailing_newline", "test_validate_key_refuses_escapes"),
        12,
    ),
    (
        bad_input,
        (
            "test_flipped_byte_in_frame",
            "test_truncated_data_object",
            "test_missing_data_object",
            "test_every_v2_data_object_is_needed",
        ),
        9,
    ),
    (
        bad_input,
        (
            "test_wrong_tensor_adler32",
            "test_wrong_frame_adler32",
            "test_wrong_frame_changed_count",
            "test_manifest_with_other_parent_digest",
            "test_manifest_with_other_parent_version",
        ),
        7,
    ),
    (test_codecs, ("test_huge_window_is_refused",), 2),
    (
        test_codecs,
        (
            "test_lying_content_size_is_refused",
            "test_frame_without_content_size_is_refused",
            "test_content_size_must_match_declared_size",
        ),
        3,
    ),
    (test_codecs, ("test_garbage_is_refused", "test_truncated_frames_are_refused"), 10),
    (test_codecs, ("test_invalid_xor_sparse_is_refused",), 14),
    (test_codecs_patch, ("test_damaged_content_is_refused",), 9),
    (test_schema, ("test_invalid_examples_fail_schema_and_parser",), len(test_schema.INVALID)),
    (test_schema, ("test_examples_beyond_the_schema_fail_the_parser",), len(test_schema.BEYOND)),
    (test_signing_ed25519, ("test_subscriber_refuses_and_applies_nothing",), 10),
]


def _cases(fn: Callable[..., Any]) -> int:
    """Number of parametrized cases of a test function (1 when not parametrized)."""
    marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
    return math.prod(len(m.args[1]) for m in marks)


def test_reference_table_is_current() -> None:
    """The tests the docstring's table points to exist and have the counted cases."""
    for module, names, count in REFERENCES:
        assert sum(_cases(getattr(module, name)) for name in names) == count, names
    assert len(test_schema.INVALID) == 27 and len(test_schema.BEYOND) == 10


# --- helpers -------------------------------------------------------------------------------


def edit_delta(world: World, edit: Callable[[dict[str, Any]], None], *, fix: bool = True) -> None:
    world.edit_manifest(2, edit, fix_digest=fix)


def write_delta_text(world: World, text: str | bytes) -> None:
    data = text.encode() if isinstance(text, str) else text
    (world.store / DELTA_KEY).write_bytes(data)


def raw_text_edit(world: World, placeholder: Any, raw: str, edit: Callable[..., None]) -> None:
    """Edit the delta with ``placeholder`` (a unique value) in place of a JSON fragment, then
    splice the raw fragment ``raw`` into the text (for what ``json.dumps`` cannot write)."""
    edit_delta(world, edit)
    text = (world.store / DELTA_KEY).read_text()
    token = json.dumps(placeholder)
    assert text.count(token) == 1
    write_delta_text(world, text.replace(token, raw))


def set_frame(field: str, value: Any, *, tensor: str = BIG, index: int = 1) -> Callable[..., None]:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"][tensor]["frames"][index][field] = value

    return edit


def fresh_sync_fails(store: Path, errors: type[Exception] | tuple[type[Exception], ...]) -> str:
    """A subscriber without tensors cannot reach version 1 and keeps nothing."""
    sub = Subscriber(store)
    with pytest.raises(errors) as info:
        sub.sync(1)
    assert isinstance(info.value, DeltastoreError)
    assert sub.version is None and sub.tensors is None
    return str(info.value)


# --- manifests: sizes, ranges, order, names, codecs ------------------------------------------

HUGE_SHAPES: dict[str, Any] = {
    "2^60 elements": [2**30, 2**30],
    "one dim of 2^60": [2**60],
    "16 dims of 2^16": [2**16] * 16,
    "17 dims": [1] * 17,
    "dim of 2^64": [2**64],
    "negative dim": [-1000, -300],
    "float dim": [1000.0, 300],
    "bool dim": [True, 300],
    "string dim": ["1000", 300],
}


@pytest.mark.parametrize("shape", list(HUGE_SHAPES), ids=list(HUGE_SHAPES))
def test_huge_or_malformed_shape(world: World, shape: str) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"][BIG]["shape"] = HUGE_SHAPES[shape]

    edit_delta(world, edit)
    expect_sync_error(world, ManifestError, "shape", "elements", "malformed")
    TRIED["manifest: shape"] += 1


def test_shape_with_a_100000_digit_dimension(world: World) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"][BIG]["shape"] = [424242.5, 300]

    raw_text_edit(world, 424242.5, "1" * 100_000, edit)
    expect_sync_error(world, ManifestError, "json", "digits")
    TRIED["manifest: shape"] += 1


def test_huge_anchor_is_refused_before_allocating(world: World) -> None:
    """A fresh subscriber would allocate what the anchor declares: a 2^48-element tensor is
    refused by the frame size limit before anything is allocated or fetched."""

    def edit(m: dict[str, Any]) -> None:
        entry = m["tensors"][BIG]
        entry["shape"] = [2**24, 2**24]
        last = entry["frames"][-1]
        last["stop"] = last["changed"] = 2**48
        last["changed"] -= last["start"]
        entry["changed"] = 2**48

    world.edit_manifest(1, edit)
    message = fresh_sync_fails(world.store, (FrameError, ManifestError))
    assert "max_frame_bytes" in message or "frame" in message
    TRIED["manifest: shape"] += 1


FRAME_FIELDS: dict[str, tuple[str, Any]] = {
    "negative start": ("start", -1),
    "negative stop": ("stop", -5),
    "negative offset": ("offset", -1),
    "negative length": ("length", -1),
    "zero length": ("length", 0),
    "negative changed": ("changed", -1),
    "start 2^63": ("start", 2**63),
    "offset 2^62+1": ("offset", 2**62 + 1),
    "offset 2^64": ("offset", 2**64),
    "float offset": ("offset", 1.0),
    "bool offset": ("offset", True),
    "string offset": ("offset", "0"),
    "null length": ("length", None),
    "empty frame": ("stop", None),  # stop = start, filled in below
}


@pytest.mark.parametrize("case", list(FRAME_FIELDS), ids=list(FRAME_FIELDS))
def test_negative_or_out_of_range_frame_fields(world: World, case: str) -> None:
    field, value = FRAME_FIELDS[case]

    def edit(m: dict[str, Any]) -> None:
        frame = m["tensors"][BIG]["frames"][1]
        frame[field] = frame["start"] if case == "empty frame" else value

    edit_delta(world, edit)
    expect_sync_error(world, ManifestError, "frame", field, "malformed")
    TRIED["manifest: frame range"] += 1


@pytest.mark.parametrize("raw", ["1e3", "1.0", "NaN", "Infinity", "-Infinity", "1E+2", "0x10"])
def test_integers_in_other_number_forms(world: World, raw: str) -> None:
    raw_text_edit(world, 777777.5, raw, set_frame("offset", 777777.5))
    expect_sync_error(world, ManifestError, "offset", "json", "malformed")
    TRIED["manifest: number forms"] += 1


ORDERS = ["swapped", "reversed list", "duplicated frame", "nested frame", "same start"]


@pytest.mark.parametrize("order", ORDERS)
def test_frames_out_of_order_or_overlapping(world: World, order: str) -> None:
    def edit(m: dict[str, Any]) -> None:
        frames = m["tensors"][BIG]["frames"]
        if order == "swapped":
            frames[0], frames[1] = frames[1], frames[0]
        elif order == "reversed list":
            frames.reverse()
        elif order == "duplicated frame":
            frames.insert(1, copy.deepcopy(frames[1]))
            frames[1]["changed"] = frames[2]["changed"] = frames[1]["changed"] // 2
            m["tensors"][BIG]["changed"] = sum(f["changed"] for f in frames)
        elif order == "nested frame":
            inner = copy.deepcopy(frames[0])
            inner["start"], inner["stop"], inner["changed"] = 10, 20, 0
            frames.insert(1, inner)
        else:
            frames[1]["start"] = frames[0]["start"]

    edit_delta(world, edit)
    expect_sync_error(world, ManifestError, "order", "overlap", "frame")
    TRIED["manifest: frame order"] += 1


def _dump(value: Any) -> str:
    """JSON text where a list of ``(key, value)`` pairs wrapped in :class:`Pairs` is an object
    (so keys can repeat)."""
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{json.dumps(k)}:{_dump(v)}" for k, v in value) + "}"
    if isinstance(value, dict):
        return _dump(Pairs(value.items()))
    if isinstance(value, list):
        return "[" + ",".join(_dump(v) for v in value) + "]"
    return json.dumps(value)


class Pairs(list[tuple[str, Any]]):
    """An object's members in order, duplicates allowed."""


DUPLICATES = ["tensor name", "tensor name, same entry", "version", "frame offset", "kind"]


@pytest.mark.parametrize("where", DUPLICATES)
def test_duplicate_json_keys(world: World, where: str) -> None:
    """``json.loads`` keeps the last of repeated keys; the parser must refuse them instead
    (two readers could otherwise see different manifests in the same bytes)."""
    m = world.manifest_json(2)
    top = Pairs(m.items())
    if where.startswith("tensor name"):
        entries = list(m["tensors"].items())
        other = copy.deepcopy(entries[0][1])
        if where == "tensor name":
            other["adler32"] ^= 1
        top = Pairs((k, Pairs([*entries, (BIG, other)]) if k == "tensors" else v) for k, v in top)
    elif where == "version":
        top.append(("version", 1))
    elif where == "kind":
        top.insert(3, ("kind", "anchor"))
    else:
        frame = m["tensors"][BIG]["frames"][1]
        frame_pairs = Pairs([*frame.items(), ("offset", 0)])
        m["tensors"][BIG]["frames"][1] = frame_pairs
        top = Pairs(m.items())
    write_delta_text(world, _dump(top))
    expect_sync_error(world, ManifestError, "duplicate")
    TRIED["manifest: duplicate keys"] += 1


CODEC_NAMES = ["xor-rle", "RAW", "raw ", "", "zstd", "xor_sparse", None, 1, ["raw"]]


@pytest.mark.parametrize("codec", CODEC_NAMES, ids=[repr(c) for c in CODEC_NAMES])
def test_codec_that_does_not_exist(world: World, codec: Any) -> None:
    edit_delta(world, set_frame("codec", codec))
    expect_sync_error(world, ManifestError, "codec")
    TRIED["manifest: codec"] += 1


BAD_NAMES = ["", "a\nb", "tab\there", "nul\x00", "del\x7f", "x" * 1025, "\ud800", "a\udfffb"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n[:12]) for n in BAD_NAMES])
def test_invalid_tensor_name(world: World, name: str) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"][name] = m["tensors"].pop("lm_head.bias")

    edit_delta(world, edit)
    expect_sync_error(world, ManifestError, "tensors", "malformed", "string")
    TRIED["manifest: tensor name"] += 1


#: The writer's library string in every manifest this suite writes (``"deltastore <version>"``).
LIB = f"deltastore {__version__}".encode()

ENCODINGS: dict[str, Callable[[bytes], bytes]] = {
    "utf-8 bom": lambda b: b"\xef\xbb\xbf" + b,
    "utf-16": lambda b: b.decode().encode("utf-16"),
    "utf-32-le": lambda b: b.decode().encode("utf-32-le"),
    "overlong slash": lambda b: b.replace(LIB, LIB.replace(b" ", b"\xc0\xaf")),
    "cesu-8 surrogate": lambda b: b.replace(LIB, b"deltastore\xed\xa0\x800.1"),
    "latin-1 byte": lambda b: b.replace(LIB, b"deltastore \xe9"),
    "escaped lone surrogate": lambda b: b.replace(LIB, b"deltastore \\ud800"),
    "truncated multibyte": lambda b: b.replace(LIB, b"deltastore \xe2\x82"),
    "nul byte": lambda b: b.replace(b'"kind"', b'"kind\x00"'),
}


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_text_that_is_not_valid_utf8_json(world: World, encoding: str) -> None:
    data = (world.store / DELTA_KEY).read_bytes()
    hostile = ENCODINGS[encoding](data)
    assert hostile != data
    write_delta_text(world, hostile)
    expect_sync_error(world, ManifestError, "utf-8", "json", "string", "malformed")
    TRIED["manifest: encoding"] += 1


NESTINGS: dict[str, str] = {
    "100k [": "[" * 100_000,
    "100k balanced []": "[" * 100_000 + "]" * 100_000,
    "100k {": '{"a":' * 100_000,
    "100k in tensors": '{"format_version": 1, "tensors": ' + "[" * 100_000,
    "600 deep in a frame": "",  # filled in below: valid JSON, deep but parseable
}


@pytest.mark.parametrize("nesting", list(NESTINGS))
def test_deeply_nested_json(world: World, nesting: str) -> None:
    if nesting == "600 deep in a frame":
        raw_text_edit(world, 99999.5, "[" * 600 + "]" * 600, set_frame("object", 99999.5))
    else:
        write_delta_text(world, NESTINGS[nesting])
    expect_sync_error(world, ManifestError, "json", "malformed", "object")
    TRIED["manifest: nesting"] += 1


def test_manifest_over_the_size_limit(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    size = len((world.store / DELTA_KEY).read_bytes())
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", size - 1)
    expect_sync_error(world, ManifestError, "limit")
    TRIED["manifest: size"] += 1


MORE_OBJECTS = [
    "versions/x/",
    "versions/x/..",
    "versions/%2e%2e/x",
    "versions/x?y=1",
    "versions/x#frag",
    "versions/C:\\x",
    "\\\\server\\share\\x",
    "C:/x",
    "versions/" + "a" * 256,
    "versions/" + "/".join(["a" * 200] * 6) + "/x",  # over 1024 characters
    "versions/.hidden",
    "versions/x\r",
    "versions/x\t",
    "versions/x y",
    "versions/\u2024\u2024/x",  # one-dot leaders, not dots
    "http://169.254.169.254/latest/meta-data",
    "gs://other/x",
    "az://other/x",
    "~/x",
]


@pytest.mark.parametrize("key", MORE_OBJECTS, ids=[repr(k[:24]) for k in MORE_OBJECTS])
def test_more_object_keys_outside_the_store(world: World, key: str) -> None:
    edit_delta(world, set_frame("object", key))
    expect_sync_error(world, (ManifestError, InvalidKeyError), "object", "key")
    TRIED["manifest: object key"] += 1


# --- frames: hostile zstd headers ------------------------------------------------------------


def zstd_frame(
    payload: bytes,
    *,
    content_size: int | None,
    window_log: int | None = 17,
    fcs_bytes: int = 8,
    dict_id: int | None = None,
    reserved: bool = False,
) -> bytes:
    """A zstd frame of one raw block with a hand-written header (RFC 8878, 3.1.1.1): any
    content size (or none), window and dictionary id, so headers can lie."""
    fcs_flag = {0: 0, 2: 1, 4: 2, 8: 3}[fcs_bytes if content_size is not None else 0]
    single = window_log is None
    dict_flag, dict_bytes = (0, b"") if dict_id is None else (3, struct.pack("<I", dict_id))
    fhd = fcs_flag << 6 | single << 5 | reserved << 3 | dict_flag
    out = struct.pack("<IB", 0xFD2FB528, fhd)
    if window_log is not None:
        out += bytes([(window_log - 10) << 3])
    out += dict_bytes
    if content_size is not None:
        fmt = {2: "<H", 4: "<I", 8: "<Q"}[fcs_bytes]
        out += struct.pack(fmt, content_size - 256 if fcs_bytes == 2 else content_size)
    return out + ((len(payload) << 3) | 1).to_bytes(3, "little") + payload


SPARSE_ONE = (1).to_bytes(4, "little") + b"\x01\0\0\0" + b"\x05\x07\x00"  # k=1, gap 5, mask 7
ZSTD_HEADERS: dict[str, Callable[[bytes, int], bytes]] = {
    # (payload, declared content size) -> stored frame
    "window 2^31": lambda p, n: zstd_frame(p, content_size=n, window_log=31),
    "window 2^41": lambda p, n: zstd_frame(p, content_size=n, window_log=41),
    "content 2^40": lambda p, n: zstd_frame(p, content_size=2**40),
    "content 2^64-1": lambda p, n: zstd_frame(p, content_size=2**64 - 1),
    "content 2^32-1": lambda p, n: zstd_frame(p, content_size=2**32 - 1, fcs_bytes=4),
    "content +1": lambda p, n: zstd_frame(p, content_size=n + 1),
    "content 0": lambda p, n: zstd_frame(p, content_size=0, fcs_bytes=8),
    "no content size": lambda p, n: zstd_frame(p, content_size=None),
    "dictionary": lambda p, n: zstd_frame(p, content_size=n, dict_id=0xDEADBEEF),
    "reserved bit": lambda p, n: zstd_frame(p, content_size=n, reserved=True),
    "skippable": lambda p, n: struct.pack("<II", 0x184D2A5F, len(p)) + p,
    "two frames": lambda p, n: zstd_frame(p, content_size=n) * 2,
    "trailing byte": lambda p, n: zstd_frame(p, content_size=n) + b"\0",
}


def plant_frame(world: World, version: int, tensor: str, index: int, data: bytes) -> None:
    """Point a frame at ``data`` (stored in a new object) with a matching xxh3 and length, so
    only the zstd frame itself is hostile."""
    (world.store / EVIL_OBJECT).write_bytes(data)

    def edit(m: dict[str, Any]) -> None:
        frame = m["tensors"][tensor]["frames"][index]
        frame.update(
            object=EVIL_OBJECT, offset=0, length=len(data), xxh3=xxhash.xxh3_64_hexdigest(data)
        )

    world.edit_manifest(version, edit)


#: target -> (fixture: the store written with the 0.1.0 or the 0.2.0 codecs, version, tensor,
#: frame index); the frame's codec is the target's last word.
TARGETS = {
    "delta xor-sparse": ("world", 2, BIG, 1),
    "delta xor-dense": ("world", 2, "lm_head.bias", 0),
    "anchor raw": ("world", 1, "lm_head.bias", 0),
    "delta xor-sparse2": ("world_v2", 2, BIG, 1),
    "anchor raw-planes": ("world_v2", 1, BIG, 0),
}


def target_frame(
    request: pytest.FixtureRequest, target: str
) -> tuple[World, int, str, int, dict[str, Any]]:
    """(world, version, tensor, frame index, frame) of a target, its codec checked."""
    fixture, version, tensor, index = TARGETS[target]
    world: World = request.getfixturevalue(fixture)
    frame = world.frames(version, tensor)[index]
    assert frame["codec"] == target.split()[-1], (target, frame["codec"])
    return world, version, tensor, index, frame


def sparse_body(codec: str, k: int) -> bytes:
    """A well-formed bf16 body of ``k`` changes (gaps 0, masks 1) of a sparse codec."""
    if codec == XOR_SPARSE:
        return k.to_bytes(4, "little") + b"\x01\0\0\0" + bytes(k) + b"\x01" * k + bytes(k)
    assert codec == XOR_SPARSE2  # <u32 k><u32 e = 0><u8 L = 0>, tokens 0, mask planes
    return struct.pack("<IIB3x", k, 0, 0) + bytes(k) + b"\x01" * k + bytes(k)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("header", list(ZSTD_HEADERS))
def test_hostile_zstd_header(request: pytest.FixtureRequest, header: str, target: str) -> None:
    world, version, tensor, index, frame = target_frame(request, target)
    n, k = frame["stop"] - frame["start"], frame["changed"]
    if frame["codec"] in (XOR_SPARSE, XOR_SPARSE2):
        payload = sparse_body(frame["codec"], k)
    else:
        payload = bytes(2 * n)
    plant_frame(world, version, tensor, index, ZSTD_HEADERS[header](payload, len(payload)))
    if version == 2:
        expect_sync_error(world, FrameError, "zstd", "frame")
    else:
        fresh_sync_fails(world.store, FrameError)
    TRIED["frame: zstd header"] += 1


@pytest.mark.parametrize("target", list(TARGETS))
def test_planted_frame_with_an_honest_header_passes_the_decoder(
    request: pytest.FixtureRequest, target: str
) -> None:
    """Control for the test above: the same planted body under a well-formed header decodes,
    and is then refused by its Adler-32 (it is not the data the manifest describes), so the
    FrameErrors above come from the headers alone."""
    world, version, tensor, index, frame = target_frame(request, target)
    n, k = frame["stop"] - frame["start"], frame["changed"]
    if frame["codec"] in (XOR_SPARSE, XOR_SPARSE2):
        payload = sparse_body(frame["codec"], k)
    else:  # k non-zero words (for xor-dense: k changes, as declared)
        payload = b"\x01\x01" * k + bytes(2 * (n - k))
    plant_frame(world, version, tensor, index, zstd_frame(payload, content_size=len(payload)))
    if version == 2:
        expect_sync_error(world, IntegrityError, "adler")
    else:
        assert "Adler-32" in fresh_sync_fails(world.store, IntegrityError)


def _sparse2(k: int, e: int, low_bits: int, body: bytes, reserved: bytes = b"\0\0\0") -> bytes:
    return struct.pack("<IIB3s", k, e, low_bits, reserved) + body


#: xor-sparse2 bodies (bf16, for the frame's k changes) that lie in one way each; planted under
#: an honest zstd header through the manifest path, each must be a FrameError before anything
#: is applied.
SPARSE2_BODIES: dict[str, Callable[[int, int], bytes]] = {
    "k differs": lambda n, k: _sparse2(
        k + 1, 0, 0, bytes(k + 1) + b"\x01" * (k + 1) + bytes(k + 1)
    ),
    "L = 32": lambda n, k: _sparse2(k, 0, 32, bytes(k) + bytes(4 * k) + b"\x01" * k + bytes(k)),
    "reserved byte": lambda n, k: _sparse2(k, 0, 0, bytes(k) + b"\x01" * k + bytes(k), b"\0\1\0"),
    "zero mask": lambda n, k: _sparse2(k, 0, 0, bytes(k) + bytes(2 * k)),
    "gap past the end": lambda n, k: _sparse2(
        k, 0, 8, b"\xfe" * k + bytes(k) + b"\x01" * k + bytes(k)
    ),
    "escape token, no escape": lambda n, k: _sparse2(
        k, 0, 0, b"\xff" + bytes(k - 1) + b"\x01" * k + bytes(k)
    ),
    "escape past the end": lambda n, k: _sparse2(  # gap 255 + n: past the frame's n
        k, 1, 0, b"\xff" + bytes(k - 1) + struct.pack("<I", n) + b"\x01" * k + bytes(k)
    ),
    "escapes over the bound": lambda n, k: _sparse2(
        k, k, 0, b"\xff" * k + bytes(4 * k) + b"\x01" * k + bytes(k)
    ),
}


@pytest.mark.parametrize("body", list(SPARSE2_BODIES))
def test_hostile_xor_sparse2_body(world_v2: World, body: str) -> None:
    frame = world_v2.frames(2, BIG)[1]
    assert frame["codec"] == XOR_SPARSE2
    n, k = frame["stop"] - frame["start"], frame["changed"]
    assert k > 1 and n < 1 << 24
    payload = SPARSE2_BODIES[body](n, k)
    plant_frame(world_v2, 2, BIG, 1, zstd_frame(payload, content_size=len(payload)))
    expect_sync_error(world_v2, FrameError, "xor-sparse2")
    TRIED["frame: xor-sparse2 body"] += 1


def test_hostile_raw_planes_anchor_of_another_size(world_v2: World) -> None:
    """A raw-planes anchor frame whose content is one element short: refused by a fresh
    subscriber before anything is decoded into its tensors."""
    frame = world_v2.frames(1, BIG)[0]
    assert frame["codec"] == RAW_PLANES
    n = frame["stop"] - frame["start"]
    payload = bytes(2 * (n - 1))
    plant_frame(world_v2, 1, BIG, 0, zstd_frame(payload, content_size=len(payload)))
    fresh_sync_fails(world_v2.store, FrameError)
    TRIED["frame: raw-planes size"] += 1


# --- LATEST and listings: hints that lie are ignored, nothing unexpected is applied -----------

LATEST_CONTENT: dict[str, bytes] = {
    "100k [": b"[" * 100_000,
    "not utf-8": b"\xff\xfe{}",
    "names v1 as v2": json.dumps(
        {"format_version": 1, "version": 2, "manifest": manifest_key(1), "sha256": "0" * 64}
    ).encode(),
    "wrong sha256": json.dumps(
        {"format_version": 1, "version": 2, "manifest": manifest_key(2), "sha256": "0" * 64}
    ).encode(),
    "version 2^63": json.dumps(
        {"format_version": 1, "version": 2**63, "manifest": manifest_key(1), "sha256": "0" * 64}
    ).encode(),
    "older version": b"",  # filled in below: a valid hint for version 1
    "duplicate key": b'{"format_version":1,"version":1,"version":2}',
    "over 4096 bytes": b"",  # filled in below: a valid hint for version 2, padded
    "version -0": json.dumps(
        {"format_version": 1, "version": 0, "manifest": manifest_key(0), "sha256": "0" * 64}
    )
    .replace('"version": 0', '"version": -0')
    .encode(),
    "byte order mark": b"",  # filled in below: a valid hint for version 2 after a BOM
}


@pytest.mark.parametrize("content", list(LATEST_CONTENT))
def test_hostile_latest_is_ignored(world: World, content: str) -> None:
    data = LATEST_CONTENT[content]
    if content == "older version":
        body = (world.store / manifest_key(1)).read_bytes()
        data = json.dumps(
            {
                "format_version": 1,
                "version": 1,
                "manifest": manifest_key(1),
                "sha256": hashlib.sha256(body).hexdigest(),
            }
        ).encode()
    if content in ("over 4096 bytes", "byte order mark"):
        body = (world.store / manifest_key(2)).read_bytes()
        hint = {"format_version": 1, "version": 2, "manifest": manifest_key(2)}
        data = json.dumps({**hint, "sha256": hashlib.sha256(body).hexdigest()}).encode()
        data = data + b" " * 4096 if content == "over 4096 bytes" else b"\xef\xbb\xbf" + data
        with pytest.raises(ManifestError):
            parse_latest(data)
    (world.store / "LATEST").write_bytes(data)
    assert world.sub.sync().version == 2  # listing finds v2 regardless of the hint
    bad_input.assert_bits(bad_input.clone_bits(world.template.v2), world.sub.tensors)
    TRIED["LATEST"] += 1


STRAY_KEYS = [
    "manifests/99999999999999999999.json",  # above MAX_VERSION
    "manifests/00000000000000000003.json.tmp",
    "manifests/3.json",
    "manifests/00000000000000000003.JSON",
    "manifests/0000000000000000003.json",  # 19 digits
    "manifests/x/00000000000000000003.json",
]


def test_stray_keys_under_manifests_are_ignored(world: World) -> None:
    for key in STRAY_KEYS:
        path = world.store / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"[" * 1000)
    assert world.sub.sync().version == 2
    assert world.sub.latest() == 2
    TRIED["listing: stray keys"] += len(STRAY_KEYS)


def test_tensor_shape_differs_only_in_size(world: World) -> None:
    """A valid-looking delta whose tensor is far larger than the local one: refused by the
    table check, not allocated."""

    def edit(m: dict[str, Any]) -> None:
        m["tensors"][BIG]["shape"] = [2**20, 2**20]

    edit_delta(world, edit)
    expect_sync_error(world, TensorMismatchError, BIG)
    TRIED["manifest: shape"] += 1


# --- fuzzing: manifest parser ----------------------------------------------------------------

FUZZ_ENV = "DELTASTORE_FUZZ_EXAMPLES"


def fuzz_settings(default: int) -> settings:
    """Bounded in CI (derandomized: the same examples every run); ``DELTASTORE_FUZZ_EXAMPLES``
    sets the count and draws new examples on each run."""
    extra = os.environ.get(FUZZ_ENV)
    return settings(
        max_examples=int(extra) if extra else default,
        deadline=None,
        derandomize=not extra,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


EXAMPLES_DIR = Path(__file__).parent.parent / "manifests" / "schema" / "examples" / "valid"
VALID_BYTES = [p.read_bytes() for p in sorted(EXAMPLES_DIR.glob("*.json"))]
VALID_OBJECTS = [json.loads(b) for b in VALID_BYTES]
HOSTILE_VALUES: list[Any] = [
    0, -1, 1, 2**31, 2**32, 2**48, 2**48 + 1, 2**62, 2**63, 2**64, -(2**63), 10**30,
    1.0, -0.0, 1e300, float("nan"), float("inf"), True, False, None, "", "x" * 3000,
    "raw", "xor-sparse", "anchor", "delta", "bfloat16", "versions/../x", "versions/a",
    "\x00", "\ud800", "0" * 64, [], {}, [0] * 17, [2**24, 2**24], {"version": 1},
]  # fmt: skip
JSON_LEAVES = st.one_of(
    st.sampled_from(HOSTILE_VALUES),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.booleans(),
    st.none(),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


def parse_or_typed_error(data: bytes, category: str) -> None:
    """parse_manifest: a manifest that survives a round trip, or a typed error."""
    TRIED[category] += 1
    try:
        m = parse_manifest(data)
    except DeltastoreError:
        return
    again = parse_manifest(m.to_bytes())
    assert again == m and again.to_bytes() == m.to_bytes()
    ACCEPTED[category] += 1


@fuzz_settings(300)
@given(data=st.binary(max_size=600))
def test_fuzz_parser_on_arbitrary_bytes(data: bytes) -> None:
    for blob in (data, b'{"format_version": 1, ' + data):
        parse_or_typed_error(blob, "fuzz: parser, arbitrary bytes")
        with contextlib.suppress(DeltastoreError):
            parse_latest(blob)


@fuzz_settings(250)
@given(value=JSON_VALUES, fv=st.sampled_from([None, 1, 2, "1"]))
def test_fuzz_parser_on_arbitrary_json(value: Any, fv: Any) -> None:
    if fv is not None and isinstance(value, dict):
        value = {"format_version": fv, **value}
    parse_or_typed_error(json.dumps(value).encode(), "fuzz: parser, arbitrary JSON")
    with contextlib.suppress(DeltastoreError):
        parse_latest(json.dumps(value).encode())


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for key, child in items:
        yield from _paths(child, (*prefix, key))


@st.composite
def mutated_manifests(draw: st.DrawFn) -> Any:
    """A valid example manifest with 1 to 4 structural edits: a value replaced (by a hostile
    value or arbitrary JSON), a member deleted or added, a list element duplicated or two
    swapped."""
    obj = copy.deepcopy(draw(st.sampled_from(VALID_OBJECTS)))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(list(_paths(obj))))
        if not path:
            continue
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "dup", "swap"]))
        if op == "replace":
            value = draw(st.one_of(st.sampled_from(HOSTILE_VALUES), JSON_VALUES))
            parent[last] = copy.deepcopy(value)  # HOSTILE_VALUES holds lists and dicts
        elif op == "delete":
            del parent[last]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = copy.deepcopy(draw(JSON_LEAVES))
        elif op == "dup" and isinstance(parent, list):
            parent.insert(last, copy.deepcopy(parent[last]))
        elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
            other = draw(st.integers(0, len(parent) - 1))
            parent[last], parent[other] = parent[other], parent[last]
    return obj


@fuzz_settings(300)
@given(obj=mutated_manifests())
def test_fuzz_parser_on_mutated_manifests(obj: Any) -> None:
    parse_or_typed_error(json.dumps(obj).encode(), "fuzz: parser, mutated manifests")


@st.composite
def mutated_bytes(draw: st.DrawFn, corpus: list[bytes]) -> bytes:
    """Byte-level edits of a valid input: set, insert, delete, truncate, repeat a slice."""
    data = bytearray(draw(st.sampled_from(corpus)))
    for _ in range(draw(st.integers(1, 6))):
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["set", "insert", "delete", "truncate", "repeat", "flip"]))
        if op == "set":
            data[pos] = draw(st.integers(0, 255))
        elif op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        else:
            data[pos:pos] = data[pos : pos + draw(st.integers(1, 64))]
    return bytes(data)


@fuzz_settings(400)
@given(data=mutated_bytes(VALID_BYTES))
def test_fuzz_parser_on_mutated_bytes(data: bytes) -> None:
    parse_or_typed_error(data, "fuzz: parser, mutated bytes")


# --- fuzzing: frame decoder ------------------------------------------------------------------


class _SpyReader:
    def __init__(self, inner: Any, spy: _SpyDctx) -> None:
        self._inner, self._spy = inner, spy

    def __enter__(self) -> _SpyReader:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)

    def readinto(self, view: Any) -> int:
        got = int(self._inner.readinto(view))
        self._spy.produced += got
        assert self._spy.produced <= self._spy.bound, "decoded past the declared size"
        return got

    def read(self, size: int = -1) -> bytes:
        out = bytes(self._inner.read(size))
        self._spy.produced += len(out)
        assert self._spy.produced <= self._spy.bound, "decoded past the declared size"
        return out


class _SpyDctx:
    """Wraps the decoder's zstd context: every decompression must start only after the
    frame header's content size was checked against the manifest bound, and may not produce
    more than that bound."""

    def __init__(self, inner: zstandard.ZstdDecompressor, bound: int) -> None:
        self._inner, self.bound, self.produced = inner, bound, 0

    def _check_header(self, data: bytes) -> None:
        declared = zstandard.get_frame_parameters(data).content_size
        assert declared != zstandard.CONTENTSIZE_UNKNOWN and declared <= self.bound

    def decompress(self, data: bytes) -> bytes:
        self._check_header(data)
        out = bytes(self._inner.decompress(data))
        self.produced += len(out)
        assert self.produced <= self.bound, "decoded past the declared size"
        return out

    def stream_reader(self, data: bytes, **kwargs: Any) -> _SpyReader:
        self._check_header(data)
        return _SpyReader(self._inner.stream_reader(data, **kwargs), self)


DECODER = FrameDecoder()
REAL_DCTX = DECODER._dctx
REAL_DCTX2 = DECODER._v2._dctx


def content_limit(codec: str, n: int, size: int, changed: int) -> int:
    """The most content bytes a frame's manifest entry allows (spec section 8.3)."""
    if codec == XOR_SPARSE:
        return codecs.sparse_bound(n, size)
    if codec == XOR_SPARSE2:
        return sparse2_bounds(n, size, changed)[1] if 0 <= changed <= n else 0
    if codec == XOR_PATCH:
        return patch_bounds(n, size, changed)[1] if 1 <= changed <= n else 0
    return n * size


def decode_checked(
    codec: str, data: bytes, n: int, size: int, changed: int, category: str = ""
) -> bool:
    """Decode like a subscriber does: True when it decoded (to the declared shape), False on
    FrameError; any other exception fails the test."""
    bound = content_limit(codec, n, size, changed)
    spy = _SpyDctx(REAL_DCTX, bound)
    DECODER._dctx = spy
    DECODER._v2._dctx = spy  # type: ignore[assignment]
    try:
        if codec in (XOR_SPARSE, XOR_SPARSE2):
            (ch,) = DECODER.changes(codec, data, n, size, changed)
            pos, masks = ch.positions, ch.words
            assert pos is not None and pos.size == masks.size == changed
            assert pos.size == 0 or (int(pos[0]) >= 0 and int(pos[-1]) < n)
            assert bool(np.all(np.diff(pos) > 0)) and bool(masks.all())
        elif codec == XOR_PATCH:
            parts = list(DECODER.changes(codec, data, n, size, changed))
            assert [p.xor for p in parts] in ([True], [False], [True, False])
            pos = np.concatenate([p.positions for p in parts if p.positions is not None])
            assert pos.size == changed and np.unique(pos).size == changed
            assert int(pos.min()) >= 0 and int(pos.max()) < n
            assert all(p.words.all() for p in parts if p.xor)
        elif codec in (RAW, RAW_PLANES):
            out = np.empty(n, dtype=word_dtype(size))
            DECODER.decode_into(codec, data, out)
        else:
            total = 0
            for first, words in DECODER.chunks(data, n, size):
                assert first * size == total
                total += words.nbytes
            assert total == n * size
    except FrameError:
        return False
    finally:
        DECODER._dctx = REAL_DCTX
        DECODER._v2._dctx = REAL_DCTX2
        assert spy.produced <= bound
        TRIED[category] += bool(category)
    ACCEPTED[category] += bool(category)
    return True


@st.composite
def frame_cases(draw: st.DrawFn, *, mutate: bool) -> tuple[str, bytes, int, int, int]:
    """A valid frame (any codec, element size, density), optionally with byte edits and
    with declared sizes that may disagree with it."""
    codec = draw(st.sampled_from(CODECS))
    size = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    enc, enc2 = FrameEncoder(), FrameEncoder2()
    changed = n
    if codec in (XOR_SPARSE, XOR_SPARSE2):
        changed = draw(st.integers(0, n))
        pos = np.sort(rng.choice(n, size=changed, replace=False)).astype(np.int64)
        masks = rng.integers(1, 256, changed).astype(word_dtype(size))
        data = enc.xor_sparse(pos, masks) if codec == XOR_SPARSE else enc2.xor_sparse2(pos, masks)
    elif codec == XOR_PATCH:
        changed = draw(st.integers(1, n))
        pos = np.sort(rng.choice(n, size=changed, replace=False)).astype(np.int64)
        words = rng.integers(0, 256, changed).astype(word_dtype(size))
        absolute = (rng.random(changed) < 0.5) | (words == 0)
        data = enc.xor_patch(pos, words, absolute)
    else:
        words = rng.integers(0, 4, n * size, dtype=np.uint8).view(word_dtype(size))
        data = {RAW: enc.raw, XOR_DENSE: enc.xor_dense, RAW_PLANES: enc2.raw_planes}[codec](words)
    if mutate:
        data = draw(mutated_bytes([data]))
        if draw(st.booleans()):
            n = draw(st.integers(1, 4000))
            changed = draw(st.integers(0, n)) if codec in (XOR_SPARSE, XOR_SPARSE2) else n
            changed = draw(st.integers(1, n)) if codec == XOR_PATCH else changed
            size = draw(st.sampled_from([1, 2, 4, 8]))
    return codec, data, n, size, changed


@fuzz_settings(300)
@given(case=frame_cases(mutate=True))
def test_fuzz_decoder_on_mutated_frames(case: tuple[str, bytes, int, int, int]) -> None:
    decode_checked(*case, "fuzz: decoder, mutated frames")


@fuzz_settings(200)
@given(case=frame_cases(mutate=False))
def test_fuzz_decoder_accepts_valid_frames(case: tuple[str, bytes, int, int, int]) -> None:
    assert decode_checked(*case)


@fuzz_settings(300)
@given(
    header=st.binary(min_size=0, max_size=14),
    body=st.binary(max_size=200),
    codec=st.sampled_from(CODECS),
    n=st.integers(1, 5000),
    size=st.sampled_from([1, 2, 4, 8]),
    magic=st.booleans(),
)
def test_fuzz_decoder_on_random_bytes(
    header: bytes, body: bytes, codec: str, n: int, size: int, magic: bool
) -> None:
    data = (struct.pack("<I", 0xFD2FB528) if magic else b"") + header + body
    changed = min(n, len(body)) if codec in (XOR_SPARSE, XOR_SPARSE2, XOR_PATCH) else n
    decode_checked(codec, data, n, size, changed, "fuzz: decoder, random bytes")


@fuzz_settings(300)
@given(
    content=st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(0, 70_000)),
    fcs_bytes=st.sampled_from([2, 4, 8]),
    window_log=st.one_of(st.none(), st.integers(10, 41)),
    payload=st.binary(max_size=300),
    codec=st.sampled_from(CODECS),
    n=st.integers(1, 10_000),
    size=st.sampled_from([1, 2, 4, 8]),
)
def test_fuzz_decoder_on_hostile_headers(
    content: int | None,
    fcs_bytes: int,
    window_log: int | None,
    payload: bytes,
    codec: str,
    n: int,
    size: int,
) -> None:
    """Headers that declare any content size (up to 2^64 - 1) and window: a declared size
    above the manifest bound is refused before anything is decompressed (the spy asserts it)."""
    if content is not None:
        limit = {2: (256, 65791), 4: (0, 2**32 - 1), 8: (0, 2**64 - 1)}[fcs_bytes]
        content = min(max(content, limit[0]), limit[1])
    if window_log is None and content is None:
        window_log = 20
    data = zstd_frame(payload, content_size=content, window_log=window_log, fcs_bytes=fcs_bytes)
    header = SPARSE2_HEADER if codec == XOR_SPARSE2 else codecs.SPARSE_HEADER
    changed = min(n, max(0, (len(payload) - header) // (1 + size)))
    changed = changed if codec in (XOR_SPARSE, XOR_SPARSE2, XOR_PATCH) else n
    decode_checked(codec, data, n, size, changed, "fuzz: decoder, hostile headers")


def test_decoder_under_an_address_space_limit(tmp_path: Path) -> None:
    """In a child process limited to its current address space plus 256 MiB, frames that
    declare up to 2^64 - 1 content bytes, and a dense frame declared as 2^40 bytes (streamed
    through a fixed buffer), are all refused with FrameError and nothing runs out of memory."""
    script = tmp_path / "limited.py"
    script.write_text(
        textwrap.dedent(
            """
            import resource, struct, sys
            import numpy as np
            from deltastore.format.codecs import FrameDecoder
            from deltastore.errors import FrameError
            sys.path.insert(0, sys.argv[1])
            from tests.test_hostile import SPARSE_ONE, zstd_frame

            with open("/proc/self/status") as fh:
                vm = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize"))
            resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), vm + (256 << 20)))
            dec = FrameDecoder()
            cases = 0
            for declared in (2**31, 2**40, 2**62, 2**64 - 1):
                frame = zstd_frame(SPARSE_ONE, content_size=declared)
                for call in (
                    lambda: dec.sparse(frame, 1000, 2, 1),
                    lambda: list(dec.chunks(frame, 1000, 2)),
                    lambda: dec.into(frame, np.empty(1000, np.uint16)),
                ):
                    try:
                        call()
                    except FrameError:
                        cases += 1
            lying = zstd_frame(bytes(4096), content_size=2**40)
            try:  # declared size within the manifest bound: streamed, never allocated
                for _ in dec.chunks(lying, 2**39, 2):
                    pass
            except FrameError:
                cases += 1
            print("refused", cases)
            """
        )
    )
    root = str(Path(__file__).parent.parent)
    proc = subprocess.run(
        [sys.executable, str(script), root],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused 13" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    TRIED["decoder under RLIMIT_AS"] += 13


def test_valid_frames_decode_to_the_declared_sizes() -> None:
    """The fuzz harness accepts what it should: a frame of every codec."""
    enc = FrameEncoder()
    words = np.arange(100, dtype=np.uint16)
    assert decode_checked(RAW, enc.raw(words), 100, 2, 100)
    assert decode_checked(XOR_DENSE, enc.xor_dense(words), 100, 2, 100)
    pos = np.array([3, 50], dtype=np.int64)
    assert decode_checked(XOR_SPARSE, enc.xor_sparse(pos, np.array([1, 2], np.uint16)), 100, 2, 2)
    assert not decode_checked(RAW, enc.raw(words), 101, 2, 101)
    enc2 = FrameEncoder2()
    assert decode_checked(RAW_PLANES, enc2.raw_planes(words), 100, 2, 100)
    assert not decode_checked(RAW_PLANES, enc2.raw_planes(words), 99, 2, 99)
    masks = np.array([1, 2], np.uint16)
    assert decode_checked(XOR_SPARSE2, enc2.xor_sparse2(pos, masks), 100, 2, 2)
    assert not decode_checked(XOR_SPARSE2, enc2.xor_sparse2(pos, masks), 100, 2, 3)
