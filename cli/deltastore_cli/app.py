"""The ``deltastore`` typer app: the root options, the one error handler, the commands.

Each command lives in its own module (``publish``, ``pull``, ``log``, ``show``, ``orphans``
for ``gc``, ``verify``, ``demo``, ``bench``): it parses its options, calls one library
function (imported when it runs, so ``--help``, ``log``, ``show`` and ``verify`` never import
torch), calls :func:`~deltastore_cli.common.settle` and prints the result. Errors are not
caught there: :class:`App` turns them into one line and an exit code.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any

import typer

from deltastore._version import __version__
from deltastore_cli import bench, demo, keygen, log, mirror, orphans, publish, pull, show, verify
from deltastore_cli.common import (
    EXIT_USAGE,
    HANDLED,
    RUN,
    Settings,
    command_failed,
    print_json_error,
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

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """The global flags (``-q``, ``-v``...) may also follow the command, and ``--json``
        precede it: they are moved to their side of the command name before parsing.
        Remembers whether ``--json`` was given (:attr:`~deltastore_cli.common.Run.json`)."""
        RUN.json = False
        args = _move_global_flags(list(args))
        return list(super().parse_args(ctx, args))

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
        except typer.TyperException as exc:  # click's errors; it prints them, exits 2
            if getattr(exc, "exit_code", None) == EXIT_USAGE:
                print_json_error(EXIT_USAGE, "UsageError", exc.format_message())
            raise


#: The root's flags (they take no value), accepted after the command name too.
_GLOBAL_FLAG = re.compile(r"-q|--quiet|-v+|--verbose")


def _move_global_flags(args: list[str]) -> list[str]:
    """``args`` with the root's flags that follow the command moved before it, and a
    ``--json`` that precedes it moved after it (``bench --json`` takes a file: not moved).
    The command is the first argument that is not an option (the root's options take no
    value); nothing after ``--`` is moved."""
    end = args.index("--") if "--" in args else len(args)
    at = next((i for i, a in enumerate(args[:end]) if not a.startswith("-")), None)
    if at is None:
        return args
    head, command, rest, tail = args[:at], args[at], args[at + 1 : end], args[end:]
    flags = [a for a in rest if _GLOBAL_FLAG.fullmatch(a)]
    rest = [a for a in rest if not _GLOBAL_FLAG.fullmatch(a)]
    if command != "bench":
        rest = [a for a in head if a == "--json"] + rest
        head = [a for a in head if a != "--json"]
        RUN.json = "--json" in rest
    return head + flags + [command] + rest + tail


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
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet", "-q", help="No progress bars. The global flags may also follow the command."
        ),
    ] = False,
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
app.command("mirror", cls=Command)(mirror.mirror)
app.command("keygen", cls=Command)(keygen.keygen)
app.command("demo", cls=Command)(demo.demo)
app.command("bench", cls=Command)(bench.bench)
