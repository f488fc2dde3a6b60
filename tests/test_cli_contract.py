"""The output contract of every command off a terminal: no control characters (no ANSI escapes,
no carriage returns) on stdout or stderr, and ``--json`` gives JSON on stdout for success and for
failure (library errors and option-parsing errors alike), with the exit code in it."""

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from drlcli.cli import app
from drlcli.methods import METHODS
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

runner = CliRunner()
TINY_ARGS = ["--ptm", TINY_PTM] + [a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")]
FAST = ["--epochs", "1", "--batch-size", "12", "--device", "cpu"]
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # everything below space but \t and \n, and DEL


def drl(*args):
    result = runner.invoke(app, [str(a) for a in args])
    for stream in (result.stdout, result.stderr):
        assert not CONTROL.search(stream), f"control character in output of {args}: {stream!r}"
    return result


def json_out(result) -> list[dict]:
    """Every stdout line parses as JSON (one object; one per image for predict)."""
    lines = result.stdout.strip().splitlines()
    assert lines, "no JSON on stdout"
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def work(tmp_path_factory, stage_folders, trains_file):
    """A run with two stages trained through the CLI (the first with --verbose), and its outputs."""
    root = tmp_path_factory.mktemp("contract")
    run = root / "run"
    assert drl("init", "--run", run, *TINY_ARGS, "--random-init", "--config", trains_file).exit_code == 0
    outputs = []
    for k, (train, test) in enumerate(stage_folders[:2]):
        verbose = ["--verbose"] if k == 0 else []
        result = drl("learn-stage", "--run", run, "--data", train, "--eval-data", test, *FAST, *verbose)
        assert result.exit_code == 0, result.stderr
        outputs.append(result)
    return root, run, outputs


def test_learn_stage_logs_plain_lines_and_verbose_details(work):
    _, _, (verbose, plain) = work
    for result in (verbose, plain):
        assert "train 1/" in result.stderr and "evaluate 1/1" in result.stderr  # periodic plain lines
    assert "epoch 1/1: loss" in verbose.stderr and "done in" in verbose.stderr  # --verbose only
    assert "epoch 1/1: loss" not in plain.stderr and "done in" not in plain.stderr


def _cases(root, run, test_dir, bench_data):
    """command -> (success args, failure args, failure exit code), for every command."""
    return {
        "init": (["--run", root / "new", *TINY_ARGS, "--random-init"], ["--run", run, *TINY_ARGS, "--random-init"], 7),
        "learn-stage": (["--run", run, "--data", test_dir.parent / "train", *FAST], ["--run", run, "--data", root], 3),
        "eval": (["--run", run, "--all-seen", "--device", "cpu"], ["--run", run], 2),
        "export": (["--run", run, "--out", root / "m.pt"], ["--run", run, "--out", root / "m.x", "--format", "x"], 2),
        "predict": ([test_dir, "--run", run, "--device", "cpu"], [test_dir, "--run", root / "none"], 7),
        "verify": (["--run", run], ["--run", root], 7),
        "info": (["--run", run], ["--run", root], 7),
        "benchmark": (
            ["--data", bench_data, "--out", root / "bench", *TINY_ARGS, "--random-init", "--methods", "simplecil"]
            + ["--split", "B0Inc1", "--device", "cpu"],
            ["--data", root / "none", "--out", root / "bench2", *TINY_ARGS, "--random-init"],
            3,
        ),
        "demo": (["--out", root / "demo", "--epochs", "1", "--device", "cpu"], ["--out", root / "demo"], 7),
        "forget": (["--run", run, "--class", "class_00"], ["--run", run, "--class", "nope"], 3),
        "check-data": (["--run", run, "--data", test_dir.parent / "train"], ["--run", run, "--data", root], 3),
    }


COMMANDS = [
    *("init", "learn-stage", "eval", "export", "predict", "verify", "info", "benchmark", "demo", "forget"),
    "check-data",
]


def test_the_contract_covers_every_command():
    names = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    assert names == set(COMMANDS)


@pytest.fixture(scope="module")
def bench_data(work):
    root = work[0] / "bench-data"
    make_class_folders(root / "train", [0, 1], images_per_class=3)
    make_class_folders(root / "test", [0, 1], images_per_class=2, offset=3)
    return root


@pytest.mark.parametrize("command", COMMANDS)
def test_json_and_plain_output(work, stage_folders, bench_data, command):
    root, run, _ = work
    good, bad, code = _cases(root, run, stage_folders[0][1], bench_data)[command]
    result = drl(command, *good, "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    objects = json_out(result)
    if command == "predict":
        assert all("top" in o for o in objects) and len(objects) == 12
    else:
        assert len(objects) == 1 and objects[0]["ok"] is True
    failed = drl(command, *bad, "--json")
    assert failed.exit_code == code, (failed.stdout, failed.stderr)
    (error,) = json_out(failed)
    assert error["ok"] is False and error["error"]["exit_code"] == code and error["error"]["message"]
    assert failed.stderr.strip().splitlines()[-1] == f"error: {error['error']['message']}"
    # an option-parsing error answers --json too, in one line
    parse = drl(command, "--json", "--no-such-option")
    assert parse.exit_code == 2 and json_out(parse)[0]["error"]["kind"] == "usage"
    assert "--no-such-option" in parse.stderr and len(parse.stderr.strip().splitlines()) == 1
    if command in ("init", "demo"):  # the success case made what the second run needs to find
        shutil.rmtree(root / ("new" if command == "init" else "demo"))
    if command == "forget":  # bring the class back, for the plain run and the tests after this one
        assert drl("forget", "--run", run, "--restore", "class_00").exit_code == 0
    plain = drl(command, *good)  # the human output: plain text, no control characters either
    assert plain.exit_code == 0 and plain.stdout.strip(), plain.stderr
    if command == "forget":
        assert drl("forget", "--run", run, "--restore", "class_00").exit_code == 0


def test_quiet_and_verbose_together_are_refused(work):
    _, run, _ = work
    result = drl("info", "--run", run, "-q", "-v", "--json")
    assert result.exit_code == 2 and "exclude each other" in json_out(result)[0]["error"]["message"]


def test_artifact_paths_are_in_the_json(work, stage_folders, tmp_path):
    pytest.importorskip("matplotlib")  # --plot needs the plot extra (part of the test extra)
    _, run, _ = work
    learned = json_out(drl("learn-stage", "--run", run, "--data", stage_folders[0][0], "--json"))[0]
    assert learned["status"] == "unchanged" and learned["run_dir"] == str(run)
    plot = tmp_path / "acc.png"
    ev = json_out(drl("eval", "--run", run, "--all-seen", "--plot", plot, "--json"))[0]
    assert ev["run_dir"] == str(run) and ev["plot"] == str(plot) and plot.stat().st_size > 0
    ex = json_out(drl("export", "--run", run, "--out", tmp_path / "m.drl", "--json"))[0]
    assert ex["path"] == str(tmp_path / "m.drl") and ex["run_dir"] == str(run) and ex["format"] == "drl"


def test_every_command_has_help():
    """--help renders for every command (help texts are plain text, never parsed as markup)."""
    names = [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]
    assert len(names) >= 9
    for name in names:
        result = drl(name, "--help")
        assert result.exit_code == 0, (name, result.output)
        assert "Usage:" in result.stdout and "--help" in result.stdout


def test_top_level_help_lists_every_exit_code_whole():
    from drlcli.errors import EXIT_CODES

    result = drl("--help")
    assert result.exit_code == 0
    out = " ".join(result.stdout.split())  # whatever the terminal width wrapped
    for code, text in EXIT_CODES.items():
        assert f"{code} {text}" in out, text  # e.g. "(a bug: please report it)", not cut at the colon
    assert "--version" in out


def test_help_shows_choices_and_effective_defaults():
    from drlcli.commands.export import FORMATS
    from drlcli.methods import METHODS

    learn = " ".join(drl("learn-stage", "--help").stdout.split())
    for option, value in (("--epochs", 20), ("--batch-size", 48), ("--lr", 0.05), ("--workers", 0)):
        assert f"default: from the run's config ({value}" in learn.split(option, 1)[1], option
    assert "ease 0.025" in learn  # a method's own default is named where it differs
    assert f"<{'|'.join(METHODS)}>" in drl("init", "--help").stdout
    assert f"<{'|'.join(FORMATS)}>" in drl("export", "--help").stdout
    for args in (("init", "--ptm", "x", "--method", "nope"), ("export", "--out", "m.drl", "--format", "nope")):
        result = drl(*args, "--json")
        assert result.exit_code == 2 and json_out(result)[0]["error"]["kind"] == "usage"
        assert "nope" in json_out(result)[0]["error"]["message"]


def test_version_prints_drlcli_torch_timm_and_with_verbose_cuda():
    import timm
    import torch

    import drlcli

    result = drl("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"drlcli {drlcli.__version__}",
        f"torch {torch.__version__}",  # read from torch's files, build tag (+cpu, +cu130) included
        f"timm {timm.__version__}",
    ]
    (obj,) = json_out(drl("--version", "--json"))
    assert obj == {"ok": True, "drlcli": drlcli.__version__, "torch": torch.__version__, "timm": timm.__version__}
    verbose = drl("--version", "--verbose")  # CUDA availability: only torch can tell (it loads torch)
    assert verbose.stdout.splitlines()[-1] == f"cuda_available {torch.cuda.is_available()}"
    (obj,) = json_out(drl("-v", "--version", "--json"))
    assert obj["cuda_available"] is torch.cuda.is_available() and obj["torch"] == torch.__version__
    for misplaced in (drl("--json", "info"), drl("--verbose", "info", "--json")):  # never dropped silently
        assert misplaced.exit_code == 2 and json_out(misplaced)[0]["error"]["kind"] == "usage"
    assert "--verbose goes after the command" in json_out(drl("--verbose", "info", "--json"))[0]["error"]["message"]


def test_version_is_fast_and_does_not_import_torch():
    """`drl --version` reads the versions from the installed metadata: no torch import (seconds)."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    code = (
        "import sys; from drlcli.cli import main; sys.argv = ['drl', '--version']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules, 'timm' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("drlcli "), result.stderr
    assert result.stdout.rstrip().endswith("False False"), result.stdout


def test_top_level_help_shows_every_command_summary_whole():
    """click cuts a command's summary at 45 characters ("..."); each has a short_help shown whole."""
    out = " ".join(drl("--help").stdout.split())
    commands = out.split("Commands:", 1)[1].split("Exit codes:", 1)[0]
    assert "..." not in commands
    for command in app.registered_commands:
        assert command.short_help and command.short_help in commands, command.short_help


def test_init_config_help_names_every_section():
    from drlcli.config import config_sections

    sections = list(config_sections())
    text = " ".join(drl("init", "--help").stdout.split()).split("--config <path>", 1)[1].split("--preset", 1)[0]
    assert len(sections) >= 5 and all(section in text for section in sections), (sections, text)


def test_shell_completion_offers_commands_and_choices():
    """Typer's completion (drl --install-completion) completes command names and choice values."""

    def complete(line: str) -> list[str]:
        words = line.split(" ")
        env = {"_DRL_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(len(words) - 1)}
        result = runner.invoke(app, [], prog_name="drl", env=env)
        assert result.exit_code == 0, result.output
        return result.stdout.split()

    assert complete("drl lea") == ["learn-stage"]
    assert complete("drl init --method ") == list(METHODS)
    assert complete("drl export --format o") == ["onnx"]
    assert "--install-completion" in drl("--help").stdout


def test_help_is_fast_and_does_not_import_torch():
    """`drl --help` prints before torch loads (torch alone takes seconds to import)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    code = "import sys; from drlcli.cli import main; sys.argv = ['drl', '--help']\ntry:\n    main()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
        seconds.append(time.perf_counter() - start)
        assert result.returncode == 0 and "Usage:" in result.stdout, result.stderr
        assert result.stdout.rstrip().endswith("False"), "drl --help imported torch"
    assert min(seconds) < 1.0, seconds
