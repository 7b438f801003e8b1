"""A worker's error as plain values, and back: what crosses vLLM's ``collective_rpc``.

A worker returns ``{"type", "message", "fields"}`` (:func:`error_to_dict`) instead of raising,
so one failed rank does not take the engine down; the driver raises it again as the same type
of :mod:`deltastore.errors` (:func:`error_from_dict`). Types are looked up by name in
``deltastore.errors.__all__`` only (never imported by a name read from a worker); keyword
arguments of a constructor (``TableChangedError``'s ``added``, ...) travel in ``fields``.
Pure functions, thread-safe; no vLLM or torch import.

The ranks of an engine agree on a step before any of them enters a collective that needs all
of them (:func:`agree`): a rank that failed alone would otherwise leave the others waiting in
that collective until its timeout (gloo's: 30 min), with the engine stalled meanwhile.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from deltastore import errors
from deltastore.errors import DeltastoreError, EngineSyncError, RankError

T = TypeVar("T")


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


class _Gather(Protocol):
    """What :func:`agree` needs of a group: :class:`deltastore.sync.group.Group`."""

    rank: int

    def all_gather_bytes(self, data: bytes) -> list[bytes]: ...


def gather_errors(group: _Gather, error: Mapping[str, Any] | None) -> dict[int, Any]:
    """Every rank of ``group`` calls this with its own outcome (``error``: :func:`error_to_dict`
    of what it raised, None: it succeeded); a collective (one all-gather of JSON, never
    pickled). Returns the errors of the ranks that failed, by rank (empty: none failed)."""
    mine = b"" if error is None else json.dumps(dict(error)).encode()
    return {r: json.loads(b) for r, b in enumerate(group.all_gather_bytes(mine)) if b}


def agree(group: _Gather, error: Mapping[str, Any] | None) -> None:
    """Every rank of ``group`` calls this at the same point of a step with its own outcome
    (``error``: :func:`error_to_dict` of what it raised, None: it succeeded so far); a
    collective (two gloo all-reduces of a few bytes; local in a group of one). Returns when
    every rank succeeded; raises :class:`~deltastore.errors.RankError` naming the ranks that
    failed and their first error on a rank that succeeded, and nothing on a rank that failed
    (it reports its own error). Errors travel as JSON, never pickled."""
    failed = gather_errors(group, error)
    if not failed or error is not None:
        return
    first, err = next(iter(failed.items()))
    raise RankError(
        f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of the engine "
        f"failed ({err.get('type')} on rank {first}: {err.get('message')}); this rank stopped "
        "too and changed nothing"
    )


def agreed(group: _Gather, make: Callable[[Callable[[], None]], T], *, after: bool = False) -> T:
    """``make(before_collectives)``, in step with the other ranks of ``group`` (every rank
    calls it together): ``make`` calls ``before_collectives`` just before its first collective,
    which agrees (:func:`agree`) that every rank got there, so a rank that failed its local
    checks stops them all there instead of leaving them in a collective it never joins. A rank
    that fails before that point tells the others in that agreement, then raises; with
    ``after``, a rank that fails after the collectives tells them too, in the agreement its
    caller makes after ``make`` returned (attach's: every rank drops the new binding)."""
    stage = "local"

    def before_collectives() -> None:
        nonlocal stage
        stage = "agreeing"
        agree(group, None)
        stage = "bound"

    try:
        return make(before_collectives)
    except Exception as exc:
        if stage == "local" or (after and stage == "bound"):  # the others wait to hear it
            agree(group, error_to_dict(exc))
        raise


def root_cause(results: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The result of ``results`` (one per rank, in rank order) that explains a failure: the
    first with an error other than :class:`~deltastore.errors.RankError` (the rank that
    failed, not one that stopped because of it), else the first failed one; None when every
    rank succeeded."""
    failed = [r for r in results if r.get("error") or r.get("ok") is False]
    cause = [r for r in failed if r.get("error") and r["error"].get("type") != "RankError"]
    return (cause or failed)[0] if failed else None


__all__ = ["agree", "error_from_dict", "error_to_dict", "gather_errors", "root_cause"]
