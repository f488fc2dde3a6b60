"""``drl check-data`` (every problem of a drop in one run, nothing written to the run) and
``learn-stage --eval-fraction`` (an eval set held out of the drop, never trained on)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from drlcli.cli import app
from drlcli.data import scan_class_folders
from drlcli.data.split import held_out_indices, split_held_out
from drlcli.run.directory import RunDir

runner = CliRunner()


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


def snapshot(run: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under the run (hidden ones, the lock, included): size, mtime and, for files, bytes."""
    out = {}
    for path in sorted(run.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(run))] = (st.st_size, st.st_mtime_ns, path.read_bytes() if path.is_file() else b"")
    return out


def planted_drop(root: Path, stage_folders) -> Path:
    """Stage 3's classes with three mistakes: a corrupt file, an image copied into a second class, and
    a class (class_00) the run learned in stage 1."""
    drop = root / "drop"
    shutil.copytree(stage_folders[2][0], drop)
    shutil.copytree(stage_folders[0][0] / "class_00", drop / "class_00")
    (drop / "class_06" / "img_003.png").write_bytes(b"not an image at all")
    shutil.copy(drop / "class_07" / "img_000.png", drop / "class_08" / "img_900.png")
    return drop


def test_check_data_names_every_planted_mistake_in_one_run_and_writes_nothing(learned_run, stage_folders, tmp_path):
    drop = planted_drop(tmp_path, stage_folders)
    before = snapshot(learned_run)
    result = drl("check-data", "--run", learned_run, "--data", drop, "--json")
    assert result.exit_code == 3, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["exit_code"] == 3 and report["error"]["exit_code"] == 3
    kinds = {p["kind"]: p for p in report["problems"]}
    assert set(kinds) == {"unreadable", "shared_image", "learned_class"}, report["problems"]
    assert kinds["unreadable"]["paths"] == [str(drop / "class_06" / "img_003.png")]
    shared = kinds["shared_image"]
    assert set(shared["paths"]) == {str(drop / "class_07" / "img_000.png"), str(drop / "class_08" / "img_900.png")}
    assert shared["classes"] == ["class_07", "class_08"]
    assert kinds["learned_class"]["classes"] == ["class_00"] and "stage 1" in kinds["learned_class"]["message"]
    assert report["classes"] == {"class_00": 12, "class_06": 12, "class_07": 12, "class_08": 13}
    assert result.stderr.strip().splitlines()[-1] == f"error: {report['error']['message']}"
    # the text names all three too, and the run is as it was: manifest bytes, no lock or file added or touched
    text = drl("check-data", "--run", learned_run, "--data", drop)
    assert text.exit_code == 3
    for name in ("img_003.png", "img_900.png", "'class_00'"):
        assert name in text.stdout, text.stdout
    assert snapshot(learned_run) == before


def test_check_data_is_clean_on_a_good_drop(learned_run, stage_folders):
    train, test = stage_folders[2]
    before = snapshot(learned_run)
    result = drl("check-data", "--run", learned_run, "--data", train, "--eval-data", test, "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["clean"] is True and report["problems"] == []
    assert report["num_images"] == 36 and report["num_eval_images"] == 12
    cost = report["cost"]
    assert cost["stage"] == 3 and cost["num_images"] == 36 and cost["evaluation"] == 12
    assert cost["passes"] == cost["train"] + cost["features"] + cost["evaluation"]
    assert not cost["trained"] and cost["train"] == 0  # the frozen head trains nothing
    plain = drl("check-data", "--run", learned_run, "--data", train)
    assert plain.exit_code == 0 and "no problems" in plain.stdout
    # a drop the run has learned: learn-stage would answer "unchanged", so no problem either
    again = json.loads(drl("check-data", "--run", learned_run, "--data", stage_folders[0][0], "--json").stdout)
    assert again["clean"] is True and again["learned_as"] == 1
    assert snapshot(learned_run) == before


def test_check_data_estimates_a_trained_stage_and_reports_layout_problems(run_dir, stage_folders, tmp_path):
    report = json.loads(drl("check-data", "--run", run_dir, "--data", stage_folders[0][0], "--json").stdout)
    cost = report["cost"]
    assert cost["trained"] and cost["epochs"] == 20 and cost["train"] == 36 * 20 * 3 and cost["features"] == 36
    # a drop's own folder (train/ and test/ inside) and --eval-data of a class neither learned nor given
    split = drl("check-data", "--run", run_dir, "--data", stage_folders[0][0].parent, "--json")
    assert split.exit_code == 3 and json.loads(split.stdout)["problems"][0]["kind"] == "split_folders"
    odd = drl("check-data", "--run", run_dir, "--data", stage_folders[0][0], "--eval-data", stage_folders[1][1])
    assert odd.exit_code == 3 and "eval_class_unknown" in odd.stdout


def test_eval_fraction_learns_on_the_rest_and_evaluates_on_the_held_out_images(run_dir, stage_folders):
    train = stage_folders[0][0]
    result = drl(
        "learn-stage", "--run", run_dir, "--data", train, "--eval-fraction", "0.25",
        "--epochs", "1", "--batch-size", "12", "--device", "cpu", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, (result.stdout, result.stderr)
    meta = RunDir(run_dir).stage_meta(1)
    entry = meta["eval_data"]
    assert entry["held_out"] == 0.25 and entry["seed"] == 0 and "path" not in entry
    trained = sum(meta["images_per_class"].values())
    assert entry["num_images"] == 9 and trained == 27 and trained + entry["num_images"] == 36
    assert meta["metrics"]["eval"]["num_images"] == 9  # the stage's evaluation: the held-out images alone
    # the held-out images are not in what was trained on: the training fingerprint is the rest's
    drop = scan_class_folders(train)
    kept, held = split_held_out(drop, 0.25, seed=0)
    assert meta["data_fingerprint"] == kept.fingerprint() != drop.fingerprint()
    assert entry["fingerprint"] == held.fingerprint() and not set(kept.paths) & set(held.paths)
    info = json.loads(drl("info", "--run", run_dir, "--json").stdout)
    assert info["stages"][0]["eval_data"]["held_out"] == 0.25
    assert "held out of its drop" in drl("info", "--run", run_dir).stdout
    assert drl("verify", "--run", run_dir).exit_code == 0
    seen = drl("eval", "--run", run_dir, "--all-seen", "--device", "cpu")  # not re-evaluable: said so
    assert seen.exit_code == 2 and "held out" in seen.stderr
    again = json.loads(
        drl("learn-stage", "--run", run_dir, "--data", train, "--eval-fraction", "0.25", "--json").stdout
    )
    assert again["status"] == "unchanged"  # the same split again: recognised


def test_eval_fraction_usage_errors_change_nothing(run_dir, stage_folders):
    train, test = stage_folders[0]
    manifest = (run_dir / "manifest.json").read_bytes()
    both = drl("learn-stage", "--run", run_dir, "--data", train, "--eval-data", test, "--eval-fraction", "0.2")
    assert both.exit_code == 2 and "--eval-data, not both" in both.stderr
    for bad in ("0", "1", "-0.5", "nan"):
        result = drl("learn-stage", "--run", run_dir, "--data", train, "--eval-fraction", bad)
        assert result.exit_code == 2, (bad, result.stderr)
    assert (run_dir / "manifest.json").read_bytes() == manifest and not (run_dir / "stages" / "001").exists()


def test_held_out_split_keeps_one_image_and_holds_at_least_one():
    labels = [0] + [1] * 2 + [2] * 10
    held = held_out_indices(labels, ["a", "b", "c"], 0.05, seed=3)
    assert 0 not in held and len([i for i in held if labels[i] == 1]) == 1
    assert len([i for i in held if labels[i] == 2]) == 1  # round(0.5) -> at least 1
    assert held == held_out_indices(labels, ["a", "b", "c"], 0.05, seed=3)  # seeded: the same draw again
