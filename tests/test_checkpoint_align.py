"""Safetensors files whose tensor data is not aligned to its dtype (docs/guide.md).

safetensors does not require alignment, and writers other than deltastore may leave a header
whose length makes the data start at an odd offset. Such files are built here by hand and
must be published (anchor and delta with ``--parent``), pulled back bit-exact, and updated in
place when a pulled folder was rewritten unaligned. Read-only maps hold an unaligned tensor as
an aligned copy; writable maps write through the file's bytes at their unaligned address.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deltastore.checkpoint.safetensors import MappedCheckpoint, locate, read_header
from deltastore.format.dtypes import itemsize
from deltastore_cli import app

runner = CliRunner()
Tensors = dict[str, torch.Tensor]
CODES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL"}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def assert_bit_exact(expected: Tensors, got: Tensors) -> None:
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert np.array_equal(bits(got[name]), bits(t)), name


def write_unaligned(path: Path, tensors: Tensors) -> None:
    """A valid safetensors file whose data starts at an offset that is 1 modulo 8."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, t in tensors.items():
        raw = bits(t).tobytes()
        header[name] = {
            "dtype": CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((1 - 8 - len(text)) % 8)  # 8 + len(text) = 1 (mod 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_file_tensors(path: Path) -> Tensors:
    """Every tensor of a safetensors file, read with plain file I/O (any alignment)."""
    raw = path.read_bytes()
    out: Tensors = {}
    for name, loc in read_header(path).items():
        buf = bytearray(raw[loc.start : loc.stop])
        dtype = getattr(torch, loc.dtype)
        out[name] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(loc.shape)
    return out


def states() -> list[Tensors]:
    g = torch.Generator().manual_seed(3)
    v1 = {
        "emb": torch.randn(301, generator=g).to(torch.bfloat16),  # 602 bytes: shifts the next
        "w": torch.randn(7, 9, generator=g),
        "step": torch.tensor([1, 2, 3], dtype=torch.int64),
        "mask": torch.arange(5) % 2 == 0,
    }
    v2 = {k: t.clone() for k, t in v1.items()}
    v2["emb"][10:20] += 1
    v2["w"][3] *= -2
    v2["step"] += 1
    v3 = {k: t.clone() for k, t in v2.items()}
    v3["w"][0, 0] = float("nan")
    return [v1, v2, v3]


def ok(*args: str | Path) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, (result.exit_code, result.output)
    return result.stdout


@pytest.fixture(autouse=True)
def xdg_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_the_hand_made_file_is_unaligned(tmp_path: Path) -> None:
    path = tmp_path / "u.safetensors"
    write_unaligned(path, states()[0])
    locs = read_header(path)
    unaligned = {n for n, loc in locs.items() if loc.start % itemsize(loc.dtype)}
    assert unaligned == {"emb", "w", "step"}  # bool is 1 byte: always aligned
    assert_bit_exact(states()[0], read_file_tensors(path))


def test_a_read_only_map_copies_unaligned_tensors_and_leaves_the_file(tmp_path: Path) -> None:
    path = tmp_path / "u.safetensors"
    write_unaligned(path, states()[0])
    before = path.read_bytes()
    tensors = MappedCheckpoint(locate(path)).tensors
    assert_bit_exact(states()[0], tensors)
    for t in tensors.values():
        assert t.data_ptr() % t.element_size() == 0  # aligned for torch kernels
    tensors["w"][0] = 5.0  # private: the file never changes
    assert path.read_bytes() == before


def test_publish_unaligned_files_and_pull_them_back_bit_exact(tmp_path: Path) -> None:
    v = states()
    src = [tmp_path / f"src{i + 1}" / "model.safetensors" for i in range(3)]
    for path, state in zip(src, v, strict=True):
        write_unaligned(path, state)
    store = tmp_path / "store"
    ok("publish", store, src[0], "--version", "1")
    ok("publish", store, src[1], "--version", "2", "--parent", src[0])
    out = ok("publish", store, src[2].parent, "--version", "3", "--parent", src[1])
    assert "published v3 (delta on v2)" in out
    dest = tmp_path / "dest"
    ok("pull", store, dest, "--version", "1")
    assert_bit_exact(v[0], read_file_tensors(dest / "model.safetensors"))
    ok("pull", store, dest)
    assert_bit_exact(v[2], read_file_tensors(dest / "model.safetensors"))
    assert ok("verify", store).strip().endswith(": ok")
    assert ok("verify", "--checkout", dest, store).strip().endswith(": ok")


def test_pull_in_place_into_a_folder_rewritten_unaligned(tmp_path: Path) -> None:
    v = states()
    src = [tmp_path / f"src{i + 1}.safetensors" for i in range(2)]
    for path, state in zip(src, v[:2], strict=True):
        write_unaligned(path, state)
    store = tmp_path / "store"
    ok("publish", store, src[0], "--version", "1")
    ok("publish", store, src[1], "--version", "2", "--parent", src[0])
    dest = tmp_path / "dest"
    ok("pull", store, dest, "--version", "1")
    # another tool rewrites the pulled file, same tensors, unaligned (the sidecar still holds)
    target = dest / "model.safetensors"
    write_unaligned(target, read_file_tensors(target))
    layout = read_header(target)
    assert any(loc.start % itemsize(loc.dtype) for loc in layout.values())
    assert ok("verify", "--checkout", dest, store).strip().endswith(": ok")
    out = ok("pull", store, dest)
    assert out.startswith("pulled v2 (delta, applied 2)")
    assert read_header(target) == layout  # updated in place, in the same layout
    assert_bit_exact(v[1], read_file_tensors(target))
    assert ok("verify", "--checkout", dest, store).strip().endswith(": ok")
