"""Helpers shared by publisher and subscriber: tensor tables and whole-tensor checks.

The checks take torch tensors or :class:`~deltastore.tensors.host.HostTensor` s and import no
torch themselves."""

from __future__ import annotations

import numpy as np

from deltastore.errors import TableChangedError, TensorMismatchError
from deltastore.format.chain import table_of_entries
from deltastore.format.checksum import adler32
from deltastore.format.manifest import Manifest
from deltastore.tensors.dtypes import dtype_name, np_words
from deltastore.tensors.host import HostTensor, Tensor, Tensors

#: A tensor table: name -> (dtype name, shape).
Table = dict[str, tuple[str, tuple[int, ...]]]


def table_of_manifest(manifest: Manifest) -> Table:
    """The tensor table of a version (:func:`deltastore.format.chain.table_of_entries`)."""
    return table_of_entries(manifest.tensors)


def _changes(old: Table, new: Table) -> tuple[str, dict[str, tuple[str, ...]]]:
    """How ``new`` differs from ``old``: a description, and the names per kind of change."""
    both = sorted(set(old) & set(new))
    kinds = {
        "added": tuple(sorted(set(new) - set(old))),
        "removed": tuple(sorted(set(old) - set(new))),
        "reshaped": tuple(n for n in both if old[n][1] != new[n][1]),
        "retyped": tuple(n for n in both if old[n][0] != new[n][0]),
    }
    parts = []
    for kind, names in kinds.items():
        if not names:
            continue
        more = f", +{len(names) - 5} more" if len(names) > 5 else ""
        part = f"{len(names)} {kind}: {', '.join(names[:5])}{more}"
        if kind in ("reshaped", "retyped"):
            i = 1 if kind == "reshaped" else 0
            shown = "; ".join(f"{n} {_fmt(old[n][i])} -> {_fmt(new[n][i])}" for n in names[:3])
            part += f" ({shown})"
        parts.append(part)
    return "; ".join(parts), kinds


def _fmt(value: object) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def table_changed(old: Table, new: Manifest, held: int | None) -> TableChangedError:
    """The error for caller-owned tensors at table ``old`` (of version ``held``) asked to
    follow ``new``, whose table differs: what was added, removed, reshaped and retyped."""
    what, kinds = _changes(old, table_of_manifest(new))
    since = "the tensors' table" if held is None else f"the table of version {held}"
    return TableChangedError(
        f"version {new.version} changes {since} ({what}); the tensors were handed over by the "
        "caller (tensors=), so they cannot be reallocated and nothing was written: allocate "
        f"tensors for version {new.version}'s table and sync a new Subscriber with them, or "
        "let a Subscriber allocate its own (no tensors=)",
        **kinds,
    )


def delta_changes_table(old: Table, new: Manifest, held: int | None) -> TensorMismatchError:
    """The error for a delta whose table is not its parent's (a broken publisher)."""
    what, _ = _changes(old, table_of_manifest(new))
    return TensorMismatchError(
        f"delta {new.version} changes the tensor table of version {held} ({what}), which only "
        "an anchor may do: the store was written by a broken publisher; nothing was written, "
        "wait for an anchor"
    )


def check_table(tensors: Tensors, manifest: Manifest, *, exact: bool) -> None:
    """Raise :class:`TensorMismatchError` unless every manifest tensor exists in ``tensors``
    with the same dtype and shape (and, with ``exact``, no other tensor exists)."""
    problems: list[str] = []
    for name, entry in manifest.tensors.items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"{name}: missing")
        elif dtype_name(t.dtype) != entry.dtype or list(t.shape) != entry.shape:
            problems.append(
                f"{name}: local {dtype_name(t.dtype)}{list(t.shape)}, "
                f"manifest {entry.dtype}{entry.shape}"
            )
    if exact:
        problems += [
            f"{n}: not in version {manifest.version}" for n in tensors if n not in manifest.tensors
        ]
    if problems:
        raise TensorMismatchError(
            f"tensors do not match version {manifest.version} "
            f"({len(problems)} problems: {'; '.join(problems[:5])}); "
            "hand over the tensors of the model this store publishes"
        )


def check_contents(tensors: Tensors, manifest: Manifest) -> None:
    """Raise :class:`TensorMismatchError` unless each tensor's Adler-32 equals the manifest's.

    O(model bytes); tensors not on the CPU are copied there one at a time.
    """
    bad = [
        name
        for name, entry in manifest.tensors.items()
        if adler32(_cpu_words(tensors[name])) != entry.adler32
    ]
    raise_if_mismatched(bad, manifest)


def _cpu_words(t: Tensor) -> np.ndarray:
    """The words of a host tensor, or of a (contiguous) torch tensor copied to the CPU."""
    return np_words(t if isinstance(t, HostTensor) else t.detach().cpu())


def raise_if_mismatched(bad: list[str], manifest: Manifest) -> None:
    """Raise :class:`TensorMismatchError` naming the tensors in ``bad`` (if any)."""
    if bad:
        raise TensorMismatchError(
            f"{len(bad)} tensors differ from version {manifest.version} "
            f"(Adler-32 mismatch: {', '.join(bad[:5])}); they are not at that version"
        )
