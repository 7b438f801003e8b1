"""The package's shape (issue 12): layers, what each layer may import, public module paths.

- The import-linter contracts in ``pyproject.toml`` hold (``lint-imports``, also run by
  ``make lint``): sub-packages import only downward, the library never imports the CLI, typer
  or rich, and ``deltastore.format``, ``deltastore.store`` and ``deltastore.errors`` never
  import torch.
- The same rules as they are felt at run time, in fresh interpreters: ``import deltastore``
  and importing every library module load neither typer nor rich; ``import deltastore.format``
  and ``import deltastore.store`` load no torch.
- No ``_private`` name of one sub-package is imported by another (an AST scan), so what a
  sub-package offers the others is its public names; the top-level helpers every layer uses
  (``progress``, ``_lazy``, ``_version``) import only the standard library.
- The module paths users may have imported before the move keep working: the deprecated ones
  (``deltastore.publisher``, ``deltastore.subscriber``, ``deltastore.presets``) for one release,
  with a DeprecationWarning; ``deltastore.layout`` and ``deltastore.store.*`` without one.

docs/design/architecture.md describes the layers and the module map.
"""

from __future__ import annotations

import ast
import importlib
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
LIBRARY = ROOT / "deltastore"
CLI = ROOT / "cli" / "deltastore_cli"


def lint_imports() -> str:
    exe = Path(sys.executable).parent / "lint-imports"
    found = str(exe) if exe.is_file() else shutil.which("lint-imports")
    if found is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    return found


def loaded_after(code: str) -> list[str]:
    """Top-level module names in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    report = "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    script = f"import json, sys\n{code}\n{report}"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    return list(json.loads(out.stdout.splitlines()[-1]))


def module_name(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_import_contracts_hold() -> None:
    """``lint-imports`` with the three contracts of pyproject.toml (no cache left in the tree).

    Fails while a contract is broken; the output names each import chain that breaks it."""
    result = subprocess.run(
        [lint_imports(), "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout, result.stdout


def test_import_deltastore_loads_neither_typer_nor_rich() -> None:
    loaded = loaded_after("import deltastore")
    assert "typer" not in loaded and "rich" not in loaded


def test_no_library_module_loads_typer_rich_or_the_cli() -> None:
    """Every module of the library imported in one interpreter: still no CLI, typer or rich.
    (A module needing an optional store client that is not installed is skipped.)"""
    names = [module_name(p, ROOT) for p in sorted(LIBRARY.rglob("*.py"))]
    names = [n for n in names if n not in ("deltastore.publisher", "deltastore.subscriber")]
    code = (
        "import importlib, warnings\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if (e.name or '').startswith('deltastore'):\n"
        "            raise\n"
    )
    loaded = loaded_after(code)
    assert "deltastore" in loaded
    assert [m for m in ("typer", "rich", "deltastore_cli") if m in loaded] == []


@pytest.mark.parametrize("package", ["deltastore.format", "deltastore.store", "deltastore.errors"])
def test_format_and_store_load_no_torch(package: str) -> None:
    """Tools that only read manifests or move bytes start without torch. Every module of the
    package is imported, not only its ``__init__``."""
    base = LIBRARY / package.split(".")[1]
    paths = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    names = [module_name(p, ROOT) for p in paths]
    code = (
        "import importlib\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:\n"  # an optional store client (s3fs, ...)
        "        if (e.name or '').startswith('deltastore') or e.name == 'torch':\n"
        "            raise\n"
    )
    assert "torch" not in loaded_after(code)


def private_imports_across_packages(base: Path, package: Path) -> list[str]:
    """``from deltastore.X... import _name`` (or ``import deltastore.X._mod``) in a module of
    ``package`` (a folder under ``base``) that is not itself in sub-package ``X``.

    Top-level private modules (``deltastore._version``, ``deltastore._lazy``) are the package's
    own plumbing and may be imported anywhere; dunder names (``__all__``, ``__version__``) are
    not private. Modules outside every sub-package (``deltastore/publisher.py``, the CLI) may
    import no private name of a sub-package at all."""
    found = []
    for path in sorted(package.rglob("*.py")):
        importer = module_name(path, base)
        parts = importer.split(".")
        depth = 1 if path.name == "__init__.py" else 2
        home = parts[1] if parts[0] == "deltastore" and len(parts) > depth else None
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imports = [(node.module.split("."), [a.name for a in node.names])]
            elif isinstance(node, ast.Import):
                imports = [(a.name.split("."), []) for a in node.names]
            else:
                continue
            for target, names in imports:
                if target[0] != "deltastore" or len(target) < 2 or target[1] in (home, None):
                    continue
                if target[1].startswith("_"):  # top-level plumbing: deltastore._version
                    continue
                private = [p for p in target[2:] if p.startswith("_") and not p.startswith("__")]
                private += [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private:
                    found.append(f"{importer}:{node.lineno} {'.'.join(target)}: {private}")
    return found


def test_no_private_name_crosses_a_sub_package() -> None:
    found = private_imports_across_packages(ROOT, LIBRARY)
    found += private_imports_across_packages(CLI.parent, CLI)
    assert found == []


def test_the_private_import_scan_finds_what_it_should(tmp_path: Path) -> None:
    files = {
        "deltastore/__init__.py": "from deltastore._version import __version__\n",
        "deltastore/old.py": "from deltastore.sync.a import _x\n",  # outside sub-packages
        "deltastore/sync/__init__.py": "from deltastore.sync.a import _x\n",  # own: fine
        "deltastore/sync/a.py": (
            "from deltastore.layout.boxes import _span, inside\n"  # crosses
            "from deltastore.layout import __all__\n"  # dunder: fine
            "from deltastore._lazy import lazy_exports\n"  # top-level plumbing: fine
            "import deltastore.format._keys\n"  # a private module of another sub-package
            "from deltastore.sync.b import _y\n"  # own sub-package: fine
            "from . import _z\n"  # relative: always its own package
        ),
        "deltastore/layout/__init__.py": "import deltastore.layout.boxes\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = private_imports_across_packages(tmp_path, tmp_path / "deltastore")
    assert found == [
        "deltastore.old:1 deltastore.sync.a: ['_x']",
        "deltastore.sync.a:1 deltastore.layout.boxes: ['_span']",
        "deltastore.sync.a:4 deltastore.format._keys: ['_keys']",
    ]
    assert module_name(CLI / "__init__.py", CLI.parent) == "deltastore_cli"


@pytest.mark.parametrize("helper", ["progress.py", "_lazy.py", "_version.py"])
def test_top_level_helpers_import_nothing_of_deltastore(helper: str) -> None:
    """The helpers every layer uses sit below all of them (the layers contract does not list
    them): they import only the standard library (``_lazy`` imports by name at run time)."""
    tree = ast.parse((LIBRARY / helper).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [
        n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
    ]
    imported += ["." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert [m for m in imported if m.split(".")[0] not in sys.stdlib_module_names] == []


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("deltastore.publisher", "Publisher", "deltastore.publish.publisher"),
        ("deltastore.publisher", "PublishReport", "deltastore.publish.publisher"),
        ("deltastore.subscriber", "Subscriber", "deltastore.sync.subscriber"),
        ("deltastore.subscriber", "SyncReport", "deltastore.sync.subscriber"),
        ("deltastore.presets", "vllm_layout", "deltastore.layout.presets"),
        ("deltastore.presets", "ModelSpec", "deltastore.layout.presets"),
        ("deltastore.presets", "hf_shapes", "deltastore.layout.presets"),
    ],
)
def test_deprecated_module_paths_still_work_and_warn(old: str, name: str, new: str) -> None:
    """For one release: the same objects, and a DeprecationWarning that points at the importer."""
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    message = str(deprecations[0].message)
    assert old in message and new in message and "0.3" in message
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    assert name in module.__all__


#: Names of the old ``deltastore/layout.py`` module, now the ``deltastore.layout`` package.
OLD_LAYOUT_NAMES = (
    "BoundLayout",
    "Box",
    "Fuse",
    "Layout",
    "Part",
    "Placement",
    "Replicate",
    "Shard",
    "Stack",
    "covered",
    "fuse",
    "inside",
    "replicate",
    "shard",
    "stack",
)

#: Module paths of the store package before the move, each with a name users import from it.
STORE_PATHS = (
    ("deltastore.store", "open_store"),
    ("deltastore.store", "Store"),
    ("deltastore.store", "LocalStore"),
    ("deltastore.store", "validate_key"),
    ("deltastore.store.base", "Store"),
    ("deltastore.store.local", "LocalStore"),
    ("deltastore.store.fsspec_store", "FsspecStore"),
    ("deltastore.store.s3", "S3Store"),
    ("deltastore.store.gcs", "GCSStore"),
    ("deltastore.store.azure", "AzureStore"),
)


def test_kept_module_paths_work_without_a_warning(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        layout = importlib.import_module("deltastore.layout")
        for name in OLD_LAYOUT_NAMES:
            assert getattr(layout, name) is getattr(
                importlib.import_module("deltastore.layout.boxes"), name
            )
        for module, name in STORE_PATHS:
            try:
                value = getattr(importlib.import_module(module), name)
            except ModuleNotFoundError as e:  # an optional store client that is not installed
                if (e.name or "").startswith("deltastore"):
                    raise
                continue
            assert callable(value), (module, name)
        store = importlib.import_module("deltastore.store")
        assert store.open_store is importlib.import_module("deltastore").open_store
        assert isinstance(store.open_store(tmp_path / "s"), store.LocalStore)


# --- code shape: one implementation of each shared step ---------------------------------


def library_sources() -> dict[str, ast.Module]:
    """Every module of the library, by path relative to the repository root."""
    return {
        str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
        for p in sorted(LIBRARY.rglob("*.py"))
    }


def callers(name: str) -> set[str]:
    """Library modules that use a function named ``name`` (``name(...)``, ``x.name(...)``,
    ``partial(name, ...)``: any read of the name but its import and its definition)."""
    found = set()
    for path, tree in library_sources().items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Name) and node.id == name) or (
                isinstance(node, ast.Attribute) and node.attr == name
            ):
                found.add(path)
    return found


@pytest.mark.parametrize(
    "step",
    ["commit_manifest", "confirm_commit", "read_latest", "advance_latest", "write_anchor_copy"],
)
def test_one_commit_sequence(step: str) -> None:
    """The commit sequence (head check with LATEST read ahead, manifest create, read-backs,
    anchor copy and LATEST) is written once, ``publish.commit.commit_version``, which the
    publisher and ``commit_parts`` call: no other module runs its steps itself."""
    assert callers(step) == {"deltastore/publish/commit.py"}
    assert callers("commit_version") == {
        "deltastore/publish/publisher.py",
        "deltastore/publish/parts.py",
    }


def test_one_fold_of_frame_adlers() -> None:
    """Adler-32s of consecutive frames or slices are joined by ``checksum.combine_frames``
    only: ``combine`` itself is called nowhere else."""
    assert callers("combine") == {"deltastore/format/checksum.py"}
    assert callers("combine_frames") >= {
        "deltastore/publish/publisher.py",
        "deltastore/publish/parts.py",
        "deltastore/sync/apply.py",
    }


def test_one_codec_table() -> None:
    """No module compares a value with a codec name (``codec == XOR_SPARSE``,
    ``codec in (RAW, XOR_DENSE)``, ``== "raw"``): every codec-specific choice is a property
    or a callable of its row in ``codecs.CODEC_TABLE``."""
    from deltastore.format.codecs import CODEC_TABLE, CODECS

    names = {"RAW", "XOR_DENSE", "XOR_SPARSE", "XOR_SPARSE2", "RAW_PLANES"}

    def is_codec(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in CODECS
        if isinstance(node, ast.Name | ast.Attribute):
            return (node.id if isinstance(node, ast.Name) else node.attr) in names
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(is_codec(e) for e in node.elts)
        return False

    found = [
        f"{path}:{node.lineno}"
        for path, tree in library_sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(map(is_codec, [node.left, *node.comparators]))
    ]
    assert found == []
    assert tuple(CODEC_TABLE) == CODECS
    assert all(spec.name == name for name, spec in CODEC_TABLE.items())


def test_one_frame_size_bound() -> None:
    """The stored length of a frame is bounded by ``codecs.stored_bound`` only (what readers
    check before fetching; the zstd bound is applied nowhere else), and the largest frame is
    one constant, the publisher's cap and the subscriber's default limit."""
    import inspect

    from deltastore.format import codecs
    from deltastore.format.codecs import v2
    from deltastore.publish import publisher
    from deltastore.sync.subscriber import Subscriber

    assert callers("compress_bound") == {"deltastore/format/codecs/__init__.py"}
    assert callers("stored_bound") >= {"deltastore/sync/stage.py"}
    assert not hasattr(v2, "stored_bound")
    default = inspect.signature(Subscriber).parameters["max_frame_bytes"].default
    assert default == publisher.MAX_FRAME_BYTES == codecs.MAX_FRAME_BYTES
    assert publisher.MAX_FRAME_BYTES is codecs.MAX_FRAME_BYTES  # imported, not a copy
