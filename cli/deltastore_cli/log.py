"""``deltastore log``: list committed versions, newest first (reads manifests only)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from deltastore_cli.common import (
    human_bytes,
    out_console,
    parse_storage_options,
    print_json,
    settle,
)
from deltastore_cli.options import JsonOpt, StorageOpt, StoreArg, TimeoutOpt


def log(
    store: StoreArg,
    limit: Annotated[int | None, typer.Option(min=1, help="Show only the newest N.")] = None,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List committed versions, newest first (payload bytes per changed element; which
    versions the store also holds as an anchor copy)."""
    from deltastore.maintenance.history import version_log

    entries = version_log(
        store,
        storage_options=parse_storage_options(storage_option, timeout=timeout),
        limit=limit,
    )
    settle()
    if json_out:
        print_json([e.to_json() for e in entries])
        return
    table = Table(box=None)
    columns = ("version", "kind", "parent", "changed", "payload", "of dense", "B/changed")
    for col in (*columns, "anchor copy", "created"):
        table.add_column(col, justify="left" if col in ("kind", "created") else "right")
    for e in entries:
        per = e.bytes_per_changed_element
        table.add_row(
            str(e.version),
            e.kind,
            "-" if e.parent is None else str(e.parent),
            f"{100 * e.changed_fraction:.3f}%",
            human_bytes(e.payload_bytes),
            f"{100 * e.payload_ratio:.2f}%",
            "-" if per is None else f"{per:.3f}",
            "yes" if e.anchor_copy else "-",
            e.created,
        )
    out_console.print(table)
