"""The CLI's output plumbing: stdout gets results (text, one JSON object, or JSON lines); stderr
gets log lines, progress (a rich bar on a terminal, a plain line every few seconds otherwise),
warnings and the one-line errors (``--quiet``: warnings and errors only; ``--verbose``: timings,
per-epoch losses, the trace of an internal error)."""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .. import jsonio
from ..errors import UsageError

if TYPE_CHECKING:  # torch loads with the first command that runs, not for --help or --version
    from ..progress import Progress

log = logging.getLogger("drlcli")


# Characters that must never reach a terminal raw from data (class names, paths, reasons, library
# messages): C0 controls (newline, tab, ESC, BEL, ...), DEL and C1 controls, which move the cursor,
# retitle or clear the terminal, or fake result lines; the bidi overrides, embeddings, isolates and
# marks that reorder what the eye reads (Trojan Source); line/paragraph separators; lone surrogates
# (a non-UTF-8 file name), which cannot even be encoded for the terminal.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text: object) -> str:
    """``text`` safe to print for people: every control, bidi or separator character written as its
    Python escape (``\\x1b``, ``\\n``, ``\\u202e``), so that a hostile class name or path can neither
    drive the terminal nor fake a line. Apply it to data *values*; the text around them keeps its
    own newlines (``printable_lines`` guards a whole block)."""
    return _UNSAFE.sub(_escape, str(text))


def printable_lines(text: str) -> str:
    """A block of text drl built (a rendered result, a trace) with its own newlines kept and
    everything else ``printable``: the last guard at the stdout/stderr sinks."""
    return "\n".join(printable(line) for line in text.split("\n"))


def printable_data(obj: Any) -> Any:
    """A JSON payload with every string in it (keys too) ``printable``: what the text renderers get,
    so that none of them can insert a raw name (``--json`` prints the payload itself, exact)."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, dict):
        return {printable_data(key): printable_data(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [printable_data(value) for value in obj]
    return obj


class _Stderr:
    """sys.stderr as it is at each write, so log lines go above a live progress bar (rich swaps
    sys.stderr while the bar runs) and to whatever stream a test runner installed."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _LineFormatter(logging.Formatter):
    """Bare lines; a library warning reads like the CLI's own (``warning: ...``). A message is one
    line whatever the data in it (``printable``); a trace (``--verbose``) keeps its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return printable(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        text = printable_lines(super().format(record))
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


# A plain progress line at most this often, and a heartbeat line when this long passes without one:
# no phase is silent longer (docs/cli.md). ``command`` reads it at each call: tests shorten it.
PROGRESS_INTERVAL = 10.0
# On a terminal, a phase silent this long gets a spinner with its elapsed time.
SPINNER_AFTER = 1.0


class Reporter:
    """Progress on stderr: a rich bar on a terminal, a plain log line every few seconds otherwise.

    ``start`` adds the heartbeat: a daemon thread that, when ``interval`` passes without a line (a
    library phase that reports no steps: the head's fit, an ONNX export), prints one saying what
    still runs and for how long (off a terminal), or shows a spinner with the elapsed time (on one).
    ``close`` stops it; ``command`` calls both, whatever way the command ends."""

    def __init__(
        self,
        *,
        quiet: bool,
        interval: float = PROGRESS_INTERVAL,
        command: str = "drl",
        spinner_after: float = SPINNER_AFTER,
    ):
        self.quiet = quiet
        self.interactive = sys.stderr.isatty()
        self.interval = interval
        self.command = command
        self.spinner_after = spinner_after
        self._lock = threading.RLock()  # the heartbeat thread and the command's own calls
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = 0.0  # when the last line was printed (a bar: last updated)
        self._phase = ""
        self._step = 0
        self._first_step = 0
        self._phase_start = 0.0
        self._finished = False  # the phase reported its last step: what runs now reports nothing yet
        self._unprinted: Progress | None = None  # a step event not printed (within the interval of a line)
        self._label = ""  # what runs now: the last event's phase and detail, or what the CLI named (``phase``)
        self._since = 0.0  # when what runs now began: the command, the phase, or the end of the last one
        self._bar: Any = None
        self._task: Any = None
        self._task_phase: str | None = None  # the phase the bar's task shows (None: the heartbeat's spinner)

    # ---------------------------------------------------------------- the heartbeat

    def start(self) -> Reporter:
        """Start the heartbeat (nothing with --quiet). Returns the reporter."""
        if self.quiet or self._thread is not None:
            return self
        self._last = self._since = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name="drl-heartbeat", daemon=True)
        self._thread.start()
        return self

    def phase(self, label: str) -> None:
        """Name what the command does now when no step of it is reported (``writing model.onnx``):
        the heartbeat's lines and the terminal's spinner say it."""
        with self._lock:
            self._label, self._since = label, time.monotonic()
            self._phase, self._finished = "", False

    def _beat(self) -> None:
        tick = max(0.01, min(self.interval, self.spinner_after) / 4)
        while not self._stop.wait(tick):
            with self._lock:
                if not self._stop.is_set():
                    self._heartbeat(time.monotonic())

    def _heartbeat(self, now: float) -> None:
        """One check: a line (plain) or a spinner (terminal) when the command has been silent too long."""
        if self.interactive:
            if now - self._last >= self.spinner_after and (self._task is None or self._finished):
                self._spinner()
        elif now - self._last >= self.interval:
            if self._unprinted is not None:  # steps came, none printed since the last line: the newest one
                self._plain_line(self._unprinted, now)
            else:
                self._last = now
                log.info("%s: %s", self.command, self._still_running(now))

    def _still_running(self, now: float) -> str:
        """What runs and for how long: ``fit still running (35 s)``, ``still running (12 s since train ended)``."""
        seconds = f"{now - self._since:.0f} s"
        if self._phase and self._finished:
            return f"still running ({seconds} since {self._phase} ended)"
        return f"{self._label} still running ({seconds})" if self._label else f"still running ({seconds})"

    def _spinner(self) -> None:
        """A bar with a spinner and the elapsed time for what runs unreported (it moves by itself)."""
        after = f"after {self._phase}" if self._phase and self._finished else ""
        self._rich_task(None, f"{self.command}: {after or self._label or 'working'}", 0, 0, "")
        self._finished = False  # one spinner, until the next event

    # ---------------------------------------------------------------- events

    def __call__(self, event: Progress) -> None:
        if event.phase == "warning":  # shown even with --quiet: the user must know
            self.warn(event.detail)
            return
        if self.quiet:
            return
        with self._lock:
            now = time.monotonic()
            new_phase = self._track(event, now)
            if self.interactive:
                self._rich(event)
                self._last = now
            else:
                self._plain(event, new_phase, now)

    def _track(self, event: Progress, now: float) -> bool:
        """Follow the phases; True when ``event`` starts one (or its next pass, e.g. the next eval set)."""
        new_phase = event.phase != self._phase
        if new_phase or event.step < self._step:
            self._phase, self._phase_start, self._first_step = event.phase, now, event.step
            self._since = now
        self._step = event.step
        self._label = f"{event.phase} ({event.detail})" if event.detail else event.phase
        final = 0 < event.total <= event.step
        if final and not self._finished:
            self._since = now
        self._finished = final
        return new_phase

    def _plain(self, event: Progress, new_phase: bool, now: float) -> None:
        """A line when a phase starts, then at most one per ``interval``, and one at its last step. A
        phase without steps (``total`` 0: loading, the head's fit, a commit) prints nothing by itself:
        it names what runs for the heartbeat, whose line comes when it lasts ``interval``; so a command
        that fails at once still prints its one ``error:`` line alone."""
        if not event.total:
            self._unprinted = None
            return
        final = 0 < event.total <= event.step
        if not (new_phase or final or now - self._last >= self.interval):
            self._unprinted = event  # the heartbeat prints it if no later step does within the interval
            return
        self._plain_line(event, now)

    def _plain_line(self, event: Progress, now: float) -> None:
        """The line of a step: its phase, count, figures and the time left."""
        self._last, self._unprinted = now, None
        left = ""
        if self._first_step < event.step < event.total:
            rate = (now - self._phase_start) / (event.step - self._first_step)
            left = f", ~{rate * (event.total - event.step):.0f}s left"
        words = " ".join(w for w in (f"{event.phase} {event.step}/{event.total}", progress_text(event)) if w)
        log.info("%s%s", words, left)

    def warn(self, message: str) -> None:
        """A ``warning:`` line, one line whatever the message holds, above any progress bar."""
        self._line(f"warning: {printable(message)}", always=True)

    def log(self, message: str) -> None:
        """A milestone line (e.g. the benchmark's variant/stage), above any progress bar."""
        if not self.quiet:
            self._line(printable(message))

    def _line(self, text: str, *, always: bool = False) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
            elif always:
                print(text, file=sys.stderr)
            else:
                log.info("%s", text)
            self._last = time.monotonic()

    def result(self, text: str) -> None:
        """One result line on stdout (predict's). Under a live bar on a terminal, rich takes stdout
        over (the bar and the lines share the screen): the bar is redrawn first, so that it counts
        this result (not the count of its last timed refresh), and the line is never wrapped into two."""
        text = printable_lines(text)
        with self._lock:
            if self._bar is not None and sys.stdout.isatty():
                self._bar.refresh()
                self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
                return
        print(text)

    # ---------------------------------------------------------------- the terminal's bar

    def _rich(self, event: Progress) -> None:
        self._rich_task(event.phase, event.phase, event.step, event.total, progress_text(event))

    def _rich_task(self, phase: str | None, description: str, step: int, total: int, detail: str) -> None:
        """Show ``phase``'s task on the bar (a new one when the phase changes; ``None``: a spinner)."""
        if self._bar is None:
            self._bar = _new_bar()
            self._bar.start()
        if phase is None or phase != self._task_phase or self._task is None:
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._task_phase = phase
            self._task = self._bar.add_task(printable(description), total=total or None, count="", detail="")
        count = f"{step}/{total}" if total else ""
        self._bar.update(self._task, completed=step, total=total or None, count=count, detail=detail)

    def close(self) -> None:
        """Stop the heartbeat and the bar; safe to call twice, and from an error path."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
                self._task = None


def _new_bar() -> Any:
    """The terminal's bar: phase, bar, count, figures, elapsed and remaining time; a spinner that
    keeps turning while a step or an unreported phase runs. No text in it is read as rich markup."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.fields[count]}", markup=False),
        TextColumn("{task.fields[detail]}", markup=False),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        redirect_stdout=sys.stdout.isatty(),  # results piped to a file must stay there
    )


def progress_text(event: Progress) -> str:
    """A progress event's figures as the words beside its bar: e.g. ``epoch 2/5 loss 0.4321 lr 0.00905``.
    The detail (a folder being validated, a benchmark variant) is data: ``printable``."""
    words = [printable(event.detail)] if event.detail else []
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
    if as_json:  # exact: data, and ASCII (every control, bidi or non-ASCII character a JSON escape)
        print(jsonio.dumps({"ok": True, **payload}))
    else:  # for people: every name and path in it escaped (``printable``), the text's own lines kept
        print(printable_lines(render(printable_data(payload))), end="")


def print_error(kind: str, message: str, code: int, as_json: bool) -> None:
    """One ``error:`` line on stderr; with ``--json`` also the JSON error object on stdout."""
    message = " ".join(message.split())  # one line, whatever the library or click wrote
    message = message.encode("utf-8", "backslashreplace").decode()  # a non-UTF-8 path: escapes, not a crash
    if as_json:
        print(jsonio.dumps({"ok": False, "error": {"kind": kind, "message": message, "exit_code": code}}))
    typer.echo(f"error: {printable(message)}", err=True)  # ESC, BEL, bidi are no whitespace: escaped


def stdout_is_a_terminal() -> bool:
    """Whether results go to a person (text lines) or to a file or pipe (JSON lines)."""
    return sys.stdout.isatty()
