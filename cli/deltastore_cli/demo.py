"""``deltastore demo``: a trainer publishes AdamW versions, receivers follow, all bit-exact."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from deltastore_cli.common import (
    EXIT_MISMATCH,
    err_console,
    human_bytes,
    out_console,
    print_json,
    settings,
    settle,
)
from deltastore_cli.options import JsonOpt, SizeOpt


def demo(
    ctx: typer.Context,
    store: Annotated[
        str | None,
        typer.Option(help="Store.", show_default="./deltastore-demo, emptied first"),
    ] = None,
    size: SizeOpt = "small",
    versions: Annotated[int, typer.Option(min=2, help="Versions to publish.")] = 5,
    receivers: Annotated[int, typer.Option(min=1, help="Subscribers following the trainer.")] = 2,
    json_out: JsonOpt = False,
) -> None:
    """Run the main job: publish AdamW versions, K receivers follow, all checked bit-exact."""
    from deltastore.bench.demo import run_demo
    from deltastore.testing.sizes import SIZES

    config = SIZES[size]
    quiet = settings(ctx).quiet or json_out
    if not quiet:
        err_console.print(
            f"deltastore demo: {config.numel() / 1e6:.1f}M bf16 elements, {versions} versions, "
            f"{receivers} receivers"
        )

    def on_row(row: Any) -> None:
        if not quiet:
            err_console.print(f"  v{row.version} {row.kind}: published and synced", highlight=False)

    result = run_demo(store, config=config, versions=versions, receivers=receivers, on_row=on_row)
    settle()
    if json_out:
        print_json(
            {
                "store": result.store,
                "elements": result.elements,
                "rows": [dataclasses.asdict(r) for r in result.rows],
                "exact_by_receiver": result.exact_by_receiver,
                "ok": result.ok,
            }
        )
    else:
        table = Table()
        for col in (
            "version",
            "kind",
            "changed",
            "payload",
            "of dense",
            "publish s",
            "sync s",
            "exact",
        ):
            table.add_column(col, justify="right")
        for r in result.rows:
            table.add_row(
                str(r.version),
                r.kind,
                f"{100 * r.changed_fraction:.2f}%",
                human_bytes(r.payload_bytes),
                f"{100 * r.payload_bytes / r.dense_bytes:.2f}%",
                f"{r.publish_s:.2f}",
                f"{r.sync_s:.2f}",
                "yes" if all(r.exact) else "NO",
            )
        out_console.print(Text(f"store: {result.store}"), highlight=False)
        out_console.print(table)
        for i, ok in enumerate(result.exact_by_receiver):
            verdict = "bit-exact at every version" if ok else "MISMATCH"
            out_console.print(f"receiver {i + 1}: {verdict}", highlight=False)
        out_console.print(
            "all receivers bit-exact" if result.ok else "MISMATCH: some receiver differs",
            highlight=False,
        )
    if not result.ok:
        raise typer.Exit(EXIT_MISMATCH)
