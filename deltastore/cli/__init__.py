"""The ``deltastore`` command: a thin typer layer over the library."""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from deltastore._version import __version__


class Size(str, enum.Enum):
    """Synthetic model sizes for the demo."""

    tiny = "tiny"
    small = "small"


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
    size: Annotated[
        Size, typer.Option(help="Model size: tiny (~5M) or small (~70M elements).")
    ] = Size.small,
) -> None:
    """Publish AdamW versions of a synthetic model and sync a subscriber, bit-exact."""
    from deltastore.demo import run_demo
    from deltastore.synthetic import SMALL, TINY

    config = TINY if size is Size.tiny else SMALL
    if not run_demo(store, config=config, versions=versions):
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry point."""
    app()
