"""The vLLM weight-transfer backend's parts that need no vLLM: its registration (the
``vllm.general_plugins`` entry point, idempotent, lazy), the update and init info it accepts,
and the version a pulled model folder records. The backend inside a real engine, offline and
over HTTP: tests/vllm/test_transfer.py."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deltastore.engines import vllm_transfer as vt
from deltastore.errors import EngineSyncError

ROOT = Path(__file__).resolve().parent.parent


class FakeFactory:
    """vLLM's ``WeightTransferEngineFactory`` as far as registering goes: a second
    registration of a name raises, a module path needs a class name."""

    def __init__(self) -> None:
        self._registry: dict[str, Callable[[], Any]] = {}
        self.calls: list[tuple[Any, ...]] = []

    def register_engine(self, name: str, module: Any, class_name: str | None = None) -> None:
        if name in self._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        if isinstance(module, str) and class_name is None:
            raise ValueError("class_name is required when registering with module path")
        self.calls.append((name, module, class_name))
        self._registry[name] = lambda: (module, class_name)


def test_the_entry_point_names_register() -> None:
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = meta["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"deltastore": "deltastore.engines.vllm_transfer:register"}
    module, _, func = plugins["deltastore"].partition(":")
    assert module == vt.__name__ and getattr(vt, func) is vt.register


def test_register_is_lazy_and_idempotent() -> None:
    factory = FakeFactory()
    vt.register(factory)
    vt.register(factory)  # vLLM loads plugins in every process; a caller may register too
    assert factory.calls == [("deltastore", vt.__name__, "DeltastoreWeightTransferEngine")]
    assert vt.BACKEND == "deltastore" and vt.ENGINE_CLASS == "DeltastoreWeightTransferEngine"


def test_importing_the_backend_imports_no_vllm_and_no_torch() -> None:
    code = (
        "import sys, deltastore.engines.vllm_transfer as t; t.register.__doc__; "
        "print('vllm' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_update_info_names_store_and_version() -> None:
    info = vt.parse_info(vt.UpdateInfo, {"url": "s3://b/run", "version": 7})
    assert info == vt.UpdateInfo(version=7, url="s3://b/run")
    full = {
        "version": 3, "url": "/s", "storage_options": {"anon": True}, "from_version": 0,
        "options": {"lease_ttl": 0},
    }  # fmt: skip
    assert vt.parse_info(vt.UpdateInfo, full) == vt.UpdateInfo(**full)
    init = vt.parse_info(vt.InitInfo, {"url": "/s", "version": 0})
    assert init == vt.InitInfo(url="/s", version=0)


@pytest.mark.parametrize(
    ("cls", "info", "match"),
    [
        (vt.UpdateInfo, {"url": "/s"}, r"missing fields \['version'\].*known: \["),
        (vt.UpdateInfo, {"version": 1, "tensors": []}, r"unknown fields \['tensors'\]"),
        (vt.UpdateInfo, {"version": -1}, r"version=-1: expected a version number"),
        (vt.UpdateInfo, {"version": True}, r"version=True"),
        (vt.UpdateInfo, {"version": "3"}, r"version='3'"),
        (vt.UpdateInfo, {"version": 1, "url": ""}, r"url='': expected the store's URL"),
        (vt.UpdateInfo, {"version": 1, "from_version": 1.5}, r"from_version=1.5"),
        (vt.UpdateInfo, {"version": 1, "storage_options": "x"}, r"storage_options='x'"),
        (vt.InitInfo, {"version": 0}, r"missing fields \['url'\]"),
        (vt.InitInfo, {"url": "/s", "options": [1]}, r"options=\[1\]: expected a JSON object"),
        (vt.InitInfo, ["/s"], r"expected a JSON object"),
    ],
)
def test_bad_info_is_an_engine_sync_error_naming_the_field(
    cls: type[Any], info: Any, match: str
) -> None:
    with pytest.raises(EngineSyncError, match=match):
        vt.parse_info(cls, info)


def test_the_folder_version_is_the_pulled_folders(tmp_path: Path) -> None:
    import torch

    from deltastore import Publisher
    from deltastore.checkpoint.folders import pull_checkpoint

    store, folder = tmp_path / "store", tmp_path / "ckpt"
    pub = Publisher(str(store))
    for v in range(3):
        pub.publish({"w": torch.full((8,), float(v))}, version=v)
    pull_checkpoint(str(store), folder, version=1, lease_ttl=None)
    assert vt.folder_version(folder) == 1
    assert vt.folder_version(tmp_path / "nowhere") is None  # a hub id, say
    assert vt.folder_version(tmp_path) is None  # a folder without .deltastore.json
