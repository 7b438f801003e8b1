"""``deltastore mirror``: replicate a store's versions into another store (one fetch per
cluster; :mod:`deltastore.maintenance.mirror`)."""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import TYPE_CHECKING, Annotated

import typer

from deltastore_cli.common import (
    err_console,
    human_bytes,
    out_console,
    parse_storage_options,
    print_json,
    settle,
)
from deltastore_cli.options import JsonOpt, StorageOpt, StoreArg, TimeoutOpt, TrustedKeysOpt

if TYPE_CHECKING:  # the library is imported when the command runs: --help imports no torch
    from deltastore.maintenance.mirror import MirrorReport


def print_mirror(report: MirrorReport, json_out: bool) -> None:
    """One line per pass (``--json``: the report as one JSON line)."""
    if json_out:
        print_json(dataclasses.asdict(report))
        return
    if not report.copied:
        where = f"v{report.newest}" if report.newest is not None else "no version"
        out_console.print(f"up to date at {where}", highlight=False)
        return
    jumped = (
        f", through the anchor of v{', v'.join(map(str, report.jumped))}" if report.jumped else ""
    )
    out_console.print(
        f"mirrored v{', v'.join(map(str, report.copied))}{jumped}: {report.objects_copied} "
        f"objects, {human_bytes(report.bytes_copied)} copied ({report.objects_skipped} already "
        f"there) in {report.seconds:.2f} s",
        highlight=False,
    )


def mirror(
    source: StoreArg,
    dest: Annotated[str, typer.Argument(help="Destination store (folder, file:// or fsspec URL).")],
    watch: Annotated[
        bool, typer.Option("--watch", help="Keep polling the source and copy each new version.")
    ] = False,
    since: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="A fresh destination starts at the newest anchor or anchor copy at or below "
            "this version.",
            show_default="the source's oldest version that starts a chain",
        ),
    ] = None,
    anchor_first: Annotated[
        bool,
        typer.Option(
            "--anchor-first",
            help="A fresh destination starts at the source's newest anchor or anchor copy.",
        ),
    ] = False,
    interval: Annotated[
        float,
        typer.Option(
            min=0.05,
            metavar="SECONDS",
            help="With --watch: seconds to the next poll "
            "after a new version (1.5x longer after each idle poll).",
        ),
    ] = 5.0,
    max_interval: Annotated[
        float,
        typer.Option(
            min=0.05, metavar="SECONDS", help="With --watch: the longest wait between polls."
        ),
    ] = 60.0,
    reader_id: Annotated[
        str | None,
        typer.Option(
            help="Id of the mirror's lease on the source (leases/<id>.json).",
            show_default="<host>-<pid>-<random>",
        ),
    ] = None,
    lease_ttl: Annotated[
        float,
        typer.Option(min=0.0, metavar="SECONDS", help="Lease length on the source; 0: none."),
    ] = 600.0,
    trusted_keys: TrustedKeysOpt = None,
    storage_option: StorageOpt = None,
    dest_option: Annotated[
        list[str] | None,
        typer.Option(
            "--dest-option",
            metavar="KEY=VALUE",
            help="Passed to the destination's filesystem (repeatable; -o is the source's).",
        ),
    ] = None,
    unsafe_commits: Annotated[
        bool,
        typer.Option(
            "--unsafe-commits",
            help="Mirror into a store that ignores create-if-absent (one mirror only).",
        ),
    ] = False,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Copy every version of SOURCE that DEST lacks: data objects (each frame checked),
    then anchor copy, manifest and LATEST, as a publisher commits. With --watch, follow
    SOURCE until interrupted. Followers then read DEST."""
    from deltastore.format.keys import lease_key
    from deltastore.maintenance.mirror import Mirror

    if reader_id is not None:
        try:
            lease_key(reader_id)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--reader-id") from None
    if since is not None and anchor_first:
        raise typer.BadParameter("give --since or --anchor-first, not both")
    if watch and max_interval < interval:
        raise typer.BadParameter("must be at least --interval", param_hint="--max-interval")
    src_opts = parse_storage_options(storage_option, timeout=timeout, deadline=not watch)
    dst_opts = parse_storage_options(dest_option, timeout=timeout, deadline=not watch)
    keys = {} if trusted_keys is None else {"trusted_keys": trusted_keys}
    with Mirror(
        source, dest, storage_options=src_opts, dest_storage_options=dst_opts, since=since,
        anchor_first=anchor_first, reader_id=reader_id, lease_ttl=lease_ttl or None,
        unsafe_commits=unsafe_commits, **keys,  # type: ignore[arg-type]
    ) as m:  # fmt: skip
        if not watch:
            report = m.run_once()
            settle()
            print_mirror(report, json_out)
            return
        stop = threading.Event()  # Ctrl-C / SIGTERM: finish the version in flight, then stop
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, lambda *_: threading.Thread(target=stop.set).start())
        try:
            m.watch(stop=stop, interval=interval, max_interval=max_interval,
                    on_report=lambda r: print_mirror(r, json_out))  # fmt: skip
        finally:
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
    settle()
    err_console.print("stopped mirroring")
