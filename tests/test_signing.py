"""Signed manifests: publishers sign, keyed subscribers reject anything not signed for them.

A store of three versions (anchor, delta, delta) is signed with ``KEY``. A subscriber that
holds ``KEY`` and is at version 1 must refuse (``SignatureError``) an unsigned, re-signed,
tampered or replayed manifest before it reads a single data object (the store is wrapped in a
:class:`FaultyStore` that logs every operation), and keep its tensors bit-wise at version 1.
Secrets never show in reprs, messages, logs, manifests or ``LATEST``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from deltastore import (
    DeltastoreError,
    LocalStore,
    ManifestError,
    Publisher,
    RowSlice,
    ShardWriter,
    SignatureError,
    SigningKey,
    Subscriber,
    commit_parts,
)
from deltastore.format import signing as signing_module
from deltastore.format.manifest import (
    Manifest,
    TensorEntry,
    Writer,
    manifest_key,
    parse_manifest,
    state_digest,
)
from deltastore.format.signing import (
    SIGNING_KEY_ENV,
    parse_keys,
    resolve_keys,
    sign_manifest,
    verify_manifest,
)
from deltastore.testing.faults import FaultyStore
from deltastore_cli import app

SECRET = bytes(range(0x40, 0x60))  # 32 bytes
KEY = SigningKey("trainer-2026", SECRET)
OTHER_SECRET = b"another secret, 32 bytes long!!!"
SECRET_FORMS = [SECRET.hex(), SECRET.hex().upper(), base64.b64encode(SECRET).decode()]
SHAPES = {"embed.weight": (300, 64), "norm.weight": (64,), "head.bias": (7,)}
OPTIONS: dict[str, Any] = {"max_frame_bytes": 8192, "max_object_bytes": 16384}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16).clone()


def versions() -> list[dict[str, torch.Tensor]]:
    """Three versions of a small bf16 model; each changes ~3% of the elements."""
    gen = torch.Generator().manual_seed(7)
    out = [{n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}]
    for _ in range(2):
        nxt = {}
        for name, t in out[-1].items():
            words = bits(t).reshape(-1)
            hit = torch.rand(words.numel(), generator=gen) < 0.03
            hit[0] = True
            words[hit] ^= 3
            nxt[name] = words.view(torch.bfloat16).reshape(t.shape)
        out.append(nxt)
    return out


def assert_secret_absent(text: str | bytes) -> None:
    blob = text if isinstance(text, bytes) else text.encode("utf-8", "replace")
    for form in [*SECRET_FORMS, base64.urlsafe_b64encode(SECRET).decode().rstrip("=")]:
        assert form.encode() not in blob
        assert form.lower().encode() not in blob.lower()
    assert SECRET not in blob


@dataclass
class Signed:
    root: Path
    versions: list[dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def signed_template(tmp_path_factory: pytest.TempPathFactory) -> Signed:
    root = tmp_path_factory.mktemp("signed") / "store"
    vs = versions()
    pub = Publisher(root, signing_key=KEY, **OPTIONS)
    for i, tensors in enumerate(vs, start=1):
        assert pub.publish(tensors, version=i).kind == ("anchor" if i == 1 else "delta")
    return Signed(root, vs)


@pytest.fixture
def signed(signed_template: Signed, tmp_path: Path) -> Signed:
    root = tmp_path / "store"
    shutil.copytree(signed_template.root, root)
    return Signed(root, signed_template.versions)


def manifest_bytes(root: Path, version: int) -> bytes:
    return (root / manifest_key(version)).read_bytes()


# --- keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize("form", [*SECRET_FORMS, base64.urlsafe_b64encode(SECRET).decode()])
def test_key_text_forms(form: str) -> None:
    assert SigningKey.parse(f"trainer-2026:{form}") == KEY
    assert SigningKey.parse(f"  trainer-2026 : {form} ") == KEY
    assert SigningKey.parse(f"trainer-2026:{form.rstrip('=')}") == KEY  # padding optional


def test_several_keys_for_rotation() -> None:
    keys = parse_keys(f"new:{OTHER_SECRET.hex()},trainer-2026:{SECRET.hex()}")
    assert [k.key_id for k in keys] == ["new", "trainer-2026"]
    assert keys[1] == KEY and keys[0] != KEY
    assert resolve_keys(list(keys)) == keys
    assert resolve_keys(KEY) == (KEY,)
    assert resolve_keys(None) == ()


@pytest.mark.parametrize(
    "text",
    [
        SECRET.hex(),  # no key id
        f"bad id:{SECRET.hex()}",
        f"bad/id:{SECRET.hex()}",
        f":{SECRET.hex()}",
        f"{'x' * 65}:{SECRET.hex()}",
        f"k:{SECRET.hex()[:30]}",  # 15 bytes: too short
        f"k:{SECRET.hex()}!",  # neither hex nor base64
        f"k:{SECRET.hex()},k:{SECRET.hex()}",  # repeated id
        f"k:{SECRET.hex()},",
    ],
)
def test_bad_key_text_is_refused_without_echoing_the_secret(text: str) -> None:
    with pytest.raises(ValueError, match="key") as info:
        parse_keys(text)
    assert_secret_absent(str(info.value))


def test_bad_key_arguments() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SigningKey("k", b"short")
    with pytest.raises(TypeError):
        resolve_keys(f"k:{SECRET.hex()}")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        resolve_keys([])
    with pytest.raises(AttributeError):
        KEY.key_id = "other"  # type: ignore[misc]


def test_key_reprs_hide_the_secret() -> None:
    for text in (repr(KEY), str(KEY), f"{KEY}", f"{KEY!r}", repr([KEY]), repr({"k": KEY})):
        assert "trainer-2026" in text
        assert "redacted" in text
        assert_secret_absent(text)
    assert not hasattr(KEY, "__dict__")
    copy = pickle.loads(pickle.dumps(KEY))  # noqa: S301 - handed to spawned writers
    assert copy == KEY and hash(copy) == hash(KEY)


# --- signing -------------------------------------------------------------------------------


def test_publisher_signs_every_manifest(signed: Signed) -> None:
    for version in (1, 2, 3):
        data = manifest_bytes(signed.root, version)
        m = parse_manifest(data)
        assert m.signature is not None and m.signature.key_id == KEY.key_id
        # the signature is HMAC-SHA256 over the canonical bytes: the manifest as serialized
        # without its signature member (spec 6.7), computed here independently
        obj = json.loads(data)
        del obj["signature"]
        canonical = json.dumps(obj, indent=1, ensure_ascii=False).encode() + b"\n"
        assert m.canonical_bytes() == canonical
        assert m.signature.hmac_sha256 == hmac.new(SECRET, canonical, hashlib.sha256).hexdigest()
        # the signature is the last member: the stored bytes are the canonical ones plus it
        sig = f',\n "signature": {{\n  "key_id": "{KEY.key_id}",\n  "hmac_sha256": '
        assert (
            data
            == canonical[:-3] + sig.encode() + f'"{m.signature.hmac_sha256}"\n }}\n}}\n'.encode()
        )
        assert_secret_absent(data)
    assert_secret_absent((signed.root / "LATEST").read_bytes())


def test_keyed_and_keyless_subscribers_read_a_signed_store(signed: Signed) -> None:
    for key in (KEY, None, [SigningKey("other", OTHER_SECRET), KEY]):
        sub = Subscriber(signed.root, signing_key=key)
        assert sub.sync().version == 3
        assert sub.tensors is not None
        for name, t in signed.versions[-1].items():
            assert torch.equal(bits(sub.tensors[name]), bits(t)), name


def test_unsigned_store_still_works_without_a_key(tmp_path: Path) -> None:
    vs = versions()
    pub = Publisher(tmp_path, signing_key=None, **OPTIONS)
    for i, tensors in enumerate(vs[:2], start=1):
        pub.publish(tensors, version=i)
    assert b"signature" not in manifest_bytes(tmp_path, 2)
    unsigned = parse_manifest(manifest_bytes(tmp_path, 2))
    assert "signature" not in unsigned.model_dump()  # absent, not null, in every dump
    assert "signature" not in json.loads(unsigned.model_dump_json())
    sub = Subscriber(tmp_path, signing_key=None)
    assert sub.sync().version == 2
    # and a keyed subscriber refuses it: a fresh one reads no data object at all
    store = FaultyStore(LocalStore(tmp_path))
    keyed = Subscriber(store, signing_key=KEY)
    with pytest.raises(SignatureError, match="not signed"):
        keyed.sync()
    assert keyed.tensors is None and keyed.version is None
    assert not [op for op in store.ops if op.key.startswith("versions/")]


# --- rejection before any frame is fetched ---------------------------------------------------


def _tamper(root: Path, version: int) -> None:
    obj = json.loads(manifest_bytes(root, version))
    entry = obj["tensors"]["head.bias"]
    entry["adler32"] = (entry["adler32"] + 1) % (1 << 32)
    obj["state_digest"] = state_digest(
        (n, t["dtype"], t["shape"], t["adler32"]) for n, t in obj["tensors"].items()
    )
    (root / manifest_key(version)).write_text(json.dumps(obj, indent=1))


def _edit_signature(root: Path, version: int, **fields: Any) -> None:
    obj = json.loads(manifest_bytes(root, version))
    if fields.get("drop"):
        del obj["signature"]
    else:
        obj["signature"].update(fields)
    (root / manifest_key(version)).write_text(json.dumps(obj, indent=1))


def _resign(root: Path, version: int, key: SigningKey) -> None:
    m = sign_manifest(parse_manifest(manifest_bytes(root, version)), key)
    (root / manifest_key(version)).write_bytes(m.to_bytes())


def _replay(root: Path, old: int, new: int) -> None:
    (root / manifest_key(new)).write_bytes(manifest_bytes(root, old))


DAMAGES = {
    "unsigned": (lambda r: _edit_signature(r, 3, drop=True), "not signed"),
    "wrong-secret": (lambda r: _resign(r, 3, SigningKey(KEY.key_id, OTHER_SECRET)), "not match"),
    "unknown-key-id": (lambda r: _resign(r, 3, SigningKey("intruder", SECRET)), "intruder"),
    "renamed-key-id": (lambda r: _edit_signature(r, 3, key_id="other"), "does not trust"),
    "flipped-hmac": (
        lambda r: _edit_signature(r, 3, hmac_sha256="0" * 64),
        "not match",
    ),
    "tampered-content": (lambda r: _tamper(r, 3), "not match"),
    "tampered-parent": (lambda r: _tamper(r, 2), "not match"),
    "replayed-delta": (lambda r: _replay(r, 2, 3), "replayed"),
    "replayed-anchor": (lambda r: _replay(r, 1, 3), "replayed"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_keyed_subscriber_rejects_before_fetching(signed: Signed, damage: str) -> None:
    store = FaultyStore(LocalStore(signed.root))
    sub = Subscriber(store, signing_key=KEY)
    assert sub.sync(1).version == 1
    assert sub.tensors is not None
    before = {n: bits(t) for n, t in sub.tensors.items()}
    edit, words = DAMAGES[damage]
    edit(signed.root)
    store.reset()
    with pytest.raises(SignatureError) as info:
        sub.sync()
    err = info.value
    assert isinstance(err, DeltastoreError)
    assert words in str(err), str(err)
    assert_secret_absent(str(err))
    assert_secret_absent(repr(err))
    reads = [op for op in store.ops if op.name == "get_range" or op.key.startswith("versions/")]
    assert reads == [], reads
    assert sub.version == 1
    for name, want in before.items():
        assert torch.equal(bits(sub.tensors[name]), want), name
    # without a key the replayed manifest is still refused (its version is not its key's)
    if damage.startswith("replayed"):
        with pytest.raises(ManifestError, match="claims version"):
            Subscriber(signed.root, signing_key=None).sync()


def test_latest_naming_a_forged_manifest_is_not_trusted(signed: Signed) -> None:
    """LATEST names the SHA-256 of the manifest; a LATEST rewritten to name a forged one
    leads to that manifest, which then fails its signature."""
    _tamper(signed.root, 3)
    body = manifest_bytes(signed.root, 3)
    latest = json.loads((signed.root / "LATEST").read_text())
    latest["sha256"] = hashlib.sha256(body).hexdigest()
    (signed.root / "LATEST").write_text(json.dumps(latest))
    sub = Subscriber(signed.root, signing_key=KEY)
    with pytest.raises(SignatureError):
        sub.sync()
    assert sub.version is None and sub.tensors is None
    assert sub.sync(2).version == 2  # the intact versions are still readable


def test_hmac_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(signing_module.hmac, "compare_digest", spy)
    m = sign_manifest(parse_manifest(_example("delta.json")), KEY)
    verify_manifest(m, [KEY], version=m.version)
    assert calls and all(len(a) == 64 for a, _ in calls)


# --- environment, rotation, sharded writers, CLI ---------------------------------------------


def test_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vs = versions()
    legacy = f"trainer-2026:{base64.b64encode(SECRET).decode()}"
    monkeypatch.setenv(SIGNING_KEY_ENV, legacy)
    with pytest.raises(ValueError, match="explicit request") as refused:
        Publisher(tmp_path, **OPTIONS)  # HMAC signs only when asked for by name
    assert_secret_absent(str(refused.value))
    monkeypatch.setenv(SIGNING_KEY_ENV, legacy.replace(":", ":hmac:", 1))
    Publisher(tmp_path, **OPTIONS).publish(vs[0], version=1)
    m = parse_manifest(manifest_bytes(tmp_path, 1))
    assert m.signature is not None and m.signature.key_id == "trainer-2026"
    assert Subscriber(tmp_path).sync().version == 1
    monkeypatch.setenv(SIGNING_KEY_ENV, legacy)  # readers still take the old form
    assert Subscriber(tmp_path).sync().version == 1
    # signing_key=None turns the check off even with the variable set
    unsigned = tmp_path / "unsigned"
    Publisher(unsigned, signing_key=None, **OPTIONS).publish(vs[0], version=1)
    assert parse_manifest(manifest_bytes(unsigned, 1)).signature is None
    assert Subscriber(unsigned, signing_key=None).sync().version == 1
    with pytest.raises(SignatureError):
        Subscriber(unsigned).sync()
    # a malformed variable fails loudly, naming the variable but not the secret
    monkeypatch.setenv(SIGNING_KEY_ENV, f"trainer-2026:{SECRET.hex()}!")
    with pytest.raises(ValueError, match=SIGNING_KEY_ENV) as info:
        Subscriber(unsigned)
    assert_secret_absent(str(info.value))
    monkeypatch.setenv(SIGNING_KEY_ENV, "  ")
    assert Subscriber(unsigned).sync().version == 1  # empty: no key


def test_key_rotation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Versions signed with the old key stay readable by readers that hold both keys; a
    publisher holding both attaches to an old-key head and signs with the new key."""
    vs = versions()
    old, new = KEY, SigningKey("trainer-2027", OTHER_SECRET)
    Publisher(tmp_path, signing_key=old, **OPTIONS).publish(vs[0], version=1)
    monkeypatch.setenv(
        SIGNING_KEY_ENV, f"trainer-2027:hmac:{OTHER_SECRET.hex()},trainer-2026:hmac:{SECRET.hex()}"
    )
    pub = Publisher(tmp_path, **OPTIONS)
    assert pub.attach(vs[0]) == 1
    assert pub.publish(vs[1], version=2).kind == "delta"
    ids = [parse_manifest(manifest_bytes(tmp_path, v)).signature for v in (1, 2)]
    assert [s.key_id if s else None for s in ids] == ["trainer-2026", "trainer-2027"]
    assert Subscriber(tmp_path).sync().version == 2  # both keys, from the environment
    with pytest.raises(SignatureError, match="trainer-2026"):
        Subscriber(tmp_path, signing_key=new).sync()  # the anchor is signed with the old key
    with pytest.raises(SignatureError):
        Publisher(tmp_path, signing_key=SigningKey("x", OTHER_SECRET)).attach(vs[1])


def test_commit_parts_signs_and_shard_writers_check(tmp_path: Path) -> None:
    full = versions()[0]
    writers = [ShardWriter(tmp_path, rank, 2, signing_key=KEY, **OPTIONS) for rank in range(2)]
    rows = {0: (0, 120), 1: (120, 300)}
    for w in writers:
        a, b = rows[w.rank]
        part = {"embed.weight": RowSlice(full["embed.weight"][a:b], (300, 64), a)}
        if w.rank == 1:
            part |= {n: RowSlice.whole(full[n]) for n in ("norm.weight", "head.bias")}
        w.publish(part, version=1)
    manifest = commit_parts(tmp_path, version=1, world=2, timeout_s=10, signing_key=KEY)
    assert manifest.signature is not None and manifest.signature.key_id == KEY.key_id
    for w in writers:
        assert w.finish(1, timeout_s=10) == manifest
    assert Subscriber(tmp_path, signing_key=KEY).sync().version == 1
    intruder = ShardWriter(tmp_path, 0, 2, signing_key=SigningKey("x", OTHER_SECRET), **OPTIONS)
    with pytest.raises(SignatureError):
        intruder.attach({"embed.weight": RowSlice(full["embed.weight"][:120], (300, 64), 0)})


def test_cli_refuses_unsigned_versions_with_a_key_in_the_environment(tmp_path: Path) -> None:
    Publisher(tmp_path, signing_key=None, **OPTIONS).publish(versions()[0], version=1)
    env = {SIGNING_KEY_ENV: f"trainer-2026:{SECRET.hex()}"}
    result = CliRunner().invoke(app, ["log", str(tmp_path)], env=env)
    assert result.exit_code == 5, result.output  # damaged store
    assert "not signed" in result.output
    assert_secret_absent(result.output)
    assert CliRunner().invoke(app, ["log", str(tmp_path)], env={SIGNING_KEY_ENV: ""}).exit_code == 0


def test_secret_never_logged(signed: Signed, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    vs = versions()
    pub = Publisher(signed.root / "fresh", signing_key=KEY, **OPTIONS)
    pub.publish(vs[0], version=1)
    pub.publish(vs[1], version=2)
    Subscriber(signed.root / "fresh", signing_key=KEY).sync()
    _tamper(signed.root, 3)
    for key in (KEY, SigningKey(KEY.key_id, OTHER_SECRET)):
        with pytest.raises(SignatureError) as info:
            Subscriber(signed.root, signing_key=key).sync()
        assert_secret_absent(str(info.value))
    assert caplog.records  # the run did log (publish, LATEST, refusals)
    assert_secret_absent(caplog.text)
    for record in caplog.records:
        assert_secret_absent(repr(record.args))


# --- canonical bytes -------------------------------------------------------------------------


def _example(name: str) -> bytes:
    return (Path(__file__).parent.parent / "manifests/schema/examples/valid" / name).read_bytes()


NAMES = st.text(
    st.characters(
        blacklist_categories=("Cs",), blacklist_characters="".join(map(chr, range(32))) + "\x7f"
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    names=st.lists(NAMES, min_size=0, max_size=5, unique=True),
    library=st.text(st.characters(blacklist_categories=("Cs",)), max_size=64),
    version=st.integers(0, 2**63 - 1),
    dims=st.lists(st.integers(0, 2**48), min_size=0, max_size=3),
)
def test_canonical_bytes_follow_the_spec(
    names: list[str], library: str, version: int, dims: list[int]
) -> None:
    """Canonical bytes = ``json.dumps(manifest without signature, indent=1,
    ensure_ascii=False) + "\\n"`` (spec 6.7), for any names, library text and numbers; a
    signed manifest survives a round trip through its bytes and verifies."""
    shape = [*dims, 0]  # no elements: a valid anchor needs no frames
    entries = {
        n: TensorEntry(
            dtype="bfloat16", shape=shape, adler32=1, parent_adler32=None, changed=0, frames=[]
        )
        for n in names
    }
    m = Manifest(
        format_version=1,
        version=version,
        kind="anchor",
        parent=None,
        state_digest=state_digest((n, "bfloat16", shape, 1) for n in names),
        created="2026-01-02T03:04:05.123456789Z",
        writer=Writer(token="0" * 32, library=library),
        tensors=entries,
    )
    spec = json.dumps(m.model_dump(exclude={"signature"}), indent=1, ensure_ascii=False)
    assert m.canonical_bytes() == spec.encode() + b"\n" == m.to_bytes()
    s = sign_manifest(m, KEY)
    back = parse_manifest(s.to_bytes())
    assert back == s and back.canonical_bytes() == m.canonical_bytes()
    verify_manifest(back, [KEY], version=version)


# --- fuzz: mutated signed manifests ----------------------------------------------------------

SIGNED_EXAMPLE = _example("signed-delta.json")


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(SIGNED_EXAMPLE) - 1), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_signed_manifests_never_verify_with_other_content(
    edits: list[tuple[int, int]],
) -> None:
    """Byte edits of a signed manifest: only typed errors; whatever verifies has exactly the
    original canonical content (edits of whitespace or escapes do not change the content)."""
    key = SigningKey("example-key", bytes(range(32)))
    original = parse_manifest(SIGNED_EXAMPLE)
    data = bytearray(SIGNED_EXAMPLE)
    for pos, value in edits:
        data[pos] = value
    try:
        m = parse_manifest(bytes(data))
        verify_manifest(m, [key], version=original.version)
    except (ManifestError, SignatureError):
        return
    assert m.canonical_bytes() == original.canonical_bytes()


def test_spec_example_signature() -> None:
    """docs/spec/format-v1.md 6.7.6: the HMAC of the section 13 delta with the example key."""
    spec = (Path(__file__).parent.parent / "docs/spec/format-v1.md").read_text()
    start = spec.index("```json\n", spec.index("`manifests/00000000000000000002.json` (the delta"))
    body = spec[start + 8 : spec.index("```\n", start + 8)].encode()
    example = spec[spec.index("#### 6.7.6 Example") :]
    documented = example.split('"hmac_sha256": "')[1].split('"')[0]
    m = parse_manifest(body)
    assert m.canonical_bytes() == body and len(body) == 1044
    signed = sign_manifest(m, SigningKey("example-key", bytes(range(32))))
    assert signed.signature is not None and signed.signature.hmac_sha256 == documented
    assert f"({len(signed.to_bytes())} bytes stored)" in example


def test_tensors_handed_over_at_an_unsigned_version_are_refused(tmp_path: Path) -> None:
    """A keyed subscriber told its tensors are at version 1 checks version 1's manifest too."""
    vs = versions()
    Publisher(tmp_path, signing_key=None, **OPTIONS).publish(vs[0], version=1)
    tensors = {n: t.clone() for n, t in vs[0].items()}
    store = FaultyStore(LocalStore(tmp_path))
    sub = Subscriber(store, tensors=tensors, version=1, signing_key=KEY)
    with pytest.raises(SignatureError, match="not signed"):
        sub.sync()
    assert not [op for op in store.ops if op.key.startswith("versions/")]
    assert all(torch.equal(bits(tensors[n]), bits(t)) for n, t in vs[0].items())
