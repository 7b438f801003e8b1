"""Helpers shared by publisher and subscriber: tensor tables and whole-tensor checks."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deltastore.checksum import adler32
from deltastore.dtypes import dtype_name, np_words
from deltastore.errors import TensorMismatchError
from deltastore.manifest import Manifest


def check_table(tensors: Mapping[str, torch.Tensor], manifest: Manifest, *, exact: bool) -> None:
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


def check_contents(tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    """Raise :class:`TensorMismatchError` unless each tensor's Adler-32 equals the manifest's.

    O(model bytes); tensors not on the CPU are copied there one at a time.
    """
    bad = [
        name
        for name, entry in manifest.tensors.items()
        if adler32(np_words(tensors[name].detach().cpu())) != entry.adler32
    ]
    raise_if_mismatched(bad, manifest)


def raise_if_mismatched(bad: list[str], manifest: Manifest) -> None:
    """Raise :class:`TensorMismatchError` naming the tensors in ``bad`` (if any)."""
    if bad:
        raise TensorMismatchError(
            f"{len(bad)} tensors differ from version {manifest.version} "
            f"(Adler-32 mismatch: {', '.join(bad[:5])}); they are not at that version"
        )
