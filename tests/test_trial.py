"""Stage 1's trial (``first_session.trial transfer``, the default's; ``stage/trial.py``): a short
adaptation on half of stage 1's classes, the other half told apart through it, decides whether
stage 1 trains at all; and what each stage's learning cost (``stage/cost.py``)."""

import json

import pytest
import torch
from conftest import rewrite_stage_meta
from typer.testing import CliRunner

from drlcli import evaluate, evaluation, export_run, forget_class, learn_stage, restore_class
from drlcli.api import info, verify
from drlcli.cli import app, render
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import IntegrityError, UsageError
from drlcli.heads.base import EarlierStages
from drlcli.heads.ridge import fit as ridge_fit
from drlcli.heads.ridge.solution import Solution
from drlcli.metrics import MarginGain, Transfer, margin_gain
from drlcli.run.directory import RunDir
from drlcli.run.load import load_run
from drlcli.stage import begin as begin_module
from drlcli.stage import record as record_module
from drlcli.stage import trial as trial_module
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_stages

SMALL = {
    "ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3},
    "train": {"epochs": 2, "batch_size": 8, "seed": 3},
    "first_session": {"trial_images": 4},
}


@pytest.fixture(scope="module")
def four_class_stages(tmp_path_factory):
    """Three stages of 4 classes: (train, test) folders, 10 train and 3 test images per class."""
    return make_stages(tmp_path_factory.mktemp("data"), num_stages=3, classes_per_stage=4, train=10, test=3)


def _init(run, overrides=None):
    config = RunConfig.for_method("drl", {**SMALL, **(overrides or {})})
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)


def _init_frozen(run):
    """The frozen head's run (``--recipe frozen``) beside a default one of the same seed."""
    config = RunConfig.for_method("drl", {"train": {"seed": 3}}, preset="frozen")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)


def _decides(monkeypatch, trains: bool) -> None:
    """What the trial's margins say, whatever the tiny random PTM's are."""
    gain = MarginGain(5.0, 4.0, 30) if trains else MarginGain(0.3, 0.5, 30)  # declined, near the floor
    monkeypatch.setattr(trial_module, "margin_gain", lambda *args: gain)


def _learn(run, folders):
    return [learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu") for train, test in folders]


def test_the_default_tries_adapting_first_and_the_trial_needs_a_pausing_run():
    assert RunConfig.for_method("drl").schedule.trial == "transfer"
    assert RunConfig.for_method("ranpac", preset="switched").schedule.trial == "none"  # as published before
    with pytest.raises(UsageError, match="set schedule.pause transfer"):
        RunConfig.for_method("drl", {"first_session": {"trial": "transfer", "pause": "none"}})


def test_the_margin_gain_is_the_mean_widening_of_the_margins_and_its_z():
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    frozen = torch.tensor([[1.0, 0.3], [1.0, 0.25], [1.0, 0.2], [0.3, 1.0], [0.25, 1.0], [0.2, 1.0]])
    wider = torch.tensor([[1.0, 0.1], [1.0, 0.05], [1.0, 0.0], [0.1, 1.0], [0.05, 1.0], [0.0, 1.0]])
    gain = margin_gain(wider, frozen, labels)
    assert gain.percent > 50 and gain.z > 1.645 and gain.images == 6 and gain.moves(0.5)
    back = margin_gain(frozen, wider, labels)
    assert back.percent < 0 and back.z < -1.645 and back.moves(0.5)  # moved either way
    assert not MarginGain(0.3, 9.0, 100).moves(0.5) and not MarginGain(-3.0, -1.0, 100).moves(0.5)
    assert margin_gain(frozen, frozen, labels) == MarginGain(0.0, 0.0, 6)
    assert margin_gain(frozen[:3], frozen[:3], labels[:3]).images == 0  # one class: nothing to compare


def test_where_adapting_would_not_pay_stage_1_trains_nothing_and_the_run_answers_as_the_frozen_head(
    tmp_path, four_class_stages, monkeypatch
):
    run, frozen = tmp_path / "run", tmp_path / "frozen"
    _init(run)
    _init_frozen(frozen)
    _decides(monkeypatch, trains=False)
    results = _learn(run, four_class_stages[:2])
    first = json.loads((run / "stages/001/stage.json").read_text())
    tried = first["carry"]["trial"]
    assert tried["trains"] is False and tried["classes_trained"] == 2 and tried["classes_measured"] == 2
    assert tried["images_trained"] == 8 and tried["epochs"] == 10  # at most trial_images (4) of each class
    assert first["metrics"]["train"]["paused"] is True and "epoch_losses" not in first["metrics"]["train"]
    assert results[0].passes["training"] == 0 and results[0].passes["trial"] > 0
    assert results[1].carry["paused"] is True and results[1].carry["trial"]["trains"] is False  # tried again
    assert results[1].passes["features"] == 1.0  # the frozen track's pass: the untrained set reads its rows
    # the untrained set is the frozen PTM: the carried network's features are the frozen track's
    model = load_run(RunDir(run), device="cpu", scoring=False).model
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        with model.network.bare():
            plain = model.network(images)[:, 0]
        assert torch.equal(model.network(images)[:, 0], plain)
    _learn(frozen, four_class_stages[:2])
    ours, theirs = evaluate(run, all_seen=True, device="cpu"), evaluate(frozen, all_seen=True, device="cpu")
    assert ours.report.to_dict() == theirs.report.to_dict()
    assert verify(run).num_stages == 2
    export_run(run, tmp_path / "model.drl")
    forget_class(run, "class_00")
    restore_class(run, "class_00")
    assert verify(run).num_stages == 2


def test_a_near_miss_is_tried_again_at_the_next_stage_and_a_far_one_is_not(tmp_path, four_class_stages, monkeypatch):
    near, far = tmp_path / "near", tmp_path / "far"
    for run, percent in ((near, 0.3), (far, -0.2)):
        _init(run)
        monkeypatch.setattr(trial_module, "margin_gain", lambda *args, p=percent: MarginGain(p, 9.0, 30))
        results = _learn(run, four_class_stages[:2])
        assert results[0].carry["trial"]["trains"] is False and results[1].carry["paused"] is True
        assert ("trial" in results[1].carry) is (run == near)
        assert (results[1].passes["trial"] > 0) is (run == near)
        why = "its trial (below)" if run == near else "the run's trials said adapting changes little"
        assert f"the carried network was not trained: {why}" in render.learn_stage(results[1].to_dict())


def test_where_adapting_pays_stage_1_trains_exactly_as_without_the_trial(tmp_path, four_class_stages, monkeypatch):
    tried, plain = tmp_path / "tried", tmp_path / "plain"
    _init(tried)
    _init(plain, {"first_session": {"trial": "none"}})
    _decides(monkeypatch, trains=True)
    [stage_tried] = _learn(tried, four_class_stages[:1])
    [stage_plain] = _learn(plain, four_class_stages[:1])
    assert stage_tried.carry["trial"]["trains"] is True and stage_plain.carry is None
    assert stage_tried.epoch_losses == stage_plain.epoch_losses  # the trial's set is dropped, its RNG forked
    a = load_run(RunDir(tried), device="cpu", scoring=False).model.network.stages[0].state_dict()
    b = load_run(RunDir(plain), device="cpu", scoring=False).model.network.stages[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    passes = stage_tried.passes
    assert passes["per_image"] == pytest.approx(passes["training"] + passes["features"] + passes["trial"], abs=0.02)
    assert passes["training"] == pytest.approx(2 * 3)  # two epochs, 3 passes a step, no hold at stage 1


@pytest.mark.parametrize(
    "percent, counts, answers",
    [
        (5.0, (3, 1), "carried"),  # widened; the counts neither say adapting pays nor that it loses
        (5.0, (0, 9), "frozen"),  # widened, but the counts say adapting loses
        (-5.0, (3, 1), "frozen"),  # narrowed: the counts alone decide
    ],
)
def test_after_a_trial_that_widened_the_margins_the_carried_network_answers_unless_the_counts_say_it_loses(
    tmp_path, four_class_stages, monkeypatch, percent, counts, answers
):
    run, plain = tmp_path / "run", tmp_path / "plain"
    _init(run, {"first_session": {"trial_images": 4, "trial_answers_small_stage": 0}})  # stage 1 by rule (below)
    _init(plain, {"first_session": {"trial_images": 4, "trial_answers": False}})  # as earlier releases answer
    monkeypatch.setattr(trial_module, "margin_gain", lambda *args: MarginGain(percent, percent, 30))
    monkeypatch.setattr(begin_module, "measure", lambda *args: Transfer(*counts, 40))
    first, second = _learn(run, four_class_stages[:2])
    before = _learn(plain, four_class_stages[:2])
    assert first.carry["trial"]["trains"] is True and first.epoch_losses  # a narrowing trial trains too
    # stage 1's own classes trained the set: the trial's margins do not speak for them
    assert first.switch["answers"] == before[0].switch["answers"] == "frozen"
    assert second.carry["transfer"]["transfers"] is False and before[1].switch["answers"] == "frozen"
    assert second.switch["answers"] == answers and second.eval.top1 == second.switch["top1"][answers]
    assert evaluate(run, all_seen=True, device="cpu").answers == answers
    assert info(run)["frozen_track"]["answers"] == answers and verify(run).num_stages == 2
    said = render.learn_stage(second.to_dict())
    assert ("a trial widened the margins" in said) is (answers == "carried")


@pytest.mark.parametrize(
    "most, percent, answers",
    [
        (10, 5.0, "carried"),  # 10 images a class, at most 10: the stage answers by its own trial
        (9, 5.0, "frozen"),  # more images a class than that: its trial speaks from the next stage on
        (10, -5.0, "frozen"),  # a narrowing trial trains, and speaks for no stage
        (0, 5.0, "frozen"),  # off: as earlier releases answer
    ],
)
def test_a_small_drop_answers_by_its_own_trial(tmp_path, four_class_stages, monkeypatch, most, percent, answers):
    run = tmp_path / "run"
    _init(run, {"first_session": {"trial_images": 4, "trial_answers_small_stage": most}})
    monkeypatch.setattr(trial_module, "margin_gain", lambda *args: MarginGain(percent, percent, 30))
    (first,) = _learn(run, four_class_stages[:1])
    assert first.carry["trial"]["trains"] is True and first.epoch_losses
    assert first.switch["answers"] == answers and first.eval.top1 == first.switch["top1"][answers]
    assert evaluate(run, all_seen=True, device="cpu").answers == answers
    assert info(run)["frozen_track"]["answers"] == answers and verify(run).num_stages == 1
    said = render.learn_stage(first.to_dict())
    assert ("on a drop of few images a class" in said) is (answers == "carried")
    if answers == "carried":  # the record's counts are what the answer reads: more images a class, and it lies
        rewrite_stage_meta(run, 1, lambda meta: meta["images_per_class"].update(dict.fromkeys(meta["classes"], 11)))
        with pytest.raises(IntegrityError, match="switch record does not say the frozen track answers"):
            verify(run)


def test_a_switch_record_that_disagrees_with_the_trial_is_refused(tmp_path, four_class_stages, monkeypatch):
    run = tmp_path / "run"
    _init(run)
    _decides(monkeypatch, trains=True)
    monkeypatch.setattr(begin_module, "measure", lambda *args: Transfer(3, 1, 40))
    _learn(run, four_class_stages[:2])
    assert info(run)["frozen_track"]["answers"] == "carried"
    # what an earlier release's rule said; this run's says carried
    rewrite_stage_meta(run, 2, lambda meta: meta["switch"].update(answers="frozen"))
    with pytest.raises(IntegrityError, match="switch record does not say the carried track answers"):
        verify(run)


def test_a_stage_of_fewer_than_four_classes_defers_untrained_and_the_next_stage_is_tried(
    tmp_path, stage_folders, monkeypatch
):
    run = tmp_path / "run"
    _init(run, {"first_session": {"trial_images": 4, "trial_stages": 1}})
    _decides(monkeypatch, trains=True)  # what a trial would say, had it run
    small = _learn(run, stage_folders[:2])  # 3 classes each: nothing to try on
    for result in small:
        tried = result.carry["trial"]
        assert tried["deferred"] is True and tried["trains"] is False and tried["classes_measured"] == 3
        assert tried["images_trained"] == 0 and result.carry["paused"] is True and not result.epoch_losses
        assert result.passes["training"] == 0 and result.passes["trial"] == 0
        assert "3 classes are too few to try on" in render.learn_stage(result.to_dict())
    # the deferred stages do not count against trial_stages (1): the first stage of 4 classes is tried
    later = make_stages(tmp_path / "later", num_stages=1, classes_per_stage=4, train=10, test=3, first=3)
    [tried] = _learn(run, later)  # classes 8-11
    assert tried.carry["trial"]["deferred"] is False and tried.carry["trial"]["classes_trained"] == 2
    assert tried.carry["trial"]["trains"] is True and tried.epoch_losses
    stages = info(run)["stages"]
    assert [s["trial"]["deferred"] for s in stages] == [True, True, False]
    assert "too few classes to try adapting on" in render.info(info(run))
    assert verify(run).num_stages == 3


def test_a_deferred_stage_answers_as_the_frozen_head(tmp_path, stage_folders):
    run, frozen = tmp_path / "run", tmp_path / "frozen"
    _init(run)
    _init_frozen(frozen)
    _learn(run, stage_folders[:2])
    _learn(frozen, stage_folders[:2])
    ours, theirs = evaluate(run, all_seen=True, device="cpu"), evaluate(frozen, all_seen=True, device="cpu")
    assert ours.report.to_dict() == theirs.report.to_dict()


def test_learn_stage_and_info_say_what_the_trial_decided_and_what_learning_cost(
    tmp_path, four_class_stages, monkeypatch
):
    run = tmp_path / "run"
    _init(run)
    _decides(monkeypatch, trains=False)
    (train, test), runner = four_class_stages[0], CliRunner()
    out = runner.invoke(app, ["learn-stage", "--run", str(run), "--data", str(train), "--eval-data", str(test), "-q"])
    assert out.exit_code == 0, out.output
    assert "tried adapting first" in out.output and "adapting changes little here" in out.output
    assert "cost: " in out.output and "forward passes an image" in out.output
    out = runner.invoke(app, ["info", "--run", str(run)])
    assert out.exit_code == 0 and "passes" in out.output and "tried adapting first" in out.output
    stage = info(run)["stages"][0]
    assert stage["trial"]["trains"] is False and stage["passes"]["trial"] > 0


@pytest.mark.parametrize("value", ["x", 1e400, -1, None, [1]])
def test_a_crafted_cost_or_trial_record_is_shown_as_none(tmp_path, four_class_stages, monkeypatch, value):
    run = tmp_path / "run"
    _init(run)
    _decides(monkeypatch, trains=False)
    _learn(run, four_class_stages[:1])

    def craft(meta):
        meta["metrics"]["passes"]["per_image"] = value
        meta["carry"]["trial"]["images_trained"] = value

    rewrite_stage_meta(run, 1, craft)
    out = CliRunner().invoke(app, ["info", "--run", str(run)])
    assert out.exit_code in (0, 5), out.output  # shown without them, or refused as damage: never a crash
    if out.exit_code == 0:
        assert "tried adapting first" not in out.output


def test_after_declining_trials_a_later_stage_is_tried_and_trains_where_adapting_moves_the_features(
    tmp_path, four_class_stages, monkeypatch
):
    run = tmp_path / "run"
    _init(run)
    _decides(monkeypatch, trains=False)
    _learn(run, four_class_stages[:1])
    _decides(monkeypatch, trains=True)
    [second] = _learn(run, four_class_stages[1:2])
    assert second.carry["trial"]["trains"] is True and "paused" not in second.carry and second.epoch_losses
    assert second.carry["transfer"]["run"]["images"] == 0  # the untrained set counted no images
    [third] = _learn(run, four_class_stages[2:])  # the set trained: the forward transfer decides, no trial
    assert "trial" not in third.carry and third.carry["transfer"]["images"] == 40
    assert verify(run).num_stages == 3


def test_a_run_tries_at_most_trial_stages_stages(tmp_path, four_class_stages, monkeypatch):
    run = tmp_path / "run"
    _init(run, {"first_session": {"trial_images": 4, "trial_stages": 2}})
    _decides(monkeypatch, trains=False)
    results = _learn(run, four_class_stages)
    assert [("trial" in r.carry, r.carry["paused"]) for r in results] == [(True, True), (True, True), (False, True)]
    assert all(r.passes["training"] == 0 for r in results)


def test_an_untrained_set_is_evaluated_from_the_frozen_tracks_rows(tmp_path, four_class_stages, monkeypatch):
    """A stage that keeps the set untrained (the frozen PTM) scores the carried head on the rows the
    frozen track's evaluation passed: no second pass, the same top-1 as with one."""
    _decides(monkeypatch, trains=False)
    passes = []
    embed = evaluation.embed_images
    monkeypatch.setattr(evaluation, "embed_images", lambda *a, **k: passes.append(1) or embed(*a, **k))
    reused, passed = tmp_path / "reused", tmp_path / "passed"
    _init(reused)
    _init(passed)
    ours = _learn(reused, four_class_stages[:2])
    counted, passes[:] = len(passes), []
    evaluate_sets = record_module.evaluate_sets
    monkeypatch.setattr(record_module, "evaluate_sets", lambda *a, given=(), **k: evaluate_sets(*a, **k))
    theirs = _learn(passed, four_class_stages[:2])
    assert counted == 3 and len(passes) == 6  # the eval sets of stages 1 and 2 (1 + 2), once each against twice
    assert [r.switch["top1"] for r in ours] == [r.switch["top1"] for r in theirs]
    assert all(r.carry["paused"] for r in ours)


def test_an_untrained_sets_head_takes_the_frozen_tracks_solution_and_a_trained_one_solves_its_own(
    tmp_path, four_class_stages, monkeypatch
):
    """While the set is untrained its head's sums are the frozen track's, bit for bit: the fit takes
    that track's λ and W (checked by digest) instead of searching and solving again; once the set
    trains, its sums differ and it solves for itself."""
    run = tmp_path / "run"
    _init(run, {"ridge": {"carry_draws": 4, "carry_rank": 3}})  # the frozen track's ridge (SMALL's proj_dim is not)
    _decides(monkeypatch, trains=False)
    first = _learn(run, four_class_stages[:1])
    _decides(monkeypatch, trains=True)
    second = _learn(run, four_class_stages[1:2])
    stages = run / "stages"
    own = [json.loads((stages / f"00{i}" / "stage.json").read_text())["ridge"] for i in (1, 2)]
    frozen = [json.loads((stages / f"00{i}" / "frozen-stage.json").read_text())["ridge"] for i in (1, 2)]
    assert own[0]["earlier_columns"] == "same sums" and own[0]["lambda"] == frozen[0]["lambda"]
    assert own[0]["validation_errors"] == frozen[0]["validation_errors"]
    assert own[1]["earlier_columns"] == "carried"  # stage 2 trained the set: its own sums, its own solve
    assert first[0].switch["top1"]["carried"] == first[0].switch["top1"]["frozen"]
    assert second[0].epoch_losses and verify(run).num_stages == 2


def test_a_solution_of_other_sums_is_not_taken():
    """``fit_stage(given=...)``: a solution whose digest is not of this fit's sums is ignored."""
    ridge = {"proj_dim": 32, "layout_grid": 0, "covariance_weight": 0}
    config = RunConfig.for_method("drl", {"ridge": ridge, "train": {"seed": 3}}, preset="frozen")
    torch.manual_seed(0)
    features, labels = torch.randn(24, 1, 16), torch.arange(4).repeat(6)
    kwargs = {"image_labels": labels.tolist(), "indices": None, "num_classes": 4, "config": config, "stage_index": 1}
    earlier = EarlierStages(head=None, tensors=[], statistics=lambda: iter(()))
    offered = ridge_fit.fit_stage(earlier, features, labels, offer=True, **kwargs).solution
    taken = ridge_fit.fit_stage(earlier, features, labels, given=offered, **kwargs)
    assert taken.meta["earlier_columns"] == "same sums" and torch.equal(
        taken.tensors["ranpac.weight"], offered.weight.float()
    )
    other = Solution("0" * 64, offered.lam * 10, {}, 0, torch.zeros_like(offered.weight))
    solved = ridge_fit.fit_stage(earlier, features, labels, given=other, **kwargs)
    assert solved.meta["earlier_columns"] == "solved" and solved.meta["lambda"] == offered.lam
    assert torch.allclose(solved.tensors["ranpac.weight"], offered.weight.float())


@pytest.mark.parametrize("least, trains", [(4, False), (0, True)])
def test_a_stage_of_fewer_classes_than_train_min_classes_keeps_the_set_as_it_stands(
    tmp_path, monkeypatch, least, trains
):
    root = tmp_path / "data"
    folders = make_stages(root, num_stages=1, classes_per_stage=4, train=10, test=3)  # classes 0-3
    folders += make_stages(root, num_stages=1, classes_per_stage=2, train=10, test=3, first=3)  # 4, 5
    folders += make_stages(root, num_stages=1, classes_per_stage=4, train=10, test=3, first=3, name="big{}")  # 8-11
    run = tmp_path / "run"
    _init(run, {"first_session": {"trial_images": 4, "train_min_classes": least}})
    _decides(monkeypatch, trains=True)
    monkeypatch.setattr(begin_module, "measure", lambda *args: Transfer(3, 1, 40))  # never stalls
    first, two, four = _learn(run, folders)
    assert first.epoch_losses and four.epoch_losses and not four.carry.get("paused")
    assert bool(two.epoch_losses) is trains and two.carry.get("paused", False) is not trains
    assert (two.passes["training"] > 0) is trains
    said = render.learn_stage(two.to_dict())
    assert ("too few classes to train on" in said) is not trains
    assert verify(run).num_stages == 3
