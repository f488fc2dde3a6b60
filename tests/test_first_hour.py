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
