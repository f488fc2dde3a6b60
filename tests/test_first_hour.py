"""A new user's first hour (issue 30): mistakes found from names and records before any model is
built or image decoded, and a failed offline init that says how to get the weights and leaves
nothing behind."""

from __future__ import annotations

import pytest

from drlcli import api, learn_stage
from drlcli.errors import DataError, PTMError


def _no_model(*args, **kwargs):
    raise AssertionError("learn-stage built the model before it refused the drop")


def test_a_class_already_learned_is_refused_before_the_model_is_built(
    learned_run, stage_folders, monkeypatch, tmp_path
):
    """Before: the PTM and every stage were loaded and every image decoded first (54 s on Caltech drops)."""
    import shutil

    run = shutil.copytree(learned_run, tmp_path / "run")
    first = stage_folders[0][0]
    mixed = tmp_path / "mixed"
    shutil.copytree(stage_folders[2][0], mixed)
    shutil.copytree(next(first.iterdir()), mixed / next(first.iterdir()).name)
    monkeypatch.setattr(api, "load_run", _no_model)
    with pytest.raises(DataError, match="already learned in stage 1"):
        learn_stage(run, data_dir=mixed, device="cpu")


def test_a_drop_already_learned_is_unchanged_before_the_model_is_built(learned_run, stage_folders, monkeypatch):
    monkeypatch.setattr(api, "load_run", _no_model)
    result = learn_stage(learned_run, data_dir=stage_folders[1][0], device="cpu")
    assert result.status == "unchanged" and result.stage == 2


def test_offline_init_of_a_hub_model_names_the_fetch_and_leaves_no_folder(tmp_path, monkeypatch):
    """Before: "pass --ptm-weights FILE" without saying how to get one, and a new folder holding a .lock."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "runs" / "shop"
    with pytest.raises(PTMError) as error:
        api.init_run(run, ptm="vit_base_patch16_224.augreg_in21k")
    message = str(error.value)
    assert "hf download timm/vit_base_patch16_224.augreg_in21k config.json model.safetensors" in message
    assert "--ptm hf-hub:timm/vit_base_patch16_224.augreg_in21k" in message
    assert not run.exists()


# ----------------------------------------------------------- issue 59: a new user's first hour, again


def test_a_drop_folder_instead_of_its_train_folder_is_refused(learned_run, stage_folders, tmp_path):
    """Before: `--data drops/stage2` (holding train/ and test/) learned classes "train" and "test",
    the test images included, exit 0. Now: exit 3 naming the folders to pass, nothing learned."""
    import shutil

    from typer.testing import CliRunner

    from drlcli.cli import app

    run = shutil.copytree(learned_run, tmp_path / "run")
    drop = tmp_path / "drops" / "stage3"
    shutil.copytree(stage_folders[2][0], drop / "train")
    shutil.copytree(stage_folders[2][1], drop / "test")
    out = CliRunner().invoke(app, ["learn-stage", "--run", str(run), "--data", str(drop), "--device", "cpu"])
    assert out.exit_code == 3, out.output
    text = " ".join(out.output.split())
    assert "split folders (test, train)" in text and f"--data {drop / 'train'}" in text
    assert f"--eval-data {drop / 'test'}" in text
    assert api.info(run)["num_stages"] == 2


def test_every_bad_image_of_a_drop_is_named_in_one_error(learned_run, stage_folders, tmp_path):
    """Before: a truncated JPEG and an undecodable file took two runs of learn-stage to find."""
    import shutil

    from PIL import Image

    run = shutil.copytree(learned_run, tmp_path / "run")
    drop = shutil.copytree(stage_folders[2][0], tmp_path / "drop")
    first, second = sorted(p for p in drop.iterdir())[:2]
    jpeg = first / "cut.jpg"
    Image.new("RGB", (64, 64), (200, 10, 10)).save(jpeg)
    jpeg.write_bytes(jpeg.read_bytes()[:200])  # truncated
    (second / "noise.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png at all")
    with pytest.raises(DataError) as caught:
        learn_stage(run, data_dir=drop, device="cpu")
    message = str(caught.value)
    assert message.startswith("2 images cannot be used") and "cut.jpg" in message and "noise.png" in message
    assert "\n" not in message and api.info(run)["num_stages"] == 2


def test_a_mistyped_run_names_the_run_nearby(learned_run, tmp_path):
    """Before: "create it with `drl init --run runs/shpo`", inviting a second run at the typo."""
    import shutil

    from typer.testing import CliRunner

    from drlcli.cli import app

    runs = tmp_path / "runs"
    shutil.copytree(learned_run, runs / "shop")
    out = CliRunner().invoke(app, ["info", "--run", str(runs / "shpo")])
    assert out.exit_code == 7 and f"did you mean --run {runs / 'shop'}?" in " ".join(out.output.split())
    assert "drl init" not in out.output
    out = CliRunner().invoke(app, ["info", "--run", str(runs / "elsewhere")])
    assert out.exit_code == 7 and "drl init --run" in out.output


def test_outside_a_run_predict_asks_for_a_run(stage_folders, tmp_path, monkeypatch):
    """Before: predict without --run outside a run said to run `drl init`."""
    from typer.testing import CliRunner

    from drlcli.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DRL_RUN", raising=False)
    out = CliRunner().invoke(app, ["predict", str(stage_folders[0][1])])
    assert out.exit_code == 7 and "pass --run RUN" in out.output and "drl init" not in out.output
