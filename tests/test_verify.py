"""``deltastore verify`` (docs/cli.md, verify): the store fsck and the checkout check.

A pristine store (v1 anchor, v2-v4 deltas, v5 an anchor on v4, v6 a delta; small frames and
several data objects per version) passes the fast and the deep check. Each kind of damage is
made on a copy and must be reported with its kind, version and key: a missing object, a
truncated object, a flipped byte (XXH3), a damaged manifest, a missing parent manifest, a
wrong parent digest, a wrong parent Adler-32, a damaged LATEST, and a frame re-encoded with
another value whose hash and length were fixed in the manifest (valid zstd, so only the deep
check finds it, by Adler-32). ``--checkout`` checks pulled folders, healthy and tampered. The
deep replay's memory is bounded by a tensor, not the model (tracemalloc).

Signatures: a store signed with an Ed25519 key passes with its public key (argument,
``--trusted-keys`` text or @file, or ``DELTASTORE_TRUSTED_KEYS``); with the key held, a forged
manifest or anchor copy (unsigned, an unknown key id, its body edited after signing, an HMAC
made with the public key as secret under the Ed25519 key's id, a replayed manifest) is a
``signature`` problem (exit 5), and a frame whose bytes lost the BLAKE3 the signed manifest
records is a ``blake3`` problem.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from typer.testing import CliRunner, Result

from deltastore import Publisher
from deltastore.checkpoint.folders import SIDECAR, pull_checkpoint
from deltastore.checkpoint.safetensors import CheckpointError, MappedCheckpoint, locate
from deltastore.format.codecs import RAW, RAW_PLANES, FrameDecoder, FrameEncoder
from deltastore.format.codecs.v2 import FrameEncoder2
from deltastore.format.keys import anchor_key
from deltastore.format.manifest import LATEST_KEY, manifest_key, parse_manifest
from deltastore.format.signing import Ed25519Key, SignatureError, SigningKey, sign_manifest
from deltastore.maintenance.verify import (
    ADLER32,
    BLAKE3,
    CHAIN,
    LATEST,
    MANIFEST,
    MISSING_OBJECT,
    MISSING_PARENT,
    PARENT_ADLER32,
    PARENT_DIGEST,
    SIDECAR_MISMATCH,
    SIGNATURE,
    TABLE,
    TRUNCATED,
    XXH3,
    VerifyReport,
    verify_checkout,
    verify_store,
)
from deltastore.progress import Progress
from deltastore_cli import app
from deltastore_cli import common as common
from tests.test_crash_sync import make_states

Tensors = dict[str, torch.Tensor]
VERSIONS = 6


@pytest.fixture(scope="module")
def history() -> list[Tensors]:
    """Six tensors: four bf16 matrices, a bf16 vector and a float32 one."""
    shapes = {f"model.layers.{i}.mlp.up_proj.weight": (48, 32) for i in range(4)}
    return make_states(shapes | {"model.norm.weight": (32,)}, versions=VERSIONS, seed=3)


@pytest.fixture(scope="module")
def pristine(history: list[Tensors], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "store"
    pub = Publisher(path, max_frame_bytes=1024, max_object_bytes=4096, anchor_policy="never")
    for v in range(1, VERSIONS + 1):
        pub.publish(history[v], version=v, anchor=True if v == 5 else None)
    return path


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "store"))


def manifest(store: Path, version: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((store / manifest_key(version)).read_text())
    return data


def rewrite(store: Path, version: int, m: dict[str, Any]) -> None:
    (store / manifest_key(version)).write_text(json.dumps(m, indent=1) + "\n")


def objects(store: Path, version: int) -> list[Path]:
    return sorted((store / "versions" / f"{version:020d}").glob("*.dsz"))


def kinds(report: VerifyReport) -> list[tuple[str, int | None]]:
    return sorted((p.kind, p.version) for p in report.problems)


def cli(*args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


# --- healthy ------------------------------------------------------------------------------


def test_a_healthy_store_passes_fast_and_deep(pristine: Path) -> None:
    events: list[Progress] = []
    fast = verify_store(pristine, progress=events.append)
    assert fast.ok and fast.mode == "store", fast.problems
    assert fast.versions == tuple(range(1, VERSIONS + 1))
    frames = sum(
        len(t["frames"]) for v in fast.versions for t in manifest(pristine, v)["tensors"].values()
    )
    assert fast.frames == frames
    assert events and events[-1].frames_done == frames == events[-1].frames_total
    stored = sum(p.stat().st_size for v in fast.versions for p in objects(pristine, v))
    assert fast.bytes_read == stored and fast.orphans == 0
    deep = verify_store(pristine, deep=True)
    assert deep.ok and deep.mode == "deep", deep.problems
    assert deep.tensors_checked == 6 * VERSIONS and deep.unverified == 0
    assert deep.bytes_read == 2 * stored
    assert deep.summary().endswith(": ok")
    result = cli("verify", pristine, "--deep")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [deep.summary()]
    as_json = json.loads(cli("verify", pristine, "--json").stdout)
    assert as_json["ok"] is True and as_json["problems"] == [] and as_json["mode"] == "store"


def test_an_empty_or_missing_store_is_not_ok(tmp_path: Path) -> None:
    """Nothing wrong was found, but nothing was verified either: not "ok"."""
    report = verify_store(tmp_path / "nothing")
    assert not report.ok and report.empty and report.problems == () and report.versions == ()
    assert "holds no committed version" in report.summary()
    assert cli("verify", tmp_path / "nothing").exit_code == common.EXIT_NOT_FOUND


# --- damage -------------------------------------------------------------------------------


def assert_damaged(
    store: Path, expected: list[tuple[str, int | None]], *, deep: bool = False
) -> VerifyReport:
    report = verify_store(store, deep=deep)
    assert kinds(report) == sorted(expected), [p.line() for p in report.problems]
    result = cli("verify", store, *(["--deep"] if deep else []))
    assert result.exit_code == common.EXIT_DAMAGED, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(expected) + 1
    assert all(line.split(":")[0] in {k for k, _ in expected} for line in lines[:-1])
    assert lines[-1] == report.summary()
    return report


def test_missing_object(store: Path) -> None:
    gone = objects(store, 3)[0]
    gone.unlink()
    report = assert_damaged(store, [(MISSING_OBJECT, 3)])
    assert report.problems[0].key == gone.relative_to(store).as_posix()
    deep = verify_store(store, deep=True)
    assert kinds(deep) == [(MISSING_OBJECT, 3)] and deep.unverified > 0


def test_truncated_object(store: Path) -> None:
    obj = objects(store, 2)[0]
    obj.write_bytes(obj.read_bytes()[: obj.stat().st_size // 2])
    report = assert_damaged(store, [(TRUNCATED, 2)])
    assert "ends at byte" in report.problems[0].message
    assert kinds(verify_store(store, deep=True)) == [(TRUNCATED, 2)]


def test_flipped_byte_fails_the_xxh3(store: Path) -> None:
    m = manifest(store, 4)
    name, entry = next((n, e) for n, e in m["tensors"].items() if e["frames"])
    f = entry["frames"][0]
    path = store / f["object"]
    raw = bytearray(path.read_bytes())
    raw[f["offset"] + f["length"] // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    report = assert_damaged(store, [(XXH3, 4)])
    assert report.problems[0].tensor == name and report.problems[0].key == f["object"]


def test_damaged_manifest(store: Path, pristine: Path) -> None:
    (store / manifest_key(4)).write_text('{"format_version": 1, "version": 4')
    # v5 is an anchor (it does not need v4); v4's objects are now orphans
    report = assert_damaged(store, [(MANIFEST, 4)])
    assert report.orphans == len(objects(store, 4))
    shutil.copy(pristine / manifest_key(4), store / manifest_key(4))
    m = manifest(store, 2)
    m["version"] = 7  # parses, but names another version than its key
    rewrite(store, 2, m)
    report = assert_damaged(store, [(MANIFEST, 2), (CHAIN, 3), (CHAIN, 4)])
    assert [p.message for p in report.problems if p.kind == CHAIN] == [
        "its parent version 2 is damaged",
        "cannot be reached from an anchor: its chain breaks at version 3",
    ]


def test_missing_parent_manifest(store: Path) -> None:
    (store / manifest_key(2)).unlink()
    report = assert_damaged(store, [(MISSING_PARENT, 3), (CHAIN, 4)])
    chain = next(p for p in report.problems if p.kind == CHAIN)
    assert "breaks at version 3" in chain.message
    deep = verify_store(store, deep=True)
    assert kinds(deep) == kinds(report) and deep.unverified == 2 * 6  # v3 and v4 not reached


def test_wrong_parent_digest(store: Path) -> None:
    m = manifest(store, 3)
    m["parent"]["state_digest"] = "0" * 64
    rewrite(store, 3, m)
    assert_damaged(store, [(PARENT_DIGEST, 3), (CHAIN, 4)])


def test_wrong_parent_adler32(store: Path) -> None:
    m = manifest(store, 4)  # v5 is an anchor: nothing depends on v4
    name = "model.norm.weight"
    m["tensors"][name]["parent_adler32"] ^= 1
    rewrite(store, 4, m)
    report = assert_damaged(store, [(PARENT_ADLER32, 4)])
    assert report.problems[0].tensor == name


def test_damaged_latest(store: Path) -> None:
    (store / LATEST_KEY).write_text("not json")
    assert_damaged(store, [(LATEST, None)])


def test_latest_with_another_sha256(store: Path) -> None:
    latest = json.loads((store / LATEST_KEY).read_text())
    latest["sha256"] = "f" * 64
    (store / LATEST_KEY).write_text(json.dumps(latest))
    assert_damaged(store, [(LATEST, VERSIONS)])


def craft_wrong_values(store: Path, version: int) -> str:
    """Re-encode the first frame of a tensor of ``version`` (an anchor frame of new words,
    ``raw`` or ``raw-planes``) with one element changed in the same codec, store it in a new
    object, and point the manifest at it with the right length and XXH3-64: a frame that is
    valid in every way but its content."""
    m = manifest(store, version)
    name = "model.layers.2.mlp.up_proj.weight"
    f = m["tensors"][name]["frames"][0]
    assert f["codec"] in (RAW, RAW_PLANES)
    stored = (store / f["object"]).read_bytes()[f["offset"] : f["offset"] + f["length"]]
    words = np.empty(f["stop"] - f["start"], dtype="<u2")
    FrameDecoder().decode_into(f["codec"], stored, words)
    words[3] ^= 0x0100
    frame = FrameEncoder().raw(words) if f["codec"] == RAW else FrameEncoder2().raw_planes(words)
    key = f"versions/{version:020d}/{'e' * 12}-000000.dsz"
    (store / key).write_bytes(frame)
    f.update(object=key, offset=0, length=len(frame), xxh3=xxhash.xxh3_64_hexdigest(frame))
    rewrite(store, version, m)
    return name


@pytest.mark.parametrize("version", [1, 5])
def test_wrong_values_in_a_valid_frame_only_the_deep_check_finds(store: Path, version: int) -> None:
    name = craft_wrong_values(store, version)
    fast = verify_store(store)
    assert fast.ok, fast.problems
    assert cli("verify", store).exit_code == 0
    deep = assert_damaged(store, [(ADLER32, version)], deep=True)
    problem = deep.problems[0]
    assert problem.tensor == name and "decodes to Adler-32" in problem.message
    # the versions after it cannot be replayed for that tensor: counted, not reported
    assert deep.unverified == (3 if version == 1 else 1)


# --- memory of the deep check -------------------------------------------------------------


def randn(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=g).to(torch.bfloat16)


def deep_peak(path: Path, elements: int) -> tuple[int, int]:
    """(model bytes, peak traced memory of a deep check) for a store of 40 bf16 tensors of
    ``elements`` each, 3 versions, 4 frames per tensor whatever the size."""
    g = torch.Generator().manual_seed(5)
    tensors = {
        f"w{i:02d}": torch.randn(elements, generator=g).to(torch.bfloat16) for i in range(40)
    }
    pub = Publisher(path, max_frame_bytes=elements // 2)
    pub.publish(tensors, version=1)
    for v in (2, 3):
        for t in tensors.values():
            t[v::29] += 1.0
        pub.publish(tensors, version=v)
    tracemalloc.start()
    try:
        report = verify_store(path, deep=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok and report.tensors_checked == 120 and report.frames == 40 * 4 * 3
    return 40 * 2 * elements, peak


def test_deep_replay_memory_is_bounded_by_a_tensor(tmp_path: Path) -> None:
    """Tensors 4x larger (same count, same frames): the peak grows by about one tensor
    (and the frames in flight), not by the model (5 MiB -> 20 MiB). numpy's allocations are
    traced; the fixed part is the decoder's 2 MiB of buffers and the parsed manifests."""
    small_model, small = deep_peak(tmp_path / "small", 64 << 10)
    big_model, big = deep_peak(tmp_path / "big", 256 << 10)
    tensor = 2 * (256 << 10)
    assert big - small < 4 * tensor < (big_model - small_model) / 7, (small, big)
    assert big < big_model / 4, big


# --- checkout -----------------------------------------------------------------------------


def test_checkout_healthy_and_tampered(
    pristine: Path, history: list[Tensors], tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    pull_checkpoint(str(pristine), dest)
    for url in (None, str(pristine)):
        report = verify_checkout(dest, url)
        assert report.ok and report.mode == "checkout" and report.versions == (VERSIONS,)
        assert report.tensors_checked == 6
    assert cli("verify", "--checkout", dest).exit_code == 0
    ok = cli("verify", "--checkout", dest, pristine)
    assert ok.exit_code == 0 and ok.stdout.strip().endswith(": ok")
    name = "model.layers.1.mlp.up_proj.weight"
    ck = MappedCheckpoint(locate(dest), writable=True)
    ck.tensors[name].view(torch.int16)[5] ^= 0x0004
    ck.flush()
    report = verify_checkout(dest, pristine)
    assert kinds(report) == [(ADLER32, VERSIONS)]
    assert report.problems[0].tensor == name and report.problems[0].key == "model.safetensors"
    result = cli("verify", "--checkout", dest, pristine, "--json")
    assert result.exit_code == common.EXIT_MISMATCH
    data = json.loads(result.stdout)
    assert [p["tensor"] for p in data["problems"]] == [name] and data["ok"] is False
    text = cli("verify", "--checkout", dest)
    assert text.exit_code == common.EXIT_MISMATCH and name in text.stdout


def test_checkout_sidecar_disagrees_with_the_store(pristine: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    pull_checkpoint(str(pristine), dest, version=3)
    sidecar = json.loads((dest / SIDECAR).read_text())
    sidecar["state_digest"] = "1" * 64
    (dest / SIDECAR).write_text(json.dumps(sidecar))
    assert verify_checkout(dest).ok  # the files match the sidecar's checksums
    report = verify_checkout(dest, pristine)
    assert kinds(report) == [(SIDECAR_MISMATCH, 3)]


def test_checkout_of_a_folder_with_another_table(pristine: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    pull_checkpoint(str(pristine), dest, version=2)
    sidecar = json.loads((dest / SIDECAR).read_text())
    sidecar["adler32"]["extra.weight"] = 1
    (dest / SIDECAR).write_text(json.dumps(sidecar))
    report = verify_checkout(dest)
    assert kinds(report) == [(TABLE, 2)] and report.problems[0].tensor == "extra.weight"


def test_checkout_of_a_folder_deltastore_did_not_write(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=SIDECAR):
        verify_checkout(tmp_path)
    result = cli("verify", "--checkout", tmp_path)
    assert result.exit_code == common.EXIT_MISMATCH


@pytest.mark.parametrize(
    "args", [("verify",), ("verify", "--checkout", ".", "--deep")], ids=["nothing", "deep-checkout"]
)
def test_verify_usage_errors(args: tuple[str, ...]) -> None:
    assert cli(*args).exit_code == common.EXIT_USAGE


# --- signatures ---------------------------------------------------------------------------

KEY = Ed25519Key.generate("ops")
PUBLIC = KEY.public_key()
SIGNED_VERSIONS = 6  # anchor copies of v3 and v5; v6 (forged below) is a delta nothing needs


@pytest.fixture(scope="module")
def signed_pristine(history: list[Tensors], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("signed") / "store"
    pub = Publisher(path, max_frame_bytes=1024, signing_key=KEY, anchor_policy="every:2")
    for v in range(1, SIGNED_VERSIONS + 1):
        pub.publish(history[v], version=v)
    assert sorted(int(p.stem) for p in (path / "anchors").glob("*.json")) == [3, 5]
    return path


@pytest.fixture
def signed(signed_pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(signed_pristine, tmp_path / "signed"))


def test_a_signed_store_passes_with_its_key(
    signed_pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for deep in (False, True):
        report = verify_store(signed_pristine, deep=deep, keys=(PUBLIC,))
        assert report.ok and report.trusted_keys == ("ops",), report.problems
        assert report.summary().endswith(", signatures checked (key id ops): ok")
    keyless = verify_store(signed_pristine, keys=None)
    assert keyless.ok and keyless.trusted_keys == ()
    assert keyless.unchecked_signatures == SIGNED_VERSIONS + 2  # manifests and copies
    assert "8 signatures not checked (no trusted key)" in keyless.summary()
    result = cli("verify", signed_pristine, "--deep", "--trusted-keys", PUBLIC.to_text())
    assert result.exit_code == 0, result.output
    keyfile = tmp_path / "trusted.pub"
    keyfile.write_text(f"# the writer\n{PUBLIC.to_text()}\n")
    as_json = json.loads(
        cli("verify", signed_pristine, "--trusted-keys", f"@{keyfile}", "--json").stdout
    )
    assert as_json["ok"] is True and as_json["trusted_keys"] == ["ops"]
    monkeypatch.setenv("DELTASTORE_TRUSTED_KEYS", PUBLIC.to_text())
    assert verify_store(signed_pristine).trusted_keys == ("ops",)  # default: the environment
    assert cli("verify", signed_pristine).exit_code == 0


def put(store: Path, key: str, data: bytes) -> None:
    """Write a manifest, and point ``LATEST`` at its bytes if it names it (as a forger who
    can write to the bucket would)."""
    (store / key).write_bytes(data)
    latest = json.loads((store / LATEST_KEY).read_text())
    if latest["manifest"] == key:
        latest["sha256"] = hashlib.sha256(data).hexdigest()
        (store / LATEST_KEY).write_text(json.dumps(latest))


def forge(store: Path, key: str, how: str) -> None:
    """Replace the manifest or copy at ``key`` by a forgery made ``how``."""
    path = store / key
    m = parse_manifest(path.read_bytes())
    if how == "unsigned":
        forged = m.model_copy(update={"signature": None}).to_bytes()
    elif how == "unknown-key":
        forged = sign_manifest(m, Ed25519Key.generate("intruder")).to_bytes()
    elif how == "hmac-with-the-public-key":  # anyone can compute it: the public key is public
        forged = sign_manifest(m, SigningKey("ops", PUBLIC.raw)).to_bytes()
    elif how == "edited":  # a frame's Adler-32 changed after signing, the signature kept
        data = json.loads(path.read_bytes())
        data["tensors"]["model.norm.weight"]["frames"][0]["adler32"] ^= 1
        forged = json.dumps(data).encode()
    else:  # "replayed": version 5's validly signed manifest under version 6's key
        assert how == "replayed"
        forged = (store / manifest_key(5)).read_bytes()
    put(store, key, forged)


FORGERIES = ["unsigned", "unknown-key", "hmac-with-the-public-key", "edited", "replayed"]
REASONS = {
    "unsigned": "is not signed",
    "unknown-key": "key id 'intruder', which this reader does not trust",
    "hmac-with-the-public-key": "signed with hmac_sha256 under key id 'ops'",
    "edited": "the signature does not match (key id 'ops')",
    "replayed": "validly signed manifest of version 5, not 6: a replayed manifest",
}


@pytest.mark.parametrize("how", FORGERIES)
def test_a_forged_manifest_is_a_problem(
    signed: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = manifest_key(SIGNED_VERSIONS)
    forge(signed, key, how)
    for deep in (False, True):
        report = verify_store(signed, deep=deep, keys=(PUBLIC,))
        # the forged manifest is left out, so LATEST names no good manifest
        assert kinds(report) == [(LATEST, SIGNED_VERSIONS), (SIGNATURE, SIGNED_VERSIONS)]
        problem = report.problems[0]
        assert problem.kind == SIGNATURE and problem.key == key, report.problems
        assert REASONS[how] in problem.message
    if how != "replayed":  # without a key (a replay claims another version: a manifest problem)
        assert verify_store(signed, keys=()).ok  # the fast check cannot tell a forgery
    result = cli("verify", signed, "--trusted-keys", PUBLIC.to_text(), "--json")
    assert result.exit_code == common.EXIT_DAMAGED, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is False and data["kinds"] == {SIGNATURE: 1, LATEST: 1}
    assert [(p["kind"], p["key"]) for p in data["problems"]] == [
        (SIGNATURE, key),
        (LATEST, LATEST_KEY),
    ]
    monkeypatch.setenv("DELTASTORE_TRUSTED_KEYS", PUBLIC.to_text())  # the key in the env
    for flags in ((), ("--deep",)):
        result = cli("verify", signed, *flags)
        assert result.exit_code == common.EXIT_DAMAGED, result.output
        assert result.stdout.startswith(f"signature: v{SIGNED_VERSIONS} {key}: ")


@pytest.mark.parametrize("how", ["unsigned", "hmac-with-the-public-key"])
def test_a_forged_anchor_copy_is_a_problem(signed: Path, how: str) -> None:
    forge(signed, anchor_key(3), how)
    report = verify_store(signed, deep=True, keys=(PUBLIC,))
    assert kinds(report) == [(SIGNATURE, 3)], report.problems
    assert report.problems[0].key == anchor_key(3) and REASONS[how] in report.problems[0].message
    result = cli("verify", signed, "--trusted-keys", PUBLIC.to_text())
    assert result.exit_code == common.EXIT_DAMAGED, result.output


def test_a_frame_without_its_blake3(signed: Path) -> None:
    """v6's first frame of a tensor replaced by other bytes; its XXH3-64 and length fixed in
    the manifest, which is signed again (a broken writer) or left unsigned-checked: the
    BLAKE3 the manifest records tells the bytes are not those published."""
    m = manifest(signed, SIGNED_VERSIONS)
    name, entry = next((n, e) for n, e in m["tensors"].items() if e["frames"])
    f = entry["frames"][0]
    path = signed / f["object"]
    raw = bytearray(path.read_bytes())
    raw[f["offset"] + f["length"] // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    f["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(raw[f["offset"] : f["offset"] + f["length"]]))
    resigned = sign_manifest(parse_manifest(json.dumps(m).encode()), KEY)
    put(signed, manifest_key(SIGNED_VERSIONS), resigned.to_bytes())
    for keys in ((PUBLIC,), ()):
        for deep in (False, True):
            report = verify_store(signed, deep=deep, keys=keys)
            assert kinds(report) == [(BLAKE3, SIGNED_VERSIONS)], report.problems
            assert report.problems[0].key == f["object"] and report.problems[0].tensor == name
    result = cli("verify", signed, "--deep", "--trusted-keys", PUBLIC.to_text())
    assert result.exit_code == common.EXIT_DAMAGED and result.stdout.startswith("blake3: ")


@pytest.mark.parametrize("text", ["nonsense", KEY.to_text(), "@/nonexistent/keys.pub"])
def test_bad_trusted_keys_are_a_usage_error(
    signed_pristine: Path, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = cli("verify", signed_pristine, "--trusted-keys", text)
    assert result.exit_code == common.EXIT_USAGE, result.output
    assert "--trusted-keys" in result.output
    monkeypatch.setenv("DELTASTORE_TRUSTED_KEYS", text)
    assert cli("verify", signed_pristine).exit_code == common.EXIT_USAGE
    with pytest.raises(ValueError, match="DELTASTORE_TRUSTED_KEYS is invalid"):
        verify_store(signed_pristine)


def test_checkout_against_a_forged_manifest(signed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    pull_checkpoint(str(signed), dest, version=4)
    assert verify_checkout(dest, signed, keys=(PUBLIC,)).trusted_keys == ("ops",)
    forge(signed, manifest_key(4), "unsigned")
    assert verify_checkout(dest, signed, keys=()).ok  # nothing checks the signature
    with pytest.raises(SignatureError, match="is not signed"):
        verify_checkout(dest, signed, keys=(PUBLIC,))
    result = cli("verify", "--checkout", dest, signed, "--trusted-keys", PUBLIC.to_text())
    assert result.exit_code == common.EXIT_DAMAGED, result.output
