"""A carried run (``ranpac --preset carried``, issue 32): one adapter set trained again at every stage,
held near each stage's start, the earlier classes carried as class Gaussians moved with it."""

from pathlib import Path

import pytest
import torch
from conftest import rewrite_stage_meta
from typer.testing import CliRunner

from drlcli import evaluate, export_run, forget_class, learn_stage, load_model, restore_class
from drlcli.api import info, predict_sources, verify
from drlcli.cli import app
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import RunStateError, UsageError
from drlcli.heads.openset import RMD_MEAN, RMD_MEAN_CARRIED
from drlcli.heads.ridge import CARRY, CARRY_COV, CARRY_LINEAR, COV_FACTOR, COV_MEAN, COV_TRACE
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

SMALL = {
    "ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3},
    "train": {"epochs": 2, "batch_size": 8},
}


def _init(run, sections=SMALL):
    config = RunConfig.for_method("ranpac", sections, preset="carried")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)


@pytest.fixture(scope="module")
def carried_run(tmp_path_factory, stage_folders):
    run = tmp_path_factory.mktemp("carried") / "run"
    _init(run)
    results = [learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu") for train, test in stage_folders]
    return run, results


def test_the_preset_is_the_researched_schedule():
    config = RunConfig.for_method("ranpac", preset="carried")
    adapter, schedule = config.adapter, config.schedule
    assert (adapter.peft, schedule.stages, adapter.blocks, schedule.hold_weight) == ("adaptformer", "all", 0.5, 3.0)
    assert schedule.hold_share == 0.25
    assert (config.train.loss, config.train.lr, config.train.epochs, config.train.batch_size) == ("ce", 0.05, 20, 48)
    head = config.ridge
    assert (head.covariance_rank, head.layout_grid, head.carry_rank, head.carry_lambda) == (16, 2, 16, 1000.0)


def test_every_stage_trains_and_only_the_newest_holds_the_set_and_the_carry(carried_run):
    run, results = carried_run
    assert [r.training_skipped for r in results] == [False, False, False]
    assert all(len(r.epoch_losses) == 2 for r in results)
    loaded = load_run(run, device="cpu")
    assert [bool(t) for t in loaded.stage_totals] == [False, False, True]
    totals = loaded.stage_totals[-1]
    assert any(k.startswith("adapt.") for k in totals)
    assert not any(k.startswith("adapt.") for stage in loaded.stage_tensors[:-1] for k in stage if k not in totals)
    assert totals[f"{CARRY}mean"].shape[0] == 9 and totals[CARRY_COV[COV_MEAN]].shape[0] == 9
    assert totals[f"{CARRY}group"].tolist() == [0, 0, 0, 1, 1, 1, -1, -1, -1]  # moved twice, once, not yet
    assert len(totals[CARRY_LINEAR]) == 2
    network = loaded.model.network
    assert network.num_stages == 1 and network.stages[0].down.shape[0] == 2  # blocks 0-1 of the tiny PTM's 4
    metas = loaded.stage_metas
    assert "carry" not in metas[0] and metas[1]["carry"]["classes"] == 3 and metas[2]["carry"]["classes"] == 6
    assert metas[2]["carry"]["move"] > 0 and metas[2]["ridge"]["earlier_columns"] == "carried"
    assert all(m["train"]["loss"] == "ce" for m in metas)
    # two epochs: a training step 3 passes an image, from stage 2 also the hold's starting-set forward
    # on a quarter of each batch (the stages' images all train; the classifier starts at random)
    assert [r.passes["training"] for r in results] == pytest.approx([2 * 3, 2 * 3.25, 2 * 3.25])


def test_no_stage_keeps_sums_a_later_stage_draws_again(carried_run):
    """Issue 32 item 4: a carried run holds no Grams, Q, scatters or per-stage covariance rows
    (a later stage draws the earlier classes' sums from their Gaussians; the rows are in the totals)."""
    run, _ = carried_run
    loaded = load_run(run, device="cpu")
    assert not any(p.name.startswith("statistics") for p in (run / "stages").rglob("*.safetensors"))
    assert all(loaded.run.stage_statistics(i, loaded.manifest) == {} for i in (1, 2, 3))
    totals = loaded.stage_totals[-1]
    assert not {"gram_fit", "gram_val", "counts", "cov_scatter", "q_fit"} & set(totals)
    own = [k for stage in loaded.stage_tensors for k in stage if k not in totals]
    assert own and not {COV_MEAN, COV_FACTOR, COV_TRACE} & set(own)


def _rmd_means_now(model, folders):
    """The classes' rmd means recomputed from their training images on the run's network as it is."""
    from drlcli.data import scan_class_folders
    from drlcli.heads.openset.rmd import Moments
    from drlcli.model import embed_images

    means = []
    for folder in folders:
        images = scan_class_folders(folder)
        feats, labels = embed_images(
            model.network,
            images,
            model.data_config,
            batch_size=16,
            probes=model.probes_read,
            layout=model.layout_scored,
        )
        means.append(Moments.of(model.split(feats)[1], labels, len(images.class_names)).means)
    return torch.cat(means)


def test_the_unknown_answer_s_moments_move_with_the_network(carried_run, stage_folders):
    """Each stage moves the earlier classes' rmd means with the network (``openset.rmd.carried_moments``):
    the newest totals hold every class's, the run reads them, and they are nearer the means the moved
    network gives the classes' images than the means as their stages took them."""
    run, _ = carried_run
    loaded = load_run(run, device="cpu")
    carried = loaded.stage_totals[-1][RMD_MEAN_CARRIED]
    taken = torch.cat([tensors[RMD_MEAN] for tensors in loaded.stage_tensors])
    assert carried.shape == taken.shape == (9, loaded.model.rmd_width)
    assert torch.equal(carried[6:], taken[6:])  # the newest stage's own classes: as it took them
    assert not torch.allclose(carried[:6], taken[:6], atol=1e-4)
    assert torch.allclose(loaded.model.unknown_rmd[0].means.float(), carried)
    assert all(meta["carry"]["unknown_move"] > 0 for meta in loaded.stage_metas[1:])
    now = _rmd_means_now(loaded.model, [train for train, _ in stage_folders]).float()
    assert torch.allclose(now[6:], taken[6:], atol=1e-4)
    assert (carried[:6] - now[:6]).norm() < (taken[:6] - now[:6]).norm()


def test_a_carried_run_from_before_the_moved_moments_reads_them_as_taken_and_learns_on(carried_run, tmp_path):
    import shutil

    from conftest import rewrite_stage_weights

    run, _ = carried_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    rewrite_stage_weights(copy, 3, lambda tensors: tensors.pop(RMD_MEAN_CARRIED))
    loaded = load_run(copy, device="cpu")
    taken = torch.cat([tensors[RMD_MEAN] for tensors in loaded.stage_tensors])
    assert torch.allclose(loaded.model.unknown_rmd[0].means.float(), taken)
    learn_stage(copy, data_dir=make_class_folders(tmp_path / "more", [20, 21], images_per_class=6), device="cpu")
    assert load_run(copy, device="cpu").stage_totals[-1][RMD_MEAN_CARRIED].shape[0] == 11


def test_each_later_stage_measures_forward_transfer(tmp_path, stage_folders):
    """A carried stage after the first records its forward transfer (``metrics.Transfer``): its images,
    of classes never trained on, answered by leave-one-out class means through the network as the
    stage began (here: the run as stage 2 left it) and through the frozen PTM; the run's counts add
    up, and ``drl info`` reads them."""
    import shutil

    from drlcli.data import scan_class_folders
    from drlcli.metrics import Transfer, measure
    from drlcli.model import embed_images

    run = tmp_path / "run"
    _init(run)
    for train, _ in stage_folders[:2]:
        learn_stage(run, data_dir=train, device="cpu")
    shutil.copytree(run, tmp_path / "before")
    learn_stage(run, data_dir=stage_folders[2][0], device="cpu")
    metas = load_run(run, device="cpu").stage_metas
    assert "carry" not in metas[0]
    second, third = (Transfer.from_dict(meta["carry"]["transfer"]) for meta in metas[1:])
    assert second.images == third.images == 3 * 12
    assert Transfer.from_dict(metas[2]["carry"]["transfer"]["run"]) == second + third
    assert metas[2]["carry"]["transfer"]["transfers"] == (second + third).transfers
    model = load_run(tmp_path / "before", device="cpu").model
    images = scan_class_folders(stage_folders[2][0])
    adapted, labels = embed_images(model.network, images, model.data_config, batch_size=16)
    with model.network.bare():
        frozen, _ = embed_images(model.network, images, model.data_config, batch_size=16)
    assert measure(adapted[:, 0], frozen[:, 0], labels) == third
    shown = info(run)["stages"]
    assert shown[0]["transfer"] is None and shown[2]["transfer"]["run"] == (second + third).to_dict()


@pytest.mark.parametrize("run_counts", [{"better": 9, "worse": 9, "images": 3}, "many", {"better": 1}])
def test_crafted_forward_transfer_counts_are_refused_and_nothing_is_committed(
    carried_run, stage_folders, tmp_path, run_counts
):
    """The next stage adds its counts to the newest record's: counts that cannot be are damage (exit 5),
    found before any training (every reader of stage.json refuses them, ``drl info`` included)."""
    import shutil

    from drlcli.errors import IntegrityError

    run, _ = carried_run
    copy = Path(shutil.copytree(run, tmp_path / "copy"))
    rewrite_stage_meta(copy, 3, lambda meta: meta["carry"]["transfer"].update(run=run_counts))
    with pytest.raises(IntegrityError, match="stage 3 of run .* is malformed"):
        info(copy)
    more = make_class_folders(tmp_path / "more", [20, 21], images_per_class=6)
    phases = []
    before = (copy / "manifest.json").read_bytes()
    with pytest.raises(IntegrityError, match="is malformed|last stage record does not fit"):
        learn_stage(copy, data_dir=more, device="cpu", progress=lambda event: phases.append(event.phase))
    assert "train" not in phases  # refused before any training
    assert (copy / "manifest.json").read_bytes() == before


def test_the_loaded_run_answers_as_learn_stage_evaluated(carried_run, stage_folders):
    run, results = carried_run
    report = evaluate(run, all_seen=True, device="cpu").report
    assert report.num_images == results[-1].eval.num_images == 9 * 4
    assert report.top1 == pytest.approx(results[-1].eval.top1)
    verify(run)  # raises on any damage
    stages = info(run)["stages"]
    assert [s["holds_totals"] for s in stages] == [False, False, True]


def test_the_carried_set_moves_the_earlier_classes_features(carried_run, images, tmp_path, stage_folders):
    run, _ = carried_run
    after = load_run(run, device="cpu").model.network
    once = tmp_path / "once"
    _init(once)
    learn_stage(once, data_dir=stage_folders[0][0], device="cpu")
    before = load_run(once, device="cpu").model.network
    with torch.no_grad():
        assert not torch.allclose(after(images)[:, 0], before(images)[:, 0], atol=1e-5)


def test_export_predict_forget(carried_run, stage_folders, tmp_path):
    run, _ = carried_run
    pictures = sorted(str(p) for p in stage_folders[1][1].rglob("*.png"))
    from_run = [[c["class"] for c in p.top] for p in predict_sources(pictures, run_dir=run, device="cpu")]
    for name in ("m.drl", "m.onnx"):  # the network rebuilt from the spec (blocks 0.5), and traced
        export_run(run, tmp_path / name)
        from_file = [[c["class"] for c in p.top] for p in predict_sources(pictures, model_path=tmp_path / name)]
        assert from_file == from_run
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(run, copy)
    name = info(copy)["stages"][0]["classes"][0]
    forget_class(copy, name)
    assert name not in load_model(export_run(copy, tmp_path / "after.drl").path).class_names
    totals = load_run(copy, device="cpu").stage_totals[-1]
    assert totals[f"{CARRY}mean"].shape[0] == 8 and totals[CARRY_COV[COV_MEAN]].shape[0] == 8
    assert totals[RMD_MEAN_CARRIED].shape[0] == 8
    restore_class(copy, name)  # no stage learned since: its rows come back as they were
    totals = load_run(copy, device="cpu").stage_totals[-1]
    assert totals[f"{CARRY}mean"].shape[0] == 9
    assert torch.equal(totals[RMD_MEAN_CARRIED], load_run(run, device="cpu").stage_totals[-1][RMD_MEAN_CARRIED])


def test_a_class_forgotten_before_a_later_stage_cannot_come_back(carried_run, stage_folders, tmp_path):
    import shutil

    run, _ = carried_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    name = info(copy)["stages"][0]["classes"][0]
    forget_class(copy, name)
    extra = stage_folders[0][0].parent / "extra"
    if not extra.exists():
        shutil.copytree(stage_folders[0][0], extra)
        for folder in extra.iterdir():
            folder.rename(extra / f"x_{folder.name}")
    learn_stage(copy, data_dir=extra, device="cpu")
    manifest_before = (copy / "manifest.json").read_bytes()
    with pytest.raises(RunStateError, match="carried"):
        restore_class(copy, name)
    assert (copy / "manifest.json").read_bytes() == manifest_before


@pytest.mark.parametrize(
    "name, bad",
    [
        (f"{CARRY}group", lambda t: t.fill_(7)),  # a group with no linear part
        (f"{CARRY}parts", lambda t: t[:4]),  # counts for fewer classes
        (f"{CARRY}mean", lambda t: t[:, :2]),  # tokens the head does not read
        (RMD_MEAN_CARRIED, lambda t: t[:4]),  # moved rmd means for fewer classes
    ],
)
def test_crafted_carried_classes_are_refused_and_nothing_is_committed(carried_run, stage_folders, tmp_path, name, bad):
    import shutil

    from conftest import rewrite_stage_weights

    from drlcli.errors import IntegrityError

    run, _ = carried_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    rewrite_stage_weights(copy, 3, lambda tensors: tensors.__setitem__(name, bad(tensors[name].clone()).contiguous()))
    manifest = (copy / "manifest.json").read_bytes()
    extra = tmp_path / "extra"
    shutil.copytree(stage_folders[0][0], extra)
    for folder in list(extra.iterdir()):
        folder.rename(extra / f"y_{folder.name}")
    with pytest.raises(IntegrityError, match="not fit"):
        learn_stage(copy, data_dir=extra, device="cpu")
    assert (copy / "manifest.json").read_bytes() == manifest


@pytest.mark.parametrize(
    "sections, problem",
    [
        ({"first_session": {"peft": "none"}}, "stages all trains the adapter set"),
        ({"first_session": {"decide": True}}, "schedule.decide is for stages first"),
    ],
)
def test_carried_options_are_checked(sections, problem):
    from drlcli.config import validate

    with pytest.raises(UsageError, match=problem):
        validate(RunConfig.for_method("ranpac", sections, preset="carried"))


def test_info_counts_the_one_set_once(carried_run):
    run, results = carried_run
    stages = info(run)["stages"]
    assert [s["num_params"] for s in stages] == [results[0].num_params] * 3
    assert stages[-1]["cumulative_params"] == results[0].num_params


def test_cli_init_preset_carried(tmp_path):
    from drlcli.synthetic import init_args

    run = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["init", "--run", str(run), *init_args(), "--method", "ranpac", "--preset", "carried"]
    )
    assert result.exit_code == 0, result.output
    assert "stages: all" in (run / "run.yaml").read_text()
    from drlcli.synthetic import make_stages

    stages = make_stages(tmp_path / "data", num_stages=2, classes_per_stage=2, train=6, test=2)
    small = ["--epochs", "1", "--batch-size", "6"]
    for train, _ in stages:
        result = CliRunner().invoke(app, ["learn-stage", "--run", str(run), "--data", str(train), *small])
        assert result.exit_code == 0, result.output
    assert "carried 2 earlier classes" in result.output and "drawn 100 times per image" in result.output
    assert "the unknown answer's class means moved with them" in result.output
    assert "forward transfer: of this stage's 12 images (classes never trained on)" in result.output
    shown = CliRunner().invoke(app, ["info", "--run", str(run)])
    assert shown.exit_code == 0 and "stage 2: forward transfer:" in shown.output


def test_a_stage_interrupted_in_training_resumes_to_the_same_set_and_carry(tmp_path, stage_folders):
    """Stage 2 killed after its first epoch: the re-run reloads stage 1's set (the same "start"), resumes
    from the checkpoint and commits the same tensors as an uninterrupted run."""

    class Interrupt(Exception):
        pass

    def stop(event):
        if event.phase == "train" and event.epoch == 2:
            raise Interrupt

    runs = [tmp_path / "straight", tmp_path / "resumed"]
    for run in runs:
        _init(run)
        learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    learn_stage(runs[0], data_dir=stage_folders[1][0], device="cpu")
    with pytest.raises(Interrupt):
        learn_stage(runs[1], data_dir=stage_folders[1][0], device="cpu", progress=stop)
    resumed = learn_stage(runs[1], data_dir=stage_folders[1][0], device="cpu")
    assert resumed.resumed_from_epoch == 1
    a, b = (load_run(run, device="cpu").stage_totals[-1] for run in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_drl_s_carried_preset_rebuilds_the_sums_from_closed_form_means_and_a_gram_budget(
    tmp_path, stage_folders, monkeypatch
):
    """drl's carried schedule (the default's, ``first_session.CARRY_SUMS``): each later stage rebuilds
    the earlier classes' sums with the closed-form means, the Gram budget and the rows split between
    the fit and held-out Grams, records how, and the
    run answers as learn-stage evaluated."""
    import drlcli.heads.ridge.carry.stage as carried

    calls, real = [], carried.expected_sums

    def recorded(*args, **kwargs):
        calls.append({k: kwargs[k] for k in ("draws", "exact_mean", "gram_draws", "split_rows")})
        return real(*args, **kwargs)

    monkeypatch.setattr(carried, "expected_sums", recorded)
    config = RunConfig.for_method(
        "drl", {**SMALL, "ridge": {**SMALL["ridge"], "carry_gram_draws": 10}}, preset="carried"
    )
    assert (config.ridge.carry_mean, config.ridge.carry_gram_draws) == ("exact", 10)
    run = tmp_path / "run"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    results = [learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu") for train, test in stage_folders[:2]]
    carry = load_run(run, device="cpu").stage_metas[1]["carry"]
    assert (carry["mean"], carry["draws"], carry["gram_draws"], carry["grams"], carry["classes"]) == (
        "exact",
        4,
        10,
        "split",
        3,
    )
    assert calls == [{"draws": 4, "exact_mean": True, "gram_draws": 10, "split_rows": True}]  # what the stage drew with
    assert evaluate(run, all_seen=True, device="cpu").report.top1 == pytest.approx(results[-1].eval.top1)
    verify(run)
