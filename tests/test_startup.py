"""Start-up (docs/design/architecture.md): the commands that only read manifests never import torch.

``deltastore --help``, ``--version``, ``log``, ``show`` and ``verify`` (without ``--deep``)
run here in a subprocess whose ``torch`` cannot be imported (a ``torch`` package that raises
ImportError comes first on PYTHONPATH), against a store published beforehand with torch.
``import deltastore`` imports none of torch, typer or rich: the public names are imported on
first use (PEP 562).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deltastore
from deltastore import Publisher, __version__
from tests.helpers import console_script

ROOT = Path(__file__).parent.parent
HEAVY = ("torch", "typer", "rich", "numba")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two versions (an anchor and a delta) of three tensors, published with torch."""
    root = tmp_path_factory.mktemp("store") / "s"
    pub = Publisher(root)
    w = {
        "w": torch.linspace(-1, 1, 600).to(torch.bfloat16),
        "b": torch.arange(40, dtype=torch.float32),
        "n": torch.tensor(3, dtype=torch.int64),
    }
    pub.publish(w, version=1)
    w["b"][:5] += 1
    pub.publish(w, version=2)
    return root


def run(env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script(), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_deltastore_imports_no_torch_typer_rich_or_numba() -> None:
    code = (
        "import json, sys, deltastore, deltastore.format.manifest; "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("command", ["--help", "log", "show"])
def test_read_only_commands_load_no_kernel(command: str, store: Path) -> None:
    """The native kernels (numba) are loaded by the paths that decode deltas, never by the
    commands that only read manifests."""
    argv = {"--help": ["--help"], "log": ["log", str(store)], "show": ["show", str(store), "2"]}
    code = (
        "import atexit, sys; "
        "atexit.register(lambda: print('numba' in sys.modules, file=sys.stderr)); "
        f"sys.argv = ['deltastore', *{argv[command]!r}]; "
        "from deltastore_cli import main; main()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "False", out.stderr


@pytest.mark.parametrize("command", ["--help", "--version", "log", "log-json", "show", "verify"])
def test_read_only_commands_run_without_torch(
    command: str, no_torch: dict[str, str], store: Path
) -> None:
    args: dict[str, list[str | Path]] = {
        "--help": ["--help"],
        "--version": ["--version"],
        "log": ["log", store],
        "log-json": ["log", store, "--json"],
        "show": ["show", store, "2", "--tensors"],
        "verify": ["verify", store],
    }
    result = run(no_torch, *args[command])
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "forbids" not in result.stderr
    out = result.stdout
    if command == "--help":
        assert all(c in out for c in ("publish", "pull", "log", "show", "verify", "gc"))
    elif command == "--version":
        assert out.strip() == f"deltastore {__version__}"
    elif command == "log":
        rows = [line.split() for line in out.splitlines()[1:]]
        assert [r[:3] for r in rows] == [["2", "delta", "1"], ["1", "anchor", "-"]]
    elif command == "log-json":
        entries = json.loads(out)
        assert [(e["version"], e["changed_elements"]) for e in entries] == [(2, 5), (1, 641)]
    elif command == "show":
        assert "version       2" in out and "kind          delta" in out
        assert "tensors       3 (641 elements" in out
        assert "changed       5 " in out
        assert all(name in out for name in ("bfloat16", "float32", "int64"))
    else:
        assert out.strip().endswith(": ok") and "2 versions" in out


#: The modules of the checkpoint-folder paths (``publish``, ``pull``, ``gc``, ``verify``, the
#: library's folder sync): none imports torch when loaded, though torch is installed here
#: (tests/test_torch_free.py runs them where it is not). import-linter cannot state this: it
#: counts the imports inside functions too (the torch branches of the tensor layer).
TORCH_FREE = (
    "deltastore.checkpoint",
    "deltastore.checkpoint.folders",
    "deltastore.checkpoint.safetensors",
    "deltastore.tensors.host",
    "deltastore.tensors.dtypes",
    "deltastore.tensors.words",
    "deltastore.tensors.tables",
    "deltastore.sync.subscriber",
    "deltastore.sync.apply",
    "deltastore.sync.stage",
    "deltastore.sync.ranks",
    "deltastore.sync.group",
    "deltastore.publish.publisher",
    "deltastore.maintenance.verify",
    "deltastore.maintenance.retention",
    "deltastore.maintenance.orphans",
    "deltastore_cli",
    "deltastore_cli.publish",
    "deltastore_cli.pull",
    "deltastore_cli.verify",
    "deltastore_cli.orphans",
)


def test_the_folder_paths_import_no_torch() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "from deltastore.checkpoint import FolderSync, publish_checkpoint, pull_checkpoint\n"
        "from deltastore.checkpoint import watch_checkpoint\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_every_public_name_imports_lazily_and_is_listed() -> None:
    names = sorted(deltastore.__all__)
    code = (
        "import json, sys, deltastore\n"
        "before = sorted(m for m in sys.modules if m.startswith('deltastore.'))\n"
        "listed = [n for n in deltastore.__all__ if n not in dir(deltastore)]\n"
        f"from deltastore import {', '.join(names)}\n"
        "try:\n"
        "    from deltastore import NoSuchName\n"
        "    missing = False\n"
        "except ImportError:\n"
        "    missing = True\n"
        f"got = [n for n in {names!r} if globals()[n] is getattr(deltastore, n)]\n"
        "print(json.dumps([before, listed, got, missing]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, unlisted, got, missing_raises = json.loads(out.stdout)
    # nothing imported before first use but the errors (standard library only: their
    # __all__ is the public list of errors)
    assert before == ["deltastore._version", "deltastore.errors"]
    assert unlisted == [] and got == names and missing_raises
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        _ = deltastore.NoSuchName  # type: ignore[attr-defined]


def test_type_checking_imports_match_the_lazy_exports() -> None:
    """What type checkers see (the ``if TYPE_CHECKING:`` imports) is what runs."""
    tree = ast.parse((ROOT / "deltastore" / "__init__.py").read_text())
    seen: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module is not None
                for alias in imp.names:
                    if alias.name == "*":  # the errors: every name of errors.__all__
                        assert imp.module == "deltastore.errors"
                        seen.update(dict.fromkeys(deltastore.errors.__all__, imp.module))
                        continue
                    assert alias.asname == alias.name, alias.name  # an explicit re-export
                    seen[alias.name] = imp.module
    exports = deltastore._EXPORTS  # type: ignore[attr-defined]
    assert seen == exports
    assert sorted(deltastore.__all__) == sorted([*exports, "__version__"])
    for name, module in exports.items():
        assert getattr(deltastore, name).__module__.startswith("deltastore"), (name, module)


def test_dtype_names_and_sizes_need_no_torch_and_match_torch() -> None:
    from deltastore.format import dtypes
    from deltastore.tensors.dtypes import DTYPES, dtype_name, torch_word_dtype

    assert set(dtypes.ITEMSIZES) == set(DTYPES)  # this torch has every format dtype
    for name, size in dtypes.ITEMSIZES.items():
        assert DTYPES[name] is getattr(torch, name)
        assert dtypes.itemsize(name) == size == getattr(torch, name).itemsize, name
        assert dtype_name(getattr(torch, name)) == name
        info = dtypes.TABLE[name]
        assert info.word == dtypes.word_dtype(size) and info.word.kind == "u", name
        assert info.signed.itemsize == size and info.signed == dtypes.signed_word_dtype(size)
        assert torch_word_dtype(size) is DTYPES[info.signed.name], name
    assert dtypes.SAFETENSORS_NAMES["BF16"] == "bfloat16"
    assert set(dtypes.SAFETENSORS_CODES) == set(dtypes.NAMES) - {
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    }
