"""When a follower polls next: jittered, backing off while nothing is new, bounded.

A follower (``deltastore pull --watch``, :func:`~deltastore.checkpoint.folders.watch_checkpoint`,
the vLLM ``follow`` loop) polls the store (one request: a listing after the version it holds),
syncs what is new, and waits. :class:`PollSchedule` decides how long: ``interval`` seconds
after a poll that found a new version; ``growth`` times longer after each poll that found
nothing new, and twice as long after a failed poll or sync, never more than
``max_interval``; every wait jittered by ``+-jitter`` (a share of it) so that a fleet started
together does not poll in lockstep. N followers then make between N / ``max_interval`` and
N / ``interval`` polls per second (docs/stores.md, Followers at fleet scale).

Not thread-safe: one follower loop owns a schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class PollSchedule:
    """Waits between polls, in seconds (see the module docstring). ``interval`` must be
    positive and at most ``max_interval``; ``growth`` at least 1; ``jitter`` in [0, 1)."""

    interval: float = 5.0
    max_interval: float = 60.0
    growth: float = 1.5
    jitter: float = 0.2
    wait: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.interval <= self.max_interval:
            raise ValueError(
                f"need 0 < interval <= max_interval, got {self.interval!r} and "
                f"{self.max_interval!r}"
            )
        if not self.growth >= 1 or not 0 <= self.jitter < 1:
            raise ValueError("need growth >= 1 and 0 <= jitter < 1")
        self.wait = self.interval

    def found(self) -> None:
        """A new version was found (and synced): poll again after ``interval``."""
        self.wait = self.interval

    def idle(self) -> None:
        """Nothing new: wait ``growth`` times longer, up to ``max_interval``."""
        self.wait = min(self.max_interval, self.wait * self.growth)

    def failed(self) -> None:
        """A poll or a sync failed: wait twice as long, up to ``max_interval``."""
        self.wait = min(self.max_interval, self.wait * 2)

    def delay(self) -> float:
        """The next wait, jittered."""
        return self.wait * random.uniform(1 - self.jitter, 1 + self.jitter)


__all__ = ["PollSchedule"]
