"""The package's shape (docs/design/architecture.md): layers, what each layer may import, what
the architecture page claims, one implementation of each shared step, the public names.

- The import-linter contracts in ``pyproject.toml`` hold (``lint-imports``, also run by
  ``make lint``): sub-packages import only downward, the library never imports the CLI, typer
  or rich, and ``deltastore.format``, ``deltastore.store``, ``deltastore.catalog`` and
  ``deltastore.errors`` never import torch.
- The same rules as they are felt at run time, in fresh interpreters: ``import deltastore``
  and importing every library module load neither typer nor rich; ``import deltastore.format``
  and ``import deltastore.store`` load no torch.
- No ``_private`` name of one sub-package is imported by another (an AST scan), so what a
  sub-package offers the others is its public names; the top-level helpers every layer uses
  (``progress``, ``_lazy``, ``_version``) import only the standard library.
- Kept module paths work (``deltastore.layout``, ``deltastore.store.*``); the deprecated ones
  (``deltastore.publisher``, ``deltastore.subscriber``, ``deltastore.presets``) are gone.
- What the architecture page says can be checked: its module map lists every module and no
  missing one, its layer list is the layers contract, no module imports pickle, modules stay
  under :data:`MAX_LINES` lines (a named allow-list aside), every error class a caller can
  catch is defined in ``errors.py``, and nothing cites a tracker issue number.
- One implementation of each shared step: the commit sequence, the fold of frame Adler-32s,
  the codec table, the frame-size bounds.
- The top level exports what the guide's and README's examples import, and the errors of
  ``errors.__all__``; test tools and engine presets stay in their sub-packages.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
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
    not private. Modules outside every sub-package (``deltastore/__init__.py``, the CLI) may
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
    "old", ["deltastore.publisher", "deltastore.subscriber", "deltastore.presets"]
)
def test_deprecated_module_paths_are_gone(old: str) -> None:
    """The re-exports kept for one release are removed: import from the sub-packages."""
    assert not (ROOT / (old.replace(".", "/") + ".py")).exists()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


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

    names = {"RAW", "XOR_DENSE", "XOR_SPARSE", "XOR_SPARSE2", "RAW_PLANES", "XOR_PATCH"}

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


# --- what docs/design/architecture.md claims -------------------------------------------

ARCHITECTURE = ROOT / "docs" / "design" / "architecture.md"

#: The most lines a module should have ("modules under about 600 lines").
MAX_LINES = 600

#: Modules over :data:`MAX_LINES`, each with why it is not split (yet); no other module may
#: pass the limit, and a module that gets under it should leave the list.
LONG_MODULES: dict[str, str] = {
    "deltastore/publish/publisher.py": "ChainWriter's encode and pack loop and Publisher; "
    "the pack loop is the next to move (into publish/encode.py)",
    "deltastore/checkpoint/folders.py": "publish, pull and watch of a folder around one "
    "FolderSync; the watch loop is the next to move",
    "deltastore/catalog/chain.py": "listing, reading and planning of one ChainReader",
    "deltastore/bench/report.py": "the markdown report and the performance page",
    "deltastore/sync/subscriber.py": "Subscriber's sync, bootstrap and anchor paths",
}


def documented_modules() -> set[Path]:
    """The modules the module map of the architecture page names: the backquoted ``*.py``
    names in the first column of the table under each ``**`folder/`**`` heading."""
    found: set[Path] = set()
    base: Path | None = None
    for line in ARCHITECTURE.read_text().splitlines():
        heading = re.match(r"\*\*`([^`]+)/`\*\*", line)
        if heading:
            folder = heading.group(1)
            base = (
                LIBRARY
                if folder == "deltastore"
                else ROOT / folder
                if folder.startswith("cli/")
                else LIBRARY / folder
            )
        elif line.startswith("| `") and base is not None:
            first = line.split("|")[1]
            found |= {base / name for name in re.findall(r"`([\w/]+\.py)`", first)}
    return found


def test_the_module_map_lists_every_module_and_no_missing_one() -> None:
    """Every module of the library and the CLI is in the module map (a sub-package's
    ``__init__``, which only exports its names lazily, may be left out), and every module the
    map names exists."""
    modules = {*LIBRARY.rglob("*.py"), *CLI.rglob("*.py")}
    exports_only = {p for p in LIBRARY.glob("*/__init__.py")}
    documented = documented_modules()
    assert sorted(str(p.relative_to(ROOT)) for p in documented - modules) == []
    missing = modules - exports_only - documented
    assert sorted(str(p.relative_to(ROOT)) for p in missing) == []


def test_the_layer_list_is_the_layers_contract() -> None:
    """The layer diagram of the architecture page (under the command line) is the layers
    contract of pyproject.toml, in the same order."""
    import tomllib

    text = ARCHITECTURE.read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    doc = [re.split(r"\s{2,}", line.strip())[0] for line in block.splitlines() if line.strip()]
    assert doc[0] == "deltastore_cli"
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (layers,) = [
        c["layers"] for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers"
    ]
    assert doc[1:] == layers


def test_no_module_uses_pickle() -> None:
    """No pickle anywhere: no import of pickle (or of a library built on it), no
    ``torch.load`` (which unpickles), no ``allow_pickle=True``."""
    banned = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve"}
    found = []
    for path in sorted({*LIBRARY.rglob("*.py"), *CLI.rglob("*.py")}):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] in banned for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.load")
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                found.append(f"{path.relative_to(ROOT)}:{node.value.lineno} allow_pickle")
    assert found == []


def test_modules_stay_under_the_line_limit() -> None:
    long = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in sorted({*LIBRARY.rglob("*.py"), *CLI.rglob("*.py")})
    }
    over = {path: n for path, n in long.items() if n > MAX_LINES}
    assert set(over) <= set(LONG_MODULES), over
    text = ARCHITECTURE.read_text()
    assert all(f"`{Path(path).relative_to('deltastore')}`" in text for path in LONG_MODULES)


#: Exception classes outside ``errors.py`` that derive from a public error, and why.
PRIVATE_ERRORS = {
    "deltastore/sync/fetch.py:Cancelled": "skips the frames after a failed one; never surfaces",
    "deltastore/testing/faults.py:InjectedFault": "a test tool's injected store failure",
}


def test_every_error_a_caller_catches_lives_in_errors_py() -> None:
    """No class outside ``deltastore/errors.py`` derives from an error of ``errors.__all__``
    (but :data:`PRIVATE_ERRORS`); every class of ``errors.__all__`` is defined there."""
    from deltastore import errors

    public = set(errors.__all__)
    found = set()
    for path, tree in library_sources().items():
        if path == "deltastore/errors.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).split(".")[-1] for b in node.bases}
                if bases & public:
                    found.add(f"{path}:{node.name}")
    assert found == set(PRIVATE_ERRORS)
    assert all(getattr(errors, n).__module__ == "deltastore.errors" for n in public)


#: What may cite a tracker issue number: nothing. CHANGELOG.md, the lead's release notes, is
#: not scanned.
CITATION = re.compile(r"(?i)\bissues? ?#?\d+|(?<![\w(\]/])#\d{1,3}\b")


def citation_files() -> list[Path]:
    files = [*LIBRARY.rglob("*.py"), *CLI.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    files += [*(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").rglob("*.py")]
    files += [*(ROOT / "benchmarks").rglob("*.md")]
    files += [ROOT / name for name in ("README.md", "Makefile", "pyproject.toml")]
    return sorted(p for p in files if p.is_file())


def test_nothing_cites_a_tracker_issue_number() -> None:
    """Code comments, docstrings and docs cite the spec or the design docs, never an issue of
    a tracker that is not in the repository (the word and a number, or a hash and a number)."""
    found = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
        for path in citation_files()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if CITATION.search(line)
    ]
    assert found == []


def test_the_citation_scan_finds_what_it_should() -> None:
    word, hash_ = "issue", "#"  # not spelled out: this file is scanned too
    cited = [f"see {word} 13", f"({word}s 6, 13)", f"Issue {hash_}7", f"in {hash_}12.", word + "16"]
    fine = ["[spec](format-v1.md#94-anchor-copies)", "[Terms](#1-terms)", "color #1f77b4"]
    assert [bool(CITATION.search(t)) for t in cited] == [True] * len(cited)
    assert [bool(CITATION.search(t)) for t in fine] == [False] * len(fine)


# --- the public names ------------------------------------------------------------------

#: Test tools, engine presets and upkeep that stay in their sub-packages (with the module
#: each is imported from).
SUB_PACKAGE_NAMES = {
    "FaultyStore": "deltastore.testing",
    "InjectedFault": "deltastore.testing",
    "ModelSpec": "deltastore.layout",
    "hf_shapes": "deltastore.layout",
    "vllm_layout": "deltastore.layout",
    "FolderSync": "deltastore.checkpoint",
    "FolderRepair": "deltastore.checkpoint",
    "verify_store": "deltastore.maintenance",
    "verify_checkout": "deltastore.maintenance",
    "VerifyReport": "deltastore.maintenance",
    "Problem": "deltastore.maintenance",
    "parse_manifest": "deltastore.format.manifest",
}


def user_pages() -> str:
    """The README and the user docs (docs/*.md; not the spec or the design pages)."""
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))])


def imported_from_the_top_level(text: str) -> set[str]:
    """Names the examples import from ``deltastore`` or use as ``deltastore.Name``."""
    names: set[str] = set()
    for group in re.findall(r"from deltastore import (\([^)]*\)|[^\n]+)", text):
        names |= {n for n in re.split(r"[\s,()]+", group) if n.isidentifier()}
    names |= set(re.findall(r"`deltastore\.([A-Za-z_]\w*)[`(]", text))
    packages = {p.name for p in LIBRARY.iterdir() if p.is_dir() or p.suffix == ".py"}
    return {n for n in names if n not in packages and f"{n}.py" not in packages}


def test_the_top_level_is_what_the_examples_import() -> None:
    """``deltastore.__all__`` holds every name the README's and the guide's examples import
    from ``deltastore``, every error of ``errors.__all__``, and nothing the user pages never
    name; test tools, engine presets and upkeep are imported from their sub-packages."""
    import deltastore
    from deltastore import errors

    exported = set(deltastore.__all__) - {"__version__"}
    text = user_pages()
    assert imported_from_the_top_level(text) <= exported
    assert set(errors.__all__) <= exported
    for name in errors.__all__:
        assert getattr(deltastore, name) is getattr(errors, name)
    unnamed = [n for n in exported - set(errors.__all__) if not re.search(rf"\b{n}\b", text)]
    assert unnamed == []
    assert exported & set(SUB_PACKAGE_NAMES) == set()
    for name, module in SUB_PACKAGE_NAMES.items():
        assert hasattr(importlib.import_module(module), name), (module, name)
