"""The CLI's output plumbing: stdout gets results (text, one JSON object, or JSON lines); stderr
gets log lines, progress (a rich bar on a terminal, a plain line every few seconds otherwise),
warnings and the one-line errors (``--quiet``: warnings and errors only; ``--verbose``: timings,
per-epoch losses, the trace of an internal error)."""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .. import jsonio
from ..errors import UsageError

if TYPE_CHECKING:  # torch loads with the first command that runs, not for --help or --version
    from .. import api

log = logging.getLogger("drlcli")


class _Stderr:
    """sys.stderr as it is at each write, so log lines go above a live progress bar (rich swaps
    sys.stderr while the bar runs) and to whatever stream a test runner installed."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _LineFormatter(logging.Formatter):
    """Bare lines; a library warning reads like the CLI's own (``warning: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"warning: {text}" if record.levelno == logging.WARNING else text


def setup_logging(*, quiet: bool, verbose: bool) -> None:
    """The ``drlcli`` loggers print bare lines on stderr: warnings only (quiet), info, or debug (verbose)."""
    if quiet and verbose:
        raise UsageError("--quiet and --verbose exclude each other; pass one")
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(_LineFormatter("%(message)s"))
    log.handlers = [handler]
    log.propagate = False
    log.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    warnings.showwarning = _warning_line


def _warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
    """A Python warning (ours or a dependency's) as one ``warning:`` line on stderr, never a source excerpt."""
    text = " ".join(str(message).split())
    log.warning("%s: %s (%s:%d)", category.__name__, text, Path(filename).name, lineno)


class Reporter:
    """Progress on stderr: a rich bar on a terminal, a plain log line every few seconds otherwise."""

    def __init__(self, *, quiet: bool, interval: float = 10.0):
        self.quiet = quiet
        self.interactive = sys.stderr.isatty()
        self.interval = interval
        self._last = 0.0  # when the last plain line was printed
        self._phase = ""
        self._step = 0
        self._first_step = 0
        self._bar: Any = None
        self._task: Any = None
        self._phase_start = 0.0

    def __call__(self, event: api.Progress) -> None:
        if event.phase == "warning":  # shown even with --quiet: the user must know
            self.warn(event.detail)
            return
        if self.quiet:
            return
        if self.interactive:
            self._rich(event)
        else:
            self._plain(event)

    def _plain(self, event: api.Progress) -> None:
        """A line when a phase starts, then at most one per ``interval``, and one at its last step."""
        now = time.monotonic()
        new_phase = event.phase != self._phase
        if new_phase or event.step < self._step:  # a new phase, or its next pass (e.g. the next eval set)
            self._phase, self._phase_start, self._first_step = event.phase, now, event.step
        self._step = event.step
        final = 0 < event.total <= event.step
        if not (new_phase or final or now - self._last >= self.interval):
            return
        self._last = now
        left = ""
        if self._first_step < event.step < event.total:
            rate = (now - self._phase_start) / (event.step - self._first_step)
            left = f", ~{rate * (event.total - event.step):.0f}s left"
        log.info("%s %d/%d %s%s", event.phase, event.step, event.total, progress_text(event), left)

    def warn(self, message: str) -> None:
        if self._bar is not None:
            self._bar.console.print(f"warning: {message}")
        else:
            print(f"warning: {message}", file=sys.stderr)

    def log(self, message: str) -> None:
        """A milestone line (e.g. the benchmark's variant/stage), above any progress bar."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            log.info("%s", message)

    def _rich(self, event: api.Progress) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        if self._bar is None:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[detail]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
                redirect_stdout=sys.stdout.isatty(),  # results piped to a file must stay there
            )
            self._bar.start()
        if event.phase != self._phase or self._task is None:
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._phase = event.phase
            self._task = self._bar.add_task(event.phase, total=event.total or None, detail="")
        self._bar.update(self._task, completed=event.step, total=event.total or None, detail=progress_text(event))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def progress_text(event: api.Progress) -> str:
    """A progress event's figures as the words beside its bar: e.g. ``epoch 2/5 loss 0.4321 lr 0.00905``."""
    words = [event.detail] if event.detail else []
    if event.epoch is not None:
        words.append(f"epoch {event.epoch}/{event.epochs}")
    if event.loss is not None:
        words.append(f"loss {event.loss:.4f}")
    if event.lr is not None:
        words.append(f"lr {event.lr:.3g}")
    if event.eval_set is not None:
        words.append(f"set {event.eval_set}/{event.num_eval_sets}")
    if event.num_failed is not None:
        words.append(f"{event.num_failed} failed")
    return " ".join(words)


# ------------------------------------------------------------------------------ emitters


def emit(result: Any, render: Callable[[dict[str, Any]], str], *, as_json: bool) -> None:
    """A command's result on stdout: ``{"ok": true, ...}`` with ``--json``, else its rendered text."""
    payload = result if isinstance(result, dict) else result.to_dict()
    if as_json:
        print(jsonio.dumps({"ok": True, **payload}))
    else:
        print(render(payload), end="")


def print_error(kind: str, message: str, code: int, as_json: bool) -> None:
    """One ``error:`` line on stderr; with ``--json`` also the JSON error object on stdout."""
    message = " ".join(message.split())  # one line, whatever the library or click wrote
    message = message.encode("utf-8", "backslashreplace").decode()  # a non-UTF-8 path: escapes, not a crash
    if as_json:
        print(jsonio.dumps({"ok": False, "error": {"kind": kind, "message": message, "exit_code": code}}))
    typer.echo(f"error: {message}", err=True)
