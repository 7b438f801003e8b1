"""Build the example store of ``docs/spec/format-v1.md`` section 13, byte for byte.

``python -m tests.golden.make_spec_example`` (re)writes ``tests/golden/spec-example/``; the
committed files are what it writes, and ``tests/test_golden.py`` checks that they are also
exactly what the spec shows and that deltastore reads them. The values below are the spec's:
two ``bfloat16`` tensors, ``layer.weight`` ``[[0, 1, 2], [3, 4, 5]]`` and ``layer.bias`` four
zeros at version 1 (an anchor), and ``layer.weight[0, 1] = 7.0`` at version 2 (a delta), as
written by the reference writer at zstd level 1. The frames are copied, not recompressed, so
that another zstd build cannot change them.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from deltastore.format.manifest import (
    Frame,
    Latest,
    Manifest,
    Parent,
    TensorEntry,
    Writer,
    manifest_key,
)

ROOT = Path(__file__).parent / "spec-example"
OBJECT_1 = "versions/00000000000000000001/c4c72766d9ed-000000.dsz"
OBJECT_2 = "versions/00000000000000000002/c4c72766d9ed-000000.dsz"
#: The stored frames (spec section 13, "Data objects").
WEIGHT_1 = bytes.fromhex("28b52ffd200c6100000000803f004040408040a040")
BIAS_1 = bytes.fromhex("28b52ffd20084100000000000000000000")
WEIGHT_2 = bytes.fromhex("28b52ffd200b590000010000000100000001607f")
WRITER = Writer(token="c4c72766d9ed4573a9abec5bdfaa84b7", library="deltastore 0.1.0")
CREATED = "2026-11-29T09:01:19.683493Z"
DIGEST_1 = "0f0bdbab091675744941a374049357b04d7c7c1aa99a14a1d0fdf846fdfc4aed"
DIGEST_2 = "0cff695d4a94c7b046874fdf31f34500dad7b3833410d52ae9b81a27412003d6"


def _frame(obj: str, offset: int, data: bytes, xxh3: str, **fields: object) -> Frame:
    return Frame.model_validate(
        {"object": obj, "offset": offset, "length": len(data), "xxh3": xxh3, **fields}
    )


def build() -> dict[str, bytes]:
    """Every object of the example store, by key."""
    anchor = Manifest(
        format_version=1,
        version=1,
        kind="anchor",
        parent=None,
        state_digest=DIGEST_1,
        created=CREATED,
        writer=WRITER,
        tensors={
            "layer.weight": TensorEntry(
                dtype="bfloat16",
                shape=[2, 3],
                adler32=268632864,
                parent_adler32=None,
                changed=6,
                frames=[
                    _frame(
                        OBJECT_1,
                        0,
                        WEIGHT_1,
                        "0a6b230f89606778",
                        start=0,
                        stop=6,
                        codec="raw",
                        changed=6,
                        adler32=268632864,
                        parent_adler32=None,
                    )
                ],
            ),
            "layer.bias": TensorEntry(
                dtype="bfloat16",
                shape=[4],
                adler32=524289,
                parent_adler32=None,
                changed=4,
                frames=[
                    _frame(
                        OBJECT_1,
                        len(WEIGHT_1),
                        BIAS_1,
                        "be8e2d418aa0f945",
                        start=0,
                        stop=4,
                        codec="raw",
                        changed=4,
                        adler32=524289,
                        parent_adler32=None,
                    )
                ],
            ),
        },
    )
    delta = Manifest(
        format_version=1,
        version=2,
        kind="delta",
        parent=Parent(version=1, state_digest=DIGEST_1),
        state_digest=DIGEST_2,
        created=CREATED,
        writer=WRITER,
        tensors={
            "layer.weight": TensorEntry(
                dtype="bfloat16",
                shape=[2, 3],
                adler32=332137345,
                parent_adler32=268632864,
                changed=1,
                frames=[
                    _frame(
                        OBJECT_2,
                        0,
                        WEIGHT_2,
                        "c7bb05dca1b40f15",
                        start=0,
                        stop=6,
                        codec="xor-sparse",
                        changed=1,
                        adler32=332137345,
                        parent_adler32=268632864,
                    )
                ],
            ),
            "layer.bias": TensorEntry(
                dtype="bfloat16",
                shape=[4],
                adler32=524289,
                parent_adler32=524289,
                changed=0,
                frames=[],
            ),
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
        OBJECT_1: WEIGHT_1 + BIAS_1,
        OBJECT_2: WEIGHT_2,
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
