"""The first demo: a publisher and a subscriber on a local store, a table of what moved."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from deltastore.publisher import Publisher
from deltastore.subscriber import Subscriber
from deltastore.synthetic import SMALL, AdamWTrajectory, ModelConfig


def run_demo(store: str | None = None, *, config: ModelConfig = SMALL, versions: int = 5) -> bool:
    """Publish ``versions`` AdamW versions and sync a subscriber after each; True if bit-exact.

    ``store`` defaults to a fresh temporary folder, removed afterwards.
    """
    console = Console()
    root = Path(store) if store else Path(tempfile.mkdtemp(prefix="deltastore-demo-"))
    try:
        traj = AdamWTrajectory(config, lr=1e-6, seed=0)
        pub = Publisher(str(root))
        sub = Subscriber(str(root))
        console.print(f"deltastore demo: {config.numel() / 1e6:.1f}M bf16 elements, store {root}")
        table = Table()
        for col in ("v", "kind", "changed", "payload", "of dense", "pub s", "sync s", "exact"):
            table.add_column(col, justify="right")
        ok = True
        weights = traj.bf16()
        for v in range(1, versions + 1):
            if v > 1:
                weights = traj.step()
            rep = pub.publish(weights, version=v)
            srep = sub.sync()
            tensors = sub.tensors or {}
            exact = all(
                torch.equal(weights[n].view(torch.int16), tensors[n].view(torch.int16))
                for n in weights
            )
            ok &= exact
            table.add_row(
                str(v),
                rep.kind,
                f"{100 * rep.changed_fraction:.2f}%",
                f"{rep.payload_bytes / 1e6:.2f} MB",
                f"{100 * rep.payload_ratio:.2f}%",
                f"{rep.total_s:.2f}",
                f"{srep.total_s:.2f}",
                "yes" if exact else "NO",
            )
        console.print(table)
        console.print("[green]all versions bit-exact[/green]" if ok else "[red]MISMATCH[/red]")
        return ok
    finally:
        if store is None:
            shutil.rmtree(root, ignore_errors=True)
