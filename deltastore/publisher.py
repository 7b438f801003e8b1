"""Deprecated module path, kept for one release: use ``deltastore.publish``."""

import warnings

from deltastore.publish.publisher import *  # noqa: F403
from deltastore.publish.publisher import __all__ as __all__

warnings.warn(
    "deltastore.publisher moved to deltastore.publish.publisher (import from deltastore.publish); "
    "the old path goes away in deltastore 0.3",
    DeprecationWarning,
    stacklevel=2,
)
