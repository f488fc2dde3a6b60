"""The run's running totals (``stages/NNN/totals.safetensors``): only the newest stage carries them, a
stage's own files hold what is its own, and runs of earlier releases (each stage its increments and
its W) load and learn on unchanged."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load, save

from drlcli import learn_stage
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.data.images import scan_class_folders
from drlcli.heads import TOTALS_MARK, running
from drlcli.heads.openset import RMD_MEAN_CARRIED
from drlcli.heads.ridge import CARRY_COV, CARRY_LINEAR, CARRY_PER_CLASS, CARRY_Q
from drlcli.model.incremental import embed_images
from drlcli.run.directory import RunDir
from drlcli.run.layout import sha256_bytes
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

CONFIG = {"ridge": {"proj_dim": 64}}  # the frozen drl head (ridge, layout, class covariances), narrow


def _init(path):
    init_run(
        path,
        ptm=TINY_PTM,
        random_init=True,
        ptm_kwargs=TINY_PTM_KWARGS,
        config=RunConfig.for_method("drl", CONFIG, preset="frozen"),
    )
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stage_folders):
    """A run after stage 1 only, and one after stages 1 to 3."""
    root = tmp_path_factory.mktemp("totals")
    one, three = _init(root / "one"), _init(root / "three")
    learn_stage(one, data_dir=stage_folders[0][0], device="cpu")
    for train, _ in stage_folders:
        learn_stage(three, data_dir=train, device="cpu")
    return one, three


def _scores(run, stage_folders):
    model = load_run(run, device="cpu").model
    images = scan_class_folders(stage_folders[0][1])
    feats, _ = embed_images(
        model.network, images, model.data_config, batch_size=64, stages=model.stages_scored, layout=model.layout_scored
    )
    with torch.no_grad():
        return model.scores(feats)


def test_only_the_newest_stage_carries_the_totals(runs):
    _, run = runs
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    assert [n for n in manifest["files"] if "totals" in n] == ["stages/003/totals.safetensors"]
    totals = load((run / "stages/003/totals.safetensors").read_bytes())
    # a carried run's (heads/ridge/carry.py, and the unknown answer's means as it moved them)
    carried_only = {*CARRY_COV.values(), *CARRY_Q.values(), *CARRY_PER_CLASS, CARRY_LINEAR, RMD_MEAN_CARRIED}
    assert set(totals) == set(running()) - carried_only and totals[TOTALS_MARK].tolist() == [3]
    assert totals["ranpac.weight"].shape == (64, 9)  # W for every class seen
    assert totals["counts"].sum().item() == 3 * 3 * 12  # every image of the three stages
    for index in (1, 2, 3):  # a stage's own files: its Q, its classes' rows; no Gram, no W
        statistics = load((run / f"stages/{index:03d}/statistics.safetensors").read_bytes())
        weights = load((run / f"stages/{index:03d}/weights.safetensors").read_bytes())
        assert set(statistics) == {"q_fit", "q_val"} and statistics["q_fit"].shape == (64, 3)
        assert not set(weights) & running()


def test_each_stage_searches_lambda_from_the_one_before(runs):
    """Stage 1 tries the whole grid; later stages start at the λ the totals before them recorded."""
    _, run = runs
    metas = [json.loads((run / f"stages/{i:03d}/stage.json").read_text())["ridge"] for i in (1, 2, 3)]
    assert len(metas[0]["validation_errors"]) == 17
    for before, meta in zip(metas, metas[1:]):
        tried = [float(x) for x in meta["validation_errors"]]
        assert before["lambda"] in tried and 3 <= len(tried) < 17 and meta["lambda"] in tried
    totals = load((run / "stages/003/totals.safetensors").read_bytes())
    assert totals["lambda"].tolist() == [metas[2]["lambda"]]


def test_the_totals_sum_what_the_stages_would_have_summed(runs, stage_folders, tmp_path):
    """Stage 2 learned on top of stage 1's totals gives the scores of the run that learned 1 to 3, up
    to round-off (its Grams summed in float64 from stage 1's stored float32 totals)."""
    one, three = runs
    two = shutil.copytree(one, tmp_path / "two")
    for train, _ in stage_folders[1:]:
        learn_stage(two, data_dir=train, device="cpu")
    assert torch.allclose(_scores(two, stage_folders), _scores(three, stage_folders), atol=1e-5)


def _to_release_before(run):
    """A run as releases before the totals stored it: each stage's own increments in its statistics,
    its W (and the newest's shared covariance, the rmd scatter) in its weights; format 1."""
    manifest = json.loads((run / "manifest.json").read_text())
    (index,) = manifest["stages"]
    folder = f"stages/{index:03d}"
    totals = load((run / f"{folder}/totals.safetensors").read_bytes())
    totals.pop(TOTALS_MARK)
    totals.pop("lambda")  # no earlier release recorded the λ chosen
    into = {"weights": {}, "statistics": {}}
    for name, tensor in totals.items():
        into["statistics" if name in ("gram_fit", "gram_val", "counts", "cov_scatter", "cov_counts") else "weights"][
            name
        ] = tensor
    for file, extra in into.items():
        name = f"{folder}/{file}.safetensors"
        data = save({**load((run / name).read_bytes()), **extra})
        (run / name).write_bytes(data)
        manifest["files"][name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / f"{folder}/totals.safetensors").unlink()
    del manifest["files"][f"{folder}/totals.safetensors"]
    manifest["format_version"] = 1
    (run / "manifest.json").write_text(json.dumps(manifest))


def test_a_run_of_an_earlier_release_loads_and_learns_on(runs, stage_folders, tmp_path):
    one, three = runs
    old = shutil.copytree(one, tmp_path / "old")
    _to_release_before(old)
    assert RunDir(old).verify() == []
    assert torch.equal(_scores(old, stage_folders), _scores(one, stage_folders))  # loads as it answered
    before = (old / "stages/001/statistics.safetensors").read_bytes()
    for train, _ in stage_folders[1:]:
        learn_stage(old, data_dir=train, device="cpu")
    assert (old / "stages/001/statistics.safetensors").read_bytes() == before  # its stages are left as they were
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and [n for n in manifest["files"] if "totals" in n] == [
        "stages/003/totals.safetensors"
    ]
    assert torch.allclose(_scores(old, stage_folders), _scores(three, stage_folders), atol=1e-5)


def test_a_small_stage_moves_the_earlier_classes_weights(tmp_path):
    """A stage of fewer images than earlier classes, at the λ of the stage before (one λ on the grid
    here): its W of the earlier classes is moved by its images, not solved again, and equals the
    whole solve from the run's totals."""
    from drlcli.heads.ridge.statistics import Statistics, solve
    from drlcli.synthetic import make_class_folders

    run = tmp_path / "run"
    config = {"ridge": {"proj_dim": 64, "lambda_min_exp": 1, "lambda_max_exp": 1}}
    init_run(
        run,
        ptm=TINY_PTM,
        random_init=True,
        ptm_kwargs=TINY_PTM_KWARGS,
        config=RunConfig.for_method("drl", config, preset="frozen"),
    )
    learn_stage(run, data_dir=make_class_folders(tmp_path / "one", list(range(8)), images_per_class=3), device="cpu")
    learn_stage(run, data_dir=make_class_folders(tmp_path / "two", [8, 9], images_per_class=2), device="cpu")
    metas = [json.loads((run / f"stages/{i:03d}/stage.json").read_text())["ridge"] for i in (1, 2)]
    assert [m["earlier_columns"] for m in metas] == ["solved", "moved"] and metas[1]["lambda"] == 10.0
    files = [load((run / f"stages/{i:03d}/statistics.safetensors").read_bytes()) for i in (1, 2)]
    totals = load((run / "stages/002/totals.safetensors").read_bytes())
    total = Statistics.accumulate([Statistics.from_tensors(files[0]), Statistics.from_tensors({**files[1], **totals})])
    whole = solve(total, 10.0).float()
    assert totals["ranpac.weight"].shape == (64, 10)
    assert torch.allclose(totals["ranpac.weight"], whole, rtol=1e-4, atol=1e-5 * float(whole.abs().max()))


def test_stage_json_says_how_many_classes_lambda_was_chosen_over(tmp_path, stage_folders):
    """Stage 1 with more fitted images than M leaves the kernel form: its λ, like a later stage's, is
    chosen over ``lambda_classes`` of its classes, and stage.json says so."""
    run = tmp_path / "run"
    config = {"ridge": {"proj_dim": 16, "lambda_classes": 2}}  # 3 classes of 12 images: 27 fitted > M 16
    init_run(
        run,
        ptm=TINY_PTM,
        random_init=True,
        ptm_kwargs=TINY_PTM_KWARGS,
        config=RunConfig.for_method("drl", config, preset="frozen"),
    )
    learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    meta = json.loads((run / "stages/001/stage.json").read_text())["ridge"]
    assert meta["validation_classes"] == 2 and meta["earlier_columns"] == "solved"
