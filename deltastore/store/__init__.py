"""Stores: where bytes live. :func:`open_store` (:mod:`deltastore.store.registry`) picks the
backend from a URL."""

from __future__ import annotations

from deltastore.store.base import Store, validate_key
from deltastore.store.local import LocalStore
from deltastore.store.registry import open_store

__all__ = ["LocalStore", "Store", "open_store", "validate_key"]
