"""Reader leases: ``leases/<reader>.json``, the versions a live reader still needs.

A reader MAY write a lease (format v1, section 11.1): the version it holds (or is about to
build from) and when the lease expires. Retention (``gc --keep``) keeps every version from the
oldest unexpired lease's up; expired leases are ignored and removed. Leases never affect
correctness: a reader whose versions were deleted anyway recovers from an anchor.

Pure: pydantic models and time arithmetic, no store I/O; thread-safe.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Annotated, Final, Literal

from pydantic import Field, ValidationError, field_validator

from deltastore.errors import ManifestError
from deltastore.format.keys import READER_ID_PATTERN
from deltastore.format.manifest import Version, _Model, load_json, validation_summary

#: Largest lease object readers of leases accept, in bytes.
MAX_LEASE_BYTES: Final = 4096
#: Seconds after its ``expires`` that a deleter still counts a lease as live, for clock skew
#: between readers and the deleter (spec section 11.1: the normative default).
LEASE_GRACE_S: Final = 60.0
_TIME = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?Z$")
_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def utc_text(when: datetime) -> str:
    """``when`` as the UTC time text leases and manifests use (``YYYY-MM-DDTHH:MM:SS.ffffffZ``)."""
    return when.astimezone(timezone.utc).strftime(_FORMAT)


class Lease(_Model):
    """A reader's lease: it holds ``version`` (every version from it up is kept) until
    ``expires`` (UTC). ``written``: when it was last written (UTC)."""

    format_version: Literal[1]
    reader: Annotated[str, Field(pattern=READER_ID_PATTERN)]
    version: Version
    written: str
    expires: str

    @field_validator("written", "expires")
    @classmethod
    def _valid_time(cls, value: str) -> str:
        if not _TIME.fullmatch(value):
            raise ValueError(f"{value[:40]!r} is not a UTC time YYYY-MM-DDTHH:MM:SS[.fraction]Z")
        parse_time(value)  # a real calendar date
        return value

    @classmethod
    def new(cls, reader: str, version: int, ttl_s: float, now: datetime | None = None) -> Lease:
        """A lease of ``reader`` on ``version`` for ``ttl_s`` seconds from ``now``."""
        now = now or datetime.now(timezone.utc)
        return cls(
            format_version=1,
            reader=reader,
            version=version,
            written=utc_text(now),
            expires=utc_text(now + timedelta(seconds=ttl_s)),
        )

    def expired(self, now: datetime, grace_s: float = 0.0) -> bool:
        """Whether the lease ended more than ``grace_s`` seconds before ``now``."""
        return parse_time(self.expires) + timedelta(seconds=grace_s) < now

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def parse_time(text: str) -> datetime:
    """A UTC time text (as :func:`utc_text` writes, fraction optional) as an aware datetime."""
    base, _, frac = text.rstrip("Z").partition(".")
    when = datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    return when + timedelta(microseconds=int((frac + "000000")[:6])) if frac else when


def parse_lease(data: bytes, *, key: str = "lease") -> Lease:
    """Parse a lease object; :class:`ManifestError` when it is damaged."""
    try:
        return Lease.model_validate(load_json(data, key, MAX_LEASE_BYTES))
    except ValidationError as exc:
        raise ManifestError(f"{key} is malformed: {validation_summary(exc)}") from None


__all__ = ["LEASE_GRACE_S", "MAX_LEASE_BYTES", "Lease", "parse_lease", "parse_time", "utc_text"]
