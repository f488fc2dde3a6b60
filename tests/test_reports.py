"""`drl eval --report DIR` (per-class precision/recall/F1, the confusion matrix as CSV and picture,
the stage table) and `drl predict --format csv` (issue 63): numbers checked against hand counts,
and hostile class names neither run as spreadsheet formulas nor break the CSV or the picture."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import shutil
import sys

import pytest
import torch
from typer.testing import CliRunner

from drlcli.cli import app
from drlcli.commands.report import write_report
from drlcli.csvsafe import cell, csv_text, prediction_rows
from drlcli.metrics import HistorySummary, class_scores, confusion_matrix
from drlcli.plots import drawable
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

runner = CliRunner()
HOSTILE = ["=cmd|' calc'!A0", "a,b", 'say "hi" $x$']  # class folders cannot hold the "/" of "/C calc"
NEEDS_PLOT = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="the plot extra (matplotlib) is missing"
)


def _read(path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def _drl(*args, **kw):
    return runner.invoke(app, [str(a) for a in args], **kw)


# ------------------------------------------------------------------------------ the metrics


def test_class_scores_against_a_hand_count():
    """3 images of class 0 (2 right, 1 called 1), 2 of class 1 (1 right, 1 called 2), 1 of class 2
    (right); class 3 neither shown nor predicted: undefined, and out of the averages."""
    targets = torch.tensor([0, 0, 0, 1, 1, 2])
    predictions = torch.tensor([0, 0, 1, 1, 2, 2])
    confusion = confusion_matrix(predictions, targets, 4)
    assert confusion.tolist() == [[2, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    s = class_scores(confusion)
    assert s.support == [3, 2, 1, 0]
    assert s.precision == [1.0, 0.5, 0.5, None]  # 2/2, 1/2, 1/2
    assert s.recall == [round(2 / 3, 6), 0.5, 1.0, None]  # per-class accuracy: 2/3, 1/2, 1/1
    assert s.f1 == [0.8, 0.5, round(2 / 3, 6), None]  # 2PR/(P+R)
    assert s.macro == (round(2 / 3, 6), round((2 / 3 + 0.5 + 1) / 3, 6), round((0.8 + 0.5 + 2 / 3) / 3, 6))
    assert s.weighted == (0.75, round(4 / 6, 6), round((3 * 0.8 + 2 * 0.5 + 2 / 3) / 6, 6))  # recall: accuracy


def test_a_class_predicted_but_never_shown_counts_zero():
    """scikit-learn's convention: a class only predicted has precision 0, recall 0 and is averaged."""
    s = class_scores(confusion_matrix(torch.tensor([1, 1]), torch.tensor([0, 0]), 2))
    assert s.precision == [0.0, 0.0] and s.recall == [0.0, 0.0] and s.f1 == [0.0, 0.0]
    assert s.macro == (0.0, 0.0, 0.0) and s.support == [2, 0]


def test_cells_are_safe_for_spreadsheets():
    assert cell("=cmd|' /C calc'!A0") == "'=cmd|' /C calc'!A0"
    assert [cell(v) for v in ("+1", "-x", "@SUM(A1)", "\tx", "ok", None, True, -0.5, 3)] == [
        "'+1",
        "'-x",
        "'@SUM(A1)",
        "'\tx",
        "ok",
        "",
        "true",
        "-0.5",
        "3",
    ]  # numbers stay numbers, negative ones too
    text = csv_text([["a,b", 'say "hi"', "two\nlines"]])
    assert next(csv.reader(io.StringIO(text, newline=""))) == ["a,b", 'say "hi"', "two\nlines"]


def test_picture_labels_draw_literally():
    assert drawable("$x$") == r"\$x\$"  # no mathtext
    assert drawable("a\x1b[31mb\nc") == "a\\x1b[31mb\\nc"  # ESC and newline as escapes
    assert drawable("x" * 50, limit=10) == "x" * 9 + "…"


@NEEDS_PLOT
def test_write_report_with_hostile_names(tmp_path):
    """The report writer itself, with names no folder could hold ("/"), a newline and ESC."""
    names = ["=cmd|' /C calc'!A0", "a,b", 'q"uote $x$', "new\nline\x1b[2J", "@home"]
    targets = torch.tensor([0, 1, 2, 3, 4, 4])
    predictions = torch.tensor([0, 1, 1, 3, 4, 0])
    history = HistorySummary([80.0, 66.6667], 73.3333, 66.6667, {"1": 10.0}, 10.0, [[80.0, None], [70.0, 60.0]])
    out = write_report(tmp_path / "r", predictions, targets, names, [1, 1, 1, 2, 2], history, title="t $a$")
    per_class = _read(out / "per_class.csv")
    assert [r[0] for r in per_class[1:6]] == ["'=cmd|' /C calc'!A0", "a,b", 'q"uote $x$', "new\nline\x1b[2J", "'@home"]
    assert _read(out / "confusion.csv")[0][1:] == [cell(n) for n in names]
    assert _read(out / "stages.csv") == [
        ["after_stage", "A_t", "stage_1", "stage_2"],
        ["1", "80.0", "80.0", ""],
        ["2", "66.6667", "70.0", "60.0"],
    ]
    assert (out / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------ through the CLI


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """A frozen tiny run of two stages: stage 1's classes are named HOSTILE; eval data registered."""
    from drlcli import learn_stage
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig

    root = tmp_path_factory.mktemp("hostile")
    stages = []
    for k, ids in enumerate(([0, 1, 2], [3, 4]), 1):
        train = make_class_folders(root / f"s{k}" / "train", ids, images_per_class=6)
        test = make_class_folders(root / f"s{k}" / "test", ids, images_per_class=3, offset=6)
        if k == 1:
            for folder in (train, test):
                for i, name in zip(ids, HOSTILE):
                    shutil.move(folder / f"class_{i:02d}", folder / name)
        stages.append((train, test))
    run = root / "run"
    init_run(
        run,
        ptm=TINY_PTM,
        random_init=True,
        ptm_kwargs=TINY_PTM_KWARGS,
        config=RunConfig.for_method("drl", preset="frozen"),
    )
    for train, test in stages:
        learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu")
    return run, stages


@NEEDS_PLOT
def test_eval_report_writes_the_four_files(hostile_run, tmp_path):
    run, _ = hostile_run
    report = tmp_path / "out" / "report"
    result = _drl("eval", "--run", run, "--all-seen", "--report", report, "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    ev = json.loads(result.stdout)
    assert ev["report"] == str(report)
    assert sorted(p.name for p in report.iterdir()) == ["confusion.csv", "confusion.png", "per_class.csv", "stages.csv"]
    names = [cell(n) for n in (*HOSTILE, "class_03", "class_04")]

    confusion = _read(report / "confusion.csv")
    assert confusion[0][1:] == names and [r[0] for r in confusion[1:]] == names
    counts = [[int(v) for v in r[1:]] for r in confusion[1:]]
    assert sum(map(sum, counts)) == ev["accuracy"]["num_images"] == 15
    assert sum(counts[i][i] for i in range(5)) == round(ev["accuracy"]["top1"] * 15 / 100)

    per_class = _read(report / "per_class.csv")
    assert per_class[0] == ["class", "stage", "precision", "recall", "f1", "support"]
    assert [r[0] for r in per_class[1:6]] == names and [r[1] for r in per_class[1:6]] == ["1"] * 3 + ["2"] * 2
    assert names[0] == "'=cmd|' calc'!A0"  # a formula no more; "a,b" and the quotes came back whole
    for i, row in enumerate(per_class[1:6]):  # recall is the class's accuracy, by hand from the matrix
        assert float(row[3]) == pytest.approx(counts[i][i] / sum(counts[i]), abs=1e-6) and int(row[5]) == 3
    assert [r[0] for r in per_class[6:]] == ["macro avg", "weighted avg"]
    assert float(per_class[7][3]) == pytest.approx(ev["accuracy"]["top1"] / 100, abs=1e-4)

    stages = _read(report / "stages.csv")
    assert stages[0] == ["after_stage", "A_t", "stage_1", "stage_2"]
    assert [float(v) for v in stages[2][2:]] == ev["history"]["matrix"][1]
    assert float(stages[2][1]) == ev["history"]["accuracy"][1] and stages[1][3] == ""

    png = (report / "confusion.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(report / "confusion.png") as image:
        image.verify()
    text = _drl("eval", "--run", run, "--all-seen", "--report", report, "--device", "cpu").stdout
    assert f"report: {report}" in text


def test_eval_report_refusals(hostile_run, tmp_path, monkeypatch):
    run, _ = hostile_run
    inside = _drl("eval", "--run", run, "--all-seen", "--report", run / "report", "--json")
    assert inside.exit_code == 2 and "inside the drl run directory" in json.loads(inside.stdout)["error"]["message"]
    assert not (run / "report").exists()
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert _drl("eval", "--run", run, "--all-seen", "--report", a_file).exit_code == 2
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    result = _drl("eval", "--run", run, "--all-seen", "--report", tmp_path / "r", "--json")
    error = json.loads(result.stdout)["error"]
    assert result.exit_code == 2 and error["kind"] == "missing_dependency"
    assert "pip install 'drlcli[plot]'" in error["message"] and not (tmp_path / "r").exists()


def test_predict_csv_one_row_per_image(hostile_run):
    run, stages = hostile_run
    tests = [stages[0][1], stages[1][1]]
    result = _drl("predict", *tests, "--run", run, "--format", "csv", "--top-k", "2", "--device", "cpu")
    assert result.exit_code == 0, result.output
    rows = list(csv.reader(io.StringIO(result.stdout, newline="")))
    assert rows[0] == ["path", "class_1", "score_1", "class_2", "score_2", "unknown", "error"]
    assert len(rows) == 1 + 15 and all(len(r) == 7 for r in rows)
    classes = {r[1] for r in rows[1:]} | {r[3] for r in rows[1:]}
    assert classes <= {cell(n) for n in (*HOSTILE, "class_03", "class_04")}
    assert not any(c.startswith("=") for r in rows for c in r)
    assert all(float(r[2]) >= float(r[4]) and r[5] in ("true", "false") and r[6] == "" for r in rows[1:])
    jsonl = _drl("predict", *tests, "--run", run, "--top-k", "2", "--device", "cpu")  # not a terminal: jsonl
    aliased = _drl("predict", *tests, "--run", run, "--top-k", "2", "--device", "cpu", "--json")
    lines = [json.loads(line) for line in jsonl.stdout.splitlines()]
    assert jsonl.stdout == aliased.stdout and len(lines) == 15
    assert [cell(x["top"][0]["class"]) for x in lines] == [r[1] for r in rows[1:]]


def test_predict_formats_and_their_conflict(hostile_run, tmp_path):
    run, stages = hostile_run
    one = str(sorted((stages[1][1] / "class_03").iterdir())[0])
    text = _drl("predict", one, str(tmp_path / "gone.png"), "--run", run, "--format", "text", "--device", "cpu")
    assert text.exit_code == 3 and text.stdout.startswith(f"{one}: ") and "error: no such file" in text.stdout
    rows = list(csv.reader(io.StringIO(_drl("predict", tmp_path / "gone.png", "--run", run, "--format", "csv").stdout)))
    assert rows[1] == [str(tmp_path / "gone.png"), *[""] * 10, "", "no such file"]
    clash = _drl("predict", one, "--run", run, "--json", "--format", "csv")
    assert clash.exit_code == 2 and "--json is --format jsonl" in clash.output


def test_prediction_rows_pad_and_guard():
    p = {"path": "-x.png", "top": [{"class": "@a", "score": -1.5}], "unknown": None, "known_score": None}
    assert prediction_rows(p, top_k=2, header=True) == [
        ["path", "class_1", "score_1", "class_2", "score_2", "unknown", "error"],
        ["-x.png", "@a", -1.5, None, None, None, None],
    ]
    assert csv_text(prediction_rows(p, top_k=2)) == "'-x.png,'@a,-1.5,,,,\r\n"
