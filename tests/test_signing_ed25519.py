"""Ed25519-signed stores against a hostile store: readers hold public keys only.

A store of five versions (anchor, then deltas; anchor copies at 3 and 5) is signed with
``KEY``, an Ed25519 private key; readers trust ``KEY.public_key()``. Each forgery below (a
manifest signed by the wrong key, by an unknown key id, with an HMAC made from the public key,
stripped of its signature, edited after signing; a frame replaced by bytes of the same length
and the same XXH3-64; a data object swapped between versions; an anchor copy swapped for an
older signed one) must be refused by the :class:`~deltastore.Subscriber` and by ``pull`` with
a typed error and its documented exit code, and never change a weight: tensors stay bit-wise
at the version they were at. A reader process holding only the public key cannot publish a
version another reader accepts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from typer.testing import CliRunner

from deltastore import (
    ChainError,
    Ed25519Key,
    FrameError,
    IntegrityError,
    ManifestError,
    PublicKey,
    Publisher,
    SignatureError,
    SigningKey,
    Subscriber,
)
from deltastore.format.ed25519 import frame_digest
from deltastore.format.keys import anchor_key
from deltastore.format.manifest import Manifest, manifest_key, parse_manifest, state_digest
from deltastore.format.signing import (
    SIGNING_KEY_ENV,
    TRUSTED_KEYS_ENV,
    parse_keys,
    resolve_keys,
    resolve_trust,
    sign_manifest,
)
from deltastore_cli import app

KEY = Ed25519Key("trainer-ed", bytes(range(32)))
TRUST = [KEY.public_key()]
SHAPES = {"embed.weight": (300, 64), "norm.weight": (64,), "head.bias": (7,)}
OPTIONS: dict[str, Any] = {"max_frame_bytes": 8192, "max_object_bytes": 16384}
VERSIONS = 5


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16).clone()


def versions() -> list[dict[str, torch.Tensor]]:
    """Five versions of a small bf16 model; each changes ~3% of the elements."""
    gen = torch.Generator().manual_seed(11)
    out = [{n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}]
    for _ in range(VERSIONS - 1):
        nxt = {}
        for name, t in out[-1].items():
            words = bits(t).reshape(-1)
            hit = torch.rand(words.numel(), generator=gen) < 0.03
            hit[0] = True
            words[hit] ^= 5
            nxt[name] = words.view(torch.bfloat16).reshape(t.shape)
        out.append(nxt)
    return out


@dataclass
class Store:
    root: Path
    versions: list[dict[str, torch.Tensor]]

    def manifest(self, version: int, copy: bool = False) -> Manifest:
        key = anchor_key(version) if copy else manifest_key(version)
        return parse_manifest((self.root / key).read_bytes())

    def write(self, version: int, m: Manifest | dict[str, Any], copy: bool = False) -> None:
        key = anchor_key(version) if copy else manifest_key(version)
        data = m.to_bytes() if isinstance(m, Manifest) else json.dumps(m, indent=1).encode()
        (self.root / key).write_bytes(data)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("ed25519") / "store"
    vs = versions()
    pub = Publisher(root, signing_key=KEY, anchor_policy="every:2", **OPTIONS)
    for i, tensors in enumerate(vs, start=1):
        pub.publish(tensors, version=i)
    return Store(root, vs)


@pytest.fixture
def store(template: Store, tmp_path: Path) -> Store:
    root = tmp_path / "store"
    shutil.copytree(template.root, root)
    return Store(root, template.versions)


def assert_at(sub: Subscriber[torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sub.tensors is not None
    for name, t in want.items():
        assert torch.equal(bits(sub.tensors[name]), bits(t)), name


# --- the writer's side -------------------------------------------------------------------------


def test_every_manifest_copy_and_frame_is_signed_and_bound(store: Store) -> None:
    assert sorted(int(p.stem) for p in (store.root / "anchors").glob("*.json")) == [3, 5]
    signed = [store.manifest(v) for v in range(1, VERSIONS + 1)]
    signed += [store.manifest(v, copy=True) for v in (3, 5)]
    for m in signed:
        assert m.signature is not None and m.signature.key_id == KEY.key_id
        assert m.signature.ed25519 is not None and m.signature.hmac_sha256 is None
        assert KEY.public_key().verify(m.canonical_bytes(), m.signature)
        for t in m.tensors.values():
            for f in t.frames:  # BLAKE3 of the stored bytes, computed here independently
                with (store.root / f.object).open("rb") as fh:
                    fh.seek(f.offset)
                    assert f.blake3 == frame_digest(fh.read(f.length))
    sub = Subscriber(store.root, trusted_keys=TRUST)
    assert sub.sync().version == VERSIONS
    assert_at(sub, store.versions[-1])


def test_key_texts_round_trip_and_roles_are_kept_apart(tmp_path: Path) -> None:
    pub = KEY.public_key()
    assert Ed25519Key.parse(KEY.to_text()) == KEY and PublicKey.parse(pub.to_text()) == pub
    assert KEY.to_text() not in repr(KEY) and KEY.to_text().split(":")[2] not in repr(KEY)
    with pytest.raises(ValueError, match="public key"):
        Ed25519Key.parse(pub.to_text())
    with pytest.raises(ValueError, match="private key"):
        parse_keys(KEY.to_text(), "trusted")  # readers are given public keys
    with pytest.raises(ValueError, match="explicit request"):
        resolve_keys(environ={SIGNING_KEY_ENV: "old:" + "00" * 32})
    assert resolve_keys(environ={SIGNING_KEY_ENV: KEY.to_text()}) == (KEY,)
    keyfile = tmp_path / "trusted.pub"
    keyfile.write_text(f"# the trainers\n{pub.to_text()}\n\nnext:ed25519:{'11' * 32}\n")
    trust = resolve_trust(environ={TRUSTED_KEYS_ENV: f"@{keyfile}"})
    assert [k.key_id for k in trust] == ["trainer-ed", "next"]
    with pytest.raises(ValueError, match="two different keys"):
        resolve_trust([pub, PublicKey(KEY.key_id, bytes(32))], None)
    with pytest.raises(TypeError, match="cannot sign"):
        Publisher(tmp_path / "s", signing_key=pub)  # type: ignore[arg-type]


# --- forged manifests ------------------------------------------------------------------------


def _resign(s: Store, key: Ed25519Key | SigningKey, version: int = 5) -> None:
    s.write(version, sign_manifest(s.manifest(version), key))


def _strip(s: Store) -> None:
    obj = json.loads((s.root / manifest_key(5)).read_bytes())
    del obj["signature"]
    s.write(5, obj)


def _edit(s: Store) -> None:
    obj = json.loads((s.root / manifest_key(5)).read_bytes())
    entry = obj["tensors"]["head.bias"]
    entry["adler32"] = (entry["adler32"] + 1) % (1 << 32)
    obj["state_digest"] = state_digest(
        (n, t["dtype"], t["shape"], t["adler32"]) for n, t in obj["tensors"].items()
    )
    s.write(5, obj)


def _hmac_from_public_key(s: Store) -> None:
    """The algorithm-confusion forgery: an HMAC keyed with the (public) key bytes, under the
    Ed25519 key id. Frames keep their BLAKE3 so only the signature is wrong."""
    _resign(s, SigningKey(KEY.key_id, KEY.public_key().raw))


def _no_frame_digest(s: Store) -> None:
    obj = json.loads((s.root / manifest_key(5)).read_bytes())
    frames = [f for t in obj["tensors"].values() for f in t["frames"]]
    del frames[0]["blake3"]
    s.write(5, obj)


Errors = type[Exception] | tuple[type[Exception], ...]
FORGED: dict[str, tuple[Callable[[Store], None], Errors, str]] = {
    "wrong-key": (lambda s: _resign(s, Ed25519Key.generate(KEY.key_id)), SignatureError,
                  "does not match"),
    "unknown-key-id": (lambda s: _resign(s, Ed25519Key.generate("intruder")), SignatureError,
                       "intruder"),
    "hmac-with-public-key": (_hmac_from_public_key, SignatureError, "forged signature"),
    "signature-stripped": (_strip, SignatureError, "not signed"),
    "body-edited": (_edit, SignatureError, "does not match"),
    "frame-digest-dropped": (_no_frame_digest, ManifestError, "blake3"),
    "replayed": (lambda s: shutil.copy(s.root / manifest_key(4), s.root / manifest_key(5)),
                 SignatureError, "replayed"),
}  # fmt: skip


# --- forged data (manifests untouched, or re-signed by the real key) ------------------------


def _first_frame(s: Store, version: int, copy: bool = False) -> tuple[Manifest, Any]:
    m = s.manifest(version, copy)
    frame = next(f for t in m.tensors.values() for f in t.frames)
    return m, frame


def _forge_frame(s: Store, version: int, copy: bool = False) -> tuple[Manifest, Any, bytes]:
    """Replace the first frame's stored bytes by other bytes of the same length."""
    m, f = _first_frame(s, version, copy)
    path = s.root / f.object
    data = bytearray(path.read_bytes())
    forged = bytes(b ^ 0x5A for b in data[f.offset : f.offset + f.length])
    data[f.offset : f.offset + f.length] = forged
    path.write_bytes(bytes(data))
    return m, f, forged


def _collide_unsigned(s: Store) -> None:
    """The forged frame's XXH3 patched into the manifest: a 64-bit collision by
    construction, which the signature then no longer covers."""
    m, f, forged = _forge_frame(s, 5)
    s.write(5, _with_xxh3(m, f, xxhash.xxh3_64_hexdigest(forged)))


def _collide_signed(s: Store) -> None:
    """As if the forged frame had the XXH3-64 the signed manifest records (a real second
    preimage): the manifest, re-signed by the real key, binds the forged XXH3 but the
    original BLAKE3. Only the BLAKE3 check stands between the forged bytes and the decoder."""
    m, f, forged = _forge_frame(s, 5)
    s.write(5, sign_manifest(_with_xxh3(m, f, xxhash.xxh3_64_hexdigest(forged)), KEY))


def _with_xxh3(m: Manifest, frame: Any, value: str) -> Manifest:
    tensors = {
        n: t.model_copy(update={"frames": [
            f.model_copy(update={"xxh3": value}) if f is frame else f for f in t.frames]})
        for n, t in m.tensors.items()
    }  # fmt: skip
    return m.model_copy(update={"tensors": tensors})


def _swap_object(s: Store) -> None:
    """Version 4's first data object copied over version 5's."""
    _, old = _first_frame(s, 4)
    _, new = _first_frame(s, 5)
    shutil.copy(s.root / old.object, s.root / new.object)


FORGED_DATA: dict[str, tuple[Callable[[Store], None], Errors, str]] = {
    "xxh3-collision-unsigned": (_collide_unsigned, SignatureError, "does not match"),
    "xxh3-collision-signed": (_collide_signed, IntegrityError, "BLAKE3"),
    # another length: the frame at its offset is cut short (or its bytes differ)
    "object-swapped-between-versions": (_swap_object, (FrameError, IntegrityError), "frame"),
}
ALL = FORGED | FORGED_DATA


@pytest.mark.parametrize("forgery", list(ALL))
def test_subscriber_refuses_and_applies_nothing(store: Store, forgery: str) -> None:
    sub = Subscriber(store.root, trusted_keys=TRUST)
    assert sub.sync(4).version == 4
    edit, error, words = ALL[forgery]
    edit(store)
    with pytest.raises(error) as info:
        sub.sync(5)
    assert words in str(info.value), str(info.value)
    assert sub.version == 4
    assert_at(sub, store.versions[3])  # bit-wise where it was


@pytest.mark.parametrize("forgery", list(ALL))
def test_pull_refuses_with_the_documented_exit_code(
    store: Store, forgery: str, tmp_path: Path
) -> None:
    runner = CliRunner()
    dest = tmp_path / "ckpt"
    pub = KEY.public_key().to_text()
    first = runner.invoke(app, ["pull", str(store.root), str(dest), "--version", "4",
                                "--trusted-keys", pub, "--lease-ttl", "0"])  # fmt: skip
    assert first.exit_code == 0, first.output
    before = {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file()}
    ALL[forgery][0](store)
    env = {TRUSTED_KEYS_ENV: pub}  # the variable the docs name, as a user would set it
    result = runner.invoke(app, ["pull", str(store.root), str(dest), "--lease-ttl", "0"], env=env)
    assert result.exit_code == 5, result.output  # IntegrityError / ManifestError: 5
    assert {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file()} == before


def _swap_copy(s: Store) -> None:
    shutil.copy(s.root / anchor_key(3), s.root / anchor_key(5))


@pytest.mark.parametrize("forgery", [*ALL, "anchor-copy-swapped"])
@pytest.mark.parametrize("deep", [False, True], ids=["fast", "deep"])
def test_verify_reports_every_forgery(store: Store, forgery: str, deep: bool) -> None:
    env = {TRUSTED_KEYS_ENV: KEY.public_key().to_text()}
    args = ["verify", str(store.root), "--json", *(["--deep"] if deep else [])]
    clean = CliRunner().invoke(app, args, env=env)
    assert clean.exit_code == 0, clean.output
    (_swap_copy if forgery == "anchor-copy-swapped" else ALL[forgery][0])(store)
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 5, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["problems"], report


def test_forged_anchor_frame_is_refused_for_a_fresh_reader(store: Store) -> None:
    """A frame of the anchor (the non-batch decode path), forged with a collision by
    construction and re-signed: refused before decoding."""
    m, f, forged = _forge_frame(store, 1)
    store.write(1, sign_manifest(_with_xxh3(m, f, xxhash.xxh3_64_hexdigest(forged)), KEY))
    (store.root / "anchors").rename(store.root / "no-copies")  # the anchor is the only path
    sub = Subscriber(store.root, trusted_keys=TRUST)
    with pytest.raises(IntegrityError, match="BLAKE3"):
        sub.sync()
    assert sub.tensors is None and sub.version is None


def test_anchor_copy_swapped_for_an_older_signed_copy_is_never_used(store: Store) -> None:
    """anchors/5 replaced by anchors/3's bytes (validly signed, for version 3): a fresh
    reader ignores it (it names another version) and reaches version 5 bit-exact by the
    chain; with the chain gone below it, the reader fails with a typed error."""
    shutil.copy(store.root / anchor_key(3), store.root / anchor_key(5))
    sub = Subscriber(store.root, trusted_keys=TRUST)
    report = sub.sync()
    assert report.version == 5 and report.applied != (5,)  # not from the swapped copy
    assert_at(sub, store.versions[4])
    # the chain below is gone (as after gc): the forged copy is the only way in, and refused
    for v in range(1, 5):
        (store.root / manifest_key(v)).unlink()
    (store.root / anchor_key(3)).unlink()
    fresh = Subscriber(store.root, trusted_keys=TRUST)
    with pytest.raises(ChainError, match="no anchor at or below 5 can be reached"):
        fresh.sync()  # exit code 6 in the CLI
    assert fresh.tensors is None


def test_a_reader_with_only_the_public_key_cannot_publish(store: Store, tmp_path: Path) -> None:
    """A reader process (only DELTASTORE_TRUSTED_KEYS set) tries every way it has to publish
    version 6: unsigned, with the public key as a signing key, with an HMAC of the public key
    bytes, with a fresh Ed25519 key under the trainer's key id. Another reader accepts none."""
    script = """
import sys, torch
from deltastore import Ed25519Key, Publisher, PublicKey, SigningKey
from deltastore.format.signing import resolve_trust
url, path = sys.argv[1], sys.argv[2]
(pub,) = resolve_trust()  # what this reader holds: the public key, nothing else
tensors = torch.load(path)
attempts = {
    "unsigned": None,
    "hmac-of-public-key": SigningKey(pub.key_id, pub.raw),
    "fresh-key-same-id": Ed25519Key.generate(pub.key_id),
}
try:
    Publisher(url, signing_key=pub)
except TypeError as exc:
    print("public key refused:", exc)
for name, key in attempts.items():
    pub = Publisher(url, signing_key=key, max_frame_bytes=8192)
    try:
        head = pub.attach(tensors)
        pub.publish({n: t.clone() for n, t in tensors.items()}, version=head + 1)
        print("published", name, head + 1)
    except Exception as exc:  # e.g. its own key check of the head it attaches to
        print("failed", name, type(exc).__name__)
"""
    path = tmp_path / "v5.pt"
    torch.save(store.versions[4], path)
    env = {k: v for k, v in os.environ.items() if k != SIGNING_KEY_ENV}
    env[TRUSTED_KEYS_ENV] = KEY.public_key().to_text()
    out = subprocess.run(
        [sys.executable, "-c", script, str(store.root), str(path)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert "public key refused" in out.stdout, out.stdout + out.stderr
    # each attempt either failed in the writer (its own key check on attach) or committed a
    # version that no trusting reader accepts
    committed = sorted(int(p.stem) for p in (store.root / "manifests").glob("*.json"))
    assert committed[:VERSIONS] == list(range(1, VERSIONS + 1))
    for version in committed[VERSIONS:]:
        sub = Subscriber(store.root, trusted_keys=TRUST)
        with pytest.raises(SignatureError):
            sub.sync(version)
        assert sub.tensors is None
    assert "published unsigned" in out.stdout, out.stdout + out.stderr  # one got through
    sub = Subscriber(store.root, trusted_keys=TRUST)
    with pytest.raises(SignatureError):
        sub.sync()  # the newest version is a forgery
    assert sub.sync(VERSIONS).version == VERSIONS
    assert_at(sub, store.versions[4])


def test_keygen_writes_a_pair_the_trainer_and_readers_use(tmp_path: Path) -> None:
    runner = CliRunner()
    keys = tmp_path / "keys"
    made = runner.invoke(app, ["keygen", "trainer-cli", "--out", str(keys)])
    assert made.exit_code == 0, made.output
    private, public = keys / "trainer-cli.key", keys / "trainer-cli.pub"
    assert private.stat().st_mode & 0o777 == 0o600
    key = Ed25519Key.parse(private.read_text())
    assert PublicKey.parse(public.read_text()) == key.public_key()
    assert public.read_text().strip() in made.stdout and private.read_text() not in made.output
    again = runner.invoke(app, ["keygen", "trainer-cli", "--out", str(keys)])
    assert again.exit_code == 1 and "never overwrites" in again.output
    assert Ed25519Key.parse(private.read_text()) == key  # untouched
    assert runner.invoke(app, ["keygen", "bad/id", "--out", str(keys)]).exit_code == 2
    # the trainer signs from the file, a reader checks with the other file
    root, vs = tmp_path / "store", versions()
    Publisher(root, signing_key=resolve_keys(environ={SIGNING_KEY_ENV: f"@{private}"})[0],
              **OPTIONS).publish(vs[0], version=1)  # fmt: skip
    pulled = runner.invoke(app, ["pull", str(root), str(tmp_path / "ckpt"), "--lease-ttl",
                                 "0", "--trusted-keys", f"@{public}"])  # fmt: skip
    assert pulled.exit_code == 0, pulled.output
    other = runner.invoke(app, ["pull", str(root), str(tmp_path / "ckpt2"), "--lease-ttl", "0",
                                "--trusted-keys", TRUST[0].to_text()])  # fmt: skip
    assert other.exit_code == 5 and "does not trust" in other.output


def _every_frame_bound(root: Path) -> int:
    """Check every manifest and copy under ``root`` is Ed25519-signed with a BLAKE3 per frame
    that matches the stored bytes; the number of frames checked."""
    n = 0
    for path in [*(root / "manifests").glob("*.json"), *(root / "anchors").glob("*.json")]:
        m = parse_manifest(path.read_bytes())
        assert m.signature is not None and m.signature.ed25519 is not None, path
        assert KEY.public_key().verify(m.canonical_bytes(), m.signature)
        for f in (f for t in m.tensors.values() for f in t.frames):
            with (root / f.object).open("rb") as fh:
                fh.seek(f.offset)
                assert f.blake3 == frame_digest(fh.read(f.length))
            n += 1
    return n


def test_snapshot_free_and_sharded_writers_sign_and_bind_frames(tmp_path: Path) -> None:
    """The other writers: snapshot-free (its own frame packing) and two shard writers whose
    parts one commit signs; readers with the public key reach every version bit-exact."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    root = tmp_path / "free"
    pub = Publisher(root, snapshot="none", optimizer=opt, signing_key=KEY,
                    anchor_policy="every:2", max_frame_bytes=4096)  # fmt: skip
    sub = Subscriber(root, trusted_keys=TRUST)
    for v in range(1, 5):
        if v > 1:
            opt.zero_grad()
            net(torch.randn(8, 64)).square().mean().backward()
            opt.step()
        pub.publish(dict(net.named_parameters()), version=v)
        assert sub.sync().version == v
        assert sub.tensors is not None
        for name, p in net.named_parameters():
            want = p.detach().to(torch.bfloat16)
            assert torch.equal(bits(sub.tensors[name]), bits(want)), (v, name)
    assert list((root / "anchors").glob("*.json")) and _every_frame_bound(root) > 4

    from deltastore import RowSlice, ShardWriter, commit_parts

    sharded, full = tmp_path / "sharded", versions()[0]
    writers = [ShardWriter(sharded, r, 2, signing_key=KEY, **OPTIONS) for r in range(2)]
    for w, (a, b) in zip(writers, ((0, 120), (120, 300)), strict=True):
        part = {"embed.weight": RowSlice(full["embed.weight"][a:b], (300, 64), a)}
        if w.rank == 1:
            part |= {n: RowSlice.whole(full[n]) for n in ("norm.weight", "head.bias")}
        w.publish(part, version=1)
    commit_parts(sharded, version=1, world=2, timeout_s=10, signing_key=KEY)
    assert _every_frame_bound(sharded) >= 3
    reader = Subscriber(sharded, trusted_keys=TRUST)
    assert reader.sync().version == 1
    assert_at(reader, full)
    # parts written without the key cannot be committed under it
    unkeyed = tmp_path / "unkeyed"
    alone = ShardWriter(unkeyed, 0, 1, signing_key=None, **OPTIONS)
    alone.publish({n: RowSlice.whole(t) for n, t in full.items()}, version=1)
    with pytest.raises(ValueError, match="blake3"):
        commit_parts(unkeyed, version=1, world=1, timeout_s=10, signing_key=KEY)
