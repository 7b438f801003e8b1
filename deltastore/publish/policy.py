"""When a publisher writes an anchor copy: every N versions, or by cost (the default).

An *anchor copy* of version ``v`` is ``v``'s state stored in full (``anchors/<v>.json``, format
v1 section 9.4) beside ``v``'s delta. Followers keep applying deltas; a fresh or far-behind
replica starts from the newest copy at or below its target. The cost rule keeps the bytes a
fresh replica fetches (newest anchor + every delta since) under about ``(1 + k)`` anchors: a
copy is written when the deltas since the newest anchor, this version's included, exceed ``k``
times the anchor's size (the last anchor's stored bytes stand for the new one's). Sizes are
what a reader fetches: a version's frames and its manifest.

Pure: no I/O, no torch; :class:`AnchorPolicy` is frozen and thread-safe, :class:`AnchorCosts`
is the publisher's running account (one thread).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AnchorPolicy:
    """``every``: an anchor copy every ``every`` versions published since the newest anchor
    (None: by cost); ``k``: the cost rule's factor (catch-up from the newest anchor stays under
    about ``1 + k`` anchors). ``never``: no anchor copies (only the first version, table changes
    and forced anchors are anchors)."""

    every: int | None = None
    k: float = 1.0
    never: bool = False

    def __post_init__(self) -> None:
        if self.every is not None and (isinstance(self.every, bool) or self.every < 1):
            raise ValueError(f"every must be a positive number of versions, got {self.every!r}")
        if not (math.isfinite(self.k) and self.k > 0):
            raise ValueError(f"k must be a positive number, got {self.k!r}")

    @classmethod
    def parse(cls, text: str | AnchorPolicy | None) -> AnchorPolicy:
        """``"cost"`` (default, k = 1), ``"cost:K"``, ``"every:N"`` or ``"never"``."""
        if isinstance(text, AnchorPolicy):
            return text
        if text is None or text == "cost":
            return cls()
        name, _, arg = str(text).partition(":")
        try:
            if name == "cost" and arg:
                return cls(k=float(arg))
            if name == "every" and arg:
                return cls(every=int(arg))
            if name == "never" and not arg:
                return cls(never=True)
        except ValueError as exc:
            raise ValueError(f"anchor policy {text!r}: {exc}") from None
        raise ValueError(
            f"anchor policy {text!r} is not one of 'cost', 'cost:K', 'every:N', 'never'"
        )

    def __str__(self) -> str:
        if self.never:
            return "never"
        return f"every:{self.every}" if self.every is not None else f"cost:{self.k:g}"


@dataclass
class AnchorCosts:
    """The chain since the newest anchor, as the publisher knows it: ``anchor`` (its version,
    None: unknown), ``anchor_bytes`` (its stored bytes), ``delta_bytes`` and ``deltas`` (the
    stored bytes and the number of deltas published since), ``last_delta`` (the stored bytes
    of the newest delta: the estimate of the next one's)."""

    anchor: int | None = None
    anchor_bytes: int = 0
    delta_bytes: int = 0
    deltas: int = 0
    last_delta: int = 0

    def reason(self, policy: AnchorPolicy, delta_bytes: int) -> str | None:
        """Why the version whose delta is (about) ``delta_bytes`` gets an anchor copy (None:
        it does not). Decided before the delta is encoded, so that the copy is encoded in the
        same pass: ``delta_bytes`` is an estimate (the publisher passes :attr:`last_delta`)."""
        if policy.never:
            return None
        if self.anchor is None:
            return "no anchor known since the publisher started"
        since, n = self.delta_bytes + delta_bytes, self.deltas + 1
        if policy.every is not None:
            return f"every {policy.every} versions" if n >= policy.every else None
        budget = policy.k * self.anchor_bytes
        if since > budget:
            return (
                f"cost: {since} bytes of {n} deltas since anchor {self.anchor} > "
                f"{policy.k:g} x its {self.anchor_bytes} bytes"
            )
        return None

    def anchored(self, version: int, anchor_bytes: int, *, last_delta: int | None = None) -> None:
        """``version`` is now the newest anchor, of ``anchor_bytes`` stored bytes;
        ``last_delta``: the stored bytes of its delta, when it is an anchor copy's version."""
        self.anchor, self.anchor_bytes = version, anchor_bytes
        self.delta_bytes = self.deltas = 0
        if last_delta is not None:
            self.last_delta = last_delta

    def delta(self, delta_bytes: int) -> None:
        """A delta of ``delta_bytes`` stored bytes was published (no anchor copy)."""
        self.delta_bytes += delta_bytes
        self.deltas += 1
        self.last_delta = delta_bytes


__all__ = ["AnchorCosts", "AnchorPolicy"]
