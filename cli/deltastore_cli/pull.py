"""``deltastore pull``: bring a checkpoint folder to a version, or follow the store."""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from deltastore_cli.common import (
    err_console,
    human_bytes,
    out_console,
    parse_storage_options,
    print_json,
    progress_bar,
    settle,
)
from deltastore_cli.options import JsonOpt, StorageOpt, StoreArg, TimeoutOpt, TrustedKeysOpt

if TYPE_CHECKING:  # the library is imported when the command runs: --help imports no torch
    from deltastore.sync.subscriber import SyncReport


def print_pull(report: SyncReport, json_out: bool) -> None:
    """One line for a pulled version (``--json``: the report as one JSON line)."""
    if json_out:
        n = report.changed_elements
        per = report.payload_bytes / n if n else None
        print_json(dataclasses.asdict(report) | {"bytes_per_changed_element": per})
        return
    if report.kind == "none":
        out_console.print(f"already at v{report.version}", highlight=False)
        return
    n, k = report.changed_elements, len(report.applied)
    # applied over several versions, the counts add up (an element may change in each)
    changes = f"{n} elements changed" if k == 1 else f"{n} element changes over {k} versions"
    out_console.print(
        f"pulled v{report.version} ({report.kind}, applied {', '.join(map(str, report.applied))}): "
        f"{human_bytes(report.payload_bytes)} fetched, {changes} in {report.total_s:.2f} s "
        f"(pause {report.pause_s * 1000:.1f} ms)",
        highlight=False,
    )


def pull(
    ctx: typer.Context,
    store: StoreArg,
    dest: Annotated[
        Path,
        typer.Argument(help="Checkpoint folder to create or update in place.", resolve_path=True),
    ],
    version: Annotated[
        int | None,
        typer.Option("--version", min=0, help="Version.", show_default="newest"),
    ] = None,
    watch: Annotated[
        bool, typer.Option("--watch", help="Keep polling and apply each new version.")
    ] = False,
    interval: Annotated[
        float,
        typer.Option(
            min=0.05,
            help="With --watch: seconds to the next poll after a new version; each poll that "
            "finds nothing new waits 1.5x longer, up to --max-interval (±20% jitter).",
        ),
    ] = 5.0,
    max_interval: Annotated[
        float,
        typer.Option(
            min=0.05,
            help="With --watch: the longest wait between polls (also after store errors); "
            "equal to --interval for a fixed rate.",
        ),
    ] = 60.0,
    reader_id: Annotated[
        str | None,
        typer.Option(
            help="Id of this reader's lease (leases/<id>.json), which keeps the versions it "
            "needs from `gc --keep`.",
            show_default="<host>-<pid>-<random>",
        ),
    ] = None,
    lease_ttl: Annotated[
        float,
        typer.Option(
            min=0.0,
            metavar="SECONDS",
            help="Lease length, renewed after half of it while following; 0: write no lease.",
        ),
    ] = 600.0,
    trusted_keys: TrustedKeysOpt = None,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Bring folder DEST to a version: created from the newest anchor when empty, else
    updated in place. With --watch, follow the store until interrupted."""
    from deltastore.checkpoint.folders import pull_checkpoint, watch_checkpoint
    from deltastore.format.keys import lease_key

    if reader_id is not None:
        try:
            lease_key(reader_id)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--reader-id") from None
    # --watch runs until stopped: --timeout bounds each store operation, not the command
    options = parse_storage_options(storage_option, timeout=timeout, deadline=not watch)
    lease: dict[str, Any] = {"reader_id": reader_id, "lease_ttl": lease_ttl or None}
    if trusted_keys is not None:  # else DELTASTORE_TRUSTED_KEYS
        lease["trusted_keys"] = trusted_keys
    if watch:
        if version is not None:
            raise typer.BadParameter("--watch follows the newest version; drop --version")
        if max_interval < interval:
            raise typer.BadParameter("must be at least --interval", param_hint="--max-interval")
        stop = threading.Event()  # Ctrl-C / SIGTERM: finish the version in flight, then stop
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            # set from another thread: the handler may interrupt code holding the Event's lock
            signal.signal(sig, lambda *_: threading.Thread(target=stop.set).start())
        try:
            watch_checkpoint(
                store,
                dest,
                interval=interval,
                max_interval=max_interval,
                stop=stop,
                on_report=lambda r: print_pull(r, json_out),
                storage_options=options,
                **lease,
            )
        finally:  # before the outcome is settled (which ignores Ctrl-C from then on)
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
        settle()
        err_console.print("stopped watching")
        return
    with progress_bar(ctx, "pull") as progress:
        report = pull_checkpoint(
            store, dest, version=version, storage_options=options, progress=progress, **lease
        )
    settle()
    print_pull(report, json_out)
