"""Signed manifests: HMAC-SHA256 over a manifest's canonical bytes (spec section 6.7).

A writer configured with a key adds ``"signature": {"key_id": ..., "hmac_sha256": ...}`` to
every manifest it commits. A reader configured with keys rejects, with :class:`SignatureError`
and before it fetches any frame, a manifest that is unsigned, signed with a key id it does not
hold, whose HMAC does not match (modified, or signed with another secret), or that is validly
signed for another version (an older manifest replayed under a newer version's key).

Keys come from an argument (``signing_key=`` on :class:`~deltastore.Publisher`,
:class:`~deltastore.ShardWriter`, :func:`~deltastore.commit_parts` and
:class:`~deltastore.Subscriber`: a :class:`SigningKey`, a sequence of them, or None for no
signing) or, by default, from the environment variable ``DELTASTORE_SIGNING_KEY``:
``<key_id>:<secret>``, the secret in hex or base64 (at least 16 bytes). Several keys may be
given, separated by commas, for key rotation: writers sign with the first, readers accept any.

Secrets never appear in reprs, messages, logs or manifests; HMACs are compared with
:func:`hmac.compare_digest`.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import os
import re
from collections.abc import Mapping, Sequence
from typing import Final, Literal, TypeAlias

from deltastore.errors import SignatureError
from deltastore.format.manifest import KEY_ID_PATTERN, Manifest, Signature

#: Environment variable read when no ``signing_key`` argument is given.
SIGNING_KEY_ENV: Final = "DELTASTORE_SIGNING_KEY"
#: Shortest secret accepted, in bytes (HMAC-SHA256 keys SHOULD be 32 bytes).
MIN_SECRET_BYTES: Final = 16

_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


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
        _check_key_id(key_id)
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

    def hmac_sha256(self, data: bytes) -> str:
        """HMAC-SHA256 of ``data`` with this key's secret, as 64 lowercase hex digits."""
        return hmac.new(self._secret, data, hashlib.sha256).hexdigest()

    @classmethod
    def parse(cls, text: str) -> SigningKey:
        """A key from ``<key_id>:<secret>``, the secret in hex or (standard or URL-safe,
        padding optional) base64; an even-length run of hex digits is read as hex."""
        key_id, sep, encoded = text.strip().partition(":")
        if not sep:
            raise ValueError("a signing key is written <key_id>:<hex or base64 secret>")
        key_id = key_id.strip()
        _check_key_id(key_id)
        return cls(key_id, _decode_secret(key_id, encoded.strip()))


def _check_key_id(key_id: object) -> None:
    if not isinstance(key_id, str) or not re.fullmatch(KEY_ID_PATTERN, key_id):
        raise ValueError("a key id is 1 to 64 ASCII letters, digits, '.', '_' or '-'")


def _decode_secret(key_id: str, text: str) -> bytes:
    if _HEX.fullmatch(text):
        return bytes.fromhex(text)
    std = text.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(std + "=" * (-len(std) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(
            f"the secret of signing key {key_id!r} is neither hex nor base64"
        ) from None


def parse_keys(text: str) -> tuple[SigningKey, ...]:
    """Keys from ``<key_id>:<secret>[,<key_id>:<secret>...]`` (the environment form)."""
    keys = tuple(SigningKey.parse(part) for part in text.split(","))
    ids = [k.key_id for k in keys]
    if len(set(ids)) != len(ids):
        raise ValueError(f"signing key ids repeat: {', '.join(ids)}")
    return keys


KeyOption: TypeAlias = "SigningKey | Sequence[SigningKey] | Literal[_Default.FROM_ENV] | None"


def resolve_keys(
    option: KeyOption = FROM_ENV, environ: Mapping[str, str] | None = None
) -> tuple[SigningKey, ...]:
    """The keys a ``signing_key`` option stands for: none for None, the environment's
    (``DELTASTORE_SIGNING_KEY``, none when unset or empty) for :data:`FROM_ENV`."""
    if option is FROM_ENV:
        text = (os.environ if environ is None else environ).get(SIGNING_KEY_ENV, "")
        if not text.strip():
            return ()
        try:
            return parse_keys(text)
        except ValueError as exc:
            raise ValueError(f"{SIGNING_KEY_ENV} is invalid: {exc}") from None
    if option is None:
        return ()
    if isinstance(option, SigningKey):
        return (option,)
    if isinstance(option, str | bytes) or not isinstance(option, Sequence):
        raise TypeError(
            "signing_key is a SigningKey, a sequence of them, or None; use "
            "SigningKey.parse() for the '<key_id>:<secret>' form"
        )
    keys = tuple(option)
    if not keys or not all(isinstance(k, SigningKey) for k in keys):
        raise TypeError("signing_key sequences hold one or more SigningKey objects")
    return keys


def sign_manifest(manifest: Manifest, key: SigningKey) -> Manifest:
    """``manifest`` with a signature of its canonical bytes by ``key`` (replacing any)."""
    digest = key.hmac_sha256(manifest.canonical_bytes())
    signature = Signature(key_id=key.key_id, hmac_sha256=digest)
    return manifest.model_copy(update={"signature": signature})


def verify_manifest(
    manifest: Manifest, keys: Sequence[SigningKey], *, version: int, name: str = "manifest"
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
            f"{name} is signed with key id {sig.key_id!r}, which this reader does not hold "
            f"(it holds {_ids(keys)}); nothing was fetched"
        )
    if not hmac.compare_digest(key.hmac_sha256(manifest.canonical_bytes()), sig.hmac_sha256):
        raise SignatureError(
            f"{name}: the signature does not match (key id {sig.key_id!r}): the manifest was "
            "modified or signed with another secret; nothing was fetched"
        )
    if manifest.version != version:
        raise SignatureError(
            f"{name} holds a validly signed manifest of version {manifest.version}, not "
            f"{version}: a replayed manifest; nothing was fetched"
        )


def _ids(keys: Sequence[SigningKey]) -> str:
    return " or ".join(repr(k.key_id) for k in keys)


__all__ = [
    "FROM_ENV",
    "MIN_SECRET_BYTES",
    "SIGNING_KEY_ENV",
    "KeyOption",
    "SignatureError",
    "SigningKey",
    "parse_keys",
    "resolve_keys",
    "sign_manifest",
    "verify_manifest",
]
