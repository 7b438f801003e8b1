"""Planning a sync: the versions to apply, from the state a receiver holds to a target.

The plan goes back along parent links from the target to the version the receiver holds, or
to the first anchor met. When the held state does not fit that chain (the delta after it
applies to another state of that version, the chain skips it, or the store's manifest of the
held version has another state: e.g. after two publishers raced on a store without enforced
preconditions), the plan goes on back to the newest anchor at or below the target instead,
and says why. It fails only when no such anchor can be reached (:class:`ChainError`, or
:class:`WrongParentError` when a delta's parent is not the state the store holds for that
version); the error then describes the store's chain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from deltastore.errors import ChainError, ManifestError, ManifestNotFoundError, WrongParentError
from deltastore.format.manifest import Manifest


@dataclass(frozen=True)
class Held:
    """The state a receiver's tensors are at: version, state digest, per-tensor Adler-32."""

    version: int
    digest: str
    adler: Mapping[str, int]

    def fits(self, m: Manifest) -> bool:
        """Whether the delta ``m`` applies to this state (its parent is this very state)."""
        return (
            m.parent is not None
            and m.parent.version == self.version
            and m.parent.state_digest == self.digest
            and all(
                e.parent_adler32 == self.adler[n] for n, e in m.tensors.items() if n in self.adler
            )
        )


def plan(
    url: str,
    target: int,
    held: Held | None,
    manifest: Callable[[int], Manifest],
    forget: Callable[[int | None], None],
) -> tuple[list[Manifest], str | None]:
    """Versions to apply to reach ``target``, oldest first, and why the held state did not
    fit the chain (None: it did, or there is none). ``manifest`` reads a version's manifest
    (maybe cached); ``forget(version)`` drops a cached one that turned out stale,
    ``forget(None)`` every cached one (the store changed under the receiver)."""
    m = manifest(target)
    why: str | None = None
    if held is not None and target == held.version:
        if m.state_digest == held.digest:
            return [], None
        why = f"version {target} in the store is another state than the held version {target}"
        held = None
        forget(None)
    steps: list[Manifest] = []
    while True:
        steps.append(m)
        if m.kind == "anchor":
            break
        if m.parent is None:  # pragma: no cover - a delta always has a parent (validated)
            raise ManifestError(f"delta {m.version} has no parent")
        if held is not None and m.parent.version <= held.version:
            if held.fits(m):
                break
            why = (
                f"version {m.version} is a delta on another state of version {held.version} "
                f"than the held version {held.version}"
                if m.parent.version == held.version
                else f"version {m.version} descends from {m.parent.version}, not from the held "
                f"version {held.version}"
            )
            held = None
            forget(None)
        m = _parent(url, target, m, why, manifest, forget)
    steps.reverse()
    return steps, why


def _parent(
    url: str,
    target: int,
    child: Manifest,
    why: str | None,
    manifest: Callable[[int], Manifest],
    forget: Callable[[int | None], None],
) -> Manifest:
    """The manifest ``child`` is a delta on, checked to be the state ``child`` names."""
    if child.parent is None:  # pragma: no cover - checked by the caller
        raise ManifestError(f"delta {child.version} has no parent")
    version, digest = child.parent.version, child.parent.state_digest
    because = f"store {url}: {why}, and" if why else f"store {url}:"
    try:
        parent = manifest(version)
        if parent.state_digest != digest:  # a cached manifest may be stale: read it again
            forget(version)
            parent = manifest(version)
    except ManifestNotFoundError:
        raise ChainError(
            f"{because} no anchor at or below {target} can be reached (version {version}, "
            f"parent of {child.version}, is missing): publish an anchor"
        ) from None
    if parent.state_digest != digest:
        raise WrongParentError(
            f"{because} no anchor at or below {target} can be reached (version {child.version} "
            f"is a delta on a state of version {version} that the store does not hold: two "
            "publishers raced?): publish an anchor"
        )
    return parent


__all__ = ["Held", "plan"]
