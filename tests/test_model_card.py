"""The model card (``commands/card.py``, issue 63 item 1): ``drl export`` writes ``FILE.md`` beside
every file, ``drl info --card`` prints the run's; a Hugging Face front matter whose ``model-index``
holds what stage.json measured, a body built from the run's records, and no class name, folder name
or reason that can inject markup, HTML or end the front matter."""

import hashlib
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from drlcli import forget_class, learn_stage
from drlcli.cli import app
from drlcli.commands.card import md, plain
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

HAS_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))

# hostile class names: Markdown emphasis, HTML, table cells, headings, a front matter's end marker
HOSTILE = ["a*b_c", "<b>bold<i>", "x|y #z", "--- foo: bar"]
ESCAPED = ["a\\*b\\_c", "&lt;b&gt;bold&lt;i&gt;", "x\\|y \\#z", "\\-\\-\\- foo\\: bar"]
SMALL = {  # the default recipe's runs, small (as tests/test_switch.py)
    "ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3},
    "train": {"epochs": 2, "batch_size": 8, "seed": 3},
}


def _stage(root: Path, names: list[str], first: int) -> tuple[Path, Path]:
    """A drop's train and test folders with these class names (generated images renamed)."""
    ids = list(range(first, first + len(names)))
    folders = []
    for part, n, offset in (("train", 12, 0), ("test", 4, 100)):
        folder = make_class_folders(root / part, ids, images_per_class=n, offset=offset, seed=first)
        for class_id, name in zip(ids, names):
            (folder / f"class_{class_id:02d}").rename(folder / name)
        folders.append(folder)
    return folders[0], folders[1]


def _learn(root: Path, config: RunConfig, stages: list[list[str]]) -> Path:
    run = root / "run"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    first = 0
    for k, names in enumerate(stages, 1):
        train, test = _stage(root / f"stage{k}", names, first)
        learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu")
        first += len(names)
    return run


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory) -> Path:
    """A ``drl --preset frozen`` run of two stages, the first of hostile class names, both evaluated."""
    root = tmp_path_factory.mktemp("card")
    return _learn(root, RunConfig.for_method("drl", preset="frozen"), [HOSTILE, ["plain_1", "plain_2"]])


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def _split(card: str) -> tuple[dict, str]:
    """The card's front matter (parsed with yaml.safe_load) and its body."""
    match = re.match(r"---\n(.*?\n)---\n(.*)", card, re.DOTALL)
    assert match, card[:200]
    return yaml.safe_load(match.group(1)), match.group(2)


def _metas(run: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(run.glob("stages/*/stage.json"))]


def _export(run: Path, out: Path) -> tuple[dict, str]:
    payload = json.loads(_cli("export", "--run", str(run), "--out", str(out), "--json"))
    assert payload["card"] == str(out) + ".md"
    return payload, Path(payload["card"]).read_text()


def _before_export(card: str) -> str:
    return card.split("\n## Export\n")[0]


def test_drl_export_writes_the_card_beside_it(frozen_run, tmp_path):
    out = tmp_path / "model.drl"
    (tmp_path / "model.drl.md").write_text("a stale card")  # replaced, as export replaces an existing --out
    _, card = _export(frozen_run, out)
    front, body = _split(card)
    assert front["library_name"] == "drlcli" and front["pipeline_tag"] == "image-classification"
    assert front["tags"] == ["image-classification", "class-incremental"]
    results = front["model-index"][0]["results"]
    metas = _metas(frozen_run)
    assert [r["metrics"][0]["value"] for r in results] == [m["metrics"]["eval"]["top1"] for m in metas]
    assert all(r["task"]["type"] == "image-classification" for r in results)
    assert [r["dataset"]["name"] for r in results] == ["test", "test"]  # the registered --eval-data folders
    assert all(r["metrics"][0]["type"] == "accuracy" for r in results)
    assert f"- sha256: {hashlib.sha256(out.read_bytes()).hexdigest()}" in body
    assert (
        "- Format: drl" in body
        and "- Method (as run.yaml stores it): drl" in body
        and "- Recipe: `frozen`, as shipped" in body
    )
    assert "drl 0.1.0" in body and "plain\\_1 | 2 | yes" in body
    assert "Licence of the weights: none: random weights" in body


def test_info_card_prints_the_same_card(frozen_run, tmp_path):
    _, exported = _export(frozen_run, tmp_path / "model.drl")
    printed = _cli("info", "--run", str(frozen_run), "--card")
    assert _before_export(printed) == _before_export(exported)
    assert "## Export\n\nNone: this card describes the run" in printed
    payload = json.loads(_cli("info", "--run", str(frozen_run), "--card", "--json"))
    assert payload["card"] == printed and payload["lines"] == printed.split("\n")


@pytest.mark.skipif(not HAS_ONNX, reason="the export extra (onnx, onnxruntime) is missing")
def test_onnx_export_writes_the_card(frozen_run, tmp_path):
    out = tmp_path / "model.onnx"
    payload, card = _export(frozen_run, out)
    front, body = _split(card)
    assert payload["format"] == "onnx" and "- Format: onnx" in body
    assert f"- sha256: {hashlib.sha256(out.read_bytes()).hexdigest()}" in body
    assert [r["metrics"][0]["value"] for r in front["model-index"][0]["results"]] == [
        m["metrics"]["eval"]["top1"] for m in _metas(frozen_run)
    ]


def test_hostile_class_names_cannot_inject(frozen_run):
    card = _cli("info", "--run", str(frozen_run), "--card")
    front, body = _split(card)
    assert set(front) == {"library_name", "tags", "pipeline_tag", "model-index"}  # no "foo" key
    for name, escaped in zip(HOSTILE, ESCAPED):
        assert f"| {escaped} | 1 | yes |" in body
        assert name not in card
    assert "<" not in card and ">" not in card.replace("&gt;", "")
    assert not any(line == "---" for line in body.split("\n"))
    for line in body.split("\n"):  # every table row keeps its columns: no unescaped | from a name
        if line.startswith("| "):
            assert len(re.findall(r"(?<!\\)\|", line)) == line.count(" | ") + 2


def test_escapes():
    assert plain("a\nb\x1b[31m\u202e") == "a\\nb\\x1b[31m\\u202e"
    assert md("a\n[l](u) `c` &amp;") == "a\\\\n\\[l\\]\\(u\\) \\`c\\` &amp;amp\\;"
    assert md("--- x") == "\\-\\-\\- x"


def test_forgotten_classes_are_listed(frozen_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(frozen_run, run)
    forget_class(run, "<b>bold<i>", reason="asked *twice* <i>")
    _, body = _split(_cli("info", "--run", str(run), "--card"))
    forgotten = body.split("## Forgotten classes")[1]
    assert "| &lt;b&gt;bold&lt;i&gt; | 1 | " in forgotten
    assert "| asked \\*twice\\* &lt;i&gt; | yes |" in forgotten
    assert "| &lt;b&gt;bold&lt;i&gt; | 1 | no: forgotten |" in body
    assert "it answers 5 classes" in body


def test_default_recipe_card_names_the_answering_head(tmp_path):
    run = _learn(tmp_path, RunConfig.for_method("drl", SMALL), [["c0", "c1", "c2"], ["c3", "c4", "c5"]])
    front, body = _split(_cli("info", "--run", str(run), "--card"))
    answers = _metas(run)[-1]["switch"]["answers"]
    head = {"frozen": "the frozen PTM's head", "carried": "the adapted network's head"}[answers]
    assert f"- Answers from {head}" in body
    assert "- Recipe: `default` (drl's default), with " in body
    assert "ridge\\.carry\\_draws" in body
    assert [r["metrics"][0]["value"] for r in front["model-index"][0]["results"]] == [
        m["metrics"]["eval"]["top1"] for m in _metas(run)
    ]
