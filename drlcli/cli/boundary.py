"""The CLI's one error boundary: every failure, from option parsing (``OneLineErrors``) to deep
in the library (``command``), becomes one ``error:`` line on stderr (plus the JSON error object
with ``--json``) and the exit code ``describe`` gives it (see ``errors.EXIT_CODES``)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from ..errors import DrlError
from . import output
from .output import Reporter, emit, log, print_error, setup_logging

# click's exception base (typer vendors click in recent releases, so take it from typer's own class)
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
ClickUsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
RESUME_HINT = (
    "interrupted; the previous committed state is kept (re-run learn-stage to resume from its last finished epoch)"
)


def describe(exc: BaseException, *, interrupted: str = RESUME_HINT) -> tuple[str, str, int]:
    """``(kind, message, exit code)`` of any failure: the one map from errors to exit codes."""
    if isinstance(exc, DrlError):
        return exc.kind, str(exc), exc.exit_code
    if isinstance(exc, ClickException):  # a bad option: exit 2, like the library's UsageError
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        return "usage", f"{exc.format_message()}{hint}", exc.exit_code
    if isinstance(exc, typer.Abort):
        return "interrupted", "aborted", 130
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", interrupted, 130
    # a bug: keep the one-line contract, show the trace only when asked (--verbose)
    log.debug("internal error", exc_info=exc)
    return "internal", f"internal error {exc.__class__.__name__}: {exc} (please report it)", 1


def fail(exc: BaseException, *, as_json: bool, interrupted: str = RESUME_HINT) -> NoReturn:
    kind, message, code = describe(exc, interrupted=interrupted)
    print_error(kind, message, code, as_json)
    raise typer.Exit(code)


class OneLineErrors(TyperGroup):
    """Option-parsing errors follow the library errors' contract: one ``error:`` line on stderr,
    exit 2, and with ``--json`` the same JSON error object on stdout."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None, **extra: Any):
        argv = list(sys.argv[1:] if args is None else args)
        standalone = extra.pop("standalone_mode", True)
        if not argv or not standalone:  # bare `drl` shows the help
            return super().main(args, prog_name, complete_var, standalone_mode=standalone, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (ClickException, typer.Abort) as exc:
            kind, message, code = describe(exc)
            print_error(kind, message, code, "--json" in argv)
            sys.exit(code)
        sys.exit(code if isinstance(code, int) else 0)


def _join_process_group(device: str | None) -> bool:
    """Under torchrun, join the process group (gloo for ``--device cpu``); True on rank 0 (or alone)."""
    from .. import distributed

    if distributed.launched():
        distributed.setup(cpu=device == "cpu")
    return distributed.is_main()


@contextlib.contextmanager
def command(
    *,
    name: str,
    as_json: bool,
    quiet: bool,
    verbose: bool,
    device: str | None = None,
    interrupted: str = RESUME_HINT,
) -> Iterator[Reporter]:
    """The body of every command runs inside this: logging and progress set up for it (with the
    heartbeat that keeps a silent phase from looking hung, stopped however the body ends: result,
    error, Ctrl-C, a closed pipe), and any exception it raises turned into the one-line error and its
    exit code. Under torchrun only rank 0 reports (``Reporter.quiet`` elsewhere)."""
    start = time.perf_counter()
    reporter: Reporter | None = None
    try:
        main_rank = _join_process_group(device)
        quiet = quiet or not main_rank
        setup_logging(quiet=quiet, verbose=verbose and main_rank)
        reporter = Reporter(quiet=quiet, command=name, interval=output.PROGRESS_INTERVAL).start()
        yield reporter
    except (BrokenPipeError, typer.Exit):  # `drl predict ... | head`: the reader has all it wanted
        raise
    except (DrlError, KeyboardInterrupt, Exception) as exc:
        if reporter is not None:
            reporter.close()  # before the error line: no bar or heartbeat line after it
        fail(exc, as_json=as_json, interrupted=interrupted)
    finally:
        if reporter is not None:
            reporter.close()
    log.debug("done in %.1fs", time.perf_counter() - start)


def execute(
    action: Callable[[Reporter], Any],
    render: Callable[[dict[str, Any]], str],
    *,
    name: str,
    as_json: bool,
    quiet: bool,
    verbose: bool,
    device: str | None = None,
    phase: str = "",
) -> None:
    """Run a command's one library call inside ``command``, then print its result (rank 0 only).
    ``phase`` names what the command does until the library reports a step (the heartbeat says it)."""
    from .. import distributed

    with command(name=name, as_json=as_json, quiet=quiet, verbose=verbose, device=device) as reporter:
        if phase:
            reporter.phase(phase)
        result = action(reporter)
    if distributed.is_main():
        emit(result, render, as_json=as_json)
