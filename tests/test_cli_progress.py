"""No phase is silent: off a terminal, a phase that reports no step (the head's fit, an ONNX export)
still gets a ``still running`` line every interval (README: a line at least every 10 s), and the
heartbeat that prints it stops with the command, however the command ends. Here the interval is
0.2 s and the library's slow phases are fakes that sleep."""

import json
import logging
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

from drlcli import api
from drlcli.cli import app, output
from drlcli.cli.output import Reporter, setup_logging
from drlcli.commands import export as exporting
from drlcli.errors import StorageError

runner = CliRunner()
INTERVAL = 0.2


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


def heartbeats() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "drl-heartbeat" and t.is_alive()]


@pytest.fixture
def fast_heartbeat(monkeypatch):
    monkeypatch.setattr(output, "PROGRESS_INTERVAL", INTERVAL)
    yield
    assert not heartbeats(), "a heartbeat thread outlived its command"


@pytest.fixture
def plain_logging():
    setup_logging(quiet=False, verbose=False)
    yield
    logging.getLogger("drlcli").handlers.clear()


def _still(text: str) -> list[str]:
    return [line for line in text.splitlines() if "still running" in line]


def test_a_silent_phase_gets_a_line_every_interval_and_none_after_close(plain_logging, capsys):
    reporter = Reporter(quiet=False, interval=INTERVAL, command="export").start()
    reporter.interactive = False
    reporter.phase("writing m.onnx")
    time.sleep(1.0)  # an export that reports nothing
    reporter.close()
    lines = _still(capsys.readouterr().err)
    assert len(lines) >= 2, lines  # ~5 on an idle machine
    assert all(line.startswith("export: writing m.onnx still running (") for line in lines), lines
    assert lines[-1].endswith(" s)")
    time.sleep(3 * INTERVAL)
    assert not _still(capsys.readouterr().err) and not heartbeats()  # stopped: nothing more
    reporter.close()  # twice is harmless


def test_the_heartbeat_names_the_phase_that_ended_and_waits_for_silence(plain_logging, capsys):
    reporter = Reporter(quiet=False, interval=INTERVAL, command="learn-stage").start()
    reporter.interactive = False
    for step in range(1, 4):  # steps every 0.05 s: lines of their own, no heartbeat
        reporter(api.Progress("prototypes", step, 3))
        time.sleep(0.05)
    time.sleep(0.8)  # then the head's fit, which reports nothing
    reporter(api.Progress("fit", 0, 0, "the ridge head"))  # a phase that announces itself
    time.sleep(0.6)
    reporter.close()
    err = capsys.readouterr().err.splitlines()
    first_beat = next(i for i, line in enumerate(err) if "still running" in line)
    assert err[0] == "prototypes 1/3" and err[first_beat - 1] == "prototypes 3/3"  # the beat waited for silence
    assert "since prototypes ended)" in err[first_beat]
    assert not any(line.startswith("fit") for line in err)  # a phase without steps prints no line itself
    assert any(line.startswith("learn-stage: fit (the ridge head) still running (") for line in err), err


def test_quiet_starts_no_heartbeat(plain_logging, capsys):
    reporter = Reporter(quiet=True, interval=0.05).start()
    time.sleep(0.3)
    assert not heartbeats()
    reporter.close()
    assert capsys.readouterr().err == ""


def test_export_that_reports_nothing_is_not_silent(fast_heartbeat, monkeypatch, tmp_path):
    def slow_export(run, out, *, fmt=None, ptm_weights=None, progress=None):
        time.sleep(1.0)
        return {"num_classes": 3, "num_stages": 1, "path": str(out), "format": "onnx", "bytes": 2**20}

    monkeypatch.setattr(exporting, "export_run", slow_export)
    result = drl("export", "--run", tmp_path, "--out", tmp_path / "m.onnx", "--json")
    assert result.exit_code == 0, result.stderr
    lines = _still(result.stderr)
    assert len(lines) >= 2 and all(line.startswith(f"export: writing {tmp_path / 'm.onnx'}") for line in lines)
    assert json.loads(result.stdout)["ok"] is True  # stdout: the result only


def test_learn_stage_fit_without_events_gets_heartbeats(fast_heartbeat, monkeypatch, tmp_path):
    def fake_learn_stage(run, *, progress, **_):
        for step in (1, 2):
            progress(api.Progress("prototypes", step, 2))
        time.sleep(1.0)  # the head's fit: 70-145 s of nothing on a real run
        return {"status": "learned", "stage": 1}

    monkeypatch.setattr(api, "learn_stage", fake_learn_stage)
    result = drl("learn-stage", "--run", tmp_path, "--data", tmp_path, "--json")
    assert result.exit_code == 0, result.stderr
    lines = _still(result.stderr)
    assert len(lines) >= 2 and all(line.startswith("learn-stage: still running (") for line in lines), lines
    assert "since prototypes ended)" in lines[-1]


@pytest.mark.parametrize(
    ("raised", "code"), [(StorageError("cannot write export m.onnx: disk full"), 8), (KeyboardInterrupt(), 130)]
)
def test_the_heartbeat_stops_on_errors_and_ctrl_c(fast_heartbeat, monkeypatch, tmp_path, raised, code):
    def failing_export(*_, **__):
        time.sleep(0.6)
        raise raised

    monkeypatch.setattr(exporting, "export_run", failing_export)
    result = drl("export", "--run", tmp_path, "--out", tmp_path / "m.onnx")
    assert result.exit_code == code, result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: ")  # nothing after the error line
    assert _still(result.stderr)
    time.sleep(3 * INTERVAL)  # fast_heartbeat: no thread left


def test_predict_results_are_printed_after_the_bar_counts_them(monkeypatch, capsys):
    """On a terminal rich draws the bar and the result lines together: each line is printed after
    the bar was redrawn with the event that preceded it (not at the count of its last timed refresh),
    and as one line (soft wrap: the terminal folds it, no newline is inserted)."""

    class Bar:
        def __init__(self):
            self.calls, self.console = [], self

        def refresh(self):
            self.calls.append("refresh")

        def print(self, text, **options):
            self.calls.append((text, options["soft_wrap"], options["markup"]))

        def stop(self):
            self.calls.append("stop")

    reporter = Reporter(quiet=False)
    reporter._bar = bar = Bar()  # a live bar (rich's Progress, without a terminal to draw on)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    reporter.result("a.png: cat 0.900 [bold]")
    reporter.close()
    assert bar.calls == ["refresh", ("a.png: cat 0.900 [bold]", True, False), "stop"]
    reporter.result("b.png: dog 0.800")  # no bar: a plain line on stdout
    assert capsys.readouterr().out == "b.png: dog 0.800\n"


def test_on_a_terminal_a_silent_phase_gets_a_spinner(monkeypatch):
    reporter = Reporter(quiet=False, interval=10.0, command="export", spinner_after=0.1)
    reporter.interactive = True
    reporter.start()
    reporter.phase("writing m.onnx")
    try:
        deadline = time.monotonic() + 5
        while (reporter._bar is None or not reporter._bar.tasks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reporter._bar is not None  # rich's bar: spinner and elapsed time move by themselves
        with reporter._lock:  # the heartbeat thread adds the task right after it makes the bar
            (task,) = reporter._bar.tasks
        assert task.description == "export: writing m.onnx" and task.total is None
    finally:
        reporter.close()
    assert reporter._bar is None and not heartbeats()


def test_steps_a_little_slower_than_the_interval_print_their_counts(plain_logging, capsys):
    """Steps that come less often than the interval but more often than none: the heartbeat prints
    the newest step's count and time left, not "still running" (before: a 21-batch feature pass
    printed "prototypes 1/21", then only "still running" lines for two minutes)."""
    reporter = Reporter(quiet=False, interval=INTERVAL, command="learn-stage").start()
    reporter.interactive = False
    for step in range(1, 9):
        reporter(api.Progress("prototypes", step, 8))
        time.sleep(0.75 * INTERVAL)
    reporter.close()
    err = capsys.readouterr().err.splitlines()
    assert not _still(err_text := "\n".join(err)), err_text
    middle = [
        line
        for line in err
        if line.startswith("prototypes ") and not line.startswith(("prototypes 1/", "prototypes 8/"))
    ]
    assert middle and all("s left" in line for line in middle), err
