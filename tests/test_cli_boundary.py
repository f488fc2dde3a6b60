"""The CLI's one error boundary (``drlcli/cli/boundary.py``): every command, predict included, maps
failures to the same one-line errors and exit codes, and ``--device`` is the parsed option."""

import json

import pytest
from typer.testing import CliRunner

from drlcli import distributed, errors
from drlcli.cli import app
from drlcli.cli.boundary import describe

runner = CliRunner()


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def joined(monkeypatch):
    """Pretend torchrun started us: record how each command joins the process group."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "setup", lambda **kw: calls.append(kw))
    return calls


@pytest.mark.parametrize("command", ["eval", "learn-stage", "predict"])
def test_device_equals_form_is_parsed_like_the_spaced_form(joined, tmp_path, command):
    """``--device=cpu`` is the same option as ``--device cpu`` (a scan of argv missed it): gloo, not NCCL."""
    extra = {"eval": ["--all-seen"], "learn-stage": ["--data", tmp_path], "predict": [tmp_path / "x.png"]}[command]
    spaced = drl(command, *extra, "--run", tmp_path / "none", "--device", "cpu", "--json")
    equals = drl(command, *extra, "--run", tmp_path / "none", "--device=cpu", "--json")
    assert joined == [{"cpu": True}, {"cpu": True}]
    assert (equals.exit_code, equals.stdout, equals.stderr) == (spaced.exit_code, spaced.stdout, spaced.stderr)
    assert spaced.exit_code == errors.RunStateError.exit_code


def test_other_devices_join_with_the_default_backend(joined, tmp_path):
    drl("eval", "--run", tmp_path, "--all-seen", "--device=auto")
    drl("info", "--run", tmp_path)  # no --device option
    assert joined == [{"cpu": False}, {"cpu": False}]


def test_alone_no_process_group_is_joined(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(distributed, "setup", lambda **kw: pytest.fail("joined a process group without torchrun"))
    assert drl("eval", "--run", tmp_path, "--all-seen", "--device=cpu").exit_code == errors.RunStateError.exit_code


@pytest.mark.parametrize(
    ("raised", "kind", "code", "message"),
    [
        (RuntimeError("boom"), "internal", 1, "internal error RuntimeError: boom (please report it)"),
        (KeyboardInterrupt(), "interrupted", 130, "interrupted"),
        (errors.IntegrityError("damaged"), "integrity", 5, "damaged"),
    ],
)
def test_predict_errors_go_through_the_same_boundary(monkeypatch, tmp_path, raised, kind, code, message):
    import drlcli.commands.predict

    def failing(*args, **kwargs):
        raise raised
        yield  # a generator, like the real one

    monkeypatch.setattr(drlcli.commands.predict, "predict_sources", failing)
    result = drl("predict", tmp_path, "--json")
    assert result.exit_code == code
    assert json.loads(result.stdout)["error"] == {"kind": kind, "message": message, "exit_code": code}
    assert result.stderr.splitlines() == [f"error: {message}"]


def test_describe_maps_every_library_error_to_its_documented_code():
    for cls in (errors.UsageError, errors.DataError, errors.RunBusyError, errors.IntegrityError, errors.PTMError):
        kind, message, code = describe(cls("why"))
        assert (kind, message, code) == (cls.kind, "why", cls.exit_code) and code in errors.EXIT_CODES
    assert describe(KeyboardInterrupt())[2] == 130
    assert describe(ValueError("x"))[::2] == ("internal", 1)
