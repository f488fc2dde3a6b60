"""``--tensorboard DIR`` (issue 17): per-epoch loss and learning rate, per-stage A_t, Ā and forgetting,
read back with TensorBoard's own reader; the extra missing; folders inside a run refused; a failing
write. Through the CLI, for learn-stage and benchmark."""

import errno
import json
import shutil
import sys

import pytest
from typer.testing import CliRunner

from drlcli.cli import app
from drlcli.run.directory import RunDir
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

pytest.importorskip("tensorboard")  # the `test` extra brings it
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

runner = CliRunner()
FAST = ["--epochs", "2", "--batch-size", "12", "--device", "cpu"]
TINY_ARGS = ["--ptm", TINY_PTM, "--random-init"] + [
    a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")
]


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of ``folder``: tag -> [(step, value)], in step order."""
    reader = EventAccumulator(str(folder))
    reader.Reload()
    return {tag: sorted((e.step, e.value) for e in reader.Scalars(tag)) for tag in reader.Tags()["scalars"]}


def event_files(folder):
    return sorted(p.name for p in folder.rglob("events.out.tfevents.*"))


@pytest.fixture
def run(learned_run, tmp_path):
    path = tmp_path / "run"
    shutil.copytree(learned_run, path)
    return path


def test_learn_stage_writes_loss_lr_accuracy_and_forgetting(run_dir, stage_folders, tmp_path):
    tb = tmp_path / "tb"
    for train, test in stage_folders[:2]:
        result = drl("learn-stage", "--run", run_dir, "--data", train, "--eval-data", test, *FAST, "--tensorboard", tb)
        assert result.exit_code == 0, result.output
        assert f"tensorboard: {tb}" in result.stdout
    got = scalars(tb)
    run = RunDir(run_dir)
    for stage in (1, 2):
        losses = run.stage(stage).meta["metrics"]["train"]["epoch_losses"]
        assert got[f"loss/stage_{stage:03d}"] == [(e, pytest.approx(v, rel=1e-6)) for e, v in enumerate(losses, 1)]
        assert got[f"lr/stage_{stage:03d}"] == [(1, pytest.approx(0.01)), (2, pytest.approx(0.005))]  # cosine, 2 epochs
    history = json.loads(drl("info", "--run", run_dir, "--json").stdout)["history"]
    assert got["accuracy/A_t"] == [(t, pytest.approx(a, abs=1e-4)) for t, a in enumerate(history["accuracy"], 1)]
    assert got["accuracy/average"][-1] == (2, pytest.approx(history["average"], abs=1e-4))
    assert got["forgetting/mean"] == [(2, pytest.approx(history["mean_forgetting"], abs=1e-4))]
    assert got["forgetting/stage_001"] == [(2, pytest.approx(history["forgetting"]["1"], abs=1e-4))]
    files = event_files(tb)
    again = drl("learn-stage", "--run", run_dir, "--data", stage_folders[1][0], *FAST, "--tensorboard", tb)
    assert again.exit_code == 0 and "already learned" in again.stdout and "tensorboard" not in again.stdout
    assert event_files(tb) == files  # a call that learns nothing writes nothing
    assert not event_files(run_dir) and drl("verify", "--run", run_dir).exit_code == 0


def test_python_api_takes_tensorboard_dir(run_dir, stage_folders, tmp_path):
    from drlcli import learn_stage

    train, test = stage_folders[0]
    result = learn_stage(
        run_dir,
        data_dir=train,
        eval_data_dir=test,
        train_overrides={"epochs": 1, "batch_size": 12},
        device="cpu",
        tensorboard_dir=tmp_path / "tb",
    )
    assert set(scalars(tmp_path / "tb")) == {"loss/stage_001", "lr/stage_001", "accuracy/A_t", "accuracy/average"}
    assert (
        result.tensorboard_dir == str(tmp_path / "tb") and result.to_dict()["tensorboard_dir"] == result.tensorboard_dir
    )


def test_a_stage_with_nothing_to_log_writes_no_file(tmp_path, stage_folders):
    """simplecil trains nothing; without eval data there is no A_t: no event file, no tensorboard_dir."""
    from drlcli import learn_stage
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig

    run = tmp_path / "run"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=RunConfig.for_method("simplecil"))
    result = learn_stage(run, data_dir=stage_folders[0][0], device="cpu", tensorboard_dir=tmp_path / "tb")
    assert result.status == "learned" and result.tensorboard_dir is None and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("command", ["learn-stage", "benchmark"])
def test_a_missing_extra_is_exit_2_naming_pip(command, run, stage_folders, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if the tensorboard extra were not installed
    args = {
        "learn-stage": ["--run", run, "--data", stage_folders[2][0], *FAST],
        "benchmark": ["--data", tmp_path / "data", "--out", tmp_path / "bench", *TINY_ARGS, "--device", "cpu"],
    }[command]
    before = RunDir(run).manifest()["generation"]
    result = drl(command, *args, "--tensorboard", tmp_path / "tb", "--json")
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "missing_dependency" and "pip install 'drlcli[tensorboard]'" in error["message"]
    assert not (tmp_path / "tb").exists() and not (tmp_path / "bench").exists()
    assert RunDir(run).manifest()["generation"] == before


def test_a_folder_inside_a_run_is_refused(run, learned_run, stage_folders, tmp_path):
    """Like export --out and eval --plot: inside this run, another run, or (benchmark) OUT/runs."""
    train = stage_folders[2][0]
    (tmp_path / "a-file").write_text("not a folder")
    before = RunDir(run).manifest()["generation"]
    for folder, message in (
        (run / "tb", "is inside the drl run directory"),
        (run, "is inside the drl run directory"),
        (learned_run / "stages" / "tb", "is inside the drl run directory"),
        (tmp_path / "a-file", "is a file; pass a folder"),
    ):
        result = drl("learn-stage", "--run", run, "--data", train, *FAST, "--tensorboard", folder)
        assert result.exit_code == 2 and message in result.stderr, (folder, result.stderr)
        assert "--tensorboard" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert RunDir(run).manifest()["generation"] == before and not event_files(run)
    out = tmp_path / "bench"
    data = tmp_path / "none"
    for folder in (out / "runs", out / "runs" / "drl", out / "seed_7" / "runs" / "x"):
        seeds = ["--seeds", "7,8"] if "seed_7" in str(folder) else []
        result = drl("benchmark", "--data", data, "--out", out, *seeds, *TINY_ARGS, "--tensorboard", folder)
        assert result.exit_code == 2 and "where the benchmark keeps its run directories" in result.stderr, folder
    assert not out.exists()


def test_a_failing_event_write_is_a_storage_error(run_dir, stage_folders, tmp_path, monkeypatch):
    """Exit 8 naming --tensorboard; the stage is not committed and the re-run resumes from its checkpoint."""
    run = run_dir  # a run that trains its stages: the first event is an epoch's
    from torch.utils.tensorboard import SummaryWriter

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    before = RunDir(run).manifest()["generation"]
    train = stage_folders[0][0]
    result = drl("learn-stage", "--run", run, "--data", train, *FAST, "--tensorboard", tmp_path / "tb")
    assert result.exit_code == 8, result.output
    assert "cannot write TensorBoard events to" in result.stderr and "No space left on device" in result.stderr
    assert RunDir(run).manifest()["generation"] == before
    monkeypatch.undo()
    resumed = drl("learn-stage", "--run", run, "--data", train, *FAST, "--json")
    assert resumed.exit_code == 0 and json.loads(resumed.stdout)["resumed_from_epoch"] == 1


def test_benchmark_writes_one_folder_per_variant_with_workers_and_bf16(tmp_path):
    """benchmark --tensorboard: TB/<variant>, one TensorBoard run each; --workers (real worker processes)
    and --precision reach every stage, and results.json and stage.json record the precision."""
    data = tmp_path / "data"
    make_class_folders(data / "train", [0, 1], images_per_class=3)
    make_class_folders(data / "test", [0, 1], images_per_class=2, offset=3)
    out, tb = tmp_path / "bench", tmp_path / "tb"
    args = [
        "--data",
        data,
        "--out",
        out,
        *TINY_ARGS,
        "--methods",
        "simplecil,drl/skip_unread=false/trial=none/train_min_classes=0",  # untried: a stage of one class trains
        "--split",
        "B0Inc1",
    ]
    args += ["--epochs", "1", "--device", "cpu", "--workers", "1", "--precision", "bf16", "--tensorboard", tb]
    result = drl("benchmark", *args, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["protocol"]["precision"] == "bf16" and report["artifacts"]["tensorboard"] == str(tb)
    rows = {row["label"]: row for row in report["results"]}
    simplecil, trained = (
        scalars(tb / "simplecil"),
        scalars(tb / "drl__skip_unread=false__trial=none__train_min_classes=0"),
    )
    assert [t for t, _ in simplecil["accuracy/A_t"]] == [1, 2] and "loss/stage_001" not in simplecil
    accuracy = rows["drl/skip_unread=false/trial=none/train_min_classes=0"]["accuracy"]
    assert [a for _, a in trained["accuracy/A_t"]] == pytest.approx(accuracy, abs=1e-4)
    assert [e for e, _ in trained["loss/stage_002"]] == [1] and "forgetting/mean" in trained
    stage = RunDir(out / "runs" / "drl__skip_unread=false__trial=none__train_min_classes=0").stage(2).meta
    assert stage["precision"] == "bf16" and stage["train"]["num_workers"] == 1
