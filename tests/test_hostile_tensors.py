"""Hostile tensors in a run's files and in a ``.drl`` export, re-signed so their checksums agree: a
count of a class's images past what its stage recorded, a carried Gaussian of another dtype, a W
that does not fit R, NaN in an export, preprocessing no PTM of the run takes. Each is damage (exit 5,
nothing committed), never hours of draws, a MemoryError or a crash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import rewrite_stage_weights
from safetensors import safe_open
from safetensors.torch import load, load_file, save, save_file
from typer.testing import CliRunner

from drlcli import export_run, forget_class, learn_stage, load_model, restore_class
from drlcli.api import verify
from drlcli.cli import app
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import IntegrityError
from drlcli.heads.ridge import CARRY, WEIGHT
from drlcli.ptm import backbone
from drlcli.run.layout import sha256_bytes
from drlcli.run.load import load_run
from drlcli.serving.modelfile import with_checksum
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

SMALL = {  # test_switch.py's
    "ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3},
    "train": {"epochs": 2, "batch_size": 8, "seed": 3},
}
COUNT, PARTS, MEAN = f"{CARRY}count", f"{CARRY}parts", f"{CARRY}mean"


@pytest.fixture(scope="module")
def switched(tmp_path_factory, stage_folders):
    """The default recipe's run (switched), two stages learned."""
    run = tmp_path_factory.mktemp("hostile") / "run"
    config = RunConfig.for_method("ranpac", SMALL, preset="switched")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    for train, _ in stage_folders[:2]:
        learn_stage(run, data_dir=train, device="cpu")
    return run


@pytest.fixture
def copy(switched, tmp_path) -> Path:
    return Path(shutil.copytree(switched, tmp_path / "copy"))


def _set(name: str, make):
    return lambda tensors: tensors.__setitem__(name, make(tensors[name].clone()).contiguous())


def _refused_to_learn(run: Path, folder: Path, match: str) -> None:
    manifest = (run / "manifest.json").read_bytes()
    with pytest.raises(IntegrityError, match=match):
        learn_stage(run, data_dir=folder, device="cpu")
    assert (run / "manifest.json").read_bytes() == manifest


# ------------------------------------------------------------------ 1-2. counts bounded by the records


@pytest.mark.parametrize(
    "name, make",
    [
        (COUNT, lambda t: t.fill_(10**8)),  # hours of draws
        (COUNT, lambda t: t.fill_(2**40)),  # a MemoryError
        (PARTS, lambda t: t.fill_(10**8)),  # the fit and held-out counts the sums are weighted by
    ],
)
def test_counts_past_the_stage_record_are_refused_before_any_draw(copy, stage_folders, name, make):
    rewrite_stage_weights(copy, 2, _set(name, make))
    _refused_to_learn(copy, stage_folders[2][0], "images of a class its stage learned from 12")
    with pytest.raises(IntegrityError, match="learned from 12"):
        verify(copy)


def test_drawn_sums_of_a_crafted_spread_are_refused_not_committed(copy, stage_folders):
    rewrite_stage_weights(copy, 2, _set(f"{CARRY}spread", lambda t: t.fill_(1e200)))
    _refused_to_learn(copy, stage_folders[2][0], "not finite")


def _craft_kept_rows(run: Path, change) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    name = next(n for n in manifest["files"] if n.startswith("forgotten/rows-g"))
    rows = load((run / name).read_bytes())
    change(rows)
    data = save({k: v.contiguous() for k, v in rows.items()})
    (run / name).write_bytes(data)
    manifest["files"][name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name, value", [(COUNT, 10**8), (PARTS, 2**40), (COUNT, 0)])
def test_restore_refuses_kept_counts_loading_would_refuse(copy, name, value):
    klass = json.loads((copy / "stages/002/stage.json").read_text())["classes"][0]
    forget_class(copy, klass)
    _craft_kept_rows(copy, lambda rows: [t.fill_(value) for k, t in rows.items() if k.endswith(name)])
    manifest = (copy / "manifest.json").read_bytes()
    with pytest.raises(IntegrityError, match="forgotten"):
        restore_class(copy, klass)
    assert (copy / "manifest.json").read_bytes() == manifest
    load_run(copy, device="cpu")  # still the run it was


# ------------------------------------------------------------------ 3. dtypes and shapes


@pytest.mark.parametrize(
    "name, dtype",
    [
        (MEAN, torch.float16),
        (MEAN, torch.float32),  # floats, but not the Gaussians' float64
        (MEAN, torch.int32),
        (MEAN, torch.bool),
        (f"{CARRY}linear", torch.float16),
        (COUNT, torch.int32),
        (COUNT, torch.float64),
        (f"{CARRY}rank", torch.bool),
    ],
)
def test_carried_gaussians_of_another_dtype_are_refused(copy, stage_folders, name, dtype):
    rewrite_stage_weights(copy, 2, _set(name, lambda t: t.to(dtype)))
    _refused_to_learn(copy, stage_folders[2][0], f"totals.safetensors: tensor {name} is")
    result = CliRunner().invoke(app, ["verify", "--run", str(copy)])
    assert result.exit_code == 5, result.output


def _short_w(run: Path, name: str) -> None:
    """W of ``name`` (a totals file the manifest lists) one row short, re-signed."""
    tensors = load((run / name).read_bytes())
    tensors[WEIGHT] = tensors[WEIGHT][:-1].contiguous()
    data = save(tensors)
    (run / name).write_bytes(data)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("track", ["", "frozen-"])  # the carried network's head, and the frozen track's (it answers)
def test_w_one_row_short_is_refused_by_verify_and_predict(copy, stage_folders, track):
    _short_w(copy, f"stages/002/{track}totals.safetensors")
    with pytest.raises(IntegrityError, match=r"ranpac.weight .* not \(\d+, classes\)"):
        verify(copy)
    with pytest.raises(IntegrityError, match=r"ranpac.weight .* not \(\d+, classes\)"):
        load_run(copy, device="cpu", scoring=bool(track))  # learn-stage reads the carried head
    if track:
        image = next(stage_folders[0][1].rglob("*.png"))
        result = CliRunner().invoke(app, ["predict", "--run", str(copy), str(image)])
        assert result.exit_code == 5, result.output


# ------------------------------------------------------------------ 4. exports and preprocessing


@pytest.fixture(scope="module")
def exported(switched, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export") / "model.drl"
    export_run(switched, path)
    return path


def _craft_export(path: Path, out: Path, tensors_change=None, spec_change=None) -> Path:
    """``path`` with its tensors or spec changed and every checksum signed again."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    spec = json.loads(metadata["spec"])
    if tensors_change is not None:
        tensors_change(tensors)
    if spec_change is not None:
        spec_change(spec)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    spec = with_checksum({**spec, "payload_sha256": backbone.tensors_sha256(tensors)})
    save_file(tensors, str(out), metadata={**metadata, "spec": json.dumps(spec)})
    return out


def test_a_re_signed_export_loads_as_it_was(exported, tmp_path):
    assert load_model(_craft_export(exported, tmp_path / "same.drl")).class_names == load_model(exported).class_names


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t.__setitem__("head.weight", t["head.weight"][:-1]), "do not fit"),  # a row short
        (lambda t: t.__setitem__("head.weight", t["head.weight"][:, :-1]), "do not fit"),  # a class short
        (lambda t: t.__setitem__("head.weight", t["head.weight"].flatten()[:-1]), "do not fit"),  # an element
        (lambda t: t["head.weight"].view(-1)[0].fill_(float("nan")), "NaN or infinite"),
        (lambda t: t["prototypes"].view(-1)[3].fill_(float("inf")), "NaN or infinite"),
    ],
)
def test_a_crafted_export_s_tensors_are_refused(exported, tmp_path, change, match):
    crafted = _craft_export(exported, tmp_path / "c.drl", tensors_change=change)
    with pytest.raises(IntegrityError, match=match):
        load_model(crafted)
    image = tmp_path / "image.png"
    from PIL import Image

    Image.new("RGB", (32, 32)).save(image)
    result = CliRunner().invoke(app, ["predict", "--model", str(crafted), str(image)])
    assert result.exit_code == 5, result.output


BAD_DATA_CONFIGS = [
    ("crop_pct", 1e-9),
    ("crop_pct", 0.0),
    ("crop_pct", 3.0),
    ("input_size", [3, 8, 8]),  # another patch grid than the PTM's 32 x 32
    ("input_size", [3, 0, 32]),
    ("input_size", [3, 10**6, 32]),
    ("std", [0.5, 0.0, 0.5]),
    ("mean", [0.5, 0.5]),
    ("interpolation", "cubic-ish"),
]


@pytest.mark.parametrize("key, value", BAD_DATA_CONFIGS)
def test_an_export_s_data_config_out_of_range_is_refused(exported, tmp_path, key, value):
    crafted = _craft_export(
        exported, tmp_path / "c.drl", spec_change=lambda s: s["data_config"].__setitem__(key, value)
    )
    with pytest.raises(IntegrityError, match="data_config"):
        load_model(crafted)


@pytest.mark.parametrize("key, value", [*BAD_DATA_CONFIGS, ("mean", [0.5, float("nan"), 0.5])])
def test_a_run_s_data_config_out_of_range_is_refused(copy, key, value):
    record = yaml.safe_load((copy / "run.yaml").read_text())
    record["ptm"]["data_config"][key] = value
    data = yaml.safe_dump(record).encode()
    (copy / "run.yaml").write_bytes(data)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["run.yaml"] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="data_config"):
        load_run(copy, device="cpu", scoring=False)
