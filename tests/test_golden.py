"""The example store of ``docs/spec/format-v1.md`` section 13, committed under
``tests/golden/spec-example/``: its bytes are what the spec shows, deltastore reads every
version bit-exact with the values the spec states, and ``verify --deep`` finds it clean."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from deltastore import Subscriber
from deltastore.format.manifest import manifest_key, parse_latest, parse_manifest
from deltastore.maintenance.verify import verify_store
from tests.golden.make_spec_example import ROOT, build

SPEC = (Path(__file__).parent.parent / "docs" / "spec" / "format-v1.md").read_text()
EXAMPLE = SPEC[SPEC.index("## 13. Example") : SPEC.index("## Appendix A")]

#: The values section 13 states, as float32 (exact in bfloat16).
V1 = {
    "layer.weight": torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]),
    "layer.bias": torch.zeros(4),
}
V2 = {
    "layer.weight": torch.tensor([[0.0, 7.0, 2.0], [3.0, 4.0, 5.0]]),
    "layer.bias": V1["layer.bias"],
}


def committed() -> dict[str, bytes]:
    return {p.relative_to(ROOT).as_posix(): p.read_bytes() for p in ROOT.rglob("*") if p.is_file()}


def bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int16).flatten().tolist()


def assert_at(tensors: object, expected: dict[str, torch.Tensor]) -> None:
    assert isinstance(tensors, dict) or hasattr(tensors, "items")
    got = dict(tensors.items())  # type: ignore[attr-defined]
    assert sorted(got) == sorted(expected)
    for name, values in expected.items():
        assert got[name].dtype == torch.bfloat16 and got[name].shape == values.shape
        assert bits(got[name]) == bits(values.to(torch.bfloat16)), name


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A copy of the golden store (readers and verify may leave lock files behind)."""
    return Path(shutil.copytree(ROOT, tmp_path / "store"))


def test_committed_files_are_what_the_script_builds() -> None:
    assert committed() == build(), "run `python -m tests.golden.make_spec_example`"


def test_files_and_sizes_are_the_ones_the_spec_lists() -> None:
    listed = dict(re.findall(r"^((?:manifests|versions)/\S+|LATEST) +(\d+) bytes$", EXAMPLE, re.M))
    assert {k: len(v) for k, v in committed().items()} == {k: int(n) for k, n in listed.items()}


def test_manifests_are_the_bytes_the_spec_shows() -> None:
    files = committed()
    start = EXAMPLE.index(
        "```json\n", EXAMPLE.index("`manifests/00000000000000000002.json` (the delta")
    )
    assert EXAMPLE[start + 8 : EXAMPLE.index("```\n", start + 8)].encode() == files[manifest_key(2)]
    anchor_sha = hashlib.sha256(files[manifest_key(1)]).hexdigest()
    assert f"with SHA-256\n`{anchor_sha}`, is written" in EXAMPLE
    # the anchor's tensors, shown compactly
    start = EXAMPLE.index("```json\n", EXAMPLE.index("the tensors are"))
    shown = json.loads("{" + EXAMPLE[start + 8 : EXAMPLE.index("```\n", start + 8)] + "}")
    assert shown == json.loads(files[manifest_key(1)])["tensors"]
    latest = SPEC[SPEC.index("## 11. The LATEST hint") :]
    assert files["LATEST"].decode() in latest.split("```")[1].splitlines()
    assert (
        parse_latest(files["LATEST"]).sha256 == hashlib.sha256(files[manifest_key(2)]).hexdigest()
    )


def test_data_objects_are_the_hex_the_spec_shows() -> None:
    shown: dict[str, bytes] = {}
    obj = ""
    block = EXAMPLE[EXAMPLE.index("Data objects (hex):") :].split("```")[1]
    for line in block.strip().splitlines():
        if line.startswith("versions/"):
            obj = line.strip()
            shown[obj] = b""
        else:
            shown[obj] += bytes.fromhex(line.split()[0])
    files = committed()
    assert shown == {k: v for k, v in files.items() if k.startswith("versions/")}


def test_deltastore_reads_every_version_bit_exact(store: Path) -> None:
    fresh = Subscriber(store, signing_key=None)
    assert fresh.latest() == 2 and fresh.versions() == [1, 2]
    report = fresh.sync(1)
    assert report.kind == "anchor" and report.applied == (1,)
    assert_at(fresh.tensors, V1)
    report = fresh.sync()  # the xor-sparse delta on the anchor
    assert report.kind == "delta" and report.applied == (2,) and report.changed_elements == 1
    assert_at(fresh.tensors, V2)
    direct = Subscriber(store, signing_key=None)
    assert direct.sync(2).applied == (1, 2)
    assert_at(direct.tensors, V2)
    for version in (1, 2):
        m = parse_manifest((store / manifest_key(version)).read_bytes(), key=manifest_key(version))
        assert m.to_bytes() == (store / manifest_key(version)).read_bytes()


def test_verify_deep_finds_the_store_clean(store: Path) -> None:
    report = verify_store(store, deep=True)
    assert report.ok, [p.line() for p in report.problems]
    assert report.versions == (1, 2) and report.frames == 3 and report.tensors_checked == 4
    assert report.orphans == 0 and report.unverified == 0
