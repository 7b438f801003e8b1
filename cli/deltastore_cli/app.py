"""The ``deltastore`` typer app: the root options, the one error handler, the commands.

Each command lives in its own module (``publish``, ``pull``, ``log``, ``show``, ``orphans``
for ``gc``, ``verify``, ``demo``, ``bench``): it parses its options, calls one library
function (imported when it runs, so ``--help``, ``log``, ``show`` and ``verify`` never import
torch), calls :func:`~deltastore_cli.common.settle` and prints the result. Errors are not
caught there: :class:`App` turns them into one line and an exit code.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from deltastore._version import __version__
from deltastore_cli import bench, demo, log, orphans, publish, pull, show, verify
from deltastore_cli.common import (
    HANDLED,
    RUN,
    Settings,
    command_failed,
    settings,
    setup_logging,
)
from deltastore_cli.help import Command, Group


class App(Group):
    """The ``deltastore`` group; it runs the chosen command under the one error handler.

    A :data:`~deltastore_cli.common.HANDLED` error or a Ctrl-C (:class:`KeyboardInterrupt`)
    raised before the command settles its outcome becomes one ``error:`` line (or
    ``interrupted``) and its exit code (:func:`~deltastore_cli.common.command_failed`). One
    raised after it, while the result is printed, propagates unchanged (a closed pipe then
    ends the process as click ends it). Usage errors are click's. Serves the console script
    (:func:`deltastore_cli.main`) and in-process runs (``CliRunner``) alike, one command at a
    time per process (the outcome is process state, :data:`~deltastore_cli.common.RUN`)."""

    def invoke(self, ctx: Any) -> Any:  # ctx: the root context (typer's click Context)
        RUN.settled = False  # a new command: in-process runs may run several
        RUN.started = time.monotonic()
        try:
            with RUN.cleanup:  # the command's deadline (--timeout) ends with it
                return super().invoke(ctx)
        except HANDLED as exc:
            if RUN.settled:
                raise
            raise command_failed(exc, verbose=settings(ctx).verbose) from None


app = typer.Typer(
    cls=App,  # every command is registered with cls=Command (deltastore_cli/help.py)
    help="Move model weights through shared storage, sending only what changed.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def print_version(value: bool) -> None:
    """``--version``: print ``deltastore <version>`` and exit 0 (an eager option)."""
    if value:
        typer.echo(f"deltastore {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option("--version", callback=print_version, is_eager=True, help="Print the version."),
    ] = False,
    verbose: Annotated[
        int,
        typer.Option("--verbose", "-v", count=True, help="More logging (-vv: debug); tracebacks."),
    ] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    """deltastore: publish and pull model versions through a store."""
    ctx.obj = Settings(verbose=verbose, quiet=quiet)
    setup_logging(verbose)


# Registered in the order --help lists them.
app.command("publish", cls=Command)(publish.publish)
app.command("pull", cls=Command)(pull.pull)
app.command("log", cls=Command)(log.log)
app.command("show", cls=Command)(show.show)
app.command("gc", cls=Command, options_metavar="[--keep N] [--orphans] [OPTIONS]")(orphans.gc)
app.command("verify", cls=Command)(verify.verify)
app.command("demo", cls=Command)(demo.demo)
app.command("bench", cls=Command)(bench.bench)
