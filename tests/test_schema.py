"""The committed JSON Schema matches the models, and the examples mean what they say."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from deltastore import ManifestError
from deltastore.format.manifest import json_schema, parse_manifest
from deltastore.format.schema import main as schema_main

SCHEMA_DIR = Path(__file__).parent.parent / "manifests" / "schema"
SCHEMA_FILE = SCHEMA_DIR / "manifest.v1.schema.json"
VALID = sorted((SCHEMA_DIR / "examples" / "valid").glob("*.json"))
INVALID = sorted((SCHEMA_DIR / "examples" / "invalid").glob("*.json"))
#: Invalid manifests whose fault a JSON Schema cannot see (JSON text, cross-field invariants).
BEYOND = sorted((SCHEMA_DIR / "examples" / "invalid-beyond-schema").glob("*.json"))


def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_committed_schema_has_not_drifted() -> None:
    assert SCHEMA_FILE.read_text() == json_schema(), "run `make schema` and commit the result"
    assert schema_main(["--check", str(SCHEMA_FILE)]) == 0


def test_check_command_detects_drift(tmp_path: Path) -> None:
    stale = tmp_path / "schema.json"
    stale.write_text(json_schema().replace('"format_version"', '"fmt_version"', 1))
    assert schema_main(["--check", str(stale)]) == 1
    assert schema_main(["--write", str(stale)]) == 0
    assert stale.read_text() == json_schema()


def test_there_are_examples() -> None:
    assert len(VALID) >= 5 and len(INVALID) >= 23 and len(BEYOND) >= 8


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_examples_pass_schema_and_parser(path: Path) -> None:
    validator().validate(json.loads(path.read_text()))
    parse_manifest(path.read_bytes())


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_fail_schema_and_parser(path: Path) -> None:
    errors = list(validator().iter_errors(json.loads(path.read_text())))
    assert errors, f"{path.name} should violate the schema"
    with pytest.raises(ManifestError):
        parse_manifest(path.read_bytes())


@pytest.mark.parametrize("path", BEYOND, ids=lambda p: p.name)
def test_examples_beyond_the_schema_fail_the_parser(path: Path) -> None:
    """What a plain JSON parser makes of these passes the schema (1.0 is the integer 1 to
    JSON Schema, a duplicate member is gone, an invariant spans fields), or the plain parser
    fails (a byte order mark): the reader's own checks refuse every one."""
    with pytest.raises(ManifestError):
        parse_manifest(path.read_bytes())
    try:
        value = json.loads(path.read_bytes())
    except ValueError:
        return
    assert not list(validator().iter_errors(value)), f"{path.name} belongs in examples/invalid"


def test_tensors_hold_only_entries_under_valid_names() -> None:
    """``tensors[""] = 42`` and a name with an unpaired surrogate violate the schema itself."""
    base = json.loads((SCHEMA_DIR / "examples" / "valid" / "delta.json").read_text())
    entry = next(iter(base["tensors"].values()))
    for name, value in [("", entry), ("ok", 42), ("x\ud800", entry), ("a\x7f", entry)]:
        bad = {**base, "tensors": {**base["tensors"], name: value}}
        assert list(validator().iter_errors(bad)), (name, value)
    astral = {**base, "tensors": {**base["tensors"], "\U0001d538" * 1024: entry}}
    assert not list(validator().iter_errors(astral))  # code points, not UTF-16 units
