"""Store keys and the store registry (spec section 3.1): the key grammar lives in
``deltastore.format.keys`` (no pydantic, no torch), the manifest module re-exports it, and
``open_store`` lives in ``deltastore.store.registry``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import deltastore.format.manifest as manifest
import deltastore.store
from deltastore.errors import StoreError
from deltastore.format import keys
from deltastore.store import registry


def test_manifest_keys_round_trip() -> None:
    assert keys.manifest_key(42) == "manifests/00000000000000000042.json"
    assert keys.version_of_key(keys.manifest_key(42)) == 42
    assert keys.version_of_key(keys.manifest_key(keys.MAX_VERSION)) == keys.MAX_VERSION
    assert keys.version_of_key("manifests/99999999999999999999.json") is None
    assert keys.version_of_key("manifests/42.json") is None
    assert keys.data_prefix(7) == "versions/00000000000000000007/"
    assert re.fullmatch(keys.MANIFEST_KEY_PATTERN, keys.manifest_key(3))
    assert re.fullmatch(keys.OBJECT_PATTERN, keys.data_prefix(3) + "a-000000.dsz")
    assert not re.fullmatch(keys.KEY_PATTERN, "a/../b")


def test_manifest_module_re_exports_the_keys() -> None:
    for name in ("LATEST_KEY", "MANIFEST_PREFIX", "DATA_PREFIX", "MAX_VERSION", "KEY_PATTERN"):
        assert getattr(manifest, name) == getattr(keys, name), name
    for name in ("manifest_key", "data_prefix", "version_of_key"):
        assert getattr(manifest, name) is getattr(keys, name), name


def test_keys_and_store_import_no_manifest_model_or_torch() -> None:
    code = (
        "import json, sys, deltastore.format.keys, deltastore.store; "
        "print(json.dumps([m in sys.modules for m in "
        "('torch', 'deltastore.format.manifest')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [False, False]


def test_open_store_is_the_registry(tmp_path) -> None:
    assert deltastore.store.open_store is registry.open_store
    store = deltastore.store.open_store(tmp_path / "s")
    assert isinstance(store, deltastore.store.LocalStore)
    assert registry.open_store(store) is store
    with pytest.raises(StoreError, match="not supported"):
        registry.open_store("ftp://host/x")
    with pytest.raises(StoreError, match="takes no storage options"):
        registry.open_store(tmp_path, {"anon": True})
