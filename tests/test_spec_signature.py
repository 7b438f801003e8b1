"""The spec alone is enough to check a signature: section 6.7.6's Ed25519 example, checked
with ``json``, ``cryptography`` and ``blake3`` only (no deltastore code), from the numbers the
spec prints and the example manifest it names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import blake3
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

ROOT = Path(__file__).resolve().parents[1]
SPEC = (ROOT / "docs" / "spec" / "format-v1.md").read_text()
EXAMPLE = ROOT / "manifests" / "schema" / "examples" / "valid" / "signed-ed25519-delta.json"


def section(title: str) -> str:
    start = SPEC.index(title)
    return SPEC[start : SPEC.index("\n#### ", start + 1)]


def test_the_spec_example_verifies_from_the_spec_alone() -> None:
    text = section("#### 6.7.6 Examples")
    seed = bytes.fromhex(re.search(r"hex\s+`([0-9a-f]{64})`", text).group(1))  # type: ignore[union-attr]
    public = re.search(r"public key is\s+`([0-9a-f]{64})`", text).group(1)  # type: ignore[union-attr]
    blake = re.search(r"BLAKE3\s+`([0-9a-f]{64})`", text).group(1)  # type: ignore[union-attr]
    sig = re.search(r'"ed25519": "([0-9a-f]{128})"', text).group(1)  # type: ignore[union-attr]
    sizes = re.search(r"canonical bytes are (\d+)\s+bytes.*?\((\d+) bytes stored\)", text, re.S)
    assert sizes is not None
    # the public key follows from the private key (RFC 8032 5.1.5)
    derived = Ed25519PrivateKey.from_private_bytes(seed).public_key()
    assert derived.public_bytes(Encoding.Raw, PublicFormat.Raw).hex() == public
    # the frame's BLAKE3 (7.6) from the stored bytes of section 13
    frame = bytes.fromhex(re.search(r"\n  (28b52ffd200b59[0-9a-f]+)\s", SPEC).group(1))  # type: ignore[union-attr]
    assert blake3.blake3(frame).hexdigest() == blake
    # canonical bytes (6.7.2): the stored manifest without `signature`, json.dumps(indent=1)
    stored = EXAMPLE.read_bytes()
    obj = json.loads(stored)
    assert obj["signature"] == {"key_id": "example-key", "ed25519": sig}
    assert obj["tensors"]["layer.weight"]["frames"][0]["blake3"] == blake
    del obj["signature"]
    canonical = json.dumps(obj, indent=1, ensure_ascii=False).encode() + b"\n"
    assert (len(canonical), len(stored)) == (int(sizes.group(1)), int(sizes.group(2)))
    # RFC 8032 5.1.7 verification with the public key alone; a changed byte fails
    key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public))
    key.verify(bytes.fromhex(sig), canonical)
    forged = canonical.replace(b'"changed": 1', b'"changed": 2', 1)
    with pytest.raises(InvalidSignature):
        key.verify(bytes.fromhex(sig), forged)
