"""Deprecated module path, kept for one release: use ``deltastore.layout``."""

import warnings

from deltastore.layout.presets import *  # noqa: F403
from deltastore.layout.presets import __all__ as __all__

warnings.warn(
    "deltastore.presets moved to deltastore.layout.presets (import from deltastore.layout); "
    "the old path goes away in deltastore 0.3",
    DeprecationWarning,
    stacklevel=2,
)
