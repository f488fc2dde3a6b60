"""The CLI end to end through typer's CliRunner: outputs, files written, exit codes, bad input."""

import json
import shutil
import sys

import pytest
from safetensors.torch import save_file
from typer.testing import CliRunner

from drlcli.cli import app
from drlcli.ptm import backbone
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_stages

runner = CliRunner()
TINY_ARGS = ["--ptm", TINY_PTM] + [a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")]
FAST = ["--epochs", "2", "--batch-size", "12", "--device", "cpu"]


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


def drl_json(*args):
    result = drl(*args, "--json")
    return result, json.loads(result.stdout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, stage_folders):
    """A run with two learned stages (3 classes each), eval data registered."""
    run = tmp_path_factory.mktemp("cli") / "run"
    assert drl("init", "--run", run, *TINY_ARGS, "--random-init", "--preset", "frozen").exit_code == 0
    for train, test in stage_folders[:2]:
        result = drl("learn-stage", "--run", run, "--data", train, "--eval-data", test, *FAST)
        assert result.exit_code == 0, result.stderr
    return run


def _copy(run, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(run, target)
    return target


def test_full_flow_outputs(trained, stage_folders, tmp_path):
    run = _copy(trained, tmp_path)
    result, out = drl_json(
        "learn-stage", "--run", run, "--data", stage_folders[2][0], "--eval-data", stage_folders[2][1], *FAST
    )
    assert result.exit_code == 0 and out["ok"] and out["stage"] == 3
    assert out["classes"] == ["class_06", "class_07", "class_08"]
    assert len(out["history"]["accuracy"]) == 3 and out["eval"]["num_images"] == 36
    assert set(out["eval"]["groups"]) == {"1", "2", "3"}
    result, ev = drl_json("eval", "--run", run, "--all-seen", "--device", "cpu")
    assert result.exit_code == 0 and ev["accuracy"]["top1"] == out["eval"]["top1"]  # same model, same data
    assert ev["accuracy"]["top1"] > 60  # well above chance (11%) on separable generated classes
    assert ev["accuracy"]["top1"] <= ev["accuracy"]["top5"] == out["eval"]["top5"] <= 100
    result, info = drl_json("info", "--run", run)
    assert info["num_stages"] == 3 and info["num_classes"] == 9
    assert all(s["num_params"] > 0 and s["bytes"] > 0 for s in info["stages"])
    text = drl("eval", "--run", run, "--all-seen")
    assert text.exit_code == 0 and "A_t by stage" in text.stdout and "\x1b" not in text.stdout


def test_export_and_eval_on_a_folder(trained, stage_folders, tmp_path):
    result, out = drl_json("export", "--run", trained, "--out", tmp_path / "m.drl")
    assert result.exit_code == 0 and out["num_classes"] == 6 and (tmp_path / "m.drl").is_file()
    result, ev = drl_json("eval", "--run", trained, "--data", stage_folders[0][1])
    assert result.exit_code == 0 and ev["accuracy"]["num_images"] == 12 and set(ev["accuracy"]["groups"]) == {"1"}


def test_run_directory_holds_no_absolute_paths_and_moves(trained, tmp_path, stage_folders):
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(trained, moved)
    for path in moved.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".yaml"):
            assert str(trained) not in path.read_text() and str(tmp_path) not in path.read_text()
    result, info = drl_json("info", "--run", moved)
    assert result.exit_code == 0 and info["num_stages"] == 2


def test_env_var_selects_the_run(trained):
    result = runner.invoke(app, ["info", "--json"], env={"DRL_RUN": str(trained)})
    assert result.exit_code == 0 and json.loads(result.stdout)["num_classes"] == 6


def _unchanged(run, action):
    before = (run / "manifest.json").read_bytes()
    result, out = action()
    assert (run / "manifest.json").read_bytes() == before
    assert not out["ok"] and out["error"]["exit_code"] == result.exit_code
    lines = result.stderr.strip().splitlines()  # progress lines may come first; then one error line
    assert lines[-1].startswith("error: ") and sum(line.startswith("error: ") for line in lines) == 1
    return result, out


def test_same_data_again_is_a_no_op_and_other_data_for_a_learned_class_is_refused(trained, stage_folders, tmp_path):
    before = (trained / "manifest.json").read_bytes()
    result = drl("learn-stage", "--run", trained, "--data", stage_folders[0][0], *FAST)
    assert result.exit_code == 0 and "stage 1 already learned exactly these images; nothing to do" in result.stdout
    assert (trained / "manifest.json").read_bytes() == before
    changed = tmp_path / "changed"
    shutil.copytree(stage_folders[0][0], changed)
    shutil.copy(next((changed / "class_00").iterdir()), changed / "class_00" / "extra.png")
    result, out = _unchanged(trained, lambda: drl_json("learn-stage", "--run", trained, "--data", changed, *FAST))
    assert result.exit_code == 3 and "already learned in stage 1" in out["error"]["message"]


def test_verify_names_the_damaged_file(trained, tmp_path):
    result, out = drl_json("verify", "--run", trained)
    assert result.exit_code == 0 and out["ok"] and out["num_stages"] == 2 and out["interrupted_stage"] is None
    assert "is intact" in drl("verify", "--run", trained).stdout
    run = _copy(trained, tmp_path)
    path = run / "stages/002/weights.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    result, out = drl_json("verify", "--run", run)
    assert result.exit_code == 5 and "stages/002/weights.safetensors is damaged" in out["error"]["message"]


def test_bad_data_is_refused_and_changes_nothing(trained, make_folder, tmp_path):
    empty = make_folder("empty", [20], n=2)
    (empty / "class_21").mkdir()
    corrupt = make_folder("corrupt", [22], n=2)
    (corrupt / "class_22" / "x.jpg").write_bytes(b"\x00garbage")
    unknown_eval = make_folder("unk", [40], n=2)
    new = make_folder("new", [30], n=3)
    (tmp_path / "none").mkdir()
    cases = [
        (["--data", empty], "class_21 is empty"),
        (["--data", corrupt], "x.jpg cannot be decoded"),
        (["--data", tmp_path / "none"], "no class folders"),
        (["--data", new, "--eval-data", unknown_eval], "neither learned nor in --data"),
    ]
    for args, message in cases:
        result, out = _unchanged(trained, lambda args=args: drl_json("learn-stage", "--run", trained, *args, *FAST))
        assert result.exit_code == 3 and message in out["error"]["message"], out


def test_eval_of_unknown_classes_is_refused(trained, make_folder):
    result, out = _unchanged(trained, lambda: drl_json("eval", "--run", trained, "--data", make_folder("u", [50], n=2)))
    assert result.exit_code == 3 and "not learned" in out["error"]["message"]


def test_not_a_run_and_double_init(tmp_path, trained):
    result, out = drl_json("info", "--run", tmp_path)
    assert result.exit_code == 7 and "not a drl run directory" in out["error"]["message"]
    result, out = _unchanged(trained, lambda: drl_json("init", "--run", trained, *TINY_ARGS, "--random-init"))
    assert result.exit_code == 7 and "already holds a drl run" in out["error"]["message"]


def test_missing_and_wrong_weights(tmp_path, tiny_ptm, stage_folders):
    result, out = drl_json("init", "--run", tmp_path / "r", *TINY_ARGS, "--ptm-weights", tmp_path / "none.safetensors")
    assert result.exit_code == 6 and "not found" in out["error"]["message"]
    weights = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_ptm.state_dict().items()}, str(weights))
    assert drl("init", "--run", tmp_path / "r", *TINY_ARGS, "--ptm-weights", weights).exit_code == 0
    other = backbone.create_ptm(TINY_PTM, source=backbone.PTMSource(random_init=True, seed=5), kwargs=TINY_PTM_KWARGS)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / "other.safetensors"))
    result, out = _unchanged(
        tmp_path / "r",
        lambda: drl_json(
            "learn-stage",
            "--run",
            tmp_path / "r",
            "--data",
            stage_folders[0][0],
            "--ptm-weights",
            tmp_path / "other.safetensors",
            *FAST,
        ),
    )
    assert result.exit_code == 5 and "PTM weights differ" in out["error"]["message"]
    weights.rename(tmp_path / "moved.safetensors")  # the recorded place is gone: say what to pass
    result, out = _unchanged(
        tmp_path / "r", lambda: drl_json("learn-stage", "--run", tmp_path / "r", "--data", stage_folders[0][0], *FAST)
    )
    assert result.exit_code == 6 and "--ptm-weights" in out["error"]["message"]


def test_busy_run_exit_code(trained):
    from drlcli.run.directory import RunDir

    with RunDir(trained).writer():
        result, out = _unchanged(trained, lambda: drl_json("learn-stage", "--run", trained, "--data", trained, *FAST))
    assert result.exit_code == 4 and "busy" in out["error"]["message"]


def test_damaged_run_exit_code(trained, tmp_path):
    run = _copy(trained, tmp_path)
    path = run / "stages/001/weights.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    result, out = drl_json("eval", "--run", run, "--all-seen")
    assert result.exit_code == 5 and "001/weights.safetensors is damaged" in out["error"]["message"]


def test_usage_errors_exit_2(trained):
    assert drl("eval", "--run", trained).exit_code == 2  # neither --all-seen nor --data
    assert drl("learn-stage", "--run", trained).exit_code == 2  # --data missing (typer)
    assert drl("init", "--run", trained, "--ptm", TINY_PTM, "--ptm-arg", "oops").exit_code == 2


def test_simplecil_method(tmp_path, stage_folders):
    run = tmp_path / "s"
    assert drl("init", "--run", run, *TINY_ARGS, "--random-init", "--method", "simplecil").exit_code == 0
    result, out = drl_json(
        "learn-stage", "--run", run, "--data", stage_folders[0][0], "--eval-data", stage_folders[0][1]
    )
    assert result.exit_code == 0 and out["num_params"] == 0 and out["train_seconds"] == 0.0


def test_the_default_learns_its_adapter_set_and_answers_from_its_frozen_track_first(tmp_path):
    """What a new user's `drl init` makes (issue 32): the switched schedule. Stage 1 (whose trial on
    these random images says adapt) trains the carried adapter set and answers from the frozen track (a
    `drl --preset frozen` run's files beside its own); eval, info, export and predict read the answering track."""
    stage_folders = make_stages(tmp_path / "data", num_stages=2, classes_per_stage=4, train=10, test=3)
    run = tmp_path / "run"
    assert drl("init", "--run", run, *TINY_ARGS, "--random-init").exit_code == 0
    result, out = drl_json("learn-stage", "--run", run, "--data", stage_folders[0][0], *FAST)
    assert result.exit_code == 0, result.stderr
    assert not out["training_skipped"] and len(out["epoch_losses"]) == 2 and out["num_params"] > 0
    assert out["switch"]["answers"] == "frozen"
    text = drl("learn-stage", "--run", run, "--data", stage_folders[1][0], "--eval-data", stage_folders[1][1], *FAST)
    assert text.exit_code == 0 and "`drl init --recipe frozen`" in text.stdout  # says which track answered
    assert (
        "drawn 25 times per image (their means in closed form, the Grams from at most 50,000 draws, split between "
        "the fit and held-out parts)" in text.stdout
    )
    result, info = drl_json("info", "--run", run)
    assert info["config"]["schedule"]["switch"] == "transfer" and info["frozen_track"]["num_stages"] == 2
    assert info["frozen_track"]["answers"] == "frozen"
    assert drl("export", "--run", run, "--out", tmp_path / "model.drl").exit_code == 0
    predicted = drl("predict", "--model", tmp_path / "model.drl", stage_folders[1][1], "--device", "cpu")
    assert predicted.exit_code == 0 and len(predicted.stdout.splitlines()) == len(
        list(stage_folders[1][1].rglob("*.png"))
    )


def test_demo_runs_offline(tmp_path):
    result, out = drl_json("demo", "--out", tmp_path / "demo", "--epochs", "1", "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert len(out["history"]["accuracy"]) == 3 and (tmp_path / "demo" / "model.drl").is_file()


def test_eval_reports_matrix_forgetting_confusions_and_plot(trained, tmp_path):
    pytest.importorskip("matplotlib")  # the plot extra (part of the test extra)
    plot = tmp_path / "plots" / "accuracy.png"
    result, ev = drl_json("eval", "--run", trained, "--all-seen", "--plot", plot, "--confusions", "2")
    assert result.exit_code == 0, result.stderr
    history = ev["history"]
    assert len(history["matrix"]) == 2 and history["matrix"][0][1] is None  # stage 2's classes after stage 1
    assert history["matrix"][1] == [ev["accuracy"]["groups"]["1"], ev["accuracy"]["groups"]["2"]]
    assert history["forgetting"]["1"] == round(history["matrix"][0][0] - history["matrix"][1][0], 4)
    assert history["mean_forgetting"] == history["forgetting"]["1"]
    mistakes = round(ev["accuracy"]["num_images"] * (1 - ev["accuracy"]["top1"] / 100))
    assert (ev["confused"] == []) == (mistakes == 0) and sum(c["count"] for c in ev["confused"]) <= mistakes
    assert ev["plot"] == str(plot) and plot.read_bytes()[:4] == b"\x89PNG"
    text = drl("eval", "--run", trained, "--all-seen").stdout
    assert "accuracy matrix" in text and "t2" in text


def test_eval_confusions_count_every_mistake(trained, stage_folders, tmp_path):
    """Test images of class_00 filed as class_01 and the other way round: the run's mistakes there
    are counted per (true, predicted) pair, most frequent first, and --confusions keeps the top."""
    test = stage_folders[0][1]
    swapped = tmp_path / "swapped"
    for folder, name in (("class_00", "class_01"), ("class_01", "class_00"), ("class_02", "class_02")):
        shutil.copytree(test / folder, swapped / name)
    _, every = drl_json("eval", "--run", trained, "--data", swapped, "--confusions", "100")
    accuracy, confused = every["accuracy"], every["confused"]
    mistakes = round(accuracy["num_images"] * (1 - accuracy["top1"] / 100))
    assert accuracy["num_images"] == 12 and mistakes >= 4  # the swapped images are mostly predicted as what they show
    assert sum(c["count"] for c in confused) == mistakes
    assert all(set(c) == {"true", "predicted", "count"} and c["true"] != c["predicted"] for c in confused)
    assert [c["count"] for c in confused] == sorted((c["count"] for c in confused), reverse=True)
    _, top = drl_json("eval", "--run", trained, "--data", swapped, "--confusions", "2")
    assert len(confused) >= 2 and top["confused"] == confused[:2]


def test_eval_plot_errors(trained, tmp_path, monkeypatch):
    result, out = drl_json("eval", "--run", trained, "--all-seen", "--plot", tmp_path / "a.txt")
    assert result.exit_code == 2 and ".png" in out["error"]["message"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    result, out = drl_json("eval", "--run", trained, "--all-seen", "--plot", tmp_path / "a.png")
    assert result.exit_code == 2 and out["error"]["kind"] == "missing_dependency"
    assert "pip install 'drlcli[plot]'" in out["error"]["message"] and not (tmp_path / "a.png").exists()


def test_info_shows_growth_per_stage(trained):
    """The frozen drl has no stage networks (its head reads none): each stage's parameters are the
    ridge head's W it solved, M x the classes seen so far (M 1024 = 16 d for the tiny ViT)."""
    result, info = drl_json("info", "--run", trained)
    stages = info["stages"]
    per_stage = [1024 * 3, 1024 * 6]
    assert [s["num_params"] for s in stages] == per_stage
    assert [s["cumulative_params"] for s in stages] == per_stage  # W of stage 2 supersedes stage 1's
    on_disk = [sum(f.stat().st_size for f in (trained / "stages" / f"{i:03d}").iterdir()) for i in (1, 2)]
    assert [s["bytes"] for s in stages] == on_disk
    assert [s["cumulative_bytes"] for s in stages] == [on_disk[0], on_disk[0] + on_disk[1]]
    assert [s["cumulative_classes"] for s in stages] == [3, 6]
    base = sum((trained / name).stat().st_size for name in ("run.yaml", "ptm.safetensors"))
    assert info["base_bytes"] == base and info["total_bytes"] == base + sum(on_disk)
    text = drl("info", "--run", trained).stdout
    assert "cum.params" in text and f"{stages[-1]['cumulative_params']:,}" in text
    # the default drl makes no stage network (its head reads none), and says so
    assert [s["untrained"] for s in stages] == [True, True]
    assert f"{per_stage[0]:,}*" in text and "* no stage network" in text
