"""Build the ``xor-patch`` example store (format edition 4), byte for byte.

``python -m tests.golden.make_patch_example`` (re)writes ``tests/golden/patch-example/``; the
committed files are what it writes, and ``tests/test_golden_patch.py`` checks that they are,
that the delta's frame is the stored frame of the worked example of
``docs/spec/format-v1.md`` section 8.2.6, and that deltastore reads both versions bit-exact.

One ``bfloat16`` tensor ``t`` of 1000 elements: at version 1 (an anchor) all zero but element
999, ``0xbc23``; at version 2 (a delta) elements 3 and 301 are ``0x0001`` (XOR entries) and
element 300 is ``0x3f80`` (1.0, an absolute entry), and element 999 is sent as the absolute
entry ``0xbc23``, equal to its old word (it does not change). Checksums and digests are
computed here; the two stored frames are copied, not recompressed, so that another zstd build
cannot change them (the reference writer made them: ``FrameEncoder().raw`` and
``FrameEncoder().xor_patch``).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import xxhash

from deltastore.format.checksum import adler32
from deltastore.format.manifest import (
    Frame,
    Latest,
    Manifest,
    Parent,
    TensorEntry,
    Writer,
    manifest_key,
    state_digest,
)

ROOT = Path(__file__).parent / "patch-example"
PREFIX = "5e1f0a7c3b2d"
OBJECT_1 = f"versions/00000000000000000001/{PREFIX}-000000.dsz"
OBJECT_2 = f"versions/00000000000000000002/{PREFIX}-000000.dsz"
#: The anchor's ``raw`` frame of version 1's words.
ANCHOR = bytes.fromhex("28b52ffd60d0065d000020000023bc0100c9ff000b")
#: The delta's ``xor-patch`` frame: the stored frame of spec section 8.2.6's example.
PATCH = bytes.fromhex(
    "28b52ffd201de9000004000000000000000500000000090015030800190a01800123003f00bc"
)
#: The entries of :data:`PATCH`: positions, words, absolute flags.
POSITIONS = (3, 300, 301, 999)
WORDS = (0x0001, 0x3F80, 0x0001, 0xBC23)
ABSOLUTE = (False, True, False, True)
WRITER = Writer(token=PREFIX + "4d6e8f90a1b2c3d4e5f6", library="deltastore 0.3.0")
CREATED = "2026-12-03T06:00:00Z"
N = 1000


def versions() -> tuple[np.ndarray, np.ndarray]:
    """The words (uint16) of ``t`` at versions 1 and 2."""
    v1 = np.zeros(N, dtype=np.uint16)
    v1[999] = 0xBC23
    v2 = v1.copy()
    v2[[3, 300, 301]] = (0x0001, 0x3F80, 0x0001)
    return v1, v2


def _frame(obj: str, data: bytes, **fields: object) -> Frame:
    return Frame.model_validate(
        {
            "object": obj,
            "offset": 0,
            "length": len(data),
            "xxh3": xxhash.xxh3_64_hexdigest(data),
            "start": 0,
            "stop": N,
            **fields,
        }
    )


def build() -> dict[str, bytes]:
    """Every object of the example store, by key."""
    v1, v2 = versions()
    a1, a2 = adler32(v1), adler32(v2)
    digest_1 = state_digest([("t", "bfloat16", [N], a1)])
    anchor = Manifest(
        format_version=1,
        version=1,
        kind="anchor",
        parent=None,
        state_digest=digest_1,
        created=CREATED,
        writer=WRITER,
        tensors={
            "t": TensorEntry(
                dtype="bfloat16",
                shape=[N],
                adler32=a1,
                parent_adler32=None,
                changed=N,
                frames=[
                    _frame(
                        OBJECT_1, ANCHOR, codec="raw", changed=N, adler32=a1, parent_adler32=None
                    )
                ],
            )
        },
    )
    delta = Manifest(
        format_version=1,
        version=2,
        kind="delta",
        parent=Parent(version=1, state_digest=digest_1),
        state_digest=state_digest([("t", "bfloat16", [N], a2)]),
        created=CREATED,
        writer=WRITER,
        tensors={
            "t": TensorEntry(
                dtype="bfloat16",
                shape=[N],
                adler32=a2,
                parent_adler32=a1,
                changed=4,  # entries: element 999's absolute entry counts, unchanged
                frames=[
                    _frame(
                        OBJECT_2, PATCH, codec="xor-patch", changed=4, adler32=a2, parent_adler32=a1
                    )
                ],
            )
        },
    )
    body = delta.to_bytes()
    latest = Latest(
        format_version=1,
        version=2,
        manifest=manifest_key(2),
        sha256=hashlib.sha256(body).hexdigest(),
    )
    return {
        manifest_key(1): anchor.to_bytes(),
        manifest_key(2): body,
        OBJECT_1: ANCHOR,
        OBJECT_2: PATCH,
        "LATEST": latest.model_dump_json().encode(),
    }


def main() -> int:
    for key, data in build().items():
        path = ROOT / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"{key:<60} {len(data):>5} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
