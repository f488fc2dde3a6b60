"""benchmarks/both_heads.py scores a switched run's two heads and their sum on its registered eval data."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drlcli import learn_stage
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.metrics import MarginGain
from drlcli.stage import trial as trial_module
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders, make_stages

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "both_heads.py"
SMALL = {
    "ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3},
    "train": {"epochs": 2, "batch_size": 8, "seed": 3},
    "first_session": {"trial_images": 4},
}


def _script():
    spec = importlib.util.spec_from_file_location("both_heads", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("answers_small", [10, 0])  # stage 1 answers from the adapted head / the frozen one
def test_both_heads_scores_each_head_as_the_run_recorded_it_and_their_sum(tmp_path, monkeypatch, answers_small):
    (train, test), *_ = make_stages(tmp_path / "data", num_stages=1, classes_per_stage=4, train=10, test=3)
    run = tmp_path / "run"
    options = {**SMALL, "first_session": {"trial_images": 4, "trial_answers_small_stage": answers_small}}
    init_run(
        run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=RunConfig.for_method("drl", options)
    )
    monkeypatch.setattr(trial_module, "margin_gain", lambda *args: MarginGain(5.0, 5.0, 30))  # the set trains
    result = learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu")
    assert result.epoch_losses and result.switch["answers"] == ("carried" if answers_small else "frozen")
    with torch.inference_mode():
        row = _script().measure(run, None, (0.0, 1.0))
    assert row["images"] == 12
    assert row["adapted"] == pytest.approx(result.switch["top1"]["carried"], abs=0.01)
    assert row["frozen"] == pytest.approx(result.switch["top1"]["frozen"], abs=0.01)
    assert 0.0 <= row["both"] <= 100.0
    # a weight of 0 leaves the adapted head's answers, 1 is the plain sum
    assert row["weighted"] == {"0.0": row["adapted"], "1.0": row["both"]}


def test_both_heads_refuses_a_run_of_one_head(learned_run):
    result = subprocess.run([sys.executable, str(SCRIPT), str(learned_run)], capture_output=True, text=True)
    assert result.returncode != 0 and "not a switched run" in result.stderr
    assert not result.stdout.strip() or json.loads(result.stdout.splitlines()[-1])


def test_both_heads_per_stage_measures_every_stage_a_switched_run_learns(tmp_path):
    data = tmp_path / "data"
    make_class_folders(data / "train", list(range(8)), images_per_class=6)
    make_class_folders(data / "test", list(range(8)), images_per_class=2, offset=6)
    lines, out = tmp_path / "stages.jsonl", tmp_path / "out"
    tiny = ["--ptm", TINY_PTM, "--random-init"] + [
        a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")
    ]
    bench = ["benchmark", "--data", str(data), "--out", str(out), *tiny, "--split", "B0Inc4", "--epochs", "1"]
    bench += ["--methods", "default,frozen", "--device", "cpu"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--per-stage", str(lines), "--scores", str(tmp_path), "--", *bench],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [(r["variant"], r["stage"], r["images"]) for r in rows] == [("default", 1, 8), ("default", 2, 16)]
    results = json.loads((out / "results.json").read_text())["results"]
    assert rows[-1]["frozen"] == pytest.approx(next(r for r in results if r["label"] == "frozen")["last"], abs=0.01)
    for row in rows:  # each stage's heads as that stage recorded them
        meta = json.loads((out / "runs" / "default" / "stages" / f"{row['stage']:03d}" / "stage.json").read_text())
        assert row["adapted"] == pytest.approx(meta["switch"]["top1"]["carried"], abs=0.01)
        assert row["frozen"] == pytest.approx(meta["switch"]["top1"]["frozen"], abs=0.01)
        saved = torch.load(tmp_path / f"default-{row['stage']:03d}.pt")  # the same scores, saved
        top1 = 100.0 * (saved["frozen"].argmax(1) == saved["targets"]).float().mean().item()
        assert top1 == pytest.approx(row["frozen"], abs=0.01) and len(saved["targets"]) == row["images"]


def test_both_heads_wants_runs_or_a_command(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--per-stage", str(tmp_path / "x.jsonl")], capture_output=True, text=True
    )
    assert result.returncode == 2 and "give RUN_DIRs, or --per-stage FILE" in result.stderr
