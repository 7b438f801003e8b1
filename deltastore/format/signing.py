"""Signed manifests (spec section 6.7): Ed25519 public-key signatures, HMAC-SHA256 for old
stores, over a manifest's canonical bytes.

A writer configured with a key adds ``"signature": {"key_id": ..., "ed25519": ...}`` to every
manifest and anchor copy it commits, and a BLAKE3 digest to each of their frames
(:func:`~deltastore.format.ed25519.frame_digest`). A reader configured with keys rejects, with
:class:`SignatureError` and before it fetches any frame, a manifest that is unsigned, signed
with a key id it does not hold, signed with another algorithm than the key of that id (an
HMAC made with a public key), whose signature does not match (modified, or signed by another
key), or that is validly signed for another version (a replay).

Writers sign with an :class:`~deltastore.format.ed25519.Ed25519Key` (private); readers hold
:class:`~deltastore.format.ed25519.PublicKey` s, which cannot sign. HMAC
(:class:`SigningKey`, a shared secret: whoever can check can also sign) stays readable, and is
written only when a writer is given one explicitly.

Keys come from arguments or, by default, from the environment:

- writers' ``signing_key=`` (:class:`~deltastore.Publisher`, :class:`~deltastore.ShardWriter`,
  :func:`~deltastore.commit_parts`): ``DELTASTORE_SIGNING_KEY``, one key text
  (``<key_id>:ed25519-private:<seed>``, or ``<key_id>:hmac:<secret>`` to sign with HMAC) or
  several separated by commas (the first signs), or ``@<path>`` of a file holding them;
- readers' ``trusted_keys=`` (:class:`~deltastore.Subscriber`, ``pull``, ``verify``):
  ``DELTASTORE_TRUSTED_KEYS``, public key texts (``<key_id>:ed25519:<public key>``) separated
  by commas or newlines, or ``@<path>`` (one per line, ``#`` comments). Readers also trust the
  keys of ``DELTASTORE_SIGNING_KEY`` (including the old ``<key_id>:<secret>`` HMAC form).

Secrets never appear in reprs, messages, logs or manifests; HMACs are compared with
:func:`hmac.compare_digest`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, Literal, TypeAlias

from deltastore.errors import SignatureError
from deltastore.format.ed25519 import (
    PRIVATE_TAG,
    PUBLIC_TAG,
    Algorithm,
    Ed25519Key,
    PublicKey,
    check_key_id,
    decode_bytes,
)
from deltastore.format.manifest import Manifest, Signature

#: Environment variable of the writers' keys (read when no ``signing_key`` argument is given).
SIGNING_KEY_ENV: Final = "DELTASTORE_SIGNING_KEY"
#: Environment variable of the readers' public keys (when no ``trusted_keys`` is given).
TRUSTED_KEYS_ENV: Final = "DELTASTORE_TRUSTED_KEYS"
#: Shortest secret accepted, in bytes (HMAC-SHA256 keys SHOULD be 32 bytes).
MIN_SECRET_BYTES: Final = 16
#: Text-form tag of an HMAC key a writer may sign with.
HMAC_TAG: Final = "hmac"


class _Default(enum.Enum):
    FROM_ENV = "from the environment"


#: Default of every ``signing_key`` option: the keys of ``DELTASTORE_SIGNING_KEY``, if set.
FROM_ENV: Final = _Default.FROM_ENV


class SigningKey:
    """A named HMAC-SHA256 secret. ``repr``/``str`` show the key id only.

    ``secret`` is raw bytes, at least :data:`MIN_SECRET_BYTES` long; :meth:`parse` reads the
    ``<key_id>:<hex or base64>`` text form. Instances are immutable and picklable (so they can
    be handed to spawned writer processes)."""

    __slots__ = ("_key_id", "_secret")
    _key_id: str
    _secret: bytes

    def __init__(self, key_id: str, secret: bytes) -> None:
        check_key_id(key_id)
        if not isinstance(secret, bytes | bytearray) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the secret of signing key {key_id!r} must be at least {MIN_SECRET_BYTES} bytes"
            )
        object.__setattr__(self, "_key_id", key_id)
        object.__setattr__(self, "_secret", bytes(secret))

    @property
    def key_id(self) -> str:
        """The key's public name, written into signed manifests."""
        return self._key_id

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("SigningKey is immutable")

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self._key_id!r}, secret=<redacted>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SigningKey):
            return NotImplemented
        return self._key_id == other._key_id and hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash((SigningKey, self._key_id))

    def __reduce__(self) -> tuple[type[SigningKey], tuple[str, bytes]]:
        return (SigningKey, (self._key_id, self._secret))

    algorithm: Final[Algorithm] = "hmac_sha256"

    def hmac_sha256(self, data: bytes) -> str:
        """HMAC-SHA256 of ``data`` with this key's secret, as 64 lowercase hex digits."""
        return hmac.new(self._secret, data, hashlib.sha256).hexdigest()

    def sign(self, data: bytes) -> Signature:
        """The ``signature`` member for ``data`` (``hmac_sha256``)."""
        return Signature(key_id=self._key_id, hmac_sha256=self.hmac_sha256(data))

    def verify(self, data: bytes, signature: Signature) -> bool:
        """Whether ``signature`` holds this key's HMAC of ``data`` (constant-time compare)."""
        if signature.hmac_sha256 is None:
            return False
        return hmac.compare_digest(self.hmac_sha256(data), signature.hmac_sha256)

    @classmethod
    def parse(cls, text: str) -> SigningKey:
        """A key from ``<key_id>:[hmac:]<secret>``, the secret in hex or (standard or URL-safe,
        padding optional) base64; an even-length run of hex digits is read as hex."""
        key_id, sep, encoded = text.strip().partition(":")
        if not sep:
            raise ValueError("a signing key is written <key_id>:hmac:<hex or base64 secret>")
        key_id = key_id.strip()
        check_key_id(key_id)
        tag, sep, rest = encoded.partition(":")
        if sep and tag.strip() == HMAC_TAG:
            encoded = rest
        return cls(key_id, decode_bytes(encoded.strip(), f"the secret of signing key {key_id!r}"))


#: What signs manifests (writers): an Ed25519 private key, or an HMAC key (old stores).
Signer: TypeAlias = "Ed25519Key | SigningKey"
#: What checks them (readers): public keys, or HMAC keys (old stores); private keys check too.
Verifier: TypeAlias = "PublicKey | Ed25519Key | SigningKey"

KeyOption: TypeAlias = "Signer | Sequence[Signer] | Literal[_Default.FROM_ENV] | None"
TrustOption: TypeAlias = "Verifier | Sequence[Verifier] | str | Literal[_Default.FROM_ENV] | None"

_Role = Literal["writer", "reader", "trusted"]


def parse_key(text: str, role: _Role = "reader") -> Verifier:
    """One key text. ``role`` says where it was given: ``"writer"`` (it must sign: an
    ``ed25519-private`` key or an explicit ``hmac`` key), ``"trusted"`` (a public key or an
    explicit ``hmac`` key), ``"reader"`` (any form, the old ``<key_id>:<secret>`` HMAC form
    included)."""
    parts = text.strip().split(":")
    tag = parts[1].strip() if len(parts) == 3 else ""
    if tag == PRIVATE_TAG:
        key = Ed25519Key.parse(text)
        if role == "trusted":
            raise ValueError(
                f"key {key.key_id!r} is a private key; readers hold the public key "
                f"('{key.key_id}:{PUBLIC_TAG}:...', the .pub file `deltastore keygen` wrote)"
            )
        return key
    if tag == PUBLIC_TAG:
        if role == "writer":
            Ed25519Key.parse(text)  # raises: a public key cannot sign
        return PublicKey.parse(text)
    if tag not in ("", HMAC_TAG):
        raise ValueError(
            f"unknown key kind {tag!r}: a key is <key_id>:{PRIVATE_TAG}:..., "
            f"<key_id>:{PUBLIC_TAG}:... or <key_id>:{HMAC_TAG}:..."
        )
    if not tag and role != "reader":
        raise ValueError(
            "<key_id>:<secret> is an HMAC key, which signs only on explicit request: sign with "
            f"an Ed25519 key ('<key_id>:{PRIVATE_TAG}:...', `deltastore keygen`), or write "
            f"'<key_id>:{HMAC_TAG}:<secret>' to keep HMAC (every reader can then sign too)"
        )
    return SigningKey.parse(text)


def parse_keys(text: str, role: _Role = "reader") -> tuple[Verifier, ...]:
    """Keys from key texts separated by commas or newlines (blank lines and ``#`` comment
    lines skipped), or from the file ``@<path>`` holding such text; ids must not repeat."""
    text = text.strip()
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read the key file {str(path)!r}: {exc.strerror}") from None
    lines = [ln.split("#", 1)[0] for ln in text.splitlines()]
    parts = [p.strip() for ln in lines if ln.strip() for p in ln.split(",")]
    if not parts or not all(parts):
        raise ValueError("no key given" if not parts else "an empty key between commas")
    keys = tuple(parse_key(part, role) for part in parts)
    ids = [k.key_id for k in keys]
    if len(set(ids)) != len(ids):
        raise ValueError(f"key ids repeat: {', '.join(ids)}")
    return keys


def _from_env(name: str, role: _Role, environ: Mapping[str, str] | None) -> tuple[Verifier, ...]:
    text = (os.environ if environ is None else environ).get(name, "")
    if not text.strip():
        return ()
    try:
        return parse_keys(text, role)
    except ValueError as exc:
        raise ValueError(f"{name} is invalid: {exc}") from None


def resolve_keys(
    option: KeyOption = FROM_ENV, environ: Mapping[str, str] | None = None
) -> tuple[Signer, ...]:
    """The keys a writer's ``signing_key`` option stands for (it signs with the first): none
    for None, ``DELTASTORE_SIGNING_KEY``'s (none when unset or empty) for :data:`FROM_ENV`."""
    if option is FROM_ENV:
        found = _from_env(SIGNING_KEY_ENV, "writer", environ)
        return tuple(k for k in found if isinstance(k, SigningKey | Ed25519Key))  # all of them
    if option is None:
        return ()
    if isinstance(option, SigningKey | Ed25519Key):
        return (option,)
    if isinstance(option, PublicKey):
        raise TypeError(
            f"signing_key {option.key_id!r} is a public key, which cannot sign: give the "
            "writer its Ed25519Key (readers take public keys as trusted_keys)"
        )
    if isinstance(option, str | bytes) or not isinstance(option, Sequence):
        raise TypeError(
            "signing_key is an Ed25519Key (or an HMAC SigningKey), a sequence of them, or "
            "None; use Ed25519Key.parse() for the '<key_id>:ed25519-private:...' form"
        )
    keys = tuple(k for k in option if isinstance(k, SigningKey | Ed25519Key))
    if not keys or len(keys) != len(option):
        raise TypeError("signing_key sequences hold one or more Ed25519Key or SigningKey")
    return keys


def resolve_trust(
    trusted_keys: TrustOption = FROM_ENV,
    signing_key: KeyOption | TrustOption = FROM_ENV,
    environ: Mapping[str, str] | None = None,
) -> tuple[Verifier, ...]:
    """The keys a reader checks manifests with: ``trusted_keys`` (a key, a sequence of them,
    key text or ``@<path>``; :data:`FROM_ENV`: ``DELTASTORE_TRUSTED_KEYS``) together with
    ``signing_key``'s (:data:`FROM_ENV`: ``DELTASTORE_SIGNING_KEY``, old HMAC form included).
    No keys: the reader checks no signatures. One key id naming two keys is a ValueError."""
    keys = [*_trust(trusted_keys, TRUSTED_KEYS_ENV, "trusted", environ)]
    keys += _trust(signing_key, SIGNING_KEY_ENV, "reader", environ)
    table: dict[str, Verifier] = {}
    for key in keys:
        seen = table.setdefault(key.key_id, key)
        if seen is not key and _public(seen) != _public(key):
            raise ValueError(f"key id {key.key_id!r} names two different keys")
    return tuple(table.values())


def _trust(
    option: object, env: str, role: _Role, environ: Mapping[str, str] | None
) -> tuple[Verifier, ...]:
    if option is FROM_ENV:
        return _from_env(env, role, environ)
    if option is None:
        return ()
    if isinstance(option, str):
        return parse_keys(option, role)
    if isinstance(option, SigningKey | Ed25519Key | PublicKey):
        return (option,)
    if isinstance(option, Sequence) and all(
        isinstance(k, SigningKey | Ed25519Key | PublicKey) for k in option
    ):
        return tuple(option)
    raise TypeError("trusted_keys is a PublicKey, a sequence of them, key text, or None")


def _public(key: Verifier) -> object:
    return key.public_key() if isinstance(key, Ed25519Key) else key


def sign_manifest(manifest: Manifest, key: Signer) -> Manifest:
    """``manifest`` with a signature of its canonical bytes by ``key`` (replacing any). An
    Ed25519 signature needs ``blake3`` in every frame (ValueError otherwise: a writer bug)."""
    if isinstance(key, Ed25519Key):
        missing = next((n for n, t in manifest.tensors.items() if any(
            f.blake3 is None for f in t.frames)), None)  # fmt: skip
        if missing is not None:
            raise ValueError(
                f"{missing}: frames without blake3 cannot be signed with ed25519 (a writer "
                "signing with an Ed25519Key records each frame's BLAKE3; were the parts "
                "written by writers without the key?)"
            )
    return manifest.model_copy(update={"signature": key.sign(manifest.canonical_bytes())})


def verify_manifest(
    manifest: Manifest, keys: Sequence[Verifier], *, version: int, name: str = "manifest"
) -> None:
    """Raise :class:`SignatureError` unless ``manifest``, read from the key of ``version``
    (``name``, for messages), is signed by one of ``keys`` for that version. No keys: no check.
    """
    if not keys:
        return
    sig = manifest.signature
    if sig is None:
        raise SignatureError(
            f"{name} is not signed, and this reader accepts only manifests signed with key id "
            f"{_ids(keys)}; nothing was fetched"
        )
    key = next((k for k in keys if k.key_id == sig.key_id), None)
    if key is None:
        raise SignatureError(
            f"{name} is signed with key id {sig.key_id!r}, which this reader does not trust "
            f"(it trusts {_ids(keys)}); nothing was fetched. Add the writer's public key to "
            f"{TRUSTED_KEYS_ENV} (or --trusted-keys) if it is yours"
        )
    if key.algorithm != sig.algorithm:
        raise SignatureError(
            f"{name} is signed with {sig.algorithm} under key id {sig.key_id!r}, which this "
            f"reader holds as an {key.algorithm} key: refused (a forged signature); nothing "
            "was fetched"
        )
    if not key.verify(manifest.canonical_bytes(), sig):
        raise SignatureError(
            f"{name}: the signature does not match (key id {sig.key_id!r}): the manifest was "
            "modified or signed with another key; nothing was fetched"
        )
    if manifest.version != version:
        raise SignatureError(
            f"{name} holds a validly signed manifest of version {manifest.version}, not "
            f"{version}: a replayed manifest; nothing was fetched"
        )


def _ids(keys: Sequence[Verifier]) -> str:
    return " or ".join(repr(k.key_id) for k in keys)


__all__ = [
    "FROM_ENV",
    "HMAC_TAG",
    "MIN_SECRET_BYTES",
    "SIGNING_KEY_ENV",
    "TRUSTED_KEYS_ENV",
    "Ed25519Key",
    "KeyOption",
    "PublicKey",
    "SignatureError",
    "Signer",
    "SigningKey",
    "TrustOption",
    "Verifier",
    "parse_key",
    "parse_keys",
    "resolve_keys",
    "resolve_trust",
    "sign_manifest",
    "verify_manifest",
]
