"""Terminal escape injection: a class name, path or reason that holds control characters (ESC, BEL,
newline, C1) or bidi overrides reaches people's output only escaped (``\\x1b``, ``\\n``, ``\\u202e``),
on every path drl prints for people (result text, predict lines, progress, warnings, log lines, the
``error:`` line), while ``--json`` keeps the exact value (JSON escapes, ASCII on the wire)."""

import json
import logging
import shutil
import warnings

import pytest
from typer.testing import CliRunner

from drlcli import api
from drlcli.cli import app, output
from drlcli.cli.output import Reporter, printable, printable_data, setup_logging
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

runner = CliRunner()
TINY_ARGS = ["--ptm", TINY_PTM] + [a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")]
# retitles and clears the terminal, fakes a result line, reverses what follows, opens a C1 CSI
HOSTILE = "cat\x1b]0;PWNED\x07\x1b[2J\nclass_00 1.000\u202e\x9b\u2066"
ESCAPED = "cat\\x1b]0;PWNED\\x07\\x1b[2J\\nclass_00 1.000\\u202e\\x9b\\u2066"
DIR = "drop\x1b[2J\u202e"  # a folder name: the data's and the run's paths carry it too
DIR_ESCAPED = "drop\\x1b[2J\\u202e"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\u2066", "\r")


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean(text: str) -> None:
    """Nothing of the hostile text reaches ``text`` raw: no control or bidi character, no faked line."""
    for char in RAW:
        assert char not in text, (char, text)
    assert not any(line.startswith("class_00 1.000") for line in text.splitlines()), text


def assert_escaped(text: str, escaped: str = ESCAPED) -> None:
    """``assert_clean``, and the escaped form of the hostile text is there."""
    assert_clean(text)
    assert escaped in text, text


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A simplecil run (fast: no training) under a hostile path, that learned a hostile class name
    from a hostile data folder; and an eval folder in which that class's images are class_00's."""
    root = tmp_path_factory.mktemp("escapes") / DIR
    for part, offset in (("train", 0), ("test", 4)):
        make_class_folders(root / part, [0, 1], images_per_class=4 if part == "train" else 2, offset=offset)
        (root / part / "class_01").rename(root / part / HOSTILE)
    confusing = root / "confusing"
    shutil.copytree(root / "test" / "class_00", confusing / HOSTILE)  # every image of it is class_00's
    shutil.copytree(root / "test" / "class_00", confusing / "class_00")
    run = root / "run"
    assert drl("init", "--run", run, *TINY_ARGS, "--random-init", "--method", "simplecil").exit_code == 0
    learned = drl(
        "learn-stage", "--run", run, "--data", root / "train", "--eval-data", root / "test", "--device", "cpu"
    )
    assert learned.exit_code == 0, learned.stderr
    return root, run, confusing, learned


def test_printable_escapes_controls_c1_bidi_and_surrogates():
    assert printable(HOSTILE) == ESCAPED
    assert printable("a\tb\rc\x00\x7f\u200f\u2028\udcff") == "a\\tb\\rc\\x00\\x7f\\u200f\\u2028\\udcff"
    assert printable("Ā ünïcode ✓ 猫") == "Ā ünïcode ✓ 猫"  # printable text stays as it is
    assert printable(printable(HOSTILE)) == ESCAPED  # escaping twice changes nothing
    assert printable_data({HOSTILE: [HOSTILE, 1, None]}) == {ESCAPED: [ESCAPED, 1, None]}


def test_learn_stage_lines_and_progress_lines(hostile):
    _, _, _, learned = hostile
    assert_clean(learned.stdout)
    assert_escaped(learned.stderr, DIR_ESCAPED)  # the data folder being validated
    assert any(line.startswith("validate ") and DIR_ESCAPED in line for line in learned.stderr.splitlines())


def test_eval_text_confusions_and_tables(hostile):
    _, run, confusing, _ = hostile
    result = drl("eval", "--run", run, "--data", confusing, "--confusions", "5", "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert_escaped(result.stdout)
    assert f"{ESCAPED} -> class_00" in result.stdout  # the confusion, one line
    assert_clean(result.stderr)
    exact = json.loads(drl("eval", "--run", run, "--data", confusing, "--device", "cpu", "--json").stdout)
    assert exact["confused"][0]["true"] == HOSTILE  # --json: the exact name


def test_predict_text_lines_and_json_lines(hostile, monkeypatch):
    root, run, _, _ = hostile
    images = root / "test" / HOSTILE
    lines = drl("predict", images, "--run", run, "--device", "cpu", "--top-k", "2")
    assert lines.exit_code == 0, lines.stderr
    for char in RAW:  # JSON lines: ASCII, every control and bidi character a JSON escape
        assert char not in lines.stdout
    objects = [json.loads(line) for line in lines.stdout.splitlines()]
    assert len(objects) == 2 and objects[0]["top"][0]["class"] == HOSTILE and HOSTILE in objects[0]["path"]
    monkeypatch.setattr(output, "stdout_is_a_terminal", lambda: True)  # the text lines of a terminal
    text = drl("predict", images, "--run", run, "--device", "cpu", "--top-k", "2")
    assert text.exit_code == 0, text.stderr
    assert_escaped(text.stdout)
    assert len(text.stdout.splitlines()) == 2  # one line per image, whatever the names
    assert all(line.startswith(str(root.parent / DIR_ESCAPED)) for line in text.stdout.splitlines())
    missing = drl("predict", root / f"gone-{HOSTILE}.png", "--run", run, "--device", "cpu")
    assert missing.exit_code == 3
    assert_escaped(missing.stdout)


def test_forget_and_its_log(hostile, tmp_path, monkeypatch):
    _, run, _, _ = hostile
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    forgot = drl("forget", "--run", copy, "--class", HOSTILE, "--reason", "wrong label")
    assert forgot.exit_code == 0, forgot.stderr
    assert_escaped(forgot.stdout)
    assert f"forgot class '{ESCAPED}'" in forgot.stdout and f"forgotten now: {ESCAPED}" in forgot.stdout
    info = drl("info", "--run", copy)
    assert_escaped(info.stdout)
    assert f"forgotten: '{ESCAPED}' of stage 1" in info.stdout and "forget log:" in info.stdout

    # a reason as a crafted forget log could hold it (the library refuses such a --reason)
    real = api.info

    def crafted(path):
        result = real(path)
        for entry in [*result["forgotten"], *result["forget_history"]]:
            entry["reason"] = HOSTILE
        return result

    monkeypatch.setattr(api, "info", crafted)
    info = drl("info", "--run", copy)
    assert info.exit_code == 0, info.stderr
    assert_escaped(info.stdout)
    assert f"({ESCAPED})" in info.stdout
    assert json.loads(drl("info", "--run", copy, "--json").stdout)["forget_history"][0]["reason"] == HOSTILE


def test_export_verify_and_info_name_the_hostile_paths(hostile, tmp_path):
    root, run, _, _ = hostile
    out = tmp_path / f"m{DIR}.drl"
    for args in (("export", "--run", run, "--out", out), ("verify", "--run", run), ("info", "--run", run)):
        result = drl(*args)
        assert result.exit_code == 0, result.stderr
        assert_escaped(result.stdout, DIR_ESCAPED)
        assert_clean(result.stderr)
    assert json.loads(drl("verify", "--run", run, "--json").stdout)["run_dir"] == str(run)


def test_error_lines_are_escaped_and_json_errors_exact(hostile):
    root, _, _, _ = hostile
    missing = root / f"nope-{HOSTILE}"
    result = drl("eval", "--run", root / "run", "--data", missing, "--device", "cpu")
    assert result.exit_code == 3, result.stderr
    assert_clean(result.stderr)
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "\\x1b]0;PWNED\\x07" in line and DIR_ESCAPED in line
    exact = json.loads(drl("eval", "--run", root / "run", "--data", missing, "--json").stdout)["error"]["message"]
    assert "\x1b]0;PWNED\x07" in exact  # the JSON error object holds the text (whitespace made one line)


def test_warnings_and_library_log_lines_are_escaped(hostile, monkeypatch):
    _, run, _, _ = hostile
    real = api.info

    def noisy(path):
        warnings.warn(f"a dependency warns about {HOSTILE}", UserWarning, stacklevel=1)
        logging.getLogger("drlcli.api").warning("the library warns about %s", HOSTILE)
        logging.getLogger("drlcli.api").info("the library logs %s", HOSTILE)
        return real(path)

    monkeypatch.setattr(api, "info", noisy)
    result = drl("info", "--run", run)
    assert result.exit_code == 0, result.stderr
    assert_escaped(result.stderr)
    lines = [line for line in result.stderr.splitlines() if "PWNED" in line]
    assert len(lines) == 3 and all("cat\\x1b]0;PWNED\\x07\\x1b[2J" in line for line in lines), lines
    assert lines[0].startswith("warning: UserWarning: a dependency warns")  # its whitespace made one line


def test_progress_warnings_and_reporter_lines_are_escaped(capsys):
    setup_logging(quiet=False, verbose=False)
    try:
        reporter = Reporter(quiet=False)
        reporter.interactive = False
        reporter(api.Progress("validate", 0, 4, detail=f"data/{HOSTILE}"))
        reporter(api.Progress("warning", 0, 0, detail=f"eval set {HOSTILE} is missing"))
        reporter.log(f"variant {HOSTILE}, stage 1/2")
        reporter.close()
    finally:
        logging.getLogger("drlcli").handlers.clear()
    err = capsys.readouterr().err
    assert_escaped(err)
    assert f"validate 0/4 data/{ESCAPED}" in err and f"warning: eval set {ESCAPED} is missing" in err
    assert f"variant {ESCAPED}, stage 1/2" in err
