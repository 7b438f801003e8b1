"""PEP 562 lazy attributes for package ``__init__`` modules.

A package lists its public names and the module defining each; a name is imported on first
use, so ``import deltastore`` (or a sub-package) stays cheap and imports no torch until a name
that needs it is touched. Thread-safe as the import system is.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public names map to the absolute
    names of the modules that define them. A resolved name is cached in the package."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*exports, *vars(sys.modules[package])})

    return __getattr__, __dir__
