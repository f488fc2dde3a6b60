"""``schedule.later_epochs``: once a carried run's set has trained at a stage, a later stage trains at
most that many epochs (its cosine schedule over them); a call's ``--epochs`` sets the stage's own.
``schedule.later_batch_size``: such a stage trains in batches of that many images."""

import json

import pytest

from drlcli import learn_stage
from drlcli.commands.check_data import check_data
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import UsageError
from drlcli.metrics import MarginGain
from drlcli.schedule import Schedule
from drlcli.stage import trial as trial_module
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_stages

SMALL = {
    "ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3},
    "train": {"epochs": 3, "batch_size": 8},
    "schedule": {"later_epochs": 1},
}


def _init(run, **schedule):
    """A carried run of SMALL's options, ``schedule`` over its schedule section."""
    options = {**SMALL, "schedule": {**SMALL["schedule"], **schedule}}
    config = RunConfig.for_method("ranpac", options, preset="carried")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)


def _train_records(run, key="epochs"):
    return [json.loads(p.read_text())["train"][key] for p in sorted((run / "stages").glob("*/stage.json"))]


def test_the_bound_applies_once_the_set_has_trained():
    schedule = Schedule(carries=True, later_epochs=5)
    assert schedule.epochs(20, trained_before=False) == 20
    assert schedule.epochs(20, trained_before=True) == 5
    assert schedule.epochs(3, trained_before=True) == 3  # a bound, never more than train.epochs
    assert Schedule(carries=True).epochs(20, trained_before=True) == 20  # 0: runs of earlier releases


def test_the_later_batch_applies_once_the_set_has_trained():
    schedule = Schedule(carries=True, later_epochs=5, later_batch_size=12)
    assert schedule.batch_size(48, trained_before=False) == 48
    assert schedule.batch_size(48, trained_before=True) == 12
    assert Schedule(carries=True).batch_size(48, trained_before=True) == 48  # 0: train.batch_size
    # under torchrun the processes share the batch: it is rounded up to a multiple of them
    assert [schedule.batch_size(48, trained_before=True, processes=n) for n in (2, 3, 8)] == [12, 12, 16]


@pytest.mark.parametrize(
    ("option", "says"), [("later_epochs", "later_epochs bounds"), ("later_batch_size", "later_batch_size sets")]
)
def test_the_options_need_a_carried_set(option, says):
    with pytest.raises(UsageError, match=f"schedule.{says} the stages after the set first trained"):
        RunConfig.for_method("ranpac", {"schedule": {option: 5}}, preset="published")
    assert getattr(RunConfig.for_recipe("frozen").schedule, option) == 0


def test_stage_1_trains_its_epochs_and_later_stages_the_bound(tmp_path, stage_folders):
    run = tmp_path / "run"
    _init(run)
    results = [learn_stage(run, data_dir=train, device="cpu") for train, _ in stage_folders]
    assert [len(r.epoch_losses) for r in results] == [3, 1, 1]
    assert _train_records(run) == [3, 1, 1]  # stage.json says what each stage trained
    # the cost counts the epochs trained: 3 passes a step, from stage 2 the hold on a quarter of each batch
    assert [r.passes["training"] for r in results] == pytest.approx([3 * 3, 1 * 3.25, 1 * 3.25])


def test_later_stages_train_in_the_later_batch(tmp_path, stage_folders):
    run = tmp_path / "run"
    _init(run, later_batch_size=4)
    results = [learn_stage(run, data_dir=train, device="cpu") for train, _ in stage_folders]
    assert _train_records(run, "batch_size") == [8, 4, 4] and _train_records(run) == [3, 1, 1]
    # the same passes an image as at the run's batch: the cost follows the images read, not the steps
    assert [r.passes["training"] for r in results] == pytest.approx([3 * 3, 1 * 3.25, 1 * 3.25])


def test_a_call_s_epochs_and_batch_set_the_stage_s_own(tmp_path, stage_folders):
    run = tmp_path / "run"
    _init(run, later_batch_size=4)
    learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    second = learn_stage(
        run, data_dir=stage_folders[1][0], device="cpu", train_overrides={"epochs": 2, "batch_size": None}
    )
    assert len(second.epoch_losses) == 2 and _train_records(run) == [3, 2]
    assert _train_records(run, "batch_size") == [8, 4]  # the batch the call left unset is the schedule's
    learn_stage(run, data_dir=stage_folders[2][0], device="cpu", train_overrides={"batch_size": 6})
    assert _train_records(run) == [3, 2, 1] and _train_records(run, "batch_size") == [8, 4, 6]


def test_check_data_estimates_the_bounded_epochs(tmp_path, stage_folders):
    run = tmp_path / "run"
    _init(run)
    assert check_data(run, stage_folders[0][0]).cost.epochs == 3
    learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    assert check_data(run, stage_folders[1][0]).cost.epochs == 1


def test_a_later_stage_interrupted_resumes_with_its_bounded_epochs(tmp_path, stage_folders):
    """The epoch checkpoint of a bounded stage is keyed by the epochs it trains: the re-run resumes it."""

    class Interrupt(Exception):
        pass

    def stop(event):
        if event.phase == "train" and event.epoch == 2:
            raise Interrupt

    run = tmp_path / "run"
    _init(run, later_epochs=2)
    learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    with pytest.raises(Interrupt):
        learn_stage(run, data_dir=stage_folders[1][0], device="cpu", progress=stop)
    resumed = learn_stage(run, data_dir=stage_folders[1][0], device="cpu")
    assert resumed.resumed_from_epoch == 1 and len(resumed.epoch_losses) == 2


def test_the_first_stage_that_trains_after_deferred_ones_trains_its_full_epochs(tmp_path, stage_folders, monkeypatch):
    """Stages too small to try (``stage/trial.py``) keep the set untrained: the bound waits for one that trains."""
    monkeypatch.setattr(trial_module, "margin_gain", lambda *args: MarginGain(5.0, 4.0, 30))  # the trial says train
    run = tmp_path / "run"
    config = RunConfig.for_method("drl", {**SMALL, "schedule": {"later_epochs": 1, "trial_images": 4}})
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    later = make_stages(tmp_path / "later", num_stages=2, classes_per_stage=4, train=10, test=3, first=3)
    results = [learn_stage(run, data_dir=train, device="cpu") for train, _ in [*stage_folders[:2], *later]]
    assert [len(r.epoch_losses) for r in results] == [0, 0, 3, 1]  # two deferred stages of 3 classes
    assert _train_records(run)[2:] == [3, 1]
