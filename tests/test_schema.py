"""The committed JSON Schema matches the models, and the examples mean what they say."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from deltastore import ManifestError, parse_manifest
from deltastore.manifest import json_schema
from deltastore.schema import main as schema_main

SCHEMA_DIR = Path(__file__).parent.parent / "manifests" / "schema"
SCHEMA_FILE = SCHEMA_DIR / "manifest.v1.schema.json"
VALID = sorted((SCHEMA_DIR / "examples" / "valid").glob("*.json"))
INVALID = sorted((SCHEMA_DIR / "examples" / "invalid").glob("*.json"))


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
    assert len(VALID) >= 2 and len(INVALID) >= 8


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
