"""Deprecated module path, kept for one release: use ``deltastore.sync``."""

import warnings

from deltastore.sync.subscriber import *  # noqa: F403
from deltastore.sync.subscriber import __all__ as __all__

warnings.warn(
    "deltastore.subscriber moved to deltastore.sync.subscriber (import from deltastore.sync); "
    "the old path goes away in deltastore 0.3",
    DeprecationWarning,
    stacklevel=2,
)
