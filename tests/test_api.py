"""The Python API's data besides folders: torch Datasets of (image, label) pairs for learn_stage and evaluate."""

import json

import pytest
import torch
from conftest import Pairs, new_run

from drlcli import evaluate, learn_stage
from drlcli.data.decode import load_rgb
from drlcli.data.images import scan_class_folders
from drlcli.errors import DataError, UsageError
from drlcli.run.directory import RunDir

OPTS = {"epochs": 1, "batch_size": 12}


def as_dataset(folder, *, numbered: list[str] | None = None) -> Pairs:
    """A folder's images as (PIL image, class name) pairs, or (image, index into ``numbered``)."""
    images = scan_class_folders(folder)
    items = []
    for path, label in zip(images.paths, images.labels):
        name = images.class_names[label]
        items.append((load_rgb(path), numbered.index(name) if numbered else name))
    return Pairs(items)


def test_a_dataset_learns_the_same_stage_as_its_folder(tmp_path, stage_folders):
    train, test = stage_folders[0]
    from_folder = new_run(tmp_path / "folder")
    from_dataset = new_run(tmp_path / "dataset")
    a = learn_stage(from_folder, data_dir=train, eval_data_dir=test, train_overrides=OPTS, device="cpu")
    b = learn_stage(
        from_dataset, data=as_dataset(train), eval_data=as_dataset(test), train_overrides=OPTS, device="cpu"
    )
    assert a.classes == b.classes and a.epoch_losses == b.epoch_losses and a.eval.top1 == b.eval.top1
    ta, tb = RunDir(from_folder).stage(1).tensors, RunDir(from_dataset).stage(1).tensors
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    meta = json.loads((from_dataset / "stages" / "001" / "stage.json").read_text())
    assert meta["eval_data"] is None and meta["metrics"]["eval"]["num_images"] == 12  # evaluated, not registered
    # the same items again: nothing to do (the fingerprint of their pixels); int labels name the same classes
    again = learn_stage(from_dataset, data=as_dataset(train, numbered=["x", *a.classes]), class_names=["x", *a.classes])
    assert again.status == "unchanged" and again.stage == 1
    # evaluate a dataset as a folder
    by_folder = evaluate(from_dataset, data_dir=test, device="cpu")
    by_dataset = evaluate(from_dataset, data=as_dataset(test), device="cpu")
    assert by_folder.report.top1 == by_dataset.report.top1 == b.eval.top1


def test_a_dataset_with_other_items_is_a_new_stage_or_refused(tmp_path, stage_folders):
    run = new_run(tmp_path / "run")
    learn_stage(run, data=as_dataset(stage_folders[0][0]), train_overrides=OPTS, device="cpu")
    fewer = Pairs(as_dataset(stage_folders[0][0]).items[:-1])
    with pytest.raises(DataError, match="class 'class_00' in --data was already learned in stage 1"):
        learn_stage(run, data=fewer, train_overrides=OPTS, device="cpu")
    with pytest.raises(DataError, match=r"data \(a Pairs of 12 images\) has class\(es\) this run has not learned"):
        evaluate(run, data=as_dataset(stage_folders[1][1]), device="cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "pass the new classes' images: data_dir"),
        (
            {"data_dir": "FOLDER", "data": "DATASET"},
            r"pass data as a folder \(data_dir\) or as a dataset \(data\), not both",
        ),
        ({"data": "DATASET", "eval_data_dir": "FOLDER", "eval_data": "DATASET"}, "pass eval_data as a folder"),
        ({"data_dir": "FOLDER", "class_names": ["a"]}, "class_names names the int labels of a dataset"),
    ],
)
def test_learn_stage_data_usage_errors(run_dir, stage_folders, kwargs, message):
    folder = stage_folders[0][0]
    values = {"FOLDER": folder, "DATASET": as_dataset(folder)}
    kwargs = {k: values.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(UsageError, match=message):
        learn_stage(run_dir, device="cpu", **kwargs)
    assert RunDir(run_dir).stage_indices() == []


def test_evaluate_data_usage_errors(learned_run, stage_folders):
    test = stage_folders[0][1]
    with pytest.raises(UsageError, match="pass exactly one of --all-seen or --data DIR"):
        evaluate(learned_run, data=as_dataset(test), all_seen=True, device="cpu")
    with pytest.raises(UsageError, match="not both"):
        evaluate(learned_run, data=as_dataset(test), data_dir=test, device="cpu")
    with pytest.raises(UsageError, match="class_names names the int labels"):
        evaluate(learned_run, data_dir=test, class_names=["a"], device="cpu")
