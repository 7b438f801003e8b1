"""``deltastore show``: one version's manifest (reads one manifest only)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from deltastore_cli.common import (
    human_bytes,
    out_console,
    parse_storage_options,
    print_json,
    settle,
)
from deltastore_cli.options import JsonOpt, StorageOpt, StoreArg, TimeoutOpt


def show(
    store: StoreArg,
    version: Annotated[int, typer.Argument(min=0, help="Version to show.")],
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor.")] = False,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show one version's manifest (--json: the manifest itself)."""
    from deltastore.maintenance.history import show_manifest

    options = parse_storage_options(storage_option, timeout=timeout)
    m = show_manifest(store, version, storage_options=options)
    settle()
    if json_out:
        print_json(m.model_dump(mode="json"))
        return
    lines = [
        f"version       {m.version}",
        f"kind          {m.kind}",
        f"parent        {m.parent.version if m.parent else '-'}",
        f"created       {m.created}",
        f"writer        {m.writer.library} ({m.writer.token[:12]})",
        f"state digest  {m.state_digest}",
        f"tensors       {len(m.tensors)} "
        f"({m.total_elements} elements, {human_bytes(m.dense_bytes)})",
        f"changed       {m.changed_elements} ({100 * m.changed_fraction:.3f}%)",
        f"payload       {human_bytes(m.payload_bytes)} ({100 * m.payload_ratio:.2f}% of dense)",
    ]
    out_console.print("\n".join(lines), highlight=False)
    if tensors:
        table = Table(box=None)
        for col in ("tensor", "dtype", "shape", "changed", "frames", "payload", "codecs"):
            table.add_column(
                col, justify="left" if col in ("tensor", "dtype", "codecs") else "right"
            )
        for name, e in m.tensors.items():
            codecs = sorted({f.codec for f in e.frames})
            table.add_row(
                Text(name),
                e.dtype,
                "x".join(map(str, e.shape)) or "scalar",
                str(e.changed),
                str(len(e.frames)),
                human_bytes(sum(f.length for f in e.frames)),
                ",".join(codecs) or "-",
            )
        out_console.print(table)
