"""Format v1 manifests: pydantic models at the I/O edge, state digests.

Store key names and the key grammar are in :mod:`deltastore.format.keys`.

A manifest (``manifests/<version:020d>.json``) describes one committed version: its tensors
(dtype, shape, Adler-32 of the new and the parent bytes) and the frames that carry the data.
Parsing is strict (``extra="forbid"``, no type coercion) and checks every invariant of
``docs/spec/format-v1.md`` that can be checked without the data. Models are frozen and safe to
share between threads.

A manifest may carry a ``signature`` (Ed25519, or HMAC-SHA256 for old stores, over
:meth:`Manifest.canonical_bytes`, see :mod:`deltastore.format.signing`), absent in unsigned
manifests; its frames may carry ``blake3`` (required in every frame under Ed25519).

``python -m deltastore.format.schema --write PATH`` regenerates the JSON Schema (``make schema``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from deltastore.errors import ManifestError, UnsupportedFormatError
from deltastore.format.codecs import CODEC_TABLE, NEW_WORDS_CODECS, Codec, unknown_codec
from deltastore.format.dtypes import NAMES, itemsize

# Key names live in deltastore.format.keys; re-exported here for code that imported them
# from this module (deltastore's own modules import deltastore.format.keys).
from deltastore.format.keys import DATA_PREFIX as DATA_PREFIX
from deltastore.format.keys import KEY_PATTERN as KEY_PATTERN
from deltastore.format.keys import LATEST_KEY as LATEST_KEY
from deltastore.format.keys import MANIFEST_KEY_PATTERN, MAX_KEY_LENGTH, OBJECT_PATTERN
from deltastore.format.keys import MANIFEST_PREFIX as MANIFEST_PREFIX
from deltastore.format.keys import MAX_VERSION as MAX_VERSION
from deltastore.format.keys import SEGMENT as SEGMENT
from deltastore.format.keys import data_prefix as data_prefix
from deltastore.format.keys import manifest_key as manifest_key
from deltastore.format.keys import version_of_key as version_of_key
from deltastore.format.ratios import SizeRatios

FORMAT_VERSION: Final = 1
#: Readers refuse manifests larger than this many bytes.
MAX_MANIFEST_BYTES: Final = 256 << 20
#: Readers refuse tensors with more elements than this (2**48).
MAX_ELEMENTS: Final = 1 << 48
MAX_DIMS: Final = 16

NAME_PATTERN: Final = r"^[^\x00-\x1f\x7f]{1,1024}$"
#: The same rule as the JSON Schema states it: unpaired surrogates are excluded explicitly
#: (pydantic refuses them before any pattern is applied; the schema has no such step).
SCHEMA_NAME_PATTERN: Final = r"^[^\x00-\x1f\x7f\ud800-\udfff]{1,1024}$"
#: Key ids of signed manifests: 1 to 64 ASCII letters, digits, ``.``, ``_`` or ``-``.
KEY_ID_PATTERN: Final = r"^[A-Za-z0-9._-]{1,64}$"
#: ``LATEST`` objects larger than this are damaged (the reference writer's are ~160 bytes).
MAX_LATEST_BYTES: Final = 4096

# ``created``: RFC 3339 UTC date-time, year 0001-9999, a date that exists in the proleptic
# Gregorian calendar, hours 00-23, minutes and seconds 00-59 (no leap second). The regular
# expression says it all, so the JSON Schema states the same rule (spec section 6.3).
_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_MONTH_DAY = (
    r"(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])"  # day 01-28 of any month
    r"|(?:0[13-9]|1[0-2])-(?:29|30)"  # 29 and 30: every month but February
    r"|(?:0[13578]|1[02])-31)"  # 31: January, March, May, July, August, October, December
)
_LEAP_DAY = (
    r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])"  # divisible by 4, not by 100
    r"|(?:0[48]|[2468][048]|[13579][26])00)-02-29"  # divisible by 400 (year 0000 excluded)
)
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?"
CREATED_PATTERN: Final = rf"^(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_DAY})T{_TIME}Z$"
_CREATED = re.compile(CREATED_PATTERN)

U32 = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]
Count = Annotated[int, Field(ge=0, le=MAX_ELEMENTS)]
Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
DtypeName = Literal[NAMES]  # type: ignore[valid-type]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Parent(_Model):
    """The version a delta applies to, bound by number and by content."""

    version: Version
    state_digest: Digest


class Writer(_Model):
    """Who wrote the manifest: a random per-publisher token and the library version."""

    token: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    library: Annotated[str, Field(max_length=64)]


def _absent(value: object) -> bool:
    return value is None


class Signature(_Model):
    """A signature of the manifest's canonical bytes by the key named ``key_id``: exactly one
    of ``ed25519`` (RFC 8032, 64 bytes as 128 lowercase hex digits) and ``hmac_sha256``
    (HMAC-SHA256, 64 hex digits; readable for old stores). The absent one is omitted."""

    key_id: Annotated[str, Field(pattern=KEY_ID_PATTERN)]
    ed25519: Annotated[str, Field(pattern=r"^[0-9a-f]{128}$")] | None = Field(
        default=None, exclude_if=_absent
    )
    hmac_sha256: Digest | None = Field(default=None, exclude_if=_absent)

    @model_validator(mode="after")
    def _one(self) -> Signature:
        if (self.ed25519 is None) == (self.hmac_sha256 is None):
            raise ValueError("a signature holds exactly one of ed25519 and hmac_sha256")
        return self

    @property
    def algorithm(self) -> Literal["ed25519", "hmac_sha256"]:
        """``"ed25519"`` or ``"hmac_sha256"``: the member it holds."""
        return "ed25519" if self.ed25519 is not None else "hmac_sha256"


class Frame(_Model):
    """Elements ``[start, stop)`` of a tensor, stored at ``object[offset:offset+length]``."""

    start: Count
    stop: Count
    codec: Codec
    object: Annotated[str, Field(pattern=OBJECT_PATTERN, max_length=MAX_KEY_LENGTH)]
    offset: Annotated[int, Field(ge=0, le=2**62)]
    length: Annotated[int, Field(ge=1, le=2**62)]
    xxh3: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    changed: Count
    adler32: U32
    parent_adler32: U32 | None
    #: BLAKE3-256 (hex) of the stored bytes; in every frame of an Ed25519-signed manifest,
    #: optional elsewhere, omitted when absent (spec section 6.7).
    blake3: Digest | None = Field(default=None, exclude_if=_absent)

    @model_validator(mode="after")
    def _check(self) -> Frame:
        if self.stop <= self.start:
            raise ValueError(f"frame [{self.start}, {self.stop}) is empty or reversed")
        if self.changed > self.stop - self.start:
            raise ValueError(
                f"frame declares {self.changed} changes in {self.stop - self.start} elements"
            )
        return self


class TensorEntry(_Model):
    """One tensor of the version (global, trainer-side name and full shape)."""

    dtype: DtypeName
    shape: Annotated[list[Count], Field(max_length=MAX_DIMS)]
    adler32: U32
    parent_adler32: U32 | None
    changed: Count
    frames: list[Frame]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @model_validator(mode="after")
    def _check(self) -> TensorEntry:
        numel = math.prod(self.shape)
        if numel > MAX_ELEMENTS:
            raise ValueError(f"shape {self.shape} has more than {MAX_ELEMENTS} elements")
        if self.changed > numel:
            raise ValueError(f"{self.changed} changed elements in a tensor of {numel}")
        end = 0
        for frame in self.frames:
            if frame.start < end:
                raise ValueError(f"frame at {frame.start} overlaps or is out of order")
            if frame.stop > numel:
                raise ValueError(
                    f"frame [{frame.start}, {frame.stop}) is past the {numel} elements"
                )
            end = frame.stop
        if sum(f.changed for f in self.frames) != self.changed:
            raise ValueError("the frames' changed counts do not add up to the tensor's")
        return self


class Manifest(_Model, SizeRatios):
    """A committed version. See ``docs/spec/format-v1.md`` for the normative rules."""

    format_version: Literal[1]
    version: Version
    kind: Literal["anchor", "delta"]
    parent: Parent | None
    state_digest: Digest
    created: Annotated[str, Field(json_schema_extra={"pattern": CREATED_PATTERN})]
    writer: Writer
    tensors: dict[Annotated[str, Field(pattern=NAME_PATTERN)], TensorEntry]
    #: Optional: absent in an unsigned manifest (never ``null``). Always the last member.
    signature: Signature | None = None

    @field_validator("created")
    @classmethod
    def _valid_time(cls, value: str) -> str:
        if not _CREATED.fullmatch(value):
            raise ValueError(
                f"{value[:40]!r} is not a UTC time YYYY-MM-DDTHH:MM:SS[.fraction]Z with a real "
                "calendar date (year 0001-9999), hours 00-23, minutes and seconds 00-59"
            )
        return value

    @field_validator("signature", mode="before")
    @classmethod
    def _not_null(cls, value: object) -> object:
        if value is None:
            raise ValueError("signature is an object when present; an unsigned manifest omits it")
        return value

    @model_serializer(mode="wrap")
    def _omit_absent_signature(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Every dump (``model_dump``, JSON, ``to_bytes``) leaves out an absent signature."""
        data: dict[str, Any] = handler(self)
        if self.signature is None:
            data.pop("signature", None)
        return data

    @model_validator(mode="after")
    def _check(self) -> Manifest:
        if self.parent is not None and self.parent.version >= self.version:
            raise ValueError(f"parent version {self.parent.version} is not below {self.version}")
        if self.kind == "delta" and self.parent is None:
            raise ValueError("a delta needs a parent")
        for name, t in self.tensors.items():
            if self.parent is None and t.parent_adler32 is not None:
                raise ValueError(f"{name}: without a parent, parent_adler32 is null")
            if self.kind == "delta" and t.parent_adler32 is None:
                raise ValueError(f"{name}: a delta tensor needs parent_adler32")
            if t.parent_adler32 is None and t.changed != t.numel:
                raise ValueError(
                    f"{name}: parent_adler32 is null (not compared with a parent), so every "
                    f"element counts as changed: changed must be {t.numel}, not {t.changed}"
                )
            if any((f.parent_adler32 is None) != (t.parent_adler32 is None) for f in t.frames):
                raise ValueError(f"{name}: frames and tensor disagree on parent_adler32")
            if self.kind == "anchor":
                end = 0
                for f in t.frames:
                    if f.start != end:
                        break
                    end = f.stop
                if end != t.numel:
                    raise ValueError(f"{name}: anchor frames must cover every element in order")
                if any(f.codec not in NEW_WORDS_CODECS for f in t.frames):
                    raise ValueError(f"{name}: anchor frames must use the raw or raw-planes codec")
        if self.signature is not None and self.signature.ed25519 is not None:
            for name, t in self.tensors.items():
                if any(f.blake3 is None for f in t.frames):
                    raise ValueError(
                        f"{name}: a manifest signed with ed25519 carries blake3 in every frame"
                    )
        if (
            state_digest((n, t.dtype, t.shape, t.adler32) for n, t in self.tensors.items())
            != self.state_digest
        ):
            raise ValueError("state_digest does not match the tensor table")
        return self

    # --- derived numbers, for reports and `log` -------------------------------------------

    @property
    def changed_elements(self) -> int:
        return sum(t.changed for t in self.tensors.values())

    @property
    def total_elements(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def payload_bytes(self) -> int:
        return sum(f.length for t in self.tensors.values() for f in t.frames)

    @property
    def dense_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def objects(self) -> frozenset[str]:
        """The data object keys its frames name."""
        return frozenset(f.object for t in self.tensors.values() for f in t.frames)

    def to_bytes(self) -> bytes:
        """Serialized manifest (UTF-8 JSON) exactly as committed."""
        return self.model_dump_json(indent=1).encode() + b"\n"

    def canonical_bytes(self) -> bytes:
        """The bytes a signature covers: the manifest serialized as :meth:`to_bytes` does,
        without ``signature`` (spec section 6.7). For an unsigned manifest, its bytes."""
        return self.model_dump_json(indent=1, exclude={"signature"}).encode() + b"\n"


class Latest(_Model):
    """Content of the ``LATEST`` hint object; ``manifest`` is the manifest key of ``version``."""

    format_version: Literal[1]
    version: Version
    manifest: Annotated[str, Field(pattern=MANIFEST_KEY_PATTERN)]
    sha256: Digest

    @model_validator(mode="after")
    def _check(self) -> Latest:
        if self.manifest != manifest_key(self.version):
            raise ValueError(
                f"manifest {self.manifest!r} is not the key of version {self.version} "
                f"({manifest_key(self.version)})"
            )
        return self


def state_digest(table: Iterable[tuple[str, str, list[int], int]]) -> str:
    """SHA-256 (hex) of a tensor table: ``(name, dtype, shape, adler32)`` rows.

    Rows are sorted by name and serialized as compact JSON ``[[name, dtype, [dims], adler32],
    ...]`` (``json.dumps(..., separators=(",", ":"))``, ASCII-escaped), then hashed.
    """
    rows = sorted([name, dtype, list(shape), int(adler)] for name, dtype, shape, adler in table)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def load_json(data: bytes, what: str, limit: int | None = None) -> Any:
    """JSON text under the rules of spec section 6.1: at most ``limit`` bytes, UTF-8 without a
    byte order mark, no NaN/Infinity, no ``-0``, no duplicate member names; strings with an
    unpaired surrogate escape are refused by the (strict) models. ``limit`` defaults to
    :data:`MAX_MANIFEST_BYTES` (read at call time)."""
    limit = MAX_MANIFEST_BYTES if limit is None else limit
    if len(data) > limit:
        raise ManifestError(f"{what} is {len(data)} bytes, over the {limit} limit")
    try:
        return json.loads(
            data.decode("utf-8"),
            parse_constant=_reject_constant,
            # the hook costs a Python call per integer: only when a -0 token may be there
            parse_int=_parse_int if _MAYBE_MINUS_ZERO.search(data) else None,
            object_pairs_hook=_no_duplicates,
        )
    except UnicodeDecodeError:
        raise ManifestError(f"{what} is not UTF-8 text; the store holds a damaged object") from None
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{what} is not valid JSON ({str(exc)[:200]})") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


#: Every ``-0`` number token follows ``:``, ``[`` or ``,`` and JSON whitespace; this also
#: matches inside some strings, which only costs the slower, checking parse.
_MAYBE_MINUS_ZERO = re.compile(rb"[:\[,][ \t\n\r]*-0")


def _parse_int(text: str) -> int:
    if text == "-0":
        raise ValueError("-0 is not allowed (no number of the format is negative; write 0)")
    return int(text)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return out


def validation_summary(exc: ValidationError) -> str:
    """One line naming the first three problems of a pydantic validation error."""
    errs = exc.errors()
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in errs[:3]]
    more = f" (+{len(errs) - 3} more)" if len(errs) > 3 else ""
    return "; ".join(parts) + more


def parse_manifest(data: bytes, *, key: str = "manifest") -> Manifest:
    """Parse and validate a manifest; typed errors for anything malformed or unknown."""
    obj = load_json(data, key)
    if not isinstance(obj, dict):
        raise ManifestError(f"{key}: a manifest is a JSON object")
    if "format_version" not in obj:
        raise ManifestError(f"{key} has no format_version: it is not a deltastore manifest")
    fv = obj["format_version"]
    if type(fv) is not int:
        raise UnsupportedFormatError(
            f"{key}: format_version {fv!r} is not an integer; every format version is a JSON "
            "integer (this deltastore reads 1): the object is damaged or not a manifest"
        )
    if fv != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{key}: format_version {fv!r} is not supported; this deltastore reads format "
            f"version {FORMAT_VERSION}: upgrade deltastore to read newer stores"
        )
    try:
        return Manifest.model_validate(obj)
    except ValidationError as exc:
        codec = _unknown_codec(obj)
        if codec is not None:  # a newer edition's codec: say so, not "malformed"
            raise ManifestError(f"{key}: {unknown_codec(codec)}") from None
        raise ManifestError(f"{key} is malformed: {validation_summary(exc)}") from None


def _unknown_codec(obj: dict[str, Any]) -> str | None:
    """The first frame ``codec`` of a manifest that failed validation that this reader does
    not know (a string), if any: such a manifest was written by a newer deltastore (a newer
    edition, spec section 6.2.1), which the error says. Only called on the error path."""
    tensors = obj.get("tensors")
    for entry in tensors.values() if isinstance(tensors, dict) else ():
        frames = entry.get("frames") if isinstance(entry, dict) else None
        for frame in frames if isinstance(frames, list) else ():
            codec = frame.get("codec") if isinstance(frame, dict) else None
            if isinstance(codec, str) and codec not in CODEC_TABLE:
                return codec
    return None


def parse_latest(data: bytes) -> Latest:
    """Parse the ``LATEST`` hint; :class:`ManifestError` when it is damaged."""
    try:
        return Latest.model_validate(load_json(data, LATEST_KEY, MAX_LATEST_BYTES))
    except ValidationError as exc:
        raise ManifestError(f"LATEST is malformed: {validation_summary(exc)}") from None


def json_schema() -> str:
    """The JSON Schema of :class:`Manifest`, as committed under ``manifests/schema/``."""
    schema = Manifest.model_json_schema()
    # optional, but never null: omitted from unsigned manifests
    schema["properties"]["signature"] = {
        "$ref": "#/$defs/Signature",
        "description": "Optional Ed25519 (or HMAC-SHA256) signature of the canonical manifest "
        "bytes (spec 6.7)",
    }
    # every member of `tensors` is a tensor entry under a valid name (no patternProperties,
    # which would let any other name through with any value)
    schema["properties"]["tensors"] = {
        "additionalProperties": {"$ref": "#/$defs/TensorEntry"},
        "description": "Tensor name -> entry; MAY be empty (spec 6.3)",
        "propertyNames": {"pattern": SCHEMA_NAME_PATTERN},
        "title": "Tensors",
        "type": "object",
    }
    schema["$defs"]["Writer"]["properties"]["library"]["pattern"] = r"^[^\ud800-\udfff]*$"
    # optional members are omitted when absent, never null
    defs = schema["$defs"]
    for model, member in (
        ("Signature", "ed25519"),
        ("Signature", "hmac_sha256"),
        ("Frame", "blake3"),
    ):
        prop = defs[model]["properties"][member]
        defs[model]["properties"][member] = {**prop["anyOf"][0], "title": prop["title"]}
    defs["Signature"]["oneOf"] = [{"required": ["ed25519"]}, {"required": ["hmac_sha256"]}]
    # an Ed25519 signature binds every frame by its BLAKE3
    schema["if"] = {
        "properties": {"signature": {"required": ["ed25519"]}},
        "required": ["signature"],
    }
    schema["then"] = {
        "properties": {
            "tensors": {
                "additionalProperties": {
                    "properties": {"frames": {"items": {"required": ["blake3"]}}}
                }
            }
        }
    }
    schema["$comment"] = _SCHEMA_COMMENT
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://deltastore.dev/schema/manifest.v1.schema.json"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


_SCHEMA_COMMENT = (
    "Patterns use Unicode code points (ECMA-262 'u' flag). Rules of docs/spec/format-v1.md "
    "this schema cannot express, which readers MUST also check: the JSON text (6.1: UTF-8 "
    "without a byte order mark, no duplicate member names, no unpaired surrogate escape, "
    "integers written without fraction or exponent and never as -0; JSON Schema treats 1.0 "
    "and 1e3 as the integers 1 and 1000) and the cross-field invariants of section 6.6."
)
