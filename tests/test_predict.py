"""`drl predict`: every source kind, per-image errors without stopping, run vs exported file."""

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from drlcli.cli import app
from drlcli.commands.export import export_run
from drlcli.commands.predict import expand_sources
from drlcli.errors import UsageError

runner = CliRunner()
needs_onnx = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("onnx", "onnxruntime")),
    reason="the export extra is missing",
)


@pytest.fixture(scope="module")
def learned(learned_run):
    return learned_run


def _lines(result):
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_sources_of_every_kind_and_errors_per_line(learned, stage_folders, tmp_path):
    test_dir = stage_folders[0][1]
    one = sorted((test_dir / "class_01").iterdir())[0]
    listing = tmp_path / "list.txt"
    listing.write_text(f"{one}\n\n{test_dir / 'class_02' / 'img_012.png'}\n")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"junk")
    args = ["predict", str(test_dir / "class_00"), str(listing), str(broken), str(tmp_path / "gone.png"), "-"]
    result = runner.invoke(app, [*args, "--run", str(learned), "--top-k", "3", "--device", "cpu"], input=f"{one}\n")
    assert result.exit_code == 3  # some images failed; every line was still printed
    lines = _lines(result)
    assert len(lines) == 4 + 2 + 2 + 1
    assert all(len(x["top"]) == 3 for x in lines if "top" in x)
    assert lines[6]["path"] == str(broken) and "cannot be decoded" in lines[6]["error"]
    assert lines[7]["error"] == "no such file"
    assert lines[8]["path"] == str(one) and lines[8]["top"] == lines[4]["top"]
    scores = [t["score"] for t in lines[0]["top"]]
    assert scores == sorted(scores, reverse=True)


def test_exported_file_predicts_like_the_run(learned, stage_folders, tmp_path):
    export_run(learned, tmp_path / "m.drl")
    folder = str(stage_folders[1][1])
    from_run = runner.invoke(app, ["predict", folder, "--run", str(learned), "--json", "--device", "cpu"])
    from_file = runner.invoke(app, ["predict", folder, "--model", str(tmp_path / "m.drl"), "--json", "--device", "cpu"])
    assert from_run.exit_code == from_file.exit_code == 0
    a, b = _lines(from_run), _lines(from_file)
    assert [x["top"][0]["class"] for x in a] == [x["top"][0]["class"] for x in b]
    assert all(abs(p["score"] - q["score"]) <= 1e-5 for x, y in zip(a, b) for p, q in zip(x["top"], y["top"]))


def test_bad_invocations(learned, stage_folders, tmp_path):
    with pytest.raises(UsageError, match="no images"):
        expand_sources([str(tmp_path)])
    result = runner.invoke(app, ["predict", str(tmp_path), "--run", str(learned), "--json"])
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["kind"] == "usage"
    images = stage_folders[0][1]  # the run is what is wrong here: no run directory there (exit 7)
    result = runner.invoke(app, ["predict", str(images), "--run", str(tmp_path / "none"), "--json"])
    assert result.exit_code == 7 and json.loads(result.stdout)["error"]["kind"] == "run_state"


@pytest.mark.parametrize("suffix", ["pt", pytest.param("onnx", marks=needs_onnx)])
def test_graph_exports_predict_like_the_run(learned, stage_folders, tmp_path, suffix):
    """`predict --model` takes TorchScript (with --trust-code: it runs the file's code) and ONNX files
    too, told apart by name (tests/test_modelfile.py: what happens when name and content disagree)."""
    path = tmp_path / f"model.{suffix}"
    export_run(learned, path)  # the format follows the suffix
    folder = str(stage_folders[1][1])
    trust = ["--trust-code"] if suffix == "pt" else []
    from_run = runner.invoke(app, ["predict", folder, "--run", str(learned), "--json", "--device", "cpu"])
    from_graph = runner.invoke(app, ["predict", folder, "--model", str(path), *trust, "--json", "--top-k", "2"])
    assert from_run.exit_code == from_graph.exit_code == 0, from_graph.stderr
    a, b = _lines(from_run), _lines(from_graph)
    assert [x["top"][0]["class"] for x in a] == [x["top"][0]["class"] for x in b]
    assert all(abs(x["top"][0]["score"] - y["top"][0]["score"]) <= 1e-4 for x, y in zip(a, b))
    missing = runner.invoke(app, ["predict", folder, "--model", str(tmp_path / "none.pt"), "--json"])
    assert missing.exit_code == 2 and "not found" in json.loads(missing.stdout)["error"]["message"]


def test_fifos_devices_and_folders_get_their_own_error_lines(learned, stage_folders, tmp_path):
    """Each said as what it is (not "no such file"), never opened in a way that waits; the batch goes on."""
    import os

    good = sorted((stage_folders[0][1] / "class_01").iterdir())[0]
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    args = ["predict", str(fifo), "/dev/null", str(good), "-", "--run", str(learned), "--json", "--device", "cpu"]
    result = runner.invoke(app, args, input=f"{tmp_path}\n")
    assert result.exit_code == 3
    lines = _lines(result)
    assert [x["path"] for x in lines] == [str(fifo), "/dev/null", str(good), str(tmp_path)]
    assert lines[0]["error"] == "is a FIFO (named pipe), not an image file; pass the image file itself"
    assert lines[1]["error"] == "is a character device, not an image file; pass the image file itself"
    assert "top" in lines[2]
    assert lines[3]["error"].startswith("is a folder, not an image file: pass it as a folder source")
