"""benchmarks/carry_cost.py times a carried stage's rebuild of the earlier classes' sums, each way."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "carry_cost.py"


def test_carry_cost_reports_each_mode_per_size_against_the_first():
    command = [
        sys.executable,
        str(SCRIPT),
        "--classes",
        "2",
        "3",
        "--images",
        "2",
        "--modes",
        "drawn-1",
        "centred-1-g2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["modes"] == ["drawn-1", "centred-1-g2"] and report["M"] == 3000
    rows = report["rows"]
    assert [(r["classes"], r["earlier_images"]) for r in rows] == [(2, 4), (3, 6)]
    for row in rows:
        assert row["drawn-1_ratio"] == 1.0 and row["drawn-1_s"] > 0 and row["centred-1-g2_s"] > 0
        assert row["centred-1-g2_ratio"] > 0 and row["centred-1-g2_ms_per_image"] > 0


def test_carry_cost_names_an_unknown_mode():
    result = subprocess.run([sys.executable, str(SCRIPT), "--modes", "sampled-3"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown mode sampled-3" in result.stderr


def test_carry_cost_times_whole_draws_against_first_token_draws():
    command = [
        sys.executable,
        str(SCRIPT),
        "--draw-rounds",
        "3",
        "--classes",
        "2",
        "--images",
        "2",
        "--draw-count",
        "5",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["classes"] == 2 and report["draws_a_class"] == 5
    assert len(report["whole_s"]) == len(report["first_only_s"]) == 3
    assert min(report["whole_s"] + report["first_only_s"]) > 0 and report["median_ratio"] > 0
