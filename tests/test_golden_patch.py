"""The ``xor-patch`` golden store (``tests/golden/patch-example/``) and the worked example of
``docs/spec/format-v1.md`` section 8.2.6: the committed files are what the script builds, the
delta's stored frame and its content are the bytes the spec shows, today's encoder writes that
content, and deltastore reads both versions bit-exact (element 999's absolute entry, equal to
its old word, changes nothing)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from deltastore import Subscriber
from deltastore.format.codecs import XOR_PATCH, FrameDecoder, FrameEncoder
from deltastore.format.manifest import parse_manifest
from deltastore.maintenance.verify import verify_store
from tests.golden.make_patch_example import (
    ABSOLUTE,
    PATCH,
    POSITIONS,
    ROOT,
    WORDS,
    N,
    build,
    versions,
)

SPEC = (Path(__file__).parent.parent / "docs" / "spec" / "format-v1.md").read_text()
SECTION = SPEC[SPEC.index("#### 8.2.6 `xor-patch`") : SPEC.index("### 8.3 Decoder limits")]


def hex_blocks(text: str) -> list[bytes]:
    """The bytes of each fenced block of ``text`` made of hex pairs (a comment after two or
    more spaces and a letter-led word ends a line's bytes)."""
    out = []
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        data = bytearray()
        for line in block.splitlines():
            hexpart = re.split(r"\s{2,}(?=[a-zA-Z])", line.strip())[0]
            if not re.fullmatch(r"[0-9a-f]{2}( +[0-9a-f]{2})*", hexpart):
                break
            data += bytes.fromhex(hexpart.replace(" ", ""))
        else:
            out.append(bytes(data))
    return out


def test_committed_files_are_what_the_script_builds() -> None:
    got = {p.relative_to(ROOT).as_posix(): p.read_bytes() for p in ROOT.rglob("*") if p.is_file()}
    assert got == build(), "run `python -m tests.golden.make_patch_example`"


def test_the_spec_shows_the_golden_frame_and_todays_encoder_writes_its_content() -> None:
    content, stored = hex_blocks(SECTION)
    assert len(content) == 29 and stored == PATCH
    assert zstandard.ZstdDecompressor().decompress(PATCH) == content
    fresh = FrameEncoder().xor_patch(
        np.array(POSITIONS), np.array(WORDS, np.uint16), np.array(ABSOLUTE)
    )
    assert zstandard.ZstdDecompressor().decompress(fresh) == content


def test_the_golden_frame_decodes_to_the_spec_entries() -> None:
    xor, absolute = FrameDecoder().changes(XOR_PATCH, PATCH, N, 2, 4)
    assert xor.xor and not absolute.xor
    assert xor.positions is not None and absolute.positions is not None
    assert xor.positions.tolist() == [3, 301] and xor.words.tolist() == [0x0001, 0x0001]
    assert absolute.positions.tolist() == [300, 999]
    assert absolute.words.tolist() == [0x3F80, 0xBC23]


def test_the_manifest_counts_entries_and_the_tensor_changes_three_elements() -> None:
    m = parse_manifest((ROOT / "manifests" / "00000000000000000002.json").read_bytes())
    (frame,) = m.tensors["t"].frames
    v1, v2 = versions()
    assert frame.codec == XOR_PATCH and frame.changed == m.tensors["t"].changed == 4
    assert np.count_nonzero(v1 != v2) == 3


@pytest.mark.parametrize("target", [None, 1])
def test_deltastore_reads_every_version_bit_exact(tmp_path: Path, target: int | None) -> None:
    store = Path(shutil.copytree(ROOT, tmp_path / "store"))
    sub = Subscriber(store)
    for v, words in enumerate(versions(), start=1):
        if target is not None or v == 2:
            assert sub.sync(version=v).version == v
            got = sub.tensors["t"]  # type: ignore[index]
            assert got.dtype == torch.bfloat16 and got.shape == (N,)
            assert got.view(torch.int16).numpy().view(np.uint16).tolist() == words.tolist()
    assert verify_store(store, deep=True).ok


def spec_reader(content: bytes, n: int, s: int, changed: int) -> dict[int, tuple[bool, int]]:
    """``xor-patch`` content decoded as section 8.2.6 states it, in plain Python (no deltastore
    code): position -> (absolute, word); AssertionError where the spec says MUST reject."""
    k, e, low_bits = (int.from_bytes(content[a:b], "little") for a, b in ((0, 4), (4, 8), (8, 9)))
    assert content[9:12] == b"\0\0\0" and low_bits <= 31 and k == changed >= 1
    w, f = (low_bits + 7) // 8, (k + 7) // 8
    assert len(content) == 12 + k * (1 + w + s) + 4 * e + f
    at = 12
    tokens = content[at : at + k]
    at += k

    def planes(count: int, width: int) -> list[int]:
        nonlocal at
        values = [
            sum(content[at + j * count + i] << (8 * j) for j in range(width)) for i in range(count)
        ]
        at += count * width
        return values

    low, esc = planes(k, w), planes(e, 4)
    flags = content[at : at + f]
    at += f
    words = planes(k, s)
    assert tokens.count(255) == e and all(x < 1 << low_bits for x in low)
    out, pos, j = {}, -1, 0
    for i in range(k):
        high = tokens[i]
        if high == 255:
            high, j = 255 + esc[j], j + 1
        pos += 1 + (high << low_bits) + low[i]
        absolute = bool(flags[i >> 3] >> (i & 7) & 1)
        assert pos < n and (absolute or words[i] != 0)
        out[pos] = (absolute, words[i])
    assert k % 8 == 0 or flags[-1] >> (k % 8) == 0
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_reader_of_the_spec_alone_decodes_what_the_encoder_writes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    s = int(rng.choice([1, 2, 4, 8]))
    n = int(rng.integers(1, 3000)) if seed else 700_000  # seed 0: far entries, escapes
    k = int(rng.integers(1, min(n, 300) + 1))
    pos = np.sort(rng.choice(n if seed else 2000, size=k, replace=False))
    if not seed:  # dense entries then far ones: small L, escaped gaps
        pos = np.concatenate([pos, [600_000, 650_000, 699_999]])
        k = pos.size
    words = rng.integers(0, 256, k * s, dtype=np.uint8).view(f"<u{s}").copy()
    absolute = rng.random(k) < 0.4
    words[~absolute & (words == 0)] = 1
    data = FrameEncoder().xor_patch(pos, words, absolute)
    content = zstandard.ZstdDecompressor().decompress(data)
    assert seed or int.from_bytes(content[4:8], "little") > 0  # escapes
    got = spec_reader(content, n, s, k)
    assert got == {int(p): (bool(a), int(x)) for p, a, x in zip(pos, absolute, words, strict=True)}
