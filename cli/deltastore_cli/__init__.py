"""The ``deltastore`` command: a thin typer layer over the library.

:mod:`deltastore_cli.app` holds the app and the one error handler; each command is a module
of its own that calls one library function and formats its result. Errors become one line on
stderr and the exit codes in ``docs/cli.md`` (:mod:`deltastore_cli.common`).
"""

from __future__ import annotations

from deltastore_cli.app import app
from deltastore_cli.common import EXIT_INTERRUPTED, RUN, report_interrupt, settle

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point (``deltastore``): the process exits with the command's result.

    Errors are turned into their line and exit code by the app (:class:`~deltastore_cli.app.App`);
    this adds what only a whole process has. Once a command's outcome is settled (its work
    ended; the result is about to be printed), Ctrl-C is ignored, so a printed success is never
    followed by death by SIGINT. A Ctrl-C during the work, or before it (typer: exit 130), exits
    130 after one line, "interrupted" (no traceback)."""
    RUN.console_script = True
    try:
        app()
    except SystemExit as exc:
        settle()
        if exc.code == EXIT_INTERRUPTED:
            report_interrupt()
        raise
    except KeyboardInterrupt:  # pragma: no cover - typer turns it into exit 130
        settle()
        report_interrupt()
        raise SystemExit(EXIT_INTERRUPTED) from None
