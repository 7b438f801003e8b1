"""The ``deltastore`` command: a thin typer layer over the library."""

from __future__ import annotations

from typing import Annotated

import typer

from deltastore._version import __version__

app = typer.Typer(help="Move model weights through shared storage, sending only what changed.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"deltastore {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """deltastore command line."""


@app.command()
def demo(
    store: Annotated[
        str | None, typer.Option(help="Store folder (default: a temporary one).")
    ] = None,
    versions: Annotated[int, typer.Option(min=2, help="Versions to publish.")] = 5,
) -> None:
    """Publish AdamW versions of a synthetic model and sync a subscriber, bit-exact."""
    from deltastore.demo import run_demo

    if not run_demo(store, versions=versions):
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry point."""
    app()
