"""Runs written by an earlier release keep working (``tests/data/legacy-runs``, made at b4fbb16 by
``tests/data/make_legacy_runs.py``): each loads with the same answers to the digit, evaluates,
exports and learns its next stage. A switched run of that release kept its frozen track as a run of
its own; the first command that writes to it lists the track's files in the run's manifest (format
4, one commit a stage), dropping a stage an interrupted call left in the track alone. A format-4 run
(``tests/data/format4-runs``, made at f55ace4 by ``tests/data/make_format4_runs.py``) stays format 4:
it loads, evaluates, exports, forgets, restores and learns with the answers that release gave."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from drlcli import evaluate, export_run, forget_class, learn_stage, load_model, restore_class
from drlcli.api import info, verify
from drlcli.cli import app
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import IntegrityError, RunStateError
from drlcli.run.directory import RunDir
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

LEGACY = Path(__file__).parent / "data" / "legacy-runs"
ANSWERS = json.loads((LEGACY / "answers.json").read_text())
IMAGES = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(LEGACY / name, tmp_path / name))


def _answers(model) -> dict:
    return {"classes": list(model.class_names), "scores": model.classify(IMAGES)[0]}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_run_of_an_earlier_release_answers_exports_and_learns(name, tmp_path):
    run = _copy(name, tmp_path)
    want = ANSWERS[name]
    found = _answers(load_run(run, device="cpu").model)
    assert found["classes"] == want["classes"]
    assert torch.allclose(found["scores"], torch.tensor(want["scores"]), atol=1e-6)
    verify(run)
    assert evaluate(run, data_dir=LEGACY / "data" / "stage1", device="cpu").report.top1 is not None
    export_run(run, tmp_path / "model.drl")
    assert torch.allclose(load_model(tmp_path / "model.drl").classify(IMAGES)[0], found["scores"], atol=1e-5)
    result = learn_stage(run, data_dir=LEGACY / "data" / "stage3", device="cpu")
    assert result.stage == 3
    loaded = load_run(run, device="cpu")
    assert list(loaded.model.class_names) == want["classes"] + ["class_06", "class_07"]
    verify(run)
    if name == "switched":  # its frozen track now in the run's manifest: one manifest, format 4
        # its run.yaml has no hold_share: its stages keep reading the hold on every image, as they did
        assert loaded.config.schedule.hold_share == 1.0 and loaded.config.schedule.hold_weight == 3.0
        # ... nor later_epochs nor later_batch_size: its later stages train 20 epochs in batches of 48
        assert (loaded.config.schedule.later_epochs, loaded.config.schedule.later_batch_size) == (0, 0)
        assert not (run / "frozen" / "manifest.json").exists()
        assert RunDir(run).manifest()["format_version"] == 4


def test_a_switched_run_left_between_its_two_commits_is_named_then_completed(tmp_path, monkeypatch):
    """That release committed the frozen track's stage before the run's: an interruption between the
    two left the track one stage ahead. verify names it (exit 5); learn-stage of other data is refused
    naming the data to learn, changing nothing; learn-stage of that data reuses the track's stage."""
    run = _copy("switched", tmp_path)
    with monkeypatch.context() as patch:  # the earlier release wrote the track as a run of its own
        patch.setattr(RunDir, "_refuse_track", lambda self: None)
        learn_stage(run / "frozen", data_dir=LEGACY / "data" / "stage3", device="cpu")
    with pytest.raises(IntegrityError, match="interrupted between its two commits"):
        verify(run)
    other = shutil.copytree(LEGACY / "data" / "stage1", tmp_path / "other")
    for folder in other.iterdir():
        folder.rename(other / folder.name.replace("class_0", "class_1"))
    with pytest.raises(RunStateError, match="holds a stage 3 of other data"):
        learn_stage(run, data_dir=other, device="cpu")
    with pytest.raises(RunStateError, match="run that learn-stage again with the same data"):
        load_run(run, device="cpu")
    result = learn_stage(run, data_dir=LEGACY / "data" / "stage3", device="cpu")
    assert result.stage == 3 and result.switch["answers"] in ("frozen", "carried")
    verify(run)
    assert RunDir(run).manifest()["format_version"] == 4
    assert load_run(run, device="cpu").model.class_names[-2:] == ["class_06", "class_07"]
    assert learn_stage(run, data_dir=other, device="cpu").stage == 4


def test_forget_in_a_switched_run_of_an_earlier_release(tmp_path):
    run = _copy("switched", tmp_path)
    forget_class(run, "class_02")
    assert "class_02" not in load_run(run, device="cpu").model.class_names
    assert RunDir(run).manifest()["format_version"] == 4 and not (run / "frozen" / "manifest.json").exists()
    verify(run)


FORMAT4 = Path(__file__).parent / "data" / "format4-runs"
ANSWERS4 = json.loads((FORMAT4 / "answers.json").read_text())["switched"]


def _same(found: dict, want: dict, atol: float = 1e-6) -> None:
    assert found["classes"] == want["classes"]
    assert torch.allclose(found["scores"], torch.tensor(want["scores"]), atol=atol)


def _kept_in_frozen(run: Path) -> None:
    """Still format 4: the track's files under ``frozen/`` in the run's manifest, none beside the run's."""
    manifest = RunDir(run).manifest()
    assert manifest["format_version"] == 4 and "frozen/run.yaml" in manifest["files"]
    assert not any("/frozen-" in name for name in manifest["files"])


def test_a_format4_switched_run_answers_evaluates_and_exports_as_it_did(tmp_path):
    """``tests/data/format4-runs`` (made at f55ace4 by ``tests/data/make_format4_runs.py``): the track
    under ``frozen/``, listed in the run's manifest. It is read as it is, with the same answers."""
    run = _copy_from(FORMAT4, "switched", tmp_path)
    loaded = load_run(run, device="cpu")
    _same(_answers(loaded.model), ANSWERS4)
    assert [meta["switch"]["answers"] for meta in loaded.stage_metas] == ANSWERS4["answers"]
    verify(run)
    assert evaluate(run, data_dir=LEGACY / "data" / "stage1", device="cpu").report.top1 == ANSWERS4["top1_stage1"]
    export_run(run, tmp_path / "model.drl")
    assert torch.allclose(load_model(tmp_path / "model.drl").classify(IMAGES)[0], _answers(loaded.model)["scores"])
    assert info(run)["frozen_track"]["run_dir"] == str(run / "frozen")


def test_a_format4_switched_run_forgets_restores_and_learns_as_it_did(tmp_path):
    """A forget, a restore and the next stage of a format-4 run keep it format 4 (no file moves) and
    answer as the release that wrote it did (``answers.json``: ``forget``, ``stage3``)."""
    run = _copy_from(FORMAT4, "switched", tmp_path)
    forget_class(run, "class_02")
    _same(_answers(load_run(run, device="cpu").model), ANSWERS4["forget"])
    _kept_in_frozen(run)
    assert "frozen/forgotten/" in " ".join(RunDir(run).manifest()["files"])
    restore_class(run, "class_02")
    _same(_answers(load_run(run, device="cpu").model), ANSWERS4)
    verify(run)
    run = _copy_from(FORMAT4, "switched", tmp_path / "next")
    result = learn_stage(run, data_dir=LEGACY / "data" / "stage3", device="cpu")
    assert result.stage == 3
    # a stage trained here: another CPU's kernels sum in another order (about 1e-4 on these scores, of 1 to 8)
    _same(_answers(load_run(run, device="cpu").model), ANSWERS4["stage3"], atol=1e-3)
    _kept_in_frozen(run)
    assert "frozen/stages/003/stage.json" in RunDir(run).manifest()["files"]
    verify(run)


def _copy_from(root: Path, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root / name, tmp_path / name))


@pytest.mark.parametrize("command", ["learn-stage", "forget", "init", "info", "verify", "predict"])
def test_the_frozen_folder_of_a_format4_run_is_no_run_of_its_own(tmp_path, command):
    """A format-4 run's track is read and written only through its run: ``--run RUN/frozen`` is
    refused (exit 7) by every command, and the run is left as it was."""
    run = _copy_from(FORMAT4, "switched", tmp_path)
    before = (run / "manifest.json").read_bytes()
    data, track = str(LEGACY / "data" / "stage3"), str(run / "frozen")
    args = {
        "learn-stage": ["learn-stage", "--run", track, "--data", data, "--device", "cpu"],
        "forget": ["forget", "--run", track, "--class", "class_02"],
        "init": ["init", "--run", track, "--ptm", TINY_PTM, "--random-init"],
        "info": ["info", "--run", track],
        "verify": ["verify", "--run", track],
        "predict": ["predict", "--run", track, data],
    }[command]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 7, out.output
    assert "is the frozen track of run" in out.output and f"--run {run}" in out.output.replace("\n", "")
    assert (run / "manifest.json").read_bytes() == before and verify(run).frozen_track["num_stages"] == 2


def test_a_format4_frozen_folder_that_is_a_link_or_missing_is_refused(tmp_path):
    run = _copy_from(FORMAT4, "switched", tmp_path)
    outside = Path(shutil.copytree(run / "frozen", tmp_path / "outside"))
    shutil.rmtree(run / "frozen")
    with pytest.raises(IntegrityError, match="is missing"):
        learn_stage(run, data_dir=LEGACY / "data" / "stage3", device="cpu")
    for command in (lambda: load_run(run, device="cpu"), lambda: verify(run), lambda: info(run)):
        with pytest.raises(IntegrityError, match="is missing"):
            command()
    (run / "frozen").symlink_to(outside)
    with pytest.raises(IntegrityError, match="symbolic link"):
        load_run(run, device="cpu")
    assert len(json.loads((run / "manifest.json").read_text())["stages"]) == 2


def test_a_new_run_never_adopts_a_frozen_folder_put_beside_it(tmp_path):
    """A run made for format 5 (its run.yaml records its frozen track's config) that has learned no
    stage yet: a ``frozen/`` holding a run of an earlier release is not its track; its first stage
    writes the track beside its own files and leaves that folder as it is."""
    run = tmp_path / "run"
    config = RunConfig.for_recipe("default", {"ridge": {"proj_dim": 32}, "train": {"epochs": 1, "batch_size": 8}})
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    shutil.copytree(LEGACY / "switched" / "frozen", run / "frozen")
    learn_stage(run, data_dir=LEGACY / "data" / "stage1", device="cpu")
    manifest = RunDir(run).manifest()
    assert manifest["format_version"] == 5 and not any(n.startswith("frozen/") for n in manifest["files"])
    assert (run / "frozen" / "manifest.json").exists()
    verify(run)
