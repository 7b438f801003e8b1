"""A worker's error as plain values, and back: what crosses vLLM's ``collective_rpc``.

A worker returns ``{"type", "message", "fields"}`` (:func:`error_to_dict`) instead of raising,
so one failed rank does not take the engine down; the driver raises it again as the same type
of :mod:`deltastore.errors` (:func:`error_from_dict`). Types are looked up by name in
``deltastore.errors.__all__`` only (never imported by a name read from a worker); keyword
arguments of a constructor (``TableChangedError``'s ``added``, ...) travel in ``fields``.
Pure functions, thread-safe; no vLLM or torch import.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from deltastore import errors
from deltastore.errors import DeltastoreError, EngineSyncError


def _public_type(cls: type[BaseException]) -> type[DeltastoreError] | None:
    """The nearest class of ``cls``'s MRO listed in ``deltastore.errors.__all__`` (None: none)."""
    for base in cls.__mro__:
        public = getattr(errors, base.__name__) if base.__name__ in errors.__all__ else None
        if public is base and issubclass(public, DeltastoreError):
            return public
    return None


def _keywords(cls: type[BaseException]) -> list[str]:
    """The keyword-only arguments of ``cls``'s constructor (``TableChangedError``'s ``added``,
    ...): each is kept as the attribute of the same name, and crosses the process boundary."""
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - builtin constructors
        return []
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _plain(value: Any) -> Any:
    """``value`` as plain data (str, int, float, bool, None, lists of them) for the RPC."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, tuple | list | set | frozenset):
        return [_plain(v) for v in value]
    return str(value)


def error_to_dict(exc: BaseException) -> dict[str, Any]:
    """A worker's error as plain values for ``collective_rpc``: ``{"type", "message",
    "fields"}``. ``type`` is the nearest type of ``exc`` listed in ``deltastore.errors.__all__``
    (an error of another type: its own name, and the driver raises :class:`EngineSyncError`);
    ``fields`` holds the constructor's keyword arguments (lists for tuples).
    :func:`error_from_dict` is the inverse."""
    public = _public_type(type(exc))
    message = str(exc)
    if public is None:
        name = type(exc).__name__
    else:
        name = public.__name__
        if public is not type(exc):  # a private subclass: keep its name in the message
            message = f"{type(exc).__name__}: {message}"
    fields = {k: _plain(getattr(exc, k)) for k in _keywords(type(exc)) if hasattr(exc, k)}
    return {"type": name, "message": message, "fields": fields}


def error_from_dict(err: Mapping[str, Any], *, prefix: str = "") -> DeltastoreError:
    """The typed error of a dict made by :func:`error_to_dict`: the class of
    ``deltastore.errors.__all__`` named by ``type`` (:class:`EngineSyncError` for other names,
    with the name in the message), constructed with ``prefix + message`` and the ``fields``
    its constructor takes (lists back to tuples)."""
    name = str(err.get("type"))
    message = str(err.get("message"))
    cls = getattr(errors, name) if name in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, DeltastoreError)):
        return EngineSyncError(f"{prefix}{name}: {message}")
    given = err.get("fields") or {}
    kwargs = {
        k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if k in _keywords(cls)
    }
    return cls(f"{prefix}{message}", **kwargs)


__all__ = ["error_from_dict", "error_to_dict"]
