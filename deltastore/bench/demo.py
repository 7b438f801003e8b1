"""The main job, end to end on one machine: a trainer publishing real AdamW versions of a
synthetic Qwen-like model and K receivers following it, checked bit-exact at every version.

:func:`run_demo` does the work and returns numbers; the CLI renders them. Single-threaded
driver (the library's own worker pools run underneath).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltastore.errors import StoreError
from deltastore.publish.publisher import Publisher
from deltastore.store import LocalStore, open_store
from deltastore.sync.subscriber import Subscriber
from deltastore.testing.sizes import SIZES, SMALL, ModelConfig
from deltastore.testing.synthetic import AdamWTrajectory

#: Store used when none is given: a folder under the working directory.
DEFAULT_STORE = "deltastore-demo"
#: Written by the demo into the default store it creates (a hidden file: never a store key);
#: only a folder holding it is emptied by the next demo.
DEMO_MARKER = ".deltastore-demo"
#: What a store folder may hold (docs/spec/format-v1.md, section 3: the store's key prefixes,
#: ``LATEST`` and the local store's lock file), besides the marker and temporary ``.tmp-*``
#: files of an interrupted write.
_STORE_ENTRIES = frozenset(
    {"manifests", "versions", "anchors", "leases", "LATEST", ".deltastore.lock", DEMO_MARKER}
)


@dataclass(frozen=True)
class DemoRow:
    """One published version: sizes in bytes, times in seconds (sync: mean over receivers)."""

    version: int
    kind: str
    changed_fraction: float
    payload_bytes: int
    dense_bytes: int
    publish_s: float
    sync_s: float
    exact: tuple[bool, ...]


@dataclass
class DemoResult:
    """Everything the demo measured; ``ok`` when every receiver was bit-exact every time."""

    store: str
    elements: int
    receivers: int
    rows: list[DemoRow] = field(default_factory=list)

    @property
    def exact_by_receiver(self) -> list[bool]:
        return [all(r.exact[i] for r in self.rows) for i in range(self.receivers)]

    @property
    def ok(self) -> bool:
        return all(self.exact_by_receiver)


def _fresh_default_store(path: Path) -> None:
    """Empty the default demo folder and mark it as the demo's (:data:`DEMO_MARKER`).

    A folder that exists is removed only if an earlier demo created it (it holds the marker)
    and it holds nothing but a store; otherwise :class:`StoreError`, and nothing is removed.
    """
    if path.exists():
        entries = set(os.listdir(path)) if path.is_dir() else set()
        stray = {e for e in entries if not e.startswith(".tmp-")} - _STORE_ENTRIES
        if not path.is_dir() or stray:
            raise StoreError(
                f"{path} holds other files than a deltastore store "
                f"({', '.join(sorted(stray)) or 'it is not a folder'}); "
                "remove it, or pass --store to choose a folder"
            )
        if DEMO_MARKER not in entries:
            raise StoreError(
                f"{path} holds a deltastore store that the demo did not create (no "
                f"{DEMO_MARKER} file); remove it, or pass --store to choose a folder"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / DEMO_MARKER).write_text("created by `deltastore demo`: emptied by the next one\n")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def run_demo(
    store: str | None = None,
    *,
    config: ModelConfig | str = SMALL,
    versions: int = 5,
    receivers: int = 2,
    seed: int = 0,
    on_row: Callable[[DemoRow], None] | None = None,
) -> DemoResult:
    """Publish ``versions`` versions (v1 an anchor, then AdamW steps at lr 1e-6) and sync
    ``receivers`` fresh subscribers after each, comparing them bit-wise with the trainer.

    ``config`` is a model shape or a size name of :data:`deltastore.testing.sizes.SIZES`.
    ``store`` defaults to ``./deltastore-demo``, emptied first when an earlier demo created
    it (see :func:`_fresh_default_store`: its versions, anchor copies and the receivers'
    leases go; a folder the demo did not create is refused); a given store continues after
    its newest version with a new anchor.
    """
    if versions < 1 or receivers < 1:
        raise ValueError("versions and receivers must be at least 1")
    if isinstance(config, str):
        if config not in SIZES:
            raise ValueError(f"unknown size {config!r}; choose one of {list(SIZES)}")
        config = SIZES[config]
    if store is None:
        _fresh_default_store(Path(DEFAULT_STORE))
        store = DEFAULT_STORE
    target = open_store(store)
    pub = Publisher(target)
    subs = [Subscriber(target) for _ in range(receivers)]
    head = subs[0].latest() or 0
    traj = AdamWTrajectory(config, lr=1e-6, seed=seed)
    result = DemoResult(
        store=target.root.as_posix() if isinstance(target, LocalStore) else target.url,
        elements=config.numel(),
        receivers=receivers,
    )
    weights = traj.bf16()
    for i in range(versions):
        if i:
            weights = traj.step()
        rep = pub.publish(weights, version=head + 1 + i)
        sync_times, exact = [], []
        for sub in subs:
            t0 = time.perf_counter()
            sub.sync(rep.version)
            sync_times.append(time.perf_counter() - t0)
            got = sub.tensors or {}
            exact.append(
                set(got) == set(weights) and all(_same_bits(weights[n], got[n]) for n in weights)
            )
        row = DemoRow(
            version=rep.version,
            kind=rep.kind,
            changed_fraction=rep.changed_fraction,
            payload_bytes=rep.payload_bytes,
            dense_bytes=rep.dense_bytes,
            publish_s=rep.total_s,
            sync_s=sum(sync_times) / len(sync_times),
            exact=tuple(exact),
        )
        result.rows.append(row)
        if on_row is not None:
            on_row(row)
    return result
