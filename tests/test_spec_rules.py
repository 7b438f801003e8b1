"""Rules of ``docs/spec/format-v1.md`` that an independent reader found unstated, as the
reference reader enforces them: ``created`` is a real UTC time, a ``null``
``parent_adler32`` means every element changed, ``-0`` is no number of the format, ``LATEST``
is small and names its own version's key, and the spec prints the rules the code uses."""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from deltastore.errors import ManifestError, UnsupportedFormatError
from deltastore.format.manifest import (
    CREATED_PATTERN,
    MAX_LATEST_BYTES,
    manifest_key,
    parse_latest,
    parse_manifest,
)

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "manifests" / "schema" / "examples"
SPEC = (ROOT / "docs" / "spec" / "format-v1.md").read_text()
SCHEMA = json.loads((ROOT / "manifests" / "schema" / "manifest.v1.schema.json").read_text())


def example(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((EXAMPLES / "valid" / name).read_text())
    return data


def encode(m: dict[str, Any]) -> bytes:
    return json.dumps(m, indent=1).encode()


# --- created ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "created",
    [
        "2026-13-01T00:00:00Z",  # month 13
        "2026-00-10T00:00:00Z",  # month 0
        "0000-01-01T00:00:00Z",  # year 0
        "2026-12-31T23:59:60Z",  # leap second
        "2026-01-01T24:00:00Z",
        "2026-01-01T99:00:00Z",
        "2026-01-01T00:60:00Z",
        "2026-01-00T00:00:00Z",
        "2026-02-30T00:00:00Z",
        "2026-04-31T00:00:00Z",
        "2025-02-29T00:00:00Z",  # not a leap year
        "1900-02-29T00:00:00Z",  # divisible by 100, not by 400
        "2026-01-01T00:00:00.1234567890Z",  # 10 fraction digits
        "2026-01-01T00:00:00+00:00",
        "2026-01-01t00:00:00z",
    ],
)
def test_created_that_is_no_real_utc_time_is_rejected(created: str) -> None:
    m = example("delta.json")
    m["created"] = created
    with pytest.raises(ManifestError, match="created"):
        parse_manifest(encode(m))


def test_created_pattern_is_the_gregorian_calendar_in_the_reader_and_the_schema() -> None:
    """Every day 00-32 of months 00-13 of years where the calendar has edge cases, and
    February 29 of every year: the pattern accepts exactly the dates ``datetime`` has, and the
    committed schema states the same pattern."""
    assert SCHEMA["properties"]["created"]["pattern"] == CREATED_PATTERN
    schema = jsonschema.Draft202012Validator({"type": "string", "pattern": CREATED_PATTERN})
    rx = re.compile(CREATED_PATTERN)
    years = [1, 4, 99, 100, 400, 1600, 1900, 1999, 2000, 2024, 2025, 2100, 9996, 9999]
    dates = [(y, m, d) for y in years for m in range(14) for d in range(33)]
    dates += [(y, 2, 29) for y in range(10_000)]
    for y, m, d in dates:
        text = f"{y:04d}-{m:02d}-{d:02d}T23:59:59Z"
        try:
            datetime.date(y, m, d)
            real = True
        except ValueError:
            real = False
        assert bool(rx.fullmatch(text)) == real, text
    for text in ("2024-02-29T23:59:59Z", "2023-02-29T23:59:59Z", "2026-12-31T23:59:60Z"):
        assert schema.is_valid(text) == bool(rx.fullmatch(text))
    m = example("delta.json")
    for edge in ("0001-01-01T00:00:00Z", "0400-02-29T12:00:00Z", "9999-12-31T23:59:59.999999999Z"):
        m["created"] = edge
        assert parse_manifest(encode(m)).created == edge


def test_spec_prints_the_rules_the_reader_uses() -> None:
    assert f"CREATED_PATTERN = {CREATED_PATTERN}\n" in SPEC
    assert f"| `MAX_LATEST_BYTES` | {MAX_LATEST_BYTES} |" in SPEC


# --- parent_adler32 and changed -----------------------------------------------------------


def test_anchor_with_a_parent_may_mix_null_and_compared_tensors() -> None:
    """A null ``parent_adler32`` (a tensor not compared with the parent) means every element
    changed; an anchor with a parent may mix such tensors with compared ones."""
    m = example("anchor-with-parent.json")
    parsed = parse_manifest(encode(m))
    entries = parsed.tensors
    assert entries["model.norm.weight"].parent_adler32 is not None
    assert entries["model.norm.weight"].changed == 0
    assert entries["lm_head.weight"].parent_adler32 is None
    assert entries["lm_head.weight"].changed == entries["lm_head.weight"].numel
    bad = copy.deepcopy(m)
    head = bad["tensors"]["lm_head.weight"]
    head["changed"] -= 1
    head["frames"][0]["changed"] -= 1
    with pytest.raises(ManifestError, match=r"lm_head\.weight: parent_adler32 is null"):
        parse_manifest(encode(bad))


# --- JSON text ----------------------------------------------------------------------------


def test_negative_zero_is_no_number_of_the_format() -> None:
    text = encode(example("delta.json")).decode()
    assert '"offset": 0,' in text
    with pytest.raises(ManifestError, match="-0"):
        parse_manifest(text.replace('"offset": 0,', '"offset": -0,', 1).encode())
    latest = {"format_version": 1, "version": 0, "manifest": manifest_key(0), "sha256": "0" * 64}
    parse_latest(json.dumps(latest).encode())
    with pytest.raises(ManifestError, match="-0"):
        parse_latest(json.dumps(latest).replace('"version": 0', '"version": -0').encode())


def test_non_integer_format_version_is_not_an_upgrade_hint() -> None:
    text = encode(example("delta.json")).decode()
    with pytest.raises(UnsupportedFormatError, match="not an integer") as info:
        parse_manifest(text.replace('"format_version": 1,', '"format_version": 1.0,', 1).encode())
    assert "upgrade" not in str(info.value)


# --- LATEST -------------------------------------------------------------------------------


def latest_for(version: int, **fields: Any) -> dict[str, Any]:
    body = f"manifest {version}".encode()
    return {
        "format_version": 1,
        "version": version,
        "manifest": manifest_key(version),
        "sha256": hashlib.sha256(body).hexdigest(),
        **fields,
    }


@pytest.mark.parametrize(
    "manifest",
    [
        manifest_key(1),  # another version's key
        "manifests/00000000000000000002.json\n",
        "manifests/2.json",
        "versions/00000000000000000002/x.dsz",
    ],
)
def test_latest_names_the_key_of_its_own_version(manifest: str) -> None:
    assert parse_latest(json.dumps(latest_for(2)).encode()).version == 2
    with pytest.raises(ManifestError, match="manifest"):
        parse_latest(json.dumps(latest_for(2, manifest=manifest)).encode())


def test_latest_is_at_most_4096_bytes() -> None:
    text = json.dumps(latest_for(7)).encode()
    padded = text[:-1] + b" " * (MAX_LATEST_BYTES - len(text)) + b"}"
    assert len(padded) == MAX_LATEST_BYTES and parse_latest(padded).version == 7
    with pytest.raises(ManifestError, match="4096"):
        parse_latest(text[:-1] + b" " * (MAX_LATEST_BYTES + 1 - len(text)) + b"}")
