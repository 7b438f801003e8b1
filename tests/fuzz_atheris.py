"""Coverage-guided fuzzing with atheris (optional; not collected by pytest, not in make test).

    pip install atheris
    python tests/fuzz_atheris.py manifest -runs=200000      # parse_manifest / parse_latest
    python tests/fuzz_atheris.py frame -max_total_time=300   # FrameDecoder.sparse/chunks/into

Other arguments go to libFuzzer (``-runs``, ``-max_total_time``, corpus folders...). Without a
corpus folder, the valid example manifests (``manifest``) or a few encoded frames (``frame``)
seed a temporary one. The checks are those of ``tests/test_hostile.py``: only deltastore's
typed errors may escape, accepted manifests survive a round trip, and no decoder produces
more than the manifest bound of its frame (nor starts decompressing before checking it).
"""

from __future__ import annotations

import contextlib
import struct
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["deltastore"]):
    import numpy as np

    from deltastore.errors import DeltastoreError
    from deltastore.format.codecs import CODECS, XOR_SPARSE, FrameEncoder
    from deltastore.format.manifest import parse_latest

sys.path.insert(0, str(Path(__file__).parent.parent))
from tests.test_hostile import VALID_BYTES, decode_checked, parse_or_typed_error


def fuzz_manifest(data: bytes) -> None:
    parse_or_typed_error(data, "atheris: manifest")
    with contextlib.suppress(DeltastoreError):
        parse_latest(data)


def fuzz_frame(data: bytes) -> None:
    """Input: codec (1 byte), element size (1 byte), n (2 bytes), changed (2 bytes), frame."""
    if len(data) < 6:
        return
    codec = CODECS[data[0] % len(CODECS)]
    size = (1, 2, 4, 8)[data[1] % 4]
    n = 1 + struct.unpack_from("<H", data, 2)[0]
    changed = struct.unpack_from("<H", data, 4)[0] % (n + 1) if codec == XOR_SPARSE else n
    decode_checked(codec, data[6:], n, size, changed, "atheris: frame")


def frame_seeds() -> list[bytes]:
    enc = FrameEncoder()
    words = np.arange(300, dtype=np.uint16)
    head = struct.pack("<BBHH", 0, 1, 299, 0)
    sparse = enc.xor_sparse(np.array([1, 7, 200], dtype=np.int64), np.array([1, 2, 3], np.uint16))
    return [
        head + enc.raw(words),
        struct.pack("<BBHH", 1, 1, 299, 0) + enc.xor_dense(words),
        struct.pack("<BBHH", 2, 1, 299, 3) + sparse,
    ]


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("manifest", "frame"):
        sys.exit(__doc__)
    target = sys.argv.pop(1)
    if not any(not a.startswith("-") for a in sys.argv[1:]):  # no corpus folder: seed one
        corpus = Path(tempfile.mkdtemp(prefix=f"deltastore-{target}-"))
        seeds = VALID_BYTES if target == "manifest" else frame_seeds()
        for i, seed in enumerate(seeds):
            (corpus / f"seed-{i}").write_bytes(seed)
        sys.argv.append(str(corpus))
    atheris.Setup(sys.argv, fuzz_manifest if target == "manifest" else fuzz_frame)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
